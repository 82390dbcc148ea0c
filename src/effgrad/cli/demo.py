"""``effgrad demo``: every effgrad tool on a real dataset, with measured savings.

Uses scikit-learn's bundled handwritten digits (1,797 8x8 images: no network
needed; ``pip install 'effgrad[demo]'``):

1. trains a CNN through ``model.fit`` with micro-batches and checkpointed
   residual blocks (``effgrad.attach`` + ``checkpoint_model``);
2. measures the peak device memory of one train step on a 1,024-image batch
   with and without each technique (same update either way);
3. measures one step of a keras_hub GPT-2 language model with a real
   vocabulary: Keras's own, effgrad's (the fused loss) and with int8
   optimizer state (``compact_state``);
4. streams SmoothGrad maps of the whole dataset into ``maps.npy`` and the
   per-class mean maps through ``saliency_summary``;
5. writes ``saliency_grid.png``, ``class_means.png`` and ``summary.json``.

Loss scaling is reported but not used for training: float16 has no fast
kernels on CPU, so mixed precision only pays on a GPU.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

CHANNELS = 48
BLOCKS = 6


def load_digits() -> tuple[np.ndarray, np.ndarray]:
    """Digits as float32 images ``[N, 8, 8, 1]`` in [0, 1] and int labels."""
    try:
        from sklearn.datasets import load_digits as sklearn_digits
    except ImportError as err:
        raise SystemExit("The demo uses scikit-learn's bundled digits: pip install 'effgrad[demo]'") from err
    data = sklearn_digits()
    return (data.images / 16.0).astype("float32")[..., None], data.target.astype("int64")


def digits_cnn(checkpointed: bool, seed: int = 0):
    """The demo's small CNN for 8x8 digits (checkpointed in sqrt(n) segments if ``checkpointed``)."""
    import keras

    import effgrad

    keras.utils.set_random_seed(seed)
    inputs = keras.Input((8, 8, 1))
    h = keras.layers.Conv2D(CHANNELS, 3, padding="same", activation="relu")(inputs)
    for _ in range(BLOCKS):  # residual blocks: a functional graph, not a stack
        h = keras.layers.Add()([h, keras.layers.Conv2D(CHANNELS, 3, padding="same", activation="relu")(h)])
    outputs = keras.layers.Dense(10)(keras.layers.GlobalAveragePooling2D()(h))
    model = keras.Model(inputs, outputs, name="digits_cnn")
    # Cut where every path passes (after each residual sum), sqrt(cuts) segments.
    return effgrad.checkpoint_model(model, segments="sqrt") if checkpointed else model


def _loss():
    import keras

    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _step_memory_mib(checkpointed: bool, micro_batches: int, x, y) -> float:
    """Allocator peak (MiB above what is resident) of one train step."""
    import keras

    import effgrad

    step = effgrad.build_train_step(
        digits_cnn(checkpointed), _loss(), keras.optimizers.Adam(1e-3), micro_batches=micro_batches
    )
    step(x, y)  # trace outside the measurement
    return effgrad.memory.measure(step, x, y).extra_mib


def language_model_memory(vocabulary: int = 50257, length: int = 128, batch: int = 8) -> list[dict]:
    """One AdamW step of a keras_hub GPT-2 LM with a real vocabulary: Keras's own step, effgrad's default
    (the fused loss: the ``[batch * T, V]`` logits never exist) and with int8 optimizer state.

    Each row: the optimizer's state (MiB, counted from its variables) and what the step adds at its
    peak above what is resident (MiB, the allocator's), both measured in this process.
    """
    import keras
    import keras_hub

    import effgrad

    rng = np.random.default_rng(0)
    tokens = rng.integers(1, vocabulary, (batch, length)).astype("int32")
    x, y = {"token_ids": tokens, "padding_mask": np.ones_like(tokens)}, np.roll(tokens, -1, axis=1)

    def language_model():
        keras.utils.set_random_seed(0)
        backbone = keras_hub.models.GPT2Backbone(
            vocabulary_size=vocabulary, num_layers=2, num_heads=4, hidden_dim=128, intermediate_dim=256,
            max_sequence_length=length,
        )  # fmt: skip
        return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)

    rows = []
    for name, compact in (("Keras train_on_batch", False), ("effgrad (fused loss)", False), ("+ int8 state", True)):
        lm = language_model()
        optimizer = keras.optimizers.AdamW(1e-4)
        optimizer = effgrad.compact_state(optimizer) if compact else optimizer
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        if name.startswith("Keras"):
            lm.compile(optimizer=optimizer, loss=loss, weighted_metrics=[])  # no metric reads the logits
            step = lambda lm=lm: lm.train_on_batch(x, y)  # noqa: E731
        else:
            train = effgrad.build_train_step(lm, loss, optimizer)
            step = lambda train=train: train(x, y)  # noqa: E731
        step()  # traced and the state built outside the measurement
        state = sum(v.numpy().nbytes for v in optimizer.variables) / 2**20
        rows.append({"configuration": name, "state_mib": state, "step_mib": effgrad.memory.measure(step).extra_mib})
    return rows


def _print_table(rows: list[dict]) -> None:
    print(f"   {'configuration':<38} {'step MiB':>9} {'vs plain':>9}")
    for row in rows:
        print(f"   {row['configuration']:<38} {row['step_mib']:>9.1f} {row['ratio']:>8.2f}x")


def run(out_dir: str = "effgrad-demo") -> dict:
    import keras

    import effgrad
    from effgrad.explain import visualize

    out = Path(out_dir)
    blocked = next((p for p in (out, *out.parents) if p.exists() and not p.is_dir()), None)
    if blocked is not None:
        raise ValueError(f"--out {out}: {blocked} is a file, not a directory; give a directory (made if missing).")
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    x, y = load_digits()
    print(f"digits: {len(x)} images of 8x8, 10 classes; writing to {out}/\n")

    print("1/5 model.fit with effgrad: batches of 64 as 4 micro-batches, residual blocks checkpointed")
    model = digits_cnn(checkpointed=True)
    model.compile(optimizer=keras.optimizers.Adam(2e-3), loss=_loss(), metrics=["accuracy"])
    effgrad.attach(model, micro_batches=4)
    history = model.fit(x, y, batch_size=64, epochs=15, validation_split=0.2, shuffle=True, verbose=2)
    model.save(out / "digits_cnn.keras")

    print("\n2/5 peak memory of one train step on a batch of 1,024 images (the same update in every row)")
    big_x, big_y = x[:1024], y[:1024]
    configurations = [
        ("plain step", False, 1),
        ("micro_batches=4", False, 4),
        ("checkpoint_model (sqrt)", True, 1),
        ("micro_batches=4 + checkpointing", True, 4),
    ]
    rows = [
        {"configuration": name, "step_mib": _step_memory_mib(ckpt, k, big_x, big_y)} for name, ckpt, k in configurations
    ]
    for row in rows:
        row["ratio"] = row["step_mib"] / rows[0]["step_mib"]
    _print_table(rows)
    print("   loss scaling: off here (float32 on CPU); on a GPU, mixed_float16 turns it on (loss_scale='auto')")

    print("\n3/5 a language model (keras_hub GPT-2, 2 layers, vocabulary 50,257, 8 x 128 tokens), one AdamW step")
    lm_rows = language_model_memory()
    print(f"   {'configuration':<24} {'optimizer state MiB':>20} {'step adds MiB':>14}")
    for row in lm_rows:
        print(f"   {row['configuration']:<24} {row['state_mib']:>20.1f} {row['step_mib']:>14.1f}")
    print("   the fused loss never makes the [1,024, 50,257] logits; compact_state keeps AdamW's moments in int8")

    print("\n4/5 SmoothGrad maps of all images, streamed to maps.npy (resumable with resume=True)")
    maps_path = out / "maps.npy"
    for stale in (maps_path, maps_path.with_name(maps_path.name + ".journal.json")):
        stale.unlink(missing_ok=True)  # the demo's own output from an earlier run
    print("   per-example maps -> maps.npy:")
    maps = effgrad.saliency(
        model, x, method="smoothgrad", samples=8, noise=0.1, reduce="abs_sum", batch_size=256, out=maps_path
    )
    print("   per-class mean and variance maps (saliency_summary, nothing stored per example):")
    summary = effgrad.saliency_summary(model, x, reduce="abs_sum", batch_size=256)

    print("\n5/5 pictures")
    predicted = model.predict(x[:16], verbose=0).argmax(-1)
    grid = visualize.save_grid(
        out / "saliency_grid.png",
        x[:16, ..., 0],
        maps[:16],
        titles=[f"{t} (pred {p})" for t, p in zip(y[:16], predicted)],
    )
    classes = sorted(summary.mean)
    means = visualize.save_grid(
        out / "class_means.png",
        np.stack([x[y == c].mean(0)[..., 0] for c in classes]),
        np.stack([summary.mean[c] for c in classes]),
        titles=[f"class {c} (n={summary.count[c]})" for c in classes],
        columns=5,
    )
    print(f"   {grid}\n   {means}")

    result = {
        "dataset": "scikit-learn digits",
        "examples": int(len(x)),
        "train_accuracy": float(history.history["accuracy"][-1]),
        "val_accuracy": float(history.history["val_accuracy"][-1]),
        "step_memory": rows,
        "language_model": lm_rows,
        "saliency": {"file": str(maps_path), "shape": list(maps.shape), "method": "smoothgrad", "reduce": "abs_sum"},
        "class_counts": {str(c): summary.count[c] for c in classes},
        "pictures": [str(grid), str(means)],
        "seconds": round(time.perf_counter() - start, 1),
    }
    (out / "summary.json").write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"\nvalidation accuracy {result['val_accuracy']:.3f}; wrote {out / 'summary.json'} in {result['seconds']:.0f} s"
    )
    return result
