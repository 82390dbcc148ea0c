"""Saliency over a dataset: throughput, device memory and host memory vs N.

Vanilla gradient of each image's arg-max logit over N 32x32x3 images read
from a ``.npy`` memmap, small CNN, batch 256. The baseline (1.00x) is the
loop users write when they know TensorFlow: one ``tf.function`` with a tape
per batch, ``.numpy()`` appended to a list. Also: the same loop in eager mode
(device tensors appended: the OOM pattern), PAIR ``saliency`` (one image per
call), tf-keras-vis ``Saliency`` and Xplique ``Saliency`` (the whole array at
once, in memory), and effgrad into memory, into a ``.npy`` memmap, and into
a ``.npy`` with its three stages (read, compute, copy out) run one after
another instead of overlapped. Every row pays its own tracing, as a user
does; per-image and in-memory peers run on the smaller sizes only.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from benchmarks import common

MODULE = "benchmarks.saliency"
PEER_LIMIT = {"pair_saliency": 2_000, "tf_keras_vis": 20_000, "xplique": 20_000, "eager_loop_list": 20_000}
KINDS = [
    "tf_function_loop",
    "eager_loop_list",
    "pair_saliency",
    "tf_keras_vis",
    "xplique",
    "effgrad_memory",
    "effgrad_npy_memmap",
    "effgrad_npy_no_overlap",
]


def model_32x32():
    import keras

    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((32, 32, 3)),
            keras.layers.Conv2D(16, 3, activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Conv2D(32, 3, activation="relu"),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(10),
        ]
    )


def images(path: Path, n: int):
    """N uniform 32x32x3 images as a read-only ``.npy`` memmap (written once per N)."""
    import numpy as np

    if not path.exists():
        data = np.lib.format.open_memmap(path, mode="w+", dtype="float32", shape=(n, 32, 32, 3))
        rng = np.random.default_rng(0)
        for start in range(0, n, 4096):
            data[start : start + 4096] = rng.uniform(size=data[start : start + 4096].shape)
        data.flush()
        del data
    return np.load(path, mmap_mode="r")


def fresh(path: Path) -> Path:
    for stale in (path, path.with_name(path.name + ".journal.json")):
        stale.unlink(missing_ok=True)
    return path


def child(config: dict) -> dict:
    import numpy as np
    import tensorflow as tf

    import effgrad
    from effgrad.explain import api, engine, plan

    model, kind, n, batch = model_32x32(), config["kind"], config["n"], config["batch_size"]
    x = images(Path(config["data"]), n)
    out = Path(config["data"]).with_name(f"maps_{n}.npy")

    @tf.function
    def gradients(xb):
        with tf.GradientTape() as tape:
            tape.watch(xb)
            logits = model(xb, training=False)
            score = tf.gather(logits, tf.argmax(logits, -1), batch_dims=1)
        return tape.gradient(score, xb)

    def tf_function_loop():
        return np.concatenate([gradients(tf.convert_to_tensor(x[s : s + batch])).numpy() for s in range(0, n, batch)])

    def eager_loop_list():
        maps = []
        for start in range(0, n, batch):
            xb = tf.convert_to_tensor(x[start : start + batch])
            with tf.GradientTape() as tape:
                tape.watch(xb)
                logits = model(xb, training=False)
                score = tf.gather(logits, tf.argmax(logits, -1), batch_dims=1)
            maps.append(tape.gradient(score, xb))  # stays on the device until the end
        return tf.concat(maps, 0).numpy()

    def pair():
        import saliency.core as sc

        def call_model(images, call_model_args=None, expected_keys=None):
            images = tf.convert_to_tensor(images)
            with tf.GradientTape() as tape:
                tape.watch(images)
                logits = model(images, training=False)
                score = tf.gather(logits, tf.argmax(logits, -1), batch_dims=1)
            return {sc.base.INPUT_OUTPUT_GRADIENTS: tape.gradient(score, images).numpy()}

        method = sc.GradientSaliency()
        return np.stack([method.GetMask(x[i], call_model, {}) for i in range(n)])

    def classes():
        return np.concatenate([model.predict(x[i : i + 4096], verbose=0).argmax(-1) for i in range(0, n, 4096)])

    def tf_keras_vis():
        from tf_keras_vis.saliency import Saliency

        score = lambda out: tf.gather(out, tf.constant(classes()), batch_dims=1)  # noqa: E731
        return Saliency(model, clone=False)(score, np.asarray(x), keepdims=True, normalize_map=False)

    def xplique():
        from xplique.attributions import Saliency

        targets = tf.one_hot(classes(), 10)
        return Saliency(model, batch_size=batch).explain(np.asarray(x), targets).numpy()

    def effgrad_npy_no_overlap():
        prepared = plan.prepare(model, x, batch_size=batch)
        sink = api.open_sink(fresh(out), prepared)
        engine.stream(prepared, sink, progress=False, overlap=False)
        sink.close(failed=False)
        return sink.result

    run = {
        "tf_function_loop": tf_function_loop,
        "eager_loop_list": eager_loop_list,
        "pair_saliency": pair,
        "tf_keras_vis": tf_keras_vis,
        "xplique": xplique,
        "effgrad_memory": lambda: effgrad.saliency(model, x, batch_size=batch, progress=False),
        "effgrad_npy_memmap": lambda: effgrad.saliency(model, x, batch_size=batch, out=fresh(out), progress=False),
        "effgrad_npy_no_overlap": effgrad_npy_no_overlap,
    }[kind]
    model(tf.zeros([1, 32, 32, 3]))  # builds the model; every row traces its own functions in the timing
    start = time.perf_counter()
    report = effgrad.memory.measure(run)
    seconds = time.perf_counter() - start
    fresh(out)
    return {"examples_per_s": n / seconds, "seconds": seconds, "device_peak_mib": report.peak_mib}


def with_ratios(rows: list[dict], baseline: str) -> list[dict]:
    """Adds ``vs_baseline``: throughput over the baseline row's at the same N."""
    base = {r["n"]: r["examples_per_s"] for r in rows if r["method"] == baseline}
    for row in rows:
        if row["n"] in base:
            row["vs_baseline"] = row["examples_per_s"] / base[row["n"]]
    return rows


def sweep(module: str, sizes: list[int], kinds: list[str], limits: dict, extra: dict, rounds: int) -> list[dict]:
    """Every (N, kind) in a fresh process, ``rounds`` interleaved rounds, fastest kept; failures said."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in sizes:
            configs = [
                {"kind": kind, "n": n, "data": str(Path(tmp) / f"x_{n}.npy"), **extra}
                for kind in kinds
                if n <= limits.get(kind, n)
            ]
            best: dict[str, dict] = {}
            for _ in range(rounds):
                for config in configs:
                    try:
                        result = common.run_isolated(module, config, timeout=3600)
                    except RuntimeError as err:  # a peer that is not installed or failed: say so, keep going
                        print(f"  {config['kind']} at N={n} failed: {str(err).splitlines()[-1][:200]}", flush=True)
                        continue
                    if config["kind"] not in best or result["seconds"] < best[config["kind"]]["seconds"]:
                        best[config["kind"]] = result
            rows += [{"n": n, "method": kind, **best[kind]} for kind in kinds if kind in best]
    return rows


def run(quick: bool = False) -> dict:
    sizes = [256] if quick else [512, 2_000, 20_000, 100_000]
    kinds = ["tf_function_loop", "effgrad_npy_memmap"] if quick else KINDS  # quick: it runs, peers are for real runs
    rows = sweep(MODULE, sizes, kinds, PEER_LIMIT, {"batch_size": 256}, rounds=1 if quick else 2)
    title = (
        "Saliency (vanilla gradient) over N 32x32x3 images read from a .npy memmap, small CNN, batch 256: "
        "throughput vs the batched tf.function loop, device allocator peak and host max RSS, one fresh "
        "process per row, fastest of 2 interleaved rounds, tracing included"
    )
    columns = [
        ("n", "N", ",d"),
        ("method", "method", ""),
        ("examples_per_s", "examples/s", ",.0f"),
        ("vs_baseline", "vs tf.function loop", ".2f"),
        ("device_peak_mib", "device peak MiB", ",.0f"),
        ("host_max_rss_mib", "host max RSS MiB", ",.0f"),
    ]
    return common.publish("saliency", title, with_ratios(rows, "tf_function_loop"), columns, sizes=sizes)


if __name__ == "__main__":
    common.child_main(child)
