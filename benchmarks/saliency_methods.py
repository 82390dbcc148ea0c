"""SmoothGrad (16 samples) and Integrated Gradients (32 steps) vs the peers.

Same CNN and images as ``benchmarks.saliency``. Every library evaluates
about the same number of gradient rows per example (SmoothGrad: 16;
IG: effgrad's trapezoid uses 33 points, Xplique's Riemann sum 32) and about
256 gradient rows per pass. effgrad streams into a ``.npy`` memmap with
``*_per_pass`` 1 (one batch of 256 images per evaluation) and 4 (4 noise
samples / path points of 64 images stacked: the same 256 rows per pass).
Xplique (``SmoothGrad``/``IntegratedGradients``, batch_size=256) and
tf-keras-vis (``Saliency(smooth_samples=16)``, no IG) return everything in
memory. Noise: 0.2 of the value range (the inputs span [0, 1], so Xplique's
absolute noise is 0.2 too).
"""

from __future__ import annotations

import time
from pathlib import Path

from benchmarks import common
from benchmarks.saliency import fresh, images, model_32x32, sweep, with_ratios

MODULE = "benchmarks.saliency_methods"
KINDS = {
    "smoothgrad": ["effgrad", "effgrad_4_per_pass", "xplique", "tf_keras_vis"],
    "integrated_gradients": ["effgrad", "effgrad_4_per_pass", "xplique"],
}
SAMPLES, STEPS, NOISE = 16, 32, 0.2


def child(config: dict) -> dict:
    import numpy as np
    import tensorflow as tf

    import effgrad

    model, kind, n, method = model_32x32(), config["kind"], config["n"], config["method"]
    x = images(Path(config["data"]), n)
    out = Path(config["data"]).with_name(f"maps_{method}_{n}.npy")

    def classes():
        return np.concatenate([model.predict(x[i : i + 4096], verbose=0).argmax(-1) for i in range(0, n, 4096)])

    def run_effgrad(per_pass: int, batch: int):
        options = (
            {"samples": SAMPLES, "noise": NOISE, "samples_per_pass": per_pass}
            if method == "smoothgrad"
            else {"steps": STEPS, "steps_per_pass": per_pass}
        )
        return effgrad.saliency(model, x, method=method, batch_size=batch, out=fresh(out), progress=False, **options)

    def xplique():
        from xplique.attributions import IntegratedGradients, SmoothGrad

        explainer = (
            SmoothGrad(model, batch_size=256, nb_samples=SAMPLES, noise=NOISE)
            if method == "smoothgrad"
            else IntegratedGradients(model, batch_size=256, steps=STEPS)
        )
        return explainer.explain(np.asarray(x), tf.one_hot(classes(), 10)).numpy()

    def tf_keras_vis():
        from tf_keras_vis.saliency import Saliency

        score = lambda out: tf.gather(out, tf.constant(classes()), batch_dims=1)  # noqa: E731
        return Saliency(model, clone=False)(
            score, np.asarray(x), smooth_samples=SAMPLES, smooth_noise=NOISE, keepdims=True, normalize_map=False
        )

    run = {
        "effgrad": lambda: run_effgrad(1, 256),
        "effgrad_4_per_pass": lambda: run_effgrad(4, 64),
        "xplique": xplique,
        "tf_keras_vis": tf_keras_vis,
    }[kind]
    model(tf.zeros([1, 32, 32, 3]))
    start = time.perf_counter()
    report = effgrad.memory.measure(run)
    seconds = time.perf_counter() - start
    fresh(out)
    return {"examples_per_s": n / seconds, "seconds": seconds, "device_peak_mib": report.peak_mib}


def run(quick: bool = False) -> dict:
    sizes = [32] if quick else [2_000]
    rows = []
    for method, kinds in KINDS.items():
        kinds = ["effgrad"] if quick else kinds  # quick: it runs, peers are for real runs
        found = sweep(MODULE, sizes, kinds, {}, {"method": method}, rounds=1 if quick else 2)
        for row in with_ratios(found, "xplique"):
            rows.append({"saliency": method, **row})
    title = (
        f"SmoothGrad ({SAMPLES} samples) and Integrated Gradients ({STEPS} steps) over N 32x32x3 images, small "
        "CNN, ~256 gradient rows per pass: throughput vs Xplique, device allocator peak, host max RSS; fresh "
        "process per row, fastest of 2 interleaved rounds, tracing included"
    )
    columns = [
        ("saliency", "method", ""),
        ("n", "N", ",d"),
        ("method", "library", ""),
        ("examples_per_s", "examples/s", ",.0f"),
        ("vs_baseline", "vs Xplique", ".2f"),
        ("device_peak_mib", "device peak MiB", ",.0f"),
        ("host_max_rss_mib", "host max RSS MiB", ",.0f"),
    ]
    return common.publish("saliency_methods", title, rows, columns, sizes=sizes)


if __name__ == "__main__":
    common.child_main(child)
