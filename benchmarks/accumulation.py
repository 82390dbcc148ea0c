"""Micro-batch accumulation: peak memory and time per effective batch.

Compares effgrad micro_batches k against k=1 (the plain full batch) and
Keras 3's own ``gradient_accumulation_steps`` (k calls of batch B/k), on an
activation-heavy MLP.
"""

from __future__ import annotations

from benchmarks import common

MODULE = "benchmarks.accumulation"


def _model(depth, width, features):
    import keras

    keras.utils.set_random_seed(0)
    layers = [keras.Input((features,))]
    layers += [keras.layers.Dense(width, activation="relu") for _ in range(depth)]
    layers += [keras.layers.Dense(10)]
    return keras.Sequential(layers)


def child(config: dict) -> dict:
    import keras
    import numpy as np

    import effgrad

    k, batch, kind = config["k"], config["batch"], config["kind"]
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch, config["width"])).astype("float32")
    y = rng.integers(0, 10, size=batch)
    model = _model(config["depth"], config["width"], config["width"])
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    if kind == "effgrad":
        step = effgrad.build_train_step(model, loss, keras.optimizers.Adam(1e-4), micro_batches=k)

        def one_effective_batch():
            return step(x, y)["loss"]
    else:
        model.compile(optimizer=keras.optimizers.Adam(1e-4, gradient_accumulation_steps=k), loss=loss)
        size = batch // k
        chunks = [(x[i * size : (i + 1) * size], y[i * size : (i + 1) * size]) for i in range(k)]

        def one_effective_batch():
            return [model.train_on_batch(a, b) for a, b in chunks][-1]

    one_effective_batch()  # trace and build outside the measurement
    report = effgrad.memory.measure(one_effective_batch)
    seconds = common.median_time(one_effective_batch, warmup=0, repeats=config["repeats"])
    # Keras keeps its accumulators in optimizer variables between steps, and
    # TensorFlow creates variables from host buffers the allocator statistics
    # do not see; so they are counted from their shapes. effgrad's
    # accumulators are tensors inside the step and show in step_mib.
    mib = lambda variables: sum(int(np.prod(v.shape)) * 4 for v in variables) / 2**20  # noqa: E731
    accumulators = (
        [v for v in model.optimizer.variables if "gradient_accumulator" in v.name] if kind != "effgrad" else []
    )
    return {
        "step_mib": report.extra_mib,
        "resident_accumulators_mib": mib(accumulators),
        "gradient_mib": mib(model.trainable_variables),
        "seconds": seconds,
    }


def run(quick: bool = False) -> dict:
    if quick:
        base, batches, ks = {"depth": 4, "width": 256, "repeats": 2}, [256], [1, 2, 4]
    else:
        # Batch 512 is where activations (~64 MiB) merely equal the gradients;
        # batch 4096 is the activation-heavy case accumulation exists for.
        base, batches, ks = {"depth": 16, "width": 1024, "repeats": 3}, [512, 4096], [1, 2, 4, 8, 16]
    rows = []
    for batch in batches:
        plain = None
        for kind in ("effgrad", "keras_gradient_accumulation_steps"):
            for k in ks:
                if kind != "effgrad" and k == 1:
                    continue  # k=1 is the same plain step for both
                result = common.run_isolated(MODULE, {**base, "batch": batch, "k": k, "kind": kind})
                row = {"batch": batch, "method": kind, "k": k, **result}
                row["training_mib"] = row["step_mib"] + row["resident_accumulators_mib"]
                # What is left after one gradient buffer (two with accumulation):
                # an estimate of the activations kept for backprop.
                buffers = 1 if k == 1 else 2
                row["activations_mib"] = max(row["training_mib"] - buffers * row["gradient_mib"], 0.0)
                plain = plain or row
                row["memory_ratio"] = row["training_mib"] / plain["training_mib"]
                row["activation_ratio"] = row["activations_mib"] / plain["activations_mib"]
                row["time_ratio"] = row["seconds"] / plain["seconds"]
                rows.append(row)
    title = (
        f"Gradient accumulation: {base['depth']}x{base['width']} MLP, Adam, one effective batch. "
        "training MiB = allocator peak added by the step + resident accumulator variables (Keras); "
        "activations = training MiB minus gradient buffers; ratios vs k=1 of the same batch"
    )
    columns = [
        ("batch", "batch", "d"),
        ("method", "method", ""),
        ("k", "k", "d"),
        ("training_mib", "training MiB", ".0f"),
        ("memory_ratio", "vs k=1", ".2f"),
        ("activations_mib", "activations MiB", ".0f"),
        ("activation_ratio", "vs k=1", ".2f"),
        ("seconds", "s / effective batch", ".3f"),
        ("time_ratio", "time vs k=1", ".2f"),
    ]
    return common.publish("accumulation", title, rows, columns, config=base)


if __name__ == "__main__":
    common.child_main(child)
