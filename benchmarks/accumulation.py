"""Micro-batch accumulation: peak memory and time per effective batch, against Keras.

Per effective batch of B rows, in a fresh process each:

* ``keras train_on_batch``: Keras's own step on the whole batch (k=1);
* ``keras GA k``: Keras 3's ``gradient_accumulation_steps=k``, k calls of B/k rows;
* ``effgrad k``: ``build_train_step(micro_batches=k)``, one call.

``peak`` is the allocator's absolute peak during the effective batch: it
includes everything resident (parameters, optimizer slots, accumulators, the
batch). The memory floor of one effective batch, from shapes::

    parameters + optimizer slots + ONE gradient-sized float32 buffer (the
    accumulator; with k=1 the gradient itself) + the batch + one micro-batch's
    saved activations + the largest variable's transient gradient

Every term comes from shapes except the saved activations: which tensors each
op keeps for backprop is not in the layer shapes (an erf-based GELU keeps
several per layer), so they are measured once per micro-batch size with a
plain tape forward/backward (``_saved_activations_mib``).
"""

from __future__ import annotations

import math

from benchmarks import common

MODULE = "benchmarks.accumulation"


def _model(depth, width):
    import keras

    keras.utils.set_random_seed(0)
    layers = [keras.Input((width,))]
    layers += [keras.layers.Dense(width, activation="gelu") for _ in range(depth)]
    layers += [keras.layers.Dense(10)]
    return keras.Sequential(layers)


def _mib(variables) -> float:
    import numpy as np

    return sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in variables) / 2**20


def _saved_activations_mib(model, loss, x, y) -> float:
    """What a tape keeps for backprop of one micro-batch (measured: which tensors each op saves
    is not in the layer shapes; e.g. an erf-based GELU keeps several per layer)."""
    import tensorflow as tf

    import effgrad

    @tf.function
    def kept(x, y):
        with tf.GradientTape() as tape:
            value = tf.reduce_mean(loss(y, model(x, training=True)))
        # The first layer's gradient needs backprop through every layer, so
        # every saved activation is alive when backprop starts: that is the peak.
        return tf.reduce_sum(tape.gradient(value, model.trainable_variables[0]))

    kept(x, y)
    report = effgrad.memory.measure(kept, x, y)
    return report.extra_bytes / 2**20


def child(config: dict) -> dict:
    import time

    import keras
    import numpy as np
    import tensorflow as tf

    import effgrad

    k, batch, method, width, depth = config["k"], config["batch"], config["method"], config["width"], config["depth"]
    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(size=(batch, width)).astype("float32"))
    y = tf.constant(rng.integers(0, 10, size=batch))
    model = _model(depth, width)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def optimizer(**kwargs):
        if config["optimizer"] == "sgd":
            return keras.optimizers.SGD(1e-3, **kwargs)
        return keras.optimizers.Adam(1e-4, **kwargs)

    if method == "effgrad":
        opt = optimizer()
        step = effgrad.build_train_step(model, loss, opt, micro_batches=k)

        def one_effective_batch():
            return step(x, y)["loss"]
    else:
        opt = optimizer(gradient_accumulation_steps=k) if k > 1 else optimizer()
        model.compile(optimizer=opt, loss=loss)
        model.optimizer.build(model.trainable_variables)  # else the first call traces twice
        size = batch // k
        chunks = [(x[i * size : (i + 1) * size], y[i * size : (i + 1) * size]) for i in range(k)]

        def one_effective_batch():
            return [model.train_on_batch(a, b) for a, b in chunks][-1]

    start = time.perf_counter()
    one_effective_batch()  # trace and build outside the measurement
    first_call = time.perf_counter() - start
    report = effgrad.memory.measure(one_effective_batch)
    seconds = common.median_time(one_effective_batch, warmup=0, repeats=config["repeats"])

    params = _mib(model.trainable_variables)
    slots = _mib([v for v in opt.variables if len(v.shape) and "accumulator" not in v.name])
    largest = max(int(np.prod(v.shape)) for v in model.trainable_variables) * 4 / 2**20
    data = (x.shape.num_elements() * 4 + y.shape.num_elements() * 8) / 2**20
    activations = _saved_activations_mib(model, loss, x[: math.ceil(batch / k)], y[: math.ceil(batch / k)])
    floor = params + slots + params + data + activations + largest  # one gradient-sized buffer for any k
    return {"peak_mib": report.peak_mib, "floor_mib": floor, "seconds": seconds, "first_call_seconds": first_call}


def run(quick: bool = False) -> dict:
    if quick:
        base, batches, optimizers, ks = {"depth": 1, "width": 32, "repeats": 1}, [32], ["sgd"], [1, 4]
    else:
        base, batches, optimizers, ks = (
            {"depth": 16, "width": 1024, "repeats": 3},
            [1024, 4096],
            ["sgd", "adam"],
            [
                1,
                2,
                4,
                8,
            ],
        )
    rows = []
    for batch in batches:
        for opt in optimizers:
            group = []
            plan = [("keras", 1)] + [(m, k) for k in ks for m in ("effgrad", "keras") if k > 1 or m == "effgrad"]
            configs = [{**base, "batch": batch, "k": k, "method": m, "optimizer": opt} for m, k in plan]
            # Interleaved rounds, fastest of each: process-to-process timing drift is tens of percent here.
            results = common.run_rounds(MODULE, configs, rounds=1 if quick else 2)
            for (method, k), result in zip(plan, results):
                name = (
                    "keras train_on_batch"
                    if method == "keras" and k == 1
                    else f"keras GA {k}"
                    if method == "keras"
                    else f"effgrad k={k}"
                )
                group.append({"batch": batch, "optimizer": opt, "method": name, "k": k, **result})
            keras_plain = group[0]
            effgrad_plain = next(r for r in group if r["method"] == "effgrad k=1")
            for row in group:
                row["vs_floor"] = row["peak_mib"] / row["floor_mib"]
                row["vs_keras_step"] = row["peak_mib"] / keras_plain["peak_mib"]
                row["vs_effgrad_k1"] = row["peak_mib"] / effgrad_plain["peak_mib"]
                row["time_vs_keras_step"] = row["seconds"] / keras_plain["seconds"]
                same_k = [r for r in group if r["k"] == row["k"] and r is not row]
                if same_k:
                    other = same_k[0]
                    row["peak_vs_other"] = row["peak_mib"] / other["peak_mib"]
                    row["time_vs_other"] = row["seconds"] / other["seconds"]
            rows.extend(group)
    title = (
        f"Gradient accumulation vs Keras: {base['depth']}x{base['width']} GELU MLP, one effective batch. "
        "peak = absolute allocator peak (parameters, slots, accumulators and batch included); floor from shapes; "
        "'vs same-k peer' = effgrad k vs Keras GA k (and Keras vs effgrad)"
    )
    columns = [
        ("batch", "batch", "d"),
        ("optimizer", "opt", ""),
        ("method", "method", ""),
        ("peak_mib", "peak MiB", ".0f"),
        ("floor_mib", "floor MiB", ".0f"),
        ("vs_floor", "vs floor", ".2f"),
        ("vs_effgrad_k1", "vs effgrad k=1", ".2f"),
        ("vs_keras_step", "vs Keras step", ".2f"),
        ("peak_vs_other", "peak vs same-k peer", ".2f"),
        ("seconds", "s / batch", ".3f"),
        ("time_vs_keras_step", "time vs Keras step", ".2f"),
        ("time_vs_other", "time vs same-k peer", ".2f"),
        ("first_call_seconds", "first call s", ".1f"),
    ]
    return common.publish("accumulation", title, rows, columns, config=base)


if __name__ == "__main__":
    common.child_main(child)
