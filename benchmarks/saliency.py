"""Saliency over a dataset: throughput, device memory and host memory vs N.

(a) the naive loop: a tape per batch, device tensors appended to a list;
(b) PAIR ``saliency`` (GradientSaliency, one image per call);
(c) tf-keras-vis ``Saliency`` (the whole array at once, in memory);
(d) effgrad to an in-memory array; (e) effgrad to a ``.npy`` memmap.
Inputs are a ``.npy`` memmap of N 32x32x3 images; the maps are raw gradients
(no reduction) of each image's arg-max logit. Per-image and in-memory peers
run on the smaller sizes only (their cost is the point).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from benchmarks import common

MODULE = "benchmarks.saliency"
PEER_LIMIT = {"pair_saliency": 2_000, "tf_keras_vis": 20_000}


def _model():
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


def _inputs(path: Path, n: int):
    import numpy as np

    if not path.exists():
        data = np.lib.format.open_memmap(path, mode="w+", dtype="float32", shape=(n, 32, 32, 3))
        rng = np.random.default_rng(0)
        for start in range(0, n, 4096):
            data[start : start + 4096] = rng.uniform(size=data[start : start + 4096].shape)
        data.flush()
        del data
    return np.load(path, mmap_mode="r")


def child(config: dict) -> dict:
    import numpy as np
    import tensorflow as tf

    import effgrad

    model, kind, n, batch = _model(), config["kind"], config["n"], config["batch_size"]
    x = _inputs(Path(config["data"]), n)

    def naive():
        maps = []
        for start in range(0, n, batch):
            xb = tf.convert_to_tensor(x[start : start + batch])
            with tf.GradientTape() as tape:
                tape.watch(xb)
                out = model(xb, training=False)
                score = tf.gather(out, tf.argmax(out, -1), batch_dims=1)
            maps.append(tape.gradient(score, xb))  # stays on the device until the end
        return tf.concat(maps, 0).numpy()

    def pair():
        import saliency.core as sc

        def call_model(images, call_model_args=None, expected_keys=None):
            images = tf.convert_to_tensor(images)
            with tf.GradientTape() as tape:
                tape.watch(images)
                out = model(images, training=False)
                score = tf.gather(out, tf.argmax(out, -1), batch_dims=1)
            return {sc.base.INPUT_OUTPUT_GRADIENTS: tape.gradient(score, images).numpy()}

        method = sc.GradientSaliency()
        return np.stack([method.GetMask(x[i], call_model, {}) for i in range(n)])

    def tf_keras_vis():
        from tf_keras_vis.saliency import Saliency

        classes = np.concatenate([model.predict(x[i : i + 4096], verbose=0).argmax(-1) for i in range(0, n, 4096)])
        score = lambda out: tf.gather(out, tf.constant(classes), batch_dims=1)  # noqa: E731
        return Saliency(model, clone=False)(score, np.asarray(x), keepdims=True, normalize_map=False)

    def effgrad_memory():
        return effgrad.saliency(model, x, batch_size=batch, progress=False)

    def effgrad_npy():
        out = Path(config["data"]).with_name(f"maps_{n}.npy")
        for stale in (out, out.with_name(out.name + ".journal.json")):
            stale.unlink(missing_ok=True)
        return effgrad.saliency(model, x, batch_size=batch, out=out, progress=False)

    run = {
        "naive_list_append": naive,
        "pair_saliency": pair,
        "tf_keras_vis": tf_keras_vis,
        "effgrad_memory": effgrad_memory,
        "effgrad_npy_memmap": effgrad_npy,
    }[kind]
    model(tf.zeros([1, 32, 32, 3]))
    effgrad.saliency(model, np.asarray(x[:batch]), batch_size=batch, progress=False)  # warm the kernels
    start = time.perf_counter()
    report = effgrad.memory.measure(run)
    seconds = time.perf_counter() - start
    return {"examples_per_s": n / seconds, "seconds": seconds, "device_peak_mib": report.peak_mib}


def run(quick: bool = False) -> dict:
    sizes = [256, 1024] if quick else [2_000, 20_000, 100_000]
    limits = {k: min(v, sizes[0]) if quick else v for k, v in PEER_LIMIT.items()}
    kinds = ["naive_list_append", "pair_saliency", "tf_keras_vis", "effgrad_memory", "effgrad_npy_memmap"]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in sizes:
            data = str(Path(tmp) / f"x_{n}.npy")
            base = None
            for kind in kinds:
                if n > limits.get(kind, n):
                    continue
                try:
                    result = common.run_isolated(
                        MODULE, {"kind": kind, "n": n, "batch_size": 256, "data": data}, timeout=3600
                    )
                except RuntimeError as err:  # a peer that is not installed or failed: say so, keep going
                    print(f"  {kind} at N={n} failed: {str(err).splitlines()[-1][:200]}", flush=True)
                    continue
                row = {"n": n, "method": kind, **result}
                base = base or row
                row["throughput_vs_naive"] = row["examples_per_s"] / base["examples_per_s"]
                rows.append(row)
                Path(data).with_name(f"maps_{n}.npy").unlink(missing_ok=True)
    title = (
        "Saliency (vanilla gradient) over N 32x32x3 images read from a .npy memmap, small CNN, batch 256: "
        "throughput, device allocator peak and host max RSS, one fresh process per row"
    )
    columns = [
        ("n", "N", ",d"),
        ("method", "method", ""),
        ("examples_per_s", "examples/s", ",.0f"),
        ("throughput_vs_naive", "vs naive", ".2f"),
        ("device_peak_mib", "device peak MiB", ",.0f"),
        ("host_max_rss_mib", "host max RSS MiB", ",.0f"),
    ]
    return common.publish("saliency", title, rows, columns, sizes=sizes)


if __name__ == "__main__":
    common.child_main(child)
