"""Loss scaling: step-time overhead and mixed_float16 memory.

* time: effgrad with no scaling vs dynamic scaling vs Keras 3's
  ``LossScaleOptimizer`` (stock ``model.train_on_batch``) on the same model;
* memory: the absolute allocator peak of a step (everything resident
  included: what decides an out-of-memory error) and what the step added to
  the bytes in use before it (which also moves with what each
  implementation keeps alive between steps, so it is shown, not compared).
"""

from __future__ import annotations

from benchmarks import common

MODULE = "benchmarks.loss_scaling"


def child(config: dict) -> dict:
    import keras
    import numpy as np

    import effgrad

    keras.config.set_dtype_policy(config["policy"])
    keras.utils.set_random_seed(0)
    width, batch = config["width"], config["batch"]
    model = keras.Sequential(
        [keras.Input((width,))]
        + [keras.layers.Dense(width, activation="relu") for _ in range(config["depth"])]
        + [keras.layers.Dense(10)]
    )
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch, width)).astype("float32")
    y = rng.integers(0, 10, size=batch)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    if config["kind"] == "keras_loss_scale_optimizer":
        optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(1e-4))
        model.compile(optimizer=optimizer, loss=loss, jit_compile=False)
        model.optimizer.build(model.trainable_variables)  # else the first call traces twice

        def step():
            return model.train_on_batch(x, y)
    else:
        train = effgrad.build_train_step(model, loss, keras.optimizers.Adam(1e-4), loss_scale=config["loss_scale"])

        def step():
            return train(x, y)["loss"]

    step()
    report = effgrad.memory.measure(step)
    seconds = common.median_time(step, warmup=1, repeats=config["repeats"])
    return {"peak_mib": report.peak_mib, "step_mib": report.extra_mib, "seconds": seconds}


def run(quick: bool = False) -> dict:
    base = (
        {"depth": 1, "width": 32, "batch": 32, "repeats": 1}
        if quick
        else {"depth": 8, "width": 1024, "batch": 512, "repeats": 5}
    )
    configs = [
        ("effgrad, no scaling", {"kind": "effgrad", "loss_scale": None, "policy": "float32"}),
        ("effgrad, dynamic scaling", {"kind": "effgrad", "loss_scale": "dynamic", "policy": "float32"}),
        ("Keras LossScaleOptimizer", {"kind": "keras_loss_scale_optimizer", "loss_scale": None, "policy": "float32"}),
        ("effgrad, mixed_float16 (auto)", {"kind": "effgrad", "loss_scale": "auto", "policy": "mixed_float16"}),
    ]
    results = common.run_rounds(MODULE, [{**base, **config} for _, config in configs], rounds=1 if quick else 3)
    rows = [{"method": label, **result} for (label, _), result in zip(configs, results)]
    plain = rows[0]
    for row in rows:
        row["time_ratio"] = row["seconds"] / plain["seconds"]
        row["memory_ratio"] = row["peak_mib"] / plain["peak_mib"]
    title = (
        f"Loss scaling: {base['depth']}x{base['width']} MLP, batch {base['batch']}, Adam "
        "(ratios vs effgrad without scaling, float32)"
    )
    columns = [
        ("method", "method", ""),
        ("seconds", "s / step", ".4f"),
        ("time_ratio", "time ratio", ".2f"),
        ("peak_mib", "peak MiB", ".1f"),
        ("memory_ratio", "peak ratio", ".2f"),
        ("step_mib", "added by the step MiB", ".1f"),
    ]
    return common.publish("loss_scaling", title, rows, columns, config=base)


if __name__ == "__main__":
    common.child_main(child)
