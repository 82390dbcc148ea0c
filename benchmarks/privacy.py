"""DP-SGD at the cost of a normal step: effgrad's private step against the plain one and per-example gradients.

Per model, one fresh process per row:

* ``effgrad step``: the non-private step (the baseline, 1.00x);
* ``effgrad DP-SGD``: ``per_example_clip=1.0, noise_multiplier=1.1``: one backward pass, per-example
  norms and the clipped sum from what the taps keep (book-keeping);
* ``vectorized_map per-example``: the strongest plain-TensorFlow way (JAX's vmap): every example's
  gradient at once with ``tf.vectorized_map`` of a tape in a ``tf.function``, clipped, summed,
  noised, applied. Its memory is batch x parameters: it runs at doubling batches while the next
  one is predicted to fit in ``_CAP`` (a linear fit of the two before); the peak is extrapolated
  linearly from the largest two to the benchmark's batch, the time in proportion to the batch (marked);
* an LSTM text classifier: the plain and DP steps, and each example's norm against a loop of
  one tape per example (``norms vs naive``: the largest relative difference);
* ``TF Privacy 0.9.0``: installed with ``--no-deps`` (it would downgrade TensorFlow); the error
  it gives is recorded.

Every model is built without dropout: per-example gradients under ``vectorized_map`` would draw
their dropout masks per example, and the steps then do the same arithmetic.
"""

from __future__ import annotations

from benchmarks import common

MODULE = "benchmarks.privacy"
_CAP = 6 * 2**30  # allocator bytes the per-example baseline may reach (the machine is shared)


def _model(config):
    import keras

    keras.utils.set_random_seed(0)
    kind = config["model"]
    if kind == "mlp":
        width = config["width"]
        layers = [keras.Input((width,))] + [
            keras.layers.Dense(width, activation="gelu") for _ in range(config["depth"])
        ]
        return keras.Sequential(layers + [keras.layers.Dense(10)])
    if kind == "lstm":
        tokens = keras.Input((config["seq"],), dtype="int32")
        h = keras.layers.Embedding(config["vocab"], config["hidden"], mask_zero=True)(tokens)
        h = keras.layers.LSTM(config["hidden"])(h)
        return keras.Model(tokens, keras.layers.Dense(2)(h))
    import keras_hub

    if kind == "gpt2":
        backbone = keras_hub.models.GPT2Backbone(
            vocabulary_size=config["vocab"], num_layers=config["layers"], num_heads=config["heads"],
            hidden_dim=config["hidden"], intermediate_dim=4 * config["hidden"], max_sequence_length=config["seq"],
            dropout=0.0,
        )  # fmt: skip
        return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=config["vocab"], num_layers=config["layers"], num_heads=2, hidden_dim=config["hidden"],
        intermediate_dim=4 * config["hidden"], max_sequence_length=config["seq"], dropout=0.0,
    )  # fmt: skip
    return keras_hub.models.BertTextClassifier(backbone=backbone, num_classes=2, preprocessor=None, dropout=0.0)


def _batch(config, rows):
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(0)
    kind, seq = config["model"], config.get("seq")
    if kind == "mlp":
        x = tf.constant(rng.normal(size=(rows, config["width"])).astype("float32"))
        return x, tf.constant(rng.integers(0, 10, rows))
    lengths = rng.integers(seq // 2, seq + 1, rows)  # padded to seq: half to all of it is text
    mask = (np.arange(seq)[None] < lengths[:, None]).astype("int32")
    ids = rng.integers(1, config["vocab"], (rows, seq)).astype("int32") * mask
    if kind == "lstm":
        return tf.constant(ids), tf.constant(rng.integers(0, 2, rows))
    if kind == "gpt2":
        x = {"token_ids": tf.constant(ids), "padding_mask": tf.constant(mask)}
        return x, tf.constant(np.roll(ids, -1, axis=1))
    x = {
        "token_ids": tf.constant(ids),
        "segment_ids": tf.zeros((rows, seq), tf.int32),
        "padding_mask": tf.constant(mask),
    }
    return x, tf.constant(rng.integers(0, 2, rows))


def _vectorized_step(model, loss, optimizer, clip, noise):
    """Every example's gradient at once (tf.vectorized_map of a tape), clipped, summed, noised, averaged, applied."""
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
        grads = tf.vectorized_map(one, (x, y))  # [batch, *variable.shape] per variable
        squares = tf.add_n([tf.reduce_sum(tf.reshape(g * g, [tf.shape(g)[0], -1]), 1) for g in grads])
        factors = tf.minimum(1.0, clip / tf.maximum(tf.sqrt(squares), 1e-12))
        rows = tf.cast(tf.shape(factors)[0], tf.float32)
        final = [
            (tf.tensordot(factors, g, 1) + tf.random.normal(tf.shape(g)[1:], stddev=noise * clip)) / rows for g in grads
        ]
        optimizer.apply(final, variables)
        return squares

    return step


def _norms_against_naive(model, loss, x, y, rows: int) -> float:
    """The largest relative difference between effgrad's norms and one tape per example, on ``rows`` examples."""
    import numpy as np
    import tensorflow as tf

    import effgrad

    x, y = tf.nest.map_structure(lambda t: t[:rows], (x, y))
    got = effgrad.per_example_norms(model, loss, x, y).numpy()
    expected = []
    for i in range(rows):
        x_i = tf.nest.map_structure(lambda t, i=i: t[i : i + 1], x)
        with tf.GradientTape() as tape:
            value = tf.reduce_sum(loss(y[i : i + 1], model(x_i)))
        grads = tape.gradient(value, model.trainable_variables)
        expected.append(np.sqrt(sum(float(tf.reduce_sum(tf.square(tf.convert_to_tensor(g)))) for g in grads)))
    return float(np.max(np.abs(got - np.array(expected)) / np.array(expected)))


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
    result = {}
    if config["method"] == "vectorized_map per-example":
        unreduced = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
        step = _vectorized_step(model, unreduced, optimizer, clip=1.0, noise=1.1)
        run = lambda: step(x, y)  # noqa: E731
    else:
        private = {"per_example_clip": 1.0, "noise_multiplier": 1.1} if config["method"] == "effgrad DP-SGD" else {}
        step = effgrad.build_train_step(model, loss, optimizer, **private)
        run = lambda: step(x, y)["loss"]  # noqa: E731
        if private and config.get("check_rows"):  # after the measured step: its trace is not shared
            result["norms_vs_naive"] = None
    first = run()  # traced and built outside the measurement
    report = effgrad.memory.measure(run)
    seconds = common.median_time(run, warmup=0, repeats=config["repeats"])
    if "norms_vs_naive" in result:
        result["norms_vs_naive"] = _norms_against_naive(model, loss, x, y, config["check_rows"])
    if config["method"] != "vectorized_map per-example":
        result["loss_first"] = float(first)
    params = sum(int(tf.size(v)) for v in model.trainable_variables)
    return {"peak_mib": report.peak_mib, "seconds": seconds, "parameters": params, **result}


def _configs(quick: bool) -> dict:
    if quick:
        return {
            "16x1024 MLP": {"model": "mlp", "depth": 2, "width": 32, "batch": 32, "repeats": 1, "start": 8},
            "BERT-tiny": {"model": "bert", "layers": 1, "hidden": 16, "seq": 8, "vocab": 100, "batch": 16,
                          "repeats": 1},  # per-example rows: the MLP's code; GPT-2: BERT's on another hub model
            "LSTM classifier": {"model": "lstm", "vocab": 50, "hidden": 8, "seq": 6, "batch": 8, "repeats": 1,
                                "check_rows": 2},
        }  # fmt: skip
    return {
        "16x1024 MLP": {"model": "mlp", "depth": 16, "width": 1024, "batch": 1024, "repeats": 3, "start": 8},
        "BERT-tiny": {"model": "bert", "layers": 2, "hidden": 128, "seq": 128, "vocab": 30522, "batch": 1024,
                      "repeats": 2, "start": 16},
        "GPT-2 small": {"model": "gpt2", "layers": 12, "heads": 12, "hidden": 768, "seq": 128, "vocab": 50257,
                        "batch": 64, "repeats": 1, "start": 1},
        "LSTM classifier": {"model": "lstm", "vocab": 20000, "hidden": 128, "seq": 100, "batch": 256, "repeats": 3,
                            "check_rows": 16},
    }  # fmt: skip


def _per_example_rows(name: str, config: dict, dp: dict, base: dict) -> list[dict]:
    """The vectorized_map baseline at doubling batches while the next fits ``_CAP``, and its extrapolation."""
    measured, rows = [], config["start"]
    while rows < config["batch"]:
        result = common.run_isolated(MODULE, {**config, "method": "vectorized_map per-example", "rows": rows})
        measured.append((rows, result))
        if len(measured) >= 2:
            (r1, a), (r2, b) = measured[-2:]
            predicted = b["peak_mib"] + (b["peak_mib"] - a["peak_mib"]) / (r2 - r1) * rows
            if predicted * 2**20 > _CAP:
                break
        rows *= 2
    out = [{"model": name, "method": "vectorized_map per-example", "batch": r, **m} for r, m in measured]
    if len(measured) < 2:
        return out
    (r1, a), (r2, b) = measured[-2:]
    target = config["batch"]
    peak = b["peak_mib"] + (b["peak_mib"] - a["peak_mib"]) / (r2 - r1) * (target - r2)
    seconds = b["seconds"] * target / r2  # per-example work: time in proportion to the batch
    out.append({"model": name, "method": "vectorized_map per-example (extrapolated)", "batch": target,
                "peak_mib": peak, "seconds": seconds, "peak_x": peak / base["peak_mib"],
                "time_x": seconds / base["seconds"], "dp_peak_vs_this": dp["peak_mib"] / peak,
                "dp_time_vs_this": dp["seconds"] / seconds})  # fmt: skip
    return out


def run(quick: bool = False) -> dict:
    rows = []
    for name, config in _configs(quick).items():
        measured = {}
        for method in ("effgrad step", "effgrad DP-SGD"):
            measured[method] = common.run_isolated(MODULE, {**config, "method": method, "rows": config["batch"]})
        base, dp = measured["effgrad step"], measured["effgrad DP-SGD"]
        for method, result in measured.items():
            ratios = {"peak_x": result["peak_mib"] / base["peak_mib"], "time_x": result["seconds"] / base["seconds"]}
            rows.append({"model": name, "method": method, "batch": config["batch"], **result, **ratios})
        if "start" in config:
            rows += _per_example_rows(name, config, dp, base)
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
        ("dp_peak_vs_this", "DP peak vs this", ".3f"),
        ("dp_time_vs_this", "DP time vs this", ".3f"),
        ("norms_vs_naive", "norms vs naive", ".1e"),
        ("error", "error", ""),
    ]
    return common.publish(
        "privacy",
        "DP-SGD: per-example clipping at the cost of a normal step (one step, fresh process per row)",
        rows,
        columns,
        quick=quick,
    )


if __name__ == "__main__":
    common.child_main(child)
