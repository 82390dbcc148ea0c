"""Diagnostics: what the gradient noise scale costs, and two real runs to look at.

* cost: step time of ``micro_batches=8`` with and without ``noise_scale=True``
  (16x1024 GELU MLP, batch 1024, Adam), interleaved rounds, best of each;
* a real run: a small CNN on scikit-learn's digits trained with
  ``noise_scale=True``: B_simple per step next to the loss (noise_scale.png);
* MemoryMonitor on a clean fit and on a fit whose callback keeps device
  tensors in a list (memory_monitor.png).
"""

from __future__ import annotations

from benchmarks import common

MODULE = "benchmarks.diagnostics"


def child(config: dict) -> dict:
    if config["kind"] == "cost":
        return _cost(config)
    if config["kind"] == "run":
        return _real_run(config)
    return _monitor(config)


def _cost(config):
    import keras
    import numpy as np
    import tensorflow as tf

    import effgrad

    keras.utils.set_random_seed(0)
    width = config["width"]
    model = keras.Sequential(
        [keras.Input((width,))]
        + [keras.layers.Dense(width, activation="gelu") for _ in range(config["depth"])]
        + [keras.layers.Dense(10)]
    )
    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(size=(config["batch"], width)).astype("float32"))
    y = tf.constant(rng.integers(0, 10, size=config["batch"]))
    step = effgrad.build_train_step(
        model,
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        keras.optimizers.Adam(1e-4),
        micro_batches=8,
        noise_scale=config["noise_scale"],
    )
    step(x, y)
    return {"seconds": common.median_time(lambda: step(x, y)["loss"].numpy(), warmup=1, repeats=config["repeats"])}


def _digits():
    import numpy as np
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.images[..., None] / 16.0).astype("float32")
    return x, digits.target.astype("int64"), np.random.default_rng(0)


def _real_run(config):
    import keras

    import effgrad

    x, y, rng = _digits()
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((8, 8, 1)),
            keras.layers.Conv2D(16, 3, activation="relu", padding="same"),
            keras.layers.Conv2D(32, 3, activation="relu", padding="same"),
            keras.layers.Flatten(),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(10),
        ]
    )
    step = effgrad.build_train_step(
        model,
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        keras.optimizers.SGD(0.05),
        micro_batches=8,
        noise_scale=True,
    )
    rows = []
    for i in range(config["steps"]):
        batch = rng.choice(len(x), size=config["batch"], replace=False)
        logs = step(x[batch], y[batch])
        rows.append({"step": i, **{k: float(v) for k, v in logs.items()}})
    return {"trajectory": rows}


def _monitor(config):
    import keras
    import numpy as np

    import effgrad

    keep = []

    class Leak(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            keep.append(keras.ops.ones((256, 1024)))  # 1 MiB kept on the device per batch

    x, y, _ = _digits()
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Flatten(), keras.layers.Dense(10)])
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    callbacks = [effgrad.MemoryMonitor()] + ([Leak()] if config["leak"] else [])
    history = model.fit(x, y, epochs=config["epochs"], batch_size=128, verbose=0, callbacks=callbacks)
    return {k: list(map(float, v)) for k, v in history.history.items() if k.endswith("mib")} | {
        "kept": int(np.sum([t.shape[0] > 0 for t in keep]))
    }


def run(quick: bool = False) -> dict:
    base = (
        {"depth": 1, "width": 32, "batch": 64, "repeats": 1}
        if quick
        else {"depth": 16, "width": 1024, "batch": 1024, "repeats": 5}
    )
    configs = [{**base, "kind": "cost", "noise_scale": flag} for flag in (False, True)]
    plain, noisy = common.run_rounds(MODULE, configs, rounds=1 if quick else 3)
    trajectory = common.run_isolated(
        MODULE, {"kind": "run", "steps": 10 if quick else 300, "batch": 64 if quick else 256}
    )
    monitors = {
        leak: common.run_isolated(MODULE, {"kind": "monitor", "leak": leak, "epochs": 2 if quick else 8})
        for leak in (False, True)
    }
    rows = [
        {"what": "step, micro_batches=8", "seconds": plain["seconds"], "ratio": 1.0},
        {
            "what": "step, micro_batches=8, noise_scale=True",
            "seconds": noisy["seconds"],
            "ratio": noisy["seconds"] / plain["seconds"],
        },
    ]
    final = trajectory["trajectory"][-1]
    title = (
        f"Diagnostics: noise_scale cost ({base['depth']}x{base['width']} GELU MLP, batch {base['batch']}, Adam); "
        f"digits CNN final B_simple {final['noise_scale']:.0f} after {final['step'] + 1} steps; "
        f"MemoryMonitor current MiB clean {monitors[False]['memory_current_mib'][-1]:.0f} vs leaking "
        f"{monitors[True]['memory_current_mib'][-1]:.0f} after {len(monitors[True]['memory_current_mib'])} epochs"
    )
    columns = [("what", "what", ""), ("seconds", "s / step", ".4f"), ("ratio", "time vs without", ".3f")]
    return common.publish(
        "diagnostics",
        title,
        rows,
        columns,
        config=base,
        trajectory=trajectory["trajectory"],
        monitor={"clean": monitors[False], "leaking": monitors[True]},
    )


if __name__ == "__main__":
    common.child_main(child)
