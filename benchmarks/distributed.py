"""Data parallelism: cross-replica reductions per step, and step time, 1 vs 2 devices.

Reductions are counted where they are requested, while the step is traced:
every call of ``ReplicaContext.all_reduce`` (made by each replica) and of
``strategy.extended.batch_reduce_to`` (made once for all replicas, from a
``merge_call``: how the step sums its gradients and loss sums, as one batch). The two
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

    calls = []  # (tensors, share of one step's reduction: 1/devices for each replica's all_reduce)
    original = tf.distribute.ReplicaContext.all_reduce

    def counting(self, reduce_op, value, options=None):
        calls.append((len(tf.nest.flatten(value)), 1 / config["devices"]))
        return original(self, reduce_op, value, options)

    tf.distribute.ReplicaContext.all_reduce = counting
    strategy = tf.distribute.MirroredStrategy([f"CPU:{i}" for i in range(config["devices"])])
    batch_reduce = type(strategy.extended).batch_reduce_to

    def counting_batch(self, reduce_op, value_destination_pairs, options=None):
        calls.append((len(value_destination_pairs), 1.0))
        return batch_reduce(self, reduce_op, value_destination_pairs, options)

    type(strategy.extended).batch_reduce_to = counting_batch
    with strategy.scope():
        keras.utils.set_random_seed(0)
        depth, width = config.get("depth", 4), config.get("width", 512)  # --quick: a smaller MLP
        model = keras.Sequential(
            [keras.Input((width,))]
            + [keras.layers.Dense(width, activation="relu") for _ in range(depth)]
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
    x = rng.normal(size=(config["batch"], width)).astype("float32")
    y = rng.integers(0, 10, size=config["batch"])
    step(x, y)
    seconds = common.median_time(lambda: step(x, y)["loss"].numpy(), warmup=1, repeats=config["repeats"])
    return {
        "all_reduce_calls_per_replica": sum(share for _, share in calls),
        "tensors_per_call": calls[0][0] if calls else 0,
        "seconds": seconds,
    }


def run(quick: bool = False) -> dict:
    base = {"batch": 32, "repeats": 1, "depth": 1, "width": 32} if quick else {"batch": 1024, "repeats": 5}
    ks = (4,) if quick else (1, 4, 16)  # quick: each configuration is a process (virtual devices)
    configs = [{**base, "devices": d, "k": k} for d in (1, 2) for k in ks]
    results = common.run_rounds(MODULE, configs, rounds=1 if quick else 2)
    rows = [{**c, **r} for c, r in zip(configs, results)]
    for row in rows:
        single = next(r for r in rows if r["devices"] == 1 and r["k"] == row["k"])
        row["time_vs_1_device"] = row["seconds"] / single["seconds"]
    title = (
        f"Distributed step (MirroredStrategy over logical CPU devices of one machine), "
        f"{base.get('depth', 4)}x{base.get('width', 512)} MLP, "
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
