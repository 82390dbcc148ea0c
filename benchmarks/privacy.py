"""DP-SGD at the memory of a normal step: effgrad's private step against the non-private one and the naive way.

Per model, one fresh process per row:

* ``effgrad step``: the non-private step (the baseline, 1.00x);
* ``effgrad DP-SGD``: ``per_example_clip=1.0, noise_multiplier=1.1``: per-example norms from
  taps (no per-example gradient), a second backward pass of the clipped sum;
* ``naive per-example``: every example's gradient at once (``tf.map_fn`` of a tape over the
  examples, stacked: what per-example clipping is by hand; ``tf.vectorized_map`` segfaults
  inside TensorFlow on the BERT model here), clipped, summed, noised, applied. Its memory
  is batch x parameters, so it is measured at small batches and the peak at the
  benchmark's batch is extrapolated linearly (marked);
* ``TF Privacy 0.9.0``: installed with ``--no-deps`` (it would downgrade TensorFlow); the
  error it gives is recorded.
"""

from __future__ import annotations

from benchmarks import common

MODULE = "benchmarks.privacy"


def _model(config):
    import keras

    keras.utils.set_random_seed(0)
    if config["model"] == "mlp":
        width = config["width"]
        layers = [keras.Input((width,))] + [
            keras.layers.Dense(width, activation="gelu") for _ in range(config["depth"])
        ]
        return keras.Sequential(layers + [keras.layers.Dense(10)])
    import keras_hub

    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=config["vocab"],
        num_layers=config["layers"],
        num_heads=2,
        hidden_dim=config["hidden"],
        intermediate_dim=4 * config["hidden"],
        max_sequence_length=config["seq"],
    )
    return keras_hub.models.BertTextClassifier(backbone=backbone, num_classes=2, preprocessor=None)


def _batch(config, rows):
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(0)
    if config["model"] == "mlp":
        x = tf.constant(rng.normal(size=(rows, config["width"])).astype("float32"))
        return x, tf.constant(rng.integers(0, 10, rows))
    seq = config["seq"]
    mask = np.ones((rows, seq), "int32")
    mask[:, seq * 3 // 4 :] = 0  # a quarter of every sequence is padding
    x = {
        "token_ids": tf.constant(rng.integers(1, config["vocab"], (rows, seq)).astype("int32") * mask),
        "segment_ids": tf.zeros((rows, seq), tf.int32),
        "padding_mask": tf.constant(mask),
    }
    return x, tf.constant(rng.integers(0, 2, rows))


def _naive_step(model, loss, optimizer, clip, noise):
    """Per-example gradients of every example at once, clipped, summed, noised, averaged, applied."""
    import tensorflow as tf

    variables = model.trainable_variables

    def one(example):
        x, y = example
        x = tf.nest.map_structure(lambda t: t[None], x)
        with tf.GradientTape() as tape:
            value = tf.reduce_sum(loss(y[None], model(x, training=True)))
        return [tf.convert_to_tensor(g) for g in tape.gradient(value, variables)]

    @tf.function(autograph=False)
    def step(x, y):
        specs = [tf.TensorSpec(v.shape, tf.float32) for v in variables]
        grads = tf.map_fn(one, (x, y), fn_output_signature=specs)  # [batch, *variable.shape] per variable
        squares = tf.add_n([tf.reduce_sum(tf.reshape(g * g, [tf.shape(g)[0], -1]), 1) for g in grads])
        factors = tf.minimum(1.0, clip / tf.maximum(tf.sqrt(squares), 1e-12))
        rows = tf.cast(tf.shape(factors)[0], tf.float32)
        final = [
            (tf.tensordot(factors, g, 1) + tf.random.normal(tf.shape(g)[1:], stddev=noise * clip)) / rows for g in grads
        ]
        optimizer.apply(final, variables)
        return squares

    return step


def _tf_privacy_error() -> str:
    """What TF Privacy 0.9.0 (the last release) does on TF 2.21 / Keras 3, as a user meets it."""
    import importlib.util
    import sys
    import types

    spec = importlib.util.find_spec("tensorflow_privacy")
    if spec is None:
        return "not installed (pip install --no-deps tensorflow-privacy==0.9.0: with its dependencies it downgrades TF)"
    try:
        import tensorflow_privacy  # noqa: F401

        first = "imports"
    except Exception as err:  # noqa: BLE001 - whatever it raises is the finding
        first = f"import tensorflow_privacy: {type(err).__name__}: {err}"
    # Past the import (its package __init__ needs tensorflow_estimator, gone since TF 2.16): the fast
    # gradient clipping it offers for Keras models.
    root = spec.submodule_search_locations[0]
    for name, path in [
        ("tensorflow_privacy", root),
        ("tensorflow_privacy.privacy", f"{root}/privacy"),
        ("tensorflow_privacy.privacy.fast_gradient_clipping", f"{root}/privacy/fast_gradient_clipping"),
    ]:
        module = types.ModuleType(name)
        module.__path__ = [path]
        sys.modules.setdefault(name, module)
    import keras
    import tensorflow as tf
    from tensorflow_privacy.privacy.fast_gradient_clipping import clip_grads, layer_registry

    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4), keras.layers.Dense(3)])
    try:
        clip_grads.compute_gradient_norms(
            model,
            layer_registry.make_default_layer_registry(),
            tf.ones((4, 5)),
            tf.zeros((4, 3)),
            keras.losses.MeanSquaredError(reduction="none"),
        )
        second = "fast gradient clipping runs"
    except Exception as err:  # noqa: BLE001
        second = f"fast gradient clipping on a Keras 3 model: {type(err).__name__}: {err}"
    return f"{first}; {second}"


def child(config: dict) -> dict:
    import keras
    import tensorflow as tf

    import effgrad

    if config["method"] == "TF Privacy 0.9.0":
        return {"error": _tf_privacy_error(), "seconds": None}
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model = _model(config)
    optimizer = keras.optimizers.SGD(1e-3)
    rows = config["rows"]
    x, y = _batch(config, rows)
    if config["method"] == "naive per-example":
        step = _naive_step(model, keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None),
                           optimizer, clip=1.0, noise=1.1)  # fmt: skip
        run = lambda: step(x, y)  # noqa: E731
    else:
        private = {"per_example_clip": 1.0, "noise_multiplier": 1.1} if config["method"] == "effgrad DP-SGD" else {}
        step = effgrad.build_train_step(model, loss, optimizer, **private)
        run = lambda: step(x, y)["loss"]  # noqa: E731
    run()  # traced and built outside the measurement
    report = effgrad.memory.measure(run)
    seconds = common.median_time(run, warmup=0, repeats=config["repeats"])
    params = sum(int(tf.size(v)) for v in model.trainable_variables)
    return {"peak_mib": report.peak_mib, "seconds": seconds, "parameters": params}


def _configs(quick: bool):
    if quick:
        return {
            "16x1024 MLP": {"model": "mlp", "depth": 2, "width": 64, "batch": 64, "naive_rows": [8, 16], "repeats": 1},
            "BERT-tiny": {
                "model": "bert",
                "layers": 1,
                "hidden": 16,
                "seq": 16,
                "vocab": 500,
                "batch": 16,
                "naive_rows": [4, 8],
                "repeats": 1,
            },  # fmt: skip
        }
    return {
        "16x1024 MLP": {
            "model": "mlp",
            "depth": 16,
            "width": 1024,
            "batch": 1024,
            "naive_rows": [8, 16, 32],
            "repeats": 3,
        },  # fmt: skip
        "BERT-tiny": {
            "model": "bert",
            "layers": 2,
            "hidden": 128,
            "seq": 128,
            "vocab": 30522,
            "batch": 1024,
            "naive_rows": [16, 32, 64],
            "repeats": 2,
        },  # fmt: skip
    }


def run(quick: bool = False) -> dict:
    rows = []
    for name, config in _configs(quick).items():
        measured = {}
        for method in ("effgrad step", "effgrad DP-SGD"):
            measured[method] = common.run_isolated(MODULE, {**config, "method": method, "rows": config["batch"]})
        base = measured["effgrad step"]
        for method, result in measured.items():
            ratios = {"peak_x": result["peak_mib"] / base["peak_mib"], "time_x": result["seconds"] / base["seconds"]}
            rows.append({"model": name, "method": method, "batch": config["batch"], **result, **ratios})
        naive = [common.run_isolated(MODULE, {**config, "method": "naive per-example", "rows": r})
                 for r in config["naive_rows"]]  # fmt: skip
        for r, result in zip(config["naive_rows"], naive):
            rows.append({"model": name, "method": "naive per-example", "batch": r, **result})
        (r1, p1), (r2, p2) = (
            (config["naive_rows"][0], naive[0]["peak_mib"]),
            (config["naive_rows"][-1], naive[-1]["peak_mib"]),
        )
        slope = (p2 - p1) / (r2 - r1)
        at_batch = p2 + slope * (config["batch"] - r2)
        rows.append({"model": name, "method": "naive per-example (extrapolated)", "batch": config["batch"],
                     "peak_mib": at_batch, "peak_x": at_batch / base["peak_mib"],
                     "naive_over_dp": at_batch / measured["effgrad DP-SGD"]["peak_mib"]})  # fmt: skip
    tf_privacy = common.run_isolated(MODULE, {"method": "TF Privacy 0.9.0"})
    rows.append({"model": "-", "method": "TF Privacy 0.9.0", "error": tf_privacy["error"]})
    columns = [
        ("model", "model", ""),
        ("method", "method", ""),
        ("batch", "batch", ""),
        ("peak_mib", "peak MiB", ",.1f"),
        ("peak_x", "peak vs step", ".2f"),
        ("seconds", "s/step", ".3f"),
        ("time_x", "time vs step", ".2f"),
        ("naive_over_dp", "naive / DP peak", ".1f"),
        ("error", "error", ""),
    ]
    return common.publish(
        "privacy",
        "DP-SGD: per-example clipping at the memory of a normal step (one step, fresh process per row)",
        rows,
        columns,
        quick=quick,
    )


if __name__ == "__main__":
    common.child_main(child)
