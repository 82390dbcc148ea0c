"""Compact optimizer state: how it is quantized, what it saves, and whether training notices.

Three tables from one run:

* **quantization**: the slots of Adam after 3 epochs of an MLP on digits,
  encoded by each candidate int8 scheme (block-wise, 2,048 per block) and by
  bfloat16; how often the second moment ``v`` becomes 0 (where
  ``m / (sqrt(v) + eps)`` explodes) and the error of the update ``m / (sqrt(v) + eps)``
  itself. The scheme ``effgrad.compact_state`` uses is the one this table chose.
* **memory**: one Adam step on 8 Dense 2048x2048 (128 MiB of weights, batch 64)
  and on a keras_hub GPT2Backbone 12x768 with GPT-2's vocabulary (124M
  parameters, T=128, batch 2), fresh process per row: Keras ``train_on_batch``
  with float32 Adam (the baseline), effgrad's step with float32 / int8 /
  bfloat16 state, gathered and ``fused_update=True`` (the LM: float32 and int8
  only); state MiB counted from the optimizer's variables.
* **convergence**: the demo's digits CNN (10 epochs, batch 64) and a keras_hub
  GPT-2 LM (2 layers, hidden 64, vocabulary 512, T=32) on a Markov chain with
  4 successors per token (entropy floor 1.28 nats), 3 seeds per state dtype;
  final loss = mean over the last 20 steps. Curves: ``compact_state_convergence.png``.
"""

from __future__ import annotations

from benchmarks import common

MODULE = "benchmarks.compact_state"
BLOCK = 2048


# ---------------------------------------------------------------- quantization
def _slots_of_a_trained_mlp(epochs, width=512):
    import keras
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((64,)), keras.layers.Dense(width, activation="relu"), keras.layers.Dense(width, activation="relu")]
        + [keras.layers.Dense(10)]
    )
    opt = keras.optimizers.Adam(1e-3)
    model.compile(opt, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit((x / 16).astype("float32"), y, batch_size=64, epochs=epochs, verbose=0)
    return opt._momentums[2].numpy().ravel(), opt._velocities[2].numpy().ravel()  # the width x width kernel


def _dynamic_tree(signed):
    # bitsandbytes' dynamic map: per decade 10**-6 .. 10**0, linearly spaced fractions.
    import numpy as np

    values = [0.0, 1.0]
    for i in range(7):
        n = 2**i if signed else 2 ** (i + 1)
        edges = np.linspace(0.1, 1, n + 1)
        means = list((edges[:-1] + edges[1:]) / 2 * 10.0 ** (i - 6))
        values += means + ([-m for m in means] if signed else [])
    return np.array(sorted(values))


def _encode(x, scheme):
    import numpy as np

    if scheme == "bfloat16":
        import tensorflow as tf

        return tf.cast(tf.cast(x, tf.bfloat16), tf.float32).numpy()
    if scheme.startswith("int8 fourth root"):
        import tensorflow as tf

        from effgrad.train.compact import dequantize, quantize

        return dequantize(*quantize(tf.constant(x), BLOCK), x.shape).numpy()
    blocks = x.reshape(-1, BLOCK)
    scale = np.abs(blocks).max(1, keepdims=True)
    scale[scale == 0] = 1
    u = blocks / scale
    signed = bool((x < 0).any())
    if scheme == "int8 dynamic tree":
        table = _dynamic_tree(signed)
        codes = table[np.searchsorted((table[1:] + table[:-1]) / 2, u)]
    else:  # "int8 linear" / "int8 square root": x ~ (q / L) ** p
        power = {"int8 linear": 1, "int8 square root": 2}[scheme]
        levels = 127 if signed else 255
        codes = np.sign(u) * (np.round(levels * np.abs(u) ** (1 / power)) / levels) ** power
    return (codes * scale).ravel()


def _quantization(quick):
    import numpy as np

    m, v = _slots_of_a_trained_mlp(1, width=64) if quick else _slots_of_a_trained_mlp(3)  # quick: 2 blocks of 2,048
    update = m / (np.sqrt(v) + 1e-7)
    rows = []
    for scheme in ["int8 linear", "int8 dynamic tree", "int8 square root", "int8 fourth root (effgrad)", "bfloat16"]:
        mq, vq = _encode(m, scheme), _encode(v, scheme)
        error = np.abs(mq / (np.sqrt(vq) + 1e-7) - update)
        rows.append(
            {
                "scheme": scheme,
                "v_zeroed": float(np.mean(vq == 0) - np.mean(v == 0)),
                "m_error": float(np.linalg.norm(mq - m) / np.linalg.norm(m)),
                "v_error": float(np.linalg.norm(vq - v) / np.linalg.norm(v)),
                "update_median": float(np.median(error)),
                "update_p99": float(np.quantile(error, 0.99)),
                "update_max": float(error.max()),
            }
        )
    return rows, float(np.median(np.abs(update)))


# ---------------------------------------------------------------- memory
def child(config: dict) -> dict:
    return _convergence_child(config) if config.get("convergence") else _memory_child(config)


def _memory_child(config: dict) -> dict:
    import keras
    import numpy as np
    import tensorflow as tf

    import effgrad

    keras.utils.set_random_seed(0)
    rng, batch = np.random.default_rng(0), config["batch"]
    if config["model"] == "gpt2":  # the fine-tuning LM of benchmarks/step_floor.py
        from benchmarks.step_floor import _gpt2

        model, seq = _gpt2(config), config["seq"]
        x = [tf.constant(rng.integers(0, config["vocab"], (batch, seq)), tf.int32), tf.ones((batch, seq), tf.int32)]
        y = tf.constant(rng.normal(size=(batch, seq, config["hidden"])).astype("float32"))
    else:
        width = config["width"]
        model = keras.Sequential(
            [keras.Input((width,))] + [keras.layers.Dense(width, activation="relu") for _ in range(config["depth"])]
        )
        x = tf.constant(rng.normal(size=(batch, width)).astype("float32"))
        y = tf.constant(rng.normal(size=(batch, width)).astype("float32"))
    opt = keras.optimizers.Adam(1e-4)
    if config["state"] != "float32":
        opt = effgrad.compact_state(opt, dtype=config["state"])
    if config["method"] == "keras":
        model.compile(optimizer=opt, loss="mse")
        model.optimizer.build(model.trainable_variables)  # else the first call traces twice

        def one_step():
            return model.train_on_batch(x, y)
    else:
        step = effgrad.build_train_step(model, "mse", opt, fused_update=config["method"] == "effgrad fused")

        def one_step():
            return step(x, y)["loss"]

    one_step()
    report = effgrad.memory.measure(one_step)
    seconds = common.median_time(one_step, warmup=0, repeats=config["repeats"])
    state = sum(v.numpy().nbytes for v in opt.variables if len(v.shape)) / 2**20
    weights = sum(v.numpy().nbytes for v in model.trainable_variables) / 2**20
    return {"peak_mib": report.peak_mib, "seconds": seconds, "state_mib": state, "weights_mib": weights}


def _memory(quick):
    dense = {"model": "dense", "depth": 8, "width": 2048, "batch": 64, "repeats": 5}
    gpt2 = {"model": "gpt2", "vocab": 50257, "layers": 12, "heads": 12, "hidden": 768, "seq": 128, "batch": 2}
    shapes = [
        ("8 Dense 2048x2048, batch 64", dense, 2),
        ("GPT2Backbone 12x768 (V=50,257), T=128, batch 2", {**gpt2, "repeats": 2}, 1),
    ]
    plan = [
        ("keras", "float32"),
        ("keras", "int8"),
        ("effgrad gathered", "float32"),
        ("effgrad gathered", "int8"),
        ("effgrad fused", "float32"),
        ("effgrad fused", "int8"),
        ("effgrad fused", "bfloat16"),
    ]
    if quick:  # the code paths, not measurements
        shapes = [("1 Dense 512x512, batch 16", {**dense, "depth": 1, "width": 512, "batch": 16, "repeats": 1}, 1)]
        plan = [("keras", "float32"), ("effgrad gathered", "int8"), ("effgrad fused", "bfloat16")]
    rows = []
    for name, base, rounds in shapes:
        # The LM: Keras's step, effgrad's gathered and fused (its default there) steps, float32 and int8 state.
        methods = plan if base["model"] == "dense" else plan[:6]
        configs = [{**base, "method": method, "state": state} for method, state in methods]
        results = common.run_rounds(MODULE, configs, rounds=rounds)
        group = [{"model": name, "method": m, "state": s, **r} for (m, s), r in zip(methods, results)]
        keras_adam = group[0]
        for row in group:
            row["vs_keras"] = row["peak_mib"] / keras_adam["peak_mib"]
            row["time_vs_keras"] = row["seconds"] / keras_adam["seconds"]
            row["state_vs_float32"] = row["state_mib"] / keras_adam["state_mib"]
        rows.extend(group)
    return rows


# ---------------------------------------------------------------- convergence
def _digits_run(state, seed, epochs, steps=None):
    import keras
    import numpy as np

    import effgrad
    from effgrad.cli import demo

    x, y = demo.load_digits()
    keras.utils.set_random_seed(seed)
    model = demo.digits_cnn(checkpointed=False, seed=seed)
    opt = keras.optimizers.Adam(1e-3)
    if state != "float32":
        opt = effgrad.compact_state(opt, dtype=state)
    step = effgrad.build_train_step(model, keras.losses.SparseCategoricalCrossentropy(from_logits=True), opt)
    rng, losses = np.random.default_rng(seed), []
    for _ in range(epochs):
        order = rng.permutation(len(x))
        for i in range(0, len(x) - 63, 64):
            rows = order[i : i + 64]
            losses.append(float(step(x[rows], y[rows])["loss"]))
            if len(losses) == steps:  # --quick: the first steps of the epoch
                return losses
    return losses


def _markov_tokens(rng, batch, seq, vocab):
    import numpy as np

    successors = np.random.default_rng(1234).integers(0, vocab, size=(vocab, 4))  # the task, fixed
    probabilities = np.array([0.4, 0.3, 0.2, 0.1])
    tokens = np.empty((batch, seq + 1), "int32")
    tokens[:, 0] = rng.integers(0, vocab, batch)
    for t in range(seq):
        choice = (rng.random(batch)[:, None] > np.cumsum(probabilities)[None, :]).sum(1)
        tokens[:, t + 1] = successors[tokens[:, t], choice]
    return tokens


def _lm_run(state, seed, steps):
    import keras
    import keras_hub
    import numpy as np

    import effgrad

    vocab, seq, batch = 512, 32, 32
    keras.utils.set_random_seed(seed)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=vocab,
        num_layers=2,
        num_heads=4,
        hidden_dim=64,
        intermediate_dim=256,
        max_sequence_length=seq,
        dropout=0.0,
    )
    model = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
    opt = keras.optimizers.Adam(3e-3)
    if state != "float32":
        opt = effgrad.compact_state(opt, dtype=state)
    step = effgrad.build_train_step(model, keras.losses.SparseCategoricalCrossentropy(from_logits=True), opt)
    rng, losses = np.random.default_rng(seed), []
    mask = np.ones((batch, seq), "int32")
    for _ in range(steps):
        tokens = _markov_tokens(rng, batch, seq, vocab)
        x = {"token_ids": tokens[:, :-1], "padding_mask": mask}
        losses.append(float(step(x, tokens[:, 1:])["loss"]))
    return losses


def _convergence_child(config: dict) -> dict:
    if config["task"] == "digits CNN":
        return {"losses": _digits_run(config["state"], config["seed"], config["length"], config.get("steps"))}
    return {"losses": _lm_run(config["state"], config["seed"], config["length"])}


def _convergence(quick):
    import numpy as np

    # Quick: the LM's code path is the digits CNN's with another model (and 8 s of tracing).
    tasks = {"digits CNN": 1} if quick else {"digits CNN": 10, "GPT-2 LM, Markov tokens": 400}
    seeds = [0] if quick else [0, 1, 2]
    rows, curves = [], {}
    for task, length in tasks.items():
        finals = {}
        # Quick: int8's compiled update (seconds of XLA per variable) runs in the memory rows.
        for state in ("float32", "bfloat16") if quick else ("float32", "int8", "bfloat16"):
            runs = [
                common.run_isolated(
                    MODULE,
                    {"convergence": True, "task": task, "state": state, "seed": s, "length": length}
                    | ({"steps": 4} if quick else {}),
                )["losses"]
                for s in seeds
            ]
            curves[f"{task}|{state}"] = np.mean(runs, axis=0).tolist()
            finals[state] = [float(np.mean(r[-20:])) for r in runs]
        low, high = min(finals["float32"]), max(finals["float32"])
        for state, values in finals.items():
            mean = float(np.mean(values))
            rows.append(
                {
                    "task": task,
                    "state": state,
                    "final_loss": mean,
                    "seeds": ", ".join(f"{v:.4f}" for v in values),
                    "float32_spread": f"{low:.4f} - {high:.4f}",
                    # Within float32's spread (widened by it, for 3 seeds) or better.
                    "within_spread": mean <= high + (high - low),
                }
            )
    return rows, curves


def run(quick: bool = False) -> dict:
    quantization, median_update = _quantization(quick)
    memory = _memory(quick)
    convergence, curves = _convergence(quick)
    title = (
        "Compact optimizer state, one Adam step on weight-dominated models (fine-tuning), fresh process per row; "
        "'vs Keras' = against Keras train_on_batch with float32 Adam"
    )
    columns = [
        ("model", "model", ""),
        ("method", "method", ""),
        ("state", "state", ""),
        ("weights_mib", "weights MiB", ".0f"),
        ("state_mib", "state MiB", ".1f"),
        ("state_vs_float32", "state vs float32", ".3f"),
        ("peak_mib", "peak MiB", ".0f"),
        ("vs_keras", "vs Keras", ".2f"),
        ("seconds", "s / step", ".3f"),
        ("time_vs_keras", "time vs Keras", ".2f"),
    ]
    payload = common.publish(
        "compact_state", title, memory, columns, quantization=quantization, convergence=convergence, curves=curves
    )
    extra = [
        f"### How to store Adam's slots in 8 bits (update median |m/sqrt(v)| = {median_update:.3f})\n",
        common.markdown_table(
            quantization,
            [
                ("scheme", "scheme", ""),
                ("v_zeroed", "v entries zeroed", ".4f"),
                ("m_error", "m rel. error", ".4f"),
                ("v_error", "v rel. error", ".4f"),
                ("update_median", "update error median", ".4f"),
                ("update_p99", "p99", ".3f"),
                ("update_max", "max", ".1f"),
            ],
        ),
        "\n### Convergence (final loss: mean of the last 20 steps; per seed)\n",
        common.markdown_table(
            convergence,
            [
                ("task", "task", ""),
                ("state", "state", ""),
                ("final_loss", "final loss", ".4f"),
                ("seeds", "per seed", ""),
                ("float32_spread", "float32 spread", ""),
                ("within_spread", "within spread", ""),
            ],
        ),
    ]
    path = common.RESULTS / "compact_state.md"
    path.write_text(path.read_text() + "\n" + "\n".join(extra) + "\n")
    return payload


if __name__ == "__main__":
    common.child_main(child)
