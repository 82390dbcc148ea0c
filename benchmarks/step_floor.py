"""The train step where weights dominate (fine-tuning): peak and time against Keras and the floor.

Per configuration, in a fresh process each:

* ``keras train_on_batch`` (k=1) and ``keras GA k`` (``gradient_accumulation_steps=k``,
  k calls of B/k rows; k = 4, or the batch size if smaller): Keras's own steps;
* ``effgrad gathered``: ``fused_update=False``, every gradient held before the one update;
* ``effgrad fused``: ``fused_update=True`` (what ``"auto"``, the default, picks on these
  models): each variable's update as backprop makes its gradient, two backward passes;
* ``effgrad auto`` with ``micro_batches=k``: accumulated in place as backprop makes each gradient.

``floor`` from shapes: parameters + optimizer slots + the batch + the largest
single gradient, + one gradient-sized accumulator with k > 1 (a fused k=1 step
needs no gradient buffer); activations are left out (they are small here:
that is what makes these models weight-dominated). The third model is one
large untied token table: its gradient reaches the optimizer as the rows the
batch looked up, and Adam's update of it is the step's peak.
"""

from __future__ import annotations

from benchmarks import common

MODULE = "benchmarks.step_floor"


def _dense_stack(config):
    import keras

    keras.utils.set_random_seed(0)
    width = config["width"]
    layers = [keras.Input((width,))] + [keras.layers.Dense(width, activation="relu") for _ in range(config["depth"])]
    return keras.Sequential(layers)


def _gpt2(config):
    import keras
    import keras_hub

    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=config["vocab"],
        num_layers=config["layers"],
        num_heads=config["heads"],
        hidden_dim=config["hidden"],
        intermediate_dim=4 * config["hidden"],
        max_sequence_length=config["seq"],
        dropout=0.0,
    )
    tokens = keras.Input((config["seq"],), dtype="int32", name="token_ids")
    mask = keras.Input((config["seq"],), dtype="int32", name="padding_mask")
    hidden = backbone({"token_ids": tokens, "padding_mask": mask})
    return keras.Model([tokens, mask], keras.layers.Dense(config["hidden"])(hidden))  # a regression head


def _bag_of_embeddings(config):
    """A text classifier whose weights are one large, untied token table (fastText-like): its gradient
    reaches the optimizer as the rows the batch looked up (IndexedSlices)."""
    import keras

    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((config["seq"],), dtype="int32"),
            keras.layers.Embedding(config["vocab"], config["hidden"]),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(config["classes"]),
        ]
    )


def child(config: dict) -> dict:
    import keras
    import numpy as np
    import tensorflow as tf

    import effgrad

    rng = np.random.default_rng(0)
    batch = config["batch"]
    if config["model"] == "gpt2":
        model = _gpt2(config)
        seq = config["seq"]
        x = [tf.constant(rng.integers(0, config["vocab"], (batch, seq)), tf.int32), tf.ones((batch, seq), tf.int32)]
        y = tf.constant(rng.normal(size=(batch, seq, config["hidden"])).astype("float32"))
    elif config["model"] == "embedding":
        model = _bag_of_embeddings(config)
        x = tf.constant(rng.integers(0, config["vocab"], (batch, config["seq"])), tf.int32)
        y = tf.constant(rng.normal(size=(batch, config["classes"])).astype("float32"))
    else:
        model = _dense_stack(config)
        x = tf.constant(rng.normal(size=(batch, config["width"])).astype("float32"))
        y = tf.constant(rng.normal(size=(batch, config["width"])).astype("float32"))
    method, k = config["method"], config["k"]
    accumulation = {"gradient_accumulation_steps": k} if method == "keras" and k > 1 else {}
    if config["optimizer"] == "sgd":
        opt = keras.optimizers.SGD(1e-3, **accumulation)
    else:
        opt = keras.optimizers.Adam(1e-4, **accumulation)
    fused_update = None
    if method == "keras":
        model.compile(optimizer=opt, loss="mse")
        model.optimizer.build(model.trainable_variables)  # else the first call traces twice
        size = batch // k
        rows = [slice(i * size, (i + 1) * size) for i in range(k)]
        chunks = [(tf.nest.map_structure(lambda t, r=r: t[r], x), y[r]) for r in rows]

        def one_batch():
            return [model.train_on_batch(a, b) for a, b in chunks][-1]
    else:
        options = {"micro_batches": k}
        if method != "effgrad auto":
            options["fused_update"] = method == "effgrad fused"
        step = effgrad.build_train_step(model, "mse", opt, **options)

        def one_batch():
            return step(x, y)["loss"]

    one_batch()  # trace and build outside the measurement
    if method != "keras":
        fused_update = step.fused_update
    report = effgrad.memory.measure(one_batch)
    seconds = common.median_time(one_batch, warmup=0, repeats=config["repeats"])

    def mib(variables):
        return (
            sum(
                int(np.prod(v.shape)) * np.dtype(v.dtype.name if hasattr(v.dtype, "name") else v.dtype).itemsize
                for v in variables
            )
            / 2**20
        )

    params = mib(model.trainable_variables)
    slots = mib([v for v in opt.variables if len(v.shape) and "accumulat" not in v.name])
    largest = max(int(np.prod(v.shape)) for v in model.trainable_variables) * 4 / 2**20
    data = sum(t.shape.num_elements() * t.dtype.size for t in tf.nest.flatten([x, y])) / 2**20
    floor = params + slots + data + largest + (params if k > 1 else 0)
    return {"peak_mib": report.peak_mib, "floor_mib": floor, "seconds": seconds, "fused": fused_update}


def _configs(quick: bool) -> list[tuple[str, dict]]:
    dense = {"model": "dense", "depth": 8, "width": 2048, "batch": 64, "repeats": 3}
    gpt2 = {
        "model": "gpt2",
        "vocab": 50257,
        "layers": 12,
        "heads": 12,
        "hidden": 768,
        "seq": 128,
        "batch": 2,
        "repeats": 2,
    }
    table = {"model": "embedding", "vocab": 200000, "hidden": 256, "seq": 64, "classes": 10, "batch": 32, "repeats": 3}
    if quick:
        return [
            ("2x64 Dense, batch 8", {**dense, "depth": 2, "width": 64, "batch": 8, "repeats": 1}),
            ("Embedding 500x16, batch 4", {**table, "vocab": 500, "hidden": 16, "seq": 8, "batch": 4, "repeats": 1}),
        ]
    return [
        ("8 Dense 2048x2048, batch 64", dense),
        ("GPT2Backbone 12x768, T=128, batch 2", gpt2),
        ("Embedding 200,000x256 + Dense, T=64, batch 32", table),
    ]


def run(quick: bool = False) -> dict:
    rows = []
    for name, base in _configs(quick):
        k = min(4, base["batch"])  # Keras's GA needs at least one row per call
        plan = [
            ("keras", 1),
            ("effgrad gathered", 1),
            ("effgrad fused", 1),
            ("effgrad auto", 1),
            ("keras", k),
            ("effgrad auto", k),
        ]
        for optimizer in ["sgd"] if quick else ["sgd", "adam"]:
            configs = [{**base, "method": m, "k": ki, "optimizer": optimizer} for m, ki in plan]
            results = common.run_rounds(MODULE, configs, rounds=1)
            group = []
            for (method, ki), result in zip(plan, results):
                label = ("keras train_on_batch" if ki == 1 else f"keras GA {ki}") if method == "keras" else method
                group.append({"model": name, "optimizer": optimizer, "method": label, "k": ki, **result})
            keras_rows = {row["k"]: row for row in group if row["method"].startswith("keras")}
            for row in group:
                peer = keras_rows[row["k"]]
                row["vs_keras"] = row["peak_mib"] / peer["peak_mib"]
                row["time_vs_keras"] = row["seconds"] / peer["seconds"]
                row["vs_floor"] = row["peak_mib"] / row["floor_mib"]
            rows.extend(group)
    title = (
        "The step on weight-dominated models (fine-tuning): absolute allocator peak of one batch, fresh process "
        "per row; 'vs Keras' = against Keras's own step with the same k (train_on_batch, or GA k)"
    )
    columns = [
        ("model", "model", ""),
        ("optimizer", "opt", ""),
        ("method", "method", ""),
        ("k", "k", "d"),
        ("fused", "fused", ""),
        ("peak_mib", "peak MiB", ".0f"),
        ("floor_mib", "floor MiB", ".0f"),
        ("vs_floor", "vs floor", ".2f"),
        ("vs_keras", "vs Keras", ".2f"),
        ("seconds", "s / batch", ".3f"),
        ("time_vs_keras", "time vs Keras", ".2f"),
    ]
    return common.publish("step_floor", title, rows, columns)


if __name__ == "__main__":
    common.child_main(child)
