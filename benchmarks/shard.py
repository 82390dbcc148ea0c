"""``shard_state=True`` across worker processes: optimizer state, step peak and time per worker.

Each configuration runs as N worker processes on 127.0.0.1 (``MultiWorkerMirroredStrategy`` over
loopback, ``TF_CONFIG``), one replica each, every process with its own allocator: the peak of one
step (``effgrad.memory.measure``) is that worker's alone. Rows side by side: the unsharded effgrad
step and ``shard_state=True``, with the same N, Adam, the same global batch (one micro-batch, and one
pair with 4, whose summed gradient is reduce-scattered once at the end).

* ``state``: the optimizer's slots this worker holds (from the shapes of its variables' local copies);
* ``peak``: the allocator peak of one step (after a first, traced, step);
* ``s/step``: median step time (2 workers only: 4 processes on 2 cores measure the machine);
* ``max diff``: the largest difference between the sharded and unsharded weights after the run,
  relative to the largest weight;
* ``transport``: one all-reduce of the whole gradient (unsharded), or one reduce-scatter and one
  all-gather of it (sharded), alone, in the same processes: what loopback costs;
* ``largest share``: the share of the numbers one replica would own if whole variables were dealt
  out round-robin (largest first) instead of cut into flat shards (from the shapes).

Models: 8 Dense 2048x2048 (weight-dominated, batch 64 per worker, MSE) and a keras_hub
``GPT2CausalLM`` built from constructor arguments (fine-tuning: token ids, the fused LM loss: ``fused_loss=True``
on both sides, as "auto" declines at 256 positions per replica).
"""

from __future__ import annotations

import json
import socket
import tempfile
from pathlib import Path

from benchmarks import common

MODULE = "benchmarks.shard"


def _model(config):
    import keras

    keras.utils.set_random_seed(0)
    if config["model"] == "dense":
        width = config["width"]
        layers = [keras.Input((width,))] + [
            keras.layers.Dense(width, activation="relu") for _ in range(config["depth"])
        ]
        return keras.Sequential(layers), keras.losses.MeanSquaredError()
    import keras_hub

    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=config["vocab"],
        num_layers=config["layers"],
        num_heads=config["heads"],
        hidden_dim=config["hidden"],
        intermediate_dim=4 * config["hidden"],
        max_sequence_length=config["seq"],
        dropout=0.0,
    )
    lm = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
    return lm, keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _batch(config, rows):
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(0)
    if config["model"] == "dense":
        width = config["width"]
        return tf.constant(rng.normal(size=(rows, width)), tf.float32), tf.constant(
            rng.normal(size=(rows, width)), tf.float32
        )
    tokens = rng.integers(1, config["vocab"], (rows, config["seq"] + 1))
    x = {"token_ids": tf.constant(tokens[:, :-1], tf.int32), "padding_mask": tf.ones((rows, config["seq"]), tf.int32)}
    return x, tf.constant(tokens[:, 1:], tf.int32)


def _mib(tensors) -> float:
    import numpy as np

    return (
        sum(int(np.prod(t.shape)) * np.dtype(str(getattr(t.dtype, "name", t.dtype))).itemsize for t in tensors) / 2**20
    )


def child(config: dict) -> dict:
    """One worker's runs (``TF_CONFIG`` names it): ``{"runs": [...]}``, one per ``config["shard"]`` value."""
    import tensorflow as tf

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    return {"runs": [_one_run(strategy, {**config, "shard": shard}) for shard in config["shard"]]}


def _one_run(strategy, config: dict) -> dict:
    import keras
    import numpy as np
    import tensorflow as tf

    import effgrad
    from effgrad.train import shard as shard_lib
    from effgrad.train.shard_slots import Group

    with strategy.scope():
        model, loss = _model(config)
        optimizer = keras.optimizers.Adam(1e-4)
    micro_batches = config.get("micro_batches", 1)
    step = effgrad.build_train_step(
        model,
        loss,
        optimizer,
        micro_batches=micro_batches,
        strategy=strategy,
        shard_state=config["shard"],
        fused_loss=config.get("fused_loss", "auto"),
    )
    x, y = _batch(config, config["batch"] * config["workers"])  # the global batch: each worker takes its rows

    def one_step():
        return step(x, y)["loss"].numpy()

    one_step()  # trace and build outside the measurement
    report = effgrad.memory.measure(one_step)
    seconds = common.median_time(one_step, warmup=0, repeats=config["repeats"])
    local = [c for v in optimizer.variables if len(v.shape) for c in strategy.experimental_local_results(v.value)]
    weights = model.trainable_variables

    # The collectives alone, on gradient-sized buffers: what the loopback transport costs per step.
    @tf.function(autograph=False)
    def transport():
        def collectives():
            ones = [tf.ones(v.shape, tf.float32) for v in weights]
            if not config["shard"]:
                ctx = tf.distribute.get_replica_context()
                return tf.add_n([tf.reduce_sum(t) for t in ctx.all_reduce("sum", ones)])
            group, layouts = Group(strategy), shard_lib.plan(weights, strategy.num_replicas_in_sync).layouts
            sums = []
            for t, layout in zip(ones, layouts):
                if layout is not None:
                    sums.append(tf.reduce_sum(group.all_gather(group.reduce_scatter(layout.padded(t)))))
            return tf.add_n(sums)

        return strategy.run(collectives)

    transport()
    transport_seconds = common.median_time(
        lambda: [t.numpy() for t in strategy.experimental_local_results(transport())],
        warmup=0,
        repeats=config["repeats"],
    )
    if config.get("weights_file"):
        np.savez(config["weights_file"].format(shard=config["shard"]), *[v.numpy() for v in weights])
    return {
        "round_robin_share": _round_robin_share(weights, strategy.num_replicas_in_sync),
        "state_mib": _mib(local),
        "weights_mib": _mib(weights),
        "peak_mib": report.peak_mib,
        "seconds": seconds,
        "transport_seconds": transport_seconds,
        "shard_state": bool(step.shard_state),
    }


def _round_robin_share(variables, replicas: int) -> float:
    """The largest share of the numbers one replica would own if whole variables were dealt out instead
    (largest first, each to the least loaded replica): what flat shards avoid."""
    import math

    loads = [0] * replicas
    for size in sorted((math.prod(v.shape) for v in variables), reverse=True):
        loads[loads.index(min(loads))] += size
    return max(loads) / sum(loads)


def _free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def run_workers(config: dict, timeout: float = 1800) -> list[dict]:
    """Starts ``config["workers"]`` processes of one MultiWorkerMirroredStrategy cluster; their results."""
    hosts = [f"127.0.0.1:{port}" for port in _free_ports(config["workers"])]
    runs = []
    for index in range(config["workers"]):
        tf_config = {"cluster": {"worker": hosts}, "task": {"type": "worker", "index": index}}
        own = {**config, "weights_file": config["weights_file"] if index == 0 else None}
        runs.append((own, {"TF_CONFIG": json.dumps(tf_config)}))
    return common.run_children(MODULE, runs, timeout)


def _runs(config: dict, shards: list, weights_file: str) -> list[list[dict]]:
    """Per value of ``shards``: every worker's result (one cluster runs them in turn)."""
    results = run_workers({**config, "shard": shards, "weights_file": weights_file})
    return [[r["runs"][i] for r in results] for i in range(len(shards))]


def _configs(quick: bool) -> list[dict]:
    if quick:
        return [{"model": "dense", "depth": 1, "width": 64, "batch": 8, "repeats": 1, "workers": 2}]
    dense = {"model": "dense", "depth": 8, "width": 2048, "batch": 64, "repeats": 5}
    gpt2 = {
        "model": "gpt2",
        "vocab": 50257,
        "layers": 4,
        "heads": 8,
        "hidden": 512,
        "seq": 128,
        "batch": 2,
        "repeats": 5,
        "fused_loss": True,
    }
    micro = {**dense, "workers": 2, "micro_batches": 4}  # the gradient sum reduce-scattered once, at the end
    return [{**model, "workers": n} for model in (dense, gpt2) for n in (2, 4)] + [micro]


def _name(config) -> str:
    if config["model"] == "dense":
        micro = f", micro_batches={config['micro_batches']}" if config.get("micro_batches", 1) > 1 else ""
        return f"{config['depth']} Dense {config['width']}x{config['width']}, batch {config['batch']}/worker{micro}"
    return (
        f"GPT2CausalLM {config['layers']}x{config['hidden']}, V={config['vocab']}, T={config['seq']}, "
        f"batch {config['batch']}/worker, fused loss"
    )


def run(quick: bool = False) -> dict:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for config in _configs(quick):
            weights_file = str(Path(tmp) / f"{len(rows)}-{{shard}}.npz")
            # One cluster per run (each process's peak its own); --quick: both runs in one cluster. Timed
            # pairs (2 workers) run twice, interleaved, and keep each one's faster round (shared machine).
            clusters = [[False, True]] if quick else [[False], [True]] * (2 if config["workers"] == 2 else 1)
            runs = [r for shards in clusters for r in _runs(config, shards, weights_file)]
            if len(runs) > 2:
                rounds = [runs[0::2], runs[1::2]]  # per shard value, its rounds
                runs = [min(r, key=lambda results: max(w["seconds"] for w in results)) for r in rounds]
            pair = {}
            for shard, results in zip((False, True), runs):
                pair[shard] = {
                    "model": _name(config),
                    "workers": config["workers"],
                    "shard_state": shard,
                    "state_mib": max(r["state_mib"] for r in results),
                    "peak_mib": max(r["peak_mib"] for r in results),  # the worker with the highest peak
                    "weights_mib": results[0]["weights_mib"],
                    "seconds": max(r["seconds"] for r in results) if config["workers"] == 2 else None,
                    "transport_seconds": max(r["transport_seconds"] for r in results),
                    "sharded": all(r["shard_state"] for r in results) if shard else None,
                    "round_robin_share": results[0]["round_robin_share"] if shard else None,
                }
            plain, sharded = pair[False], pair[True]
            sharded["state_vs_unsharded"] = sharded["state_mib"] / plain["state_mib"]
            sharded["peak_vs_unsharded"] = sharded["peak_mib"] / plain["peak_mib"]
            if sharded["seconds"] is not None:
                sharded["time_vs_unsharded"] = sharded["seconds"] / plain["seconds"]
            sharded["max_diff"] = _max_diff(weights_file.format(shard=False), weights_file.format(shard=True))
            rows += [plain, sharded]
    title = (
        "shard_state across worker processes (MultiWorkerMirroredStrategy over loopback, one replica per process): "
        "optimizer state and step peak per worker, step time; Adam"
    )
    columns = [
        ("model", "model", ""),
        ("workers", "workers", "d"),
        ("shard_state", "shard_state", ""),
        ("state_mib", "state MiB/worker", ".1f"),
        ("state_vs_unsharded", "state vs unsharded", ".3f"),
        ("peak_mib", "step peak MiB/worker", ".0f"),
        ("peak_vs_unsharded", "peak vs unsharded", ".2f"),
        ("seconds", "s/step", ".3f"),
        ("time_vs_unsharded", "time vs unsharded", ".2f"),
        ("transport_seconds", "collectives alone s", ".3f"),
        ("max_diff", "max diff (rel.)", ".1e"),
        ("round_robin_share", "whole variables dealt out: largest share", ".3f"),
    ]
    return common.publish("shard", title, rows, columns, quick=quick)


def _max_diff(plain_file: str, sharded_file: str) -> float:
    import numpy as np

    with np.load(plain_file) as plain, np.load(sharded_file) as sharded:
        scale = max(float(np.abs(plain[k]).max()) for k in plain.files)
        return max(float(np.abs(plain[k] - sharded[k]).max()) for k in plain.files) / scale


if __name__ == "__main__":
    common.child_main(child)
