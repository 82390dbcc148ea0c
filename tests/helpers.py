"""Reference computations the tests compare effgrad against."""

import json
import os
import subprocess
import sys

import keras
import numpy as np
import tensorflow as tf


def mlp(seed=0, inputs=5, hidden=7, outputs=3, regularizer=None, dtype=None):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((inputs,)),
            keras.layers.Dense(hidden, activation="tanh", kernel_regularizer=regularizer, dtype=dtype),
            keras.layers.Dense(outputs, dtype=dtype),
        ]
    )


def tiny_gpt2_lm(seed=0, vocabulary=50, length=8, dropout=0.1):
    """A keras_hub GPT2CausalLM built from constructor arguments (nothing downloaded)."""
    import keras_hub

    keras.utils.set_random_seed(seed)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=vocabulary,
        num_layers=2,
        num_heads=2,
        hidden_dim=16,
        intermediate_dim=32,
        max_sequence_length=length,
        dropout=dropout,
    )
    return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)


def sequence_model(seed=0, features=4, vocab=6):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [keras.Input((None, features)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(vocab)]
    )


def plain_step(model, per_example_loss, optimizer, x, y, sample_weight=None, clip_norm=None):
    """One full-batch GradientTape update of L = sum(w*l)/sum(w) + regularization."""
    with tf.GradientTape() as tape:
        losses = per_example_loss(y, tf.cast(model(x, training=True), tf.float32))
        w = tf.ones_like(losses) if sample_weight is None else tf.cast(sample_weight, tf.float32)
        while w.shape.rank < losses.shape.rank:
            w = w[..., None]
        w = tf.broadcast_to(w, tf.shape(losses))
        loss = tf.reduce_sum(w * losses) / tf.reduce_sum(w)
        if model.losses:
            loss += tf.add_n(model.losses)
    grads = tape.gradient(loss, model.trainable_variables)
    if clip_norm is not None:
        grads, _ = tf.clip_by_global_norm(grads, clip_norm)
    optimizer.apply(grads, model.trainable_variables)
    return float(loss)


def per_example_losses(loss, y, y_pred, sample_weight=None):
    """``[batch]``: each example's unreduced loss, weighted, summed over its elements (DP-SGD's ``l_i``)."""
    fn = keras.losses.get(loss) if isinstance(loss, str) else loss
    values = tf.cast(fn.call(y, y_pred) if isinstance(fn, keras.losses.Loss) else fn(y, y_pred), tf.float32)
    mask = getattr(y_pred, "_keras_mask", None)
    if mask is not None:
        values = values * tf.cast(tf.reshape(mask, tf.shape(values)), tf.float32)
    if sample_weight is not None:
        w = tf.cast(sample_weight, tf.float32)
        values = values * tf.reshape(w, [-1] + [1] * (values.shape.rank - 1))
    return tf.reduce_sum(tf.reshape(values, [tf.shape(values)[0], -1]), axis=1)


def naive_per_example_gradients(model, loss, x, y, sample_weight=None, training=False):
    """``[example][variable]`` NumPy gradients: one forward pass, then one backward pass per example."""
    with tf.GradientTape(persistent=True) as tape:
        y_pred = model(x, training=training)
        losses = per_example_losses(loss, y, y_pred, sample_weight)
        singles = [losses[i] for i in range(int(losses.shape[0]))]
    grads = []
    for single in singles:
        g = tape.gradient(single, model.trainable_variables)
        grads.append([np.zeros(v.shape, "float32") if t is None else tf.convert_to_tensor(t).numpy()
                      for v, t in zip(model.trainable_variables, g)])  # fmt: skip
    return grads


def png_pixels(path) -> np.ndarray:
    """The picture at ``path`` as an ``[H, W, channels]`` float array; a clear failure if it is no PNG or blank."""
    import matplotlib.image

    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", path
    pixels = matplotlib.image.imread(path)
    assert pixels.ndim == 3 and min(pixels.shape[:2]) >= 100 and pixels.std() > 0.01, (path, pixels.shape)
    return pixels


def numpy_vars(variables):
    return [np.array(v.numpy()) for v in variables]


def assert_summary_equals_numpy(summary, maps, classes):
    """saliency_summary's per-class count, mean and variance equal NumPy's over the stored maps.

    ``maps`` is what effgrad.saliency returned: one array, or a dict of arrays per input.
    """
    assert sorted(summary.count) == sorted(set(classes.tolist()))
    for c, count in summary.count.items():
        assert count == (classes == c).sum()
        mean, variance = summary.mean[c], summary.variance[c]
        if isinstance(maps, dict):
            assert set(mean) == set(maps)  # the inputs' nest, as saliency() returns maps
            triples = [(mean[k], variance[k], maps[k]) for k in maps]
        else:
            triples = [(mean, variance, maps)]
        for m, v, stored in triples:
            rows = stored[classes == c]
            np.testing.assert_allclose(m, rows.mean(0), rtol=1e-4, atol=1e-6)
            np.testing.assert_allclose(v, rows.var(0), rtol=1e-3, atol=1e-7)


def in_fresh_processes(code: str, runs: dict, timeout: float = 300) -> dict:
    """``{key: value}``: ``python -c code *argv`` per ``runs[key] = argv``, side by side, each printing
    ``@@`` + JSON. A fresh process per measurement: allocator peaks then belong to it alone (the
    processes share only the wall time)."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", TF_CPU_ALLOCATOR_USE_BFC="true")
    procs = {
        key: subprocess.Popen(
            [sys.executable, "-c", code, *map(str, argv)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for key, argv in runs.items()
    }
    results = {}
    for key, proc in procs.items():
        out, err = proc.communicate(timeout=timeout)
        found = [json.loads(line[2:]) for line in out.splitlines() if line.startswith("@@")]
        assert found, err[-3000:]
        results[key] = found[0]
    return results
