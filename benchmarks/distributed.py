"""Data parallelism: cross-replica reductions per step, and step time, 1 vs 2 devices.

Reductions are counted where they are requested: every call of
``tf.distribute.ReplicaContext.all_reduce`` while the step is traced, per
replica (each call carries all gradients and loss sums as one batch). The two
"devices" are logical CPU devices of one 2-core machine, so the timing shows
the overhead of the distributed step, not a speed-up.
"""

from __future__ import annotations

from benchmarks import common

MODULE = "benchmarks.distributed"


def child(config: dict) -> dict:
    import keras
    import numpy as np
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * config["devices"])
    import effgrad

    calls = []
    original = tf.distribute.ReplicaContext.all_reduce

    def counting(self, reduce_op, value, options=None):
        calls.append(len(tf.nest.flatten(value)))
        return original(self, reduce_op, value, options)

    tf.distribute.ReplicaContext.all_reduce = counting
    strategy = tf.distribute.MirroredStrategy([f"CPU:{i}" for i in range(config["devices"])])
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [keras.Input((512,))]
            + [keras.layers.Dense(512, activation="relu") for _ in range(4)]
            + [keras.layers.Dense(10)]
        )
        optimizer = keras.optimizers.Adam(1e-4)
    step = effgrad.build_train_step(
        model,
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        optimizer,
        micro_batches=config["k"],
        strategy=strategy,
    )
    rng = np.random.default_rng(0)
    x = rng.normal(size=(config["batch"], 512)).astype("float32")
    y = rng.integers(0, 10, size=config["batch"])
    step(x, y)
    seconds = common.median_time(lambda: step(x, y)["loss"].numpy(), warmup=1, repeats=config["repeats"])
    return {
        "all_reduce_calls_per_replica": len(calls) / config["devices"],
        "tensors_per_call": calls[0] if calls else 0,
        "seconds": seconds,
    }


def run(quick: bool = False) -> dict:
    base = {"batch": 256 if quick else 1024, "repeats": 3 if quick else 5}
    ks = (4,) if quick else (1, 4, 16)  # quick: each configuration is a process (virtual devices)
    configs = [{**base, "devices": d, "k": k} for d in (1, 2) for k in ks]
    results = common.run_rounds(MODULE, configs, rounds=1 if quick else 2)
    rows = [{**c, **r} for c, r in zip(configs, results)]
    for row in rows:
        single = next(r for r in rows if r["devices"] == 1 and r["k"] == row["k"])
        row["time_vs_1_device"] = row["seconds"] / single["seconds"]
    title = (
        f"Distributed step (MirroredStrategy over logical CPU devices of one machine), 4x512 MLP, "
        f"global batch {base['batch']}: all_reduce calls per replica per step, and step time"
    )
    columns = [
        ("devices", "devices", "d"),
        ("k", "micro_batches", "d"),
        ("all_reduce_calls_per_replica", "all_reduce calls / replica / step", ".0f"),
        ("tensors_per_call", "tensors per call", "d"),
        ("seconds", "s / step", ".4f"),
        ("time_vs_1_device", "time vs 1 device", ".2f"),
    ]
    return common.publish("distributed", title, rows, columns, config=base)


if __name__ == "__main__":
    common.child_main(child)
