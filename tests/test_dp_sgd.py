"""DP-SGD in the step: the update is the sum of clipped per-example gradients plus noise added once, / B."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import effgrad
from conftest import assert_variables_close
from helpers import naive_per_example_gradients, numpy_vars, per_example_losses

_LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _mlp(seed=0, width=8):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((5,)), keras.layers.Dense(width, activation="tanh"), keras.layers.Dense(3)])


def _norms(grads):
    """``[batch]``: the norm of each example's gradient (``grads`` as naive_per_example_gradients gives them)."""
    return np.array([np.sqrt(sum(float(np.sum(g * g)) for g in example)) for example in grads])


def _clip_and_average(grads, clip):
    """sum_i g_i * min(1, C / |g_i|) / B; and how many were clipped."""
    factors = [min(1.0, clip / n) if n > 0 else 1.0 for n in _norms(grads)]
    total = [sum(f * example[j] for f, example in zip(factors, grads)) / len(grads) for j in range(len(grads[0]))]
    return total, sum(f < 1 for f in factors)


def _clipped_mean(model, loss, x, y, clip, sample_weight=None):
    """sum_i g_i * min(1, C / |g_i|) / B from one backward pass per example; and how many were clipped."""
    return _clip_and_average(naive_per_example_gradients(model, loss, x, y, sample_weight), clip)


def _two_pass_mean(model, loss, x, y, clip, norms, sample_weight=None):
    """Round 3's DP-SGD: the norms first, then a second backward pass of sum_i c_i l_i / B."""
    factors = np.minimum(1.0, clip / norms).astype("float32")
    with tf.GradientTape() as tape:
        losses = per_example_losses(loss, y, model(x, training=True), sample_weight)
        total = tf.reduce_sum(factors * losses) / len(norms)
    return [tf.convert_to_tensor(g).numpy() for g in tape.gradient(total, model.trainable_variables)]


def _after_sgd(model, mean_grad):
    return [w - g for w, g in zip(numpy_vars(model.trainable_variables), mean_grad)]


def _families(seed=0):
    """Every closed form but the recurrent ones: a masked embedding, normalizations, grouped and depthwise convs."""
    keras.utils.set_random_seed(seed)
    tokens, image = keras.Input((6,), dtype="int32"), keras.Input((6, 6, 4))
    t = keras.layers.LayerNormalization()(keras.layers.Embedding(20, 8, mask_zero=True)(tokens))
    t = keras.layers.GlobalAveragePooling1D()(keras.layers.Dense(5, activation="gelu")(t))
    # (no bias right before a normalization: its gradient would be a difference of near-equal sums)
    i = keras.layers.Conv2D(4, 3, groups=2, padding="same", use_bias=False)(image)
    i = keras.layers.DepthwiseConv2D(3, activation="relu")(keras.layers.GroupNormalization(2)(i))
    i = keras.layers.Dense(3, activation="tanh")(keras.layers.Flatten()(i))
    return keras.Model([tokens, image], keras.layers.Dense(3)(keras.layers.Concatenate()([t, i])))


@pytest.fixture(scope="module")
def families_batch():
    """A batch for :func:`_families`, its clipping bound, and the clipped mean gradient two ways."""
    rng = np.random.default_rng(0)
    rows = 7  # 7 rows: an uneven last micro-batch
    ids = rng.integers(1, 20, (rows, 6)).astype("int32")
    ids[1, 3:], ids[4, 1:] = 0, 0  # padding: masked out of each example's loss
    x, y = [ids, rng.normal(size=(rows, 6, 6, 4)).astype("float32")], rng.integers(0, 3, rows)
    w = rng.uniform(0.5, 2.0, rows).astype("float32")
    model = _families()
    # The norms from the per-example gradients themselves: effgrad.per_example_norms (a trace of its own)
    # equals them (test_per_example_norms.py), and the step under test computes its own.
    grads = naive_per_example_gradients(model, _LOSS, x, y, w)
    norms = _norms(grads)
    clip = float(np.median(norms))
    naive, clipped = _clip_and_average(grads, clip)
    assert 3 <= clipped <= 4  # about half the examples are clipped: the clipping decides the update
    two_pass = _two_pass_mean(model, _LOSS, x, y, clip, norms, w)
    loss = float(np.mean(per_example_losses(_LOSS, y, model(x), w)))
    return (x, y, w), clip, naive, two_pass, loss


@pytest.mark.parametrize("mode, micro_batches", [("eager", 1), ("function", 3), ("xla", 1)])
def test_one_backward_pass_gives_the_two_pass_update(families_batch, mode, micro_batches):
    (x, y, w), clip, naive, two_pass, loss = families_batch
    model = _families()
    before = numpy_vars(model.trainable_variables)
    rate = 1e4  # the update is the gradient's to float32 precision, whatever the weights
    step = effgrad.build_train_step(
        model, _LOSS, keras.optimizers.SGD(rate), micro_batches=micro_batches, jit_compile=mode == "xla",
        per_example_clip=clip, noise_multiplier=0.0,
    )  # fmt: skip
    tf.config.run_functions_eagerly(mode == "eager")
    try:
        logs = step(x, y, sample_weight=w)
    finally:
        tf.config.run_functions_eagerly(False)
    for v, b, n, t in zip(model.trainable_variables, before, naive, two_pass):
        got = (b - v.numpy()) / rate
        np.testing.assert_allclose(got, n, rtol=1e-5, atol=1e-6, err_msg=v.path)  # the clipped mean itself
        assert np.linalg.norm(got - t) <= 2e-6 * np.linalg.norm(t), v.path  # today's two-pass update
    assert float(logs["loss"]) == pytest.approx(loss, rel=1e-5)  # the mean per-example loss


def test_recurrent_text_classifier_trains_with_the_clipped_mean(rng):
    def lstm():
        keras.utils.set_random_seed(0)
        tokens = keras.Input((8,), dtype="int32")
        h = keras.layers.Embedding(30, 6, mask_zero=True)(tokens)
        return keras.Model(tokens, keras.layers.Dense(2)(keras.layers.LSTM(5)(h)))

    ids = rng.integers(1, 30, (6, 8)).astype("int32")
    ids[0, 5:], ids[3, 2:] = 0, 0
    y = rng.integers(0, 2, 6)
    model = lstm()
    expected_grad, clipped = _clipped_mean(model, _LOSS, ids, y, clip=0.1)
    assert clipped >= 2
    expected = _after_sgd(model, expected_grad)
    step = effgrad.build_train_step(
        model, _LOSS, keras.optimizers.SGD(1.0), micro_batches=2, per_example_clip=0.1, noise_multiplier=0.0
    )
    step(ids, y)
    assert_variables_close(model.trainable_variables, expected, rtol=1e-5, atol=1e-6)


def test_several_replicas_give_the_one_device_update(rng, strategy):
    x, y = rng.normal(size=(10, 5)).astype("float32"), rng.integers(0, 3, 10)
    # The one-device update is the clipped mean over the whole batch (the tests above): computed directly,
    # one backward pass per example, rather than by a second traced step.
    one = _mlp()
    expected_grad, clipped = _clipped_mean(one, _LOSS, x, y, clip=0.5)
    assert clipped >= 2
    expected = _after_sgd(one, expected_grad)
    with strategy.scope():
        two, optimizer = _mlp(), keras.optimizers.SGD(1.0)
    step = effgrad.build_train_step(
        two, _LOSS, optimizer, micro_batches=2, strategy=strategy, per_example_clip=0.5, noise_multiplier=0.0
    )
    step(x, y)
    assert_variables_close(two.trainable_variables, expected, rtol=1e-5, atol=1e-6)


def test_keras_hub_bert_with_padding_clips_each_example(rng):
    import keras_hub

    def bert():
        keras.utils.set_random_seed(0)
        backbone = keras_hub.models.BertBackbone(
            vocabulary_size=30, num_layers=1, num_heads=2, hidden_dim=8, intermediate_dim=16,
            max_sequence_length=6, dropout=0.0,
        )  # fmt: skip
        return keras_hub.models.BertTextClassifier(backbone=backbone, num_classes=2, preprocessor=None, dropout=0.0)

    mask = np.ones((5, 6), "int32")
    mask[0, 3:] = 0
    x = {"token_ids": rng.integers(1, 30, (5, 6)).astype("int32") * mask, "segment_ids": np.zeros((5, 6), "int32"),
         "padding_mask": mask}  # fmt: skip
    y = rng.integers(0, 2, 5)
    model = bert()
    expected_grad, clipped = _clipped_mean(model, _LOSS, x, y, clip=0.05)
    assert clipped >= 2
    expected = _after_sgd(model, expected_grad)
    step = effgrad.build_train_step(model, _LOSS, keras.optimizers.SGD(1.0), per_example_clip=0.05, noise_multiplier=0)
    step(x, y)
    assert_variables_close(model.trainable_variables, expected, rtol=1e-4, atol=1e-6)


_NOISE_CLIP = 0.5


@pytest.fixture(scope="module")
def noise_batch():
    """A batch, the initial weights of ``_mlp(width=256)`` and its update without noise (SGD, lr 1): the
    clipped mean gradient, which the noiseless step equals to float32 precision (the tests above), far
    below the noise's scale. It does not depend on the step number: it serves every draw below."""
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(8, 5)).astype("float32"), rng.integers(0, 3, 8)
    model = _mlp(width=256)
    noiseless, _ = _clipped_mean(model, _LOSS, x, y, clip=_NOISE_CLIP)
    return x, y, numpy_vars(model.trainable_variables), noiseless


def _noise(batch, *, sigma, seed, steps=(0,), strategy=None, micro_batches=1):
    """What the noise added to the update: the update minus the noiseless one, at each optimizer step in
    ``steps`` (one step built and traced, run from the same weights at each step number)."""
    x, y, before, noiseless = batch
    scope = strategy.scope() if strategy is not None else tf.init_scope()
    with scope:
        model, optimizer = _mlp(width=256), keras.optimizers.SGD(1.0)
        optimizer.build(model.trainable_variables)
    step = effgrad.build_train_step(
        model, _LOSS, optimizer, per_example_clip=_NOISE_CLIP, noise_multiplier=sigma, seed=seed,
        strategy=strategy, micro_batches=micro_batches,
    )  # fmt: skip
    draws = []
    for number in steps:
        for variable, value in zip(model.trainable_variables, before):
            variable.assign(value)
        optimizer.iterations.assign(number)  # the step number the noise is drawn for
        step(x, y)
        update = [b - a for a, b in zip(numpy_vars(model.trainable_variables), before)]
        draws.append(np.concatenate([(u - q).ravel() for u, q in zip(update, noiseless)]))
    return draws, len(x)


def test_noise_has_the_dp_sgd_scale_once_per_batch_and_fresh_every_step(noise_batch, strategy):
    (first, second), rows = _noise(noise_batch, sigma=1.5, seed=7, steps=(0, 1))
    assert first.size > 2000
    expected = 1.5 * _NOISE_CLIP / rows  # sigma * C, then divided by the batch size
    assert abs(first.mean()) < 0.05 * expected
    assert first.std() == pytest.approx(expected, rel=0.05)
    assert abs(np.corrcoef(first, second)[0, 1]) < 0.05  # a new draw at every step
    (again,), _ = _noise(noise_batch, sigma=1.5, seed=7)  # another step built with the same seed
    np.testing.assert_allclose(again, first, atol=1e-6)  # the seed makes it reproducible
    # Added once across micro-batches and replicas (drawn per replica, or per micro-batch, and summed, it
    # would be sqrt(2), or 2, times larger); its other seed draws other noise.
    (noise,), _ = _noise(noise_batch, sigma=2.0, seed=8, strategy=strategy, micro_batches=2)
    assert noise.std() == pytest.approx(2.0 * _NOISE_CLIP / rows, rel=0.05)
    assert abs(np.corrcoef(first, noise)[0, 1]) < 0.05


def test_mixed_float16_clips_the_unscaled_gradients(rng):
    keras.config.set_dtype_policy("mixed_float16")
    x, y = rng.normal(size=(6, 5)).astype("float32"), rng.integers(0, 3, 6)
    model = _mlp()
    step = effgrad.build_train_step(model, _LOSS, keras.optimizers.SGD(1.0), per_example_clip=0.3, noise_multiplier=0)
    assert isinstance(step.loss_scale, effgrad.DynamicLossScale)  # a scale of 32768 multiplies every norm
    keras.config.set_dtype_policy("float32")
    reference = _mlp()
    expected = _after_sgd(reference, _clipped_mean(reference, _LOSS, x, y, clip=0.3)[0])
    step(x, y)
    assert_variables_close(model.trainable_variables, expected, rtol=2e-2, atol=2e-3)


def test_mixed_float16_keeps_the_scale_the_plain_step_keeps(rng):
    # Backprop from S per example (not S / batch, as the plain step's mean) overflowed float16 where the
    # plain step did not: the first steps were skipped while the scale fell.
    keras.config.set_dtype_policy("mixed_float16")
    x, y = rng.normal(size=(6, 5, 8)).astype("float32"), rng.integers(0, 3, (6, 5))
    keras.utils.set_random_seed(7)
    layers = [keras.layers.Dense(16, activation="gelu"), keras.layers.LayerNormalization()]
    layers += [keras.layers.Conv1D(8, 3, padding="causal"), keras.layers.Dense(3, dtype="float32")]
    model = keras.Sequential([keras.Input((5, 8)), *layers])
    for options in ({}, dict(per_example_clip=0.5, noise_multiplier=0.0)):
        step = effgrad.build_train_step(model, _LOSS, keras.optimizers.SGD(0.01), **options)
        logs = [step(x, y) for _ in range(2)]
        assert [(float(g["grads_finite"]), float(g["loss_scale"])) for g in logs] == [(1.0, 32768.0)] * 2, options


def test_attach_trains_with_dp_sgd_like_the_step(rng):
    x, y = rng.normal(size=(12, 5)).astype("float32"), rng.integers(0, 3, 12)
    fitted, stepped = _mlp(), _mlp()
    fitted.compile(optimizer=keras.optimizers.SGD(0.5), loss=_LOSS)
    effgrad.attach(fitted, per_example_clip=0.5, noise_multiplier=0.8, seed=1, micro_batches=2)
    callback = effgrad.privacy.EpsilonCallback(num_examples=12, batch_size=6, noise_multiplier=0.8, delta=1e-3)
    history = fitted.fit(x, y, batch_size=6, epochs=1, shuffle=False, verbose=0, callbacks=[callback])
    step = effgrad.build_train_step(
        stepped, _LOSS, keras.optimizers.SGD(0.5), per_example_clip=0.5, noise_multiplier=0.8, seed=1, micro_batches=2
    )
    tf.config.run_functions_eagerly(True)  # the step's eager run equals its trace (the tests above): no trace
    try:
        for start in (0, 6):
            step(x[start : start + 6], y[start : start + 6])
    finally:
        tf.config.run_functions_eagerly(False)
    assert_variables_close(fitted.trainable_variables, stepped.trainable_variables, rtol=1e-5, atol=1e-6)
    expected = effgrad.privacy.epsilon(steps=2, batch_size=6, num_examples=12, noise_multiplier=0.8, delta=1e-3)
    assert history.history["epsilon"] == [pytest.approx(expected)]


def test_bad_privacy_options_are_refused_with_what_to_pass():
    model = _mlp()
    with pytest.raises(ValueError, match="noise_multiplier=sigma"):
        effgrad.build_train_step(model, _LOSS, keras.optimizers.SGD(), per_example_clip=1.0)
    with pytest.raises(ValueError, match="give per_example_clip"):
        effgrad.build_train_step(model, _LOSS, keras.optimizers.SGD(), noise_multiplier=1.0)
    with pytest.raises(ValueError, match="per_example_clip must be > 0"):
        effgrad.build_train_step(model, _LOSS, keras.optimizers.SGD(), per_example_clip=0, noise_multiplier=1.0)
    with pytest.raises(ValueError, match="fused_update=True cannot be combined"):
        effgrad.build_train_step(
            model, _LOSS, keras.optimizers.SGD(), per_example_clip=1.0, noise_multiplier=1.0, fused_update=True
        )
    bn = keras.Sequential([keras.Input((5,)), keras.layers.BatchNormalization(), keras.layers.Dense(3)])
    with pytest.raises(ValueError, match="BatchNormalization"):
        effgrad.build_train_step(bn, _LOSS, keras.optimizers.SGD(), per_example_clip=1.0, noise_multiplier=1.0)
    rnn = keras.Sequential([keras.Input((4, 5)), keras.layers.LSTM(3, recurrent_dropout=0.2), keras.layers.Dense(3)])
    with pytest.raises(ValueError, match="lstm.*recurrent_dropout=0") as refused:  # before any trace: at build
        effgrad.build_train_step(rnn, _LOSS, keras.optimizers.SGD(), per_example_clip=1.0, noise_multiplier=1.0)
    assert "\n" not in str(refused.value)


def test_epsilon_matches_dp_accountings_worked_examples():
    # dp-accounting's own test: one full-batch Gaussian step with sigma = 4.530877117 is (1, 1e-6)-DP.
    eps = effgrad.privacy.epsilon(steps=1, batch_size=100, num_examples=100, noise_multiplier=4.530877117, delta=1e-6)
    assert eps == pytest.approx(1.0, rel=0.02)
    pld = effgrad.privacy.epsilon(
        steps=1, batch_size=100, num_examples=100, noise_multiplier=4.530877117, delta=1e-6, accountant="pld"
    )
    assert pld <= eps * 1.01  # PLD accounting is at least as tight
    # TF Privacy's MNIST tutorial setting: 60,000 examples, batch 256, sigma 1.1, 60 epochs, delta 1e-5.
    mnist = effgrad.privacy.epsilon(steps=60 * 60000 // 256, batch_size=256, num_examples=60000,
                                    noise_multiplier=1.1, delta=1e-5)  # fmt: skip
    assert 2.5 < mnist < 3.5
    assert effgrad.privacy.epsilon(steps=1, batch_size=1, num_examples=10, noise_multiplier=0.0, delta=1e-5) == np.inf
    with pytest.raises(ValueError, match="delta must be in"):
        effgrad.privacy.epsilon(steps=1, batch_size=1, num_examples=10, noise_multiplier=1.0, delta=2)
