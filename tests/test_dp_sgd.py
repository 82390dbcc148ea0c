"""DP-SGD in the step: the update is the sum of clipped per-example gradients plus noise added once, / B."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import effgrad
from conftest import assert_variables_close
from helpers import naive_per_example_gradients, numpy_vars

_LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _mlp(seed=0, width=8):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((5,)), keras.layers.Dense(width, activation="tanh"), keras.layers.Dense(3)])


def _clipped_mean(model, loss, x, y, clip, sample_weight=None):
    """sum_i g_i * min(1, C / |g_i|) / B from one backward pass per example; and how many were clipped."""
    grads = naive_per_example_gradients(model, loss, x, y, sample_weight)
    norms = [np.sqrt(sum(float(np.sum(g * g)) for g in example)) for example in grads]
    factors = [min(1.0, clip / n) if n > 0 else 1.0 for n in norms]
    total = [sum(f * example[j] for f, example in zip(factors, grads)) / len(grads) for j in range(len(grads[0]))]
    return total, sum(f < 1 for f in factors)


def _after_sgd(model, mean_grad):
    return [w - g for w, g in zip(numpy_vars(model.trainable_variables), mean_grad)]


@pytest.mark.parametrize("micro_batches, jit", [(1, False), (3, False), (3, True)])
def test_update_is_the_mean_of_clipped_per_example_gradients(rng, micro_batches, jit):
    x, y = rng.normal(size=(11, 5)).astype("float32"), rng.integers(0, 3, 11)  # 11 rows: an uneven last slice
    w = rng.uniform(0.5, 2.0, 11).astype("float32")
    model = _mlp()
    clip = float(np.median(effgrad.per_example_norms(model, _LOSS, x, y, w)))
    expected_grad, clipped = _clipped_mean(model, _LOSS, x, y, clip=clip, sample_weight=w)
    assert 4 <= clipped <= 6  # about half the examples are clipped: the clipping decides the update
    expected = _after_sgd(model, expected_grad)
    step = effgrad.build_train_step(
        model, _LOSS, keras.optimizers.SGD(1.0), micro_batches=micro_batches, jit_compile=jit,
        per_example_clip=clip, noise_multiplier=0.0,
    )  # fmt: skip
    logs = step(x, y, sample_weight=w)
    assert_variables_close(model.trainable_variables, expected, rtol=1e-5, atol=1e-6)
    per_example = _LOSS.call(y, _mlp()(x)).numpy() * w
    assert float(logs["loss"]) == pytest.approx(per_example.mean(), rel=1e-5)  # the mean per-example loss


def test_several_replicas_give_the_one_device_update(rng, strategy):
    x, y = rng.normal(size=(10, 5)).astype("float32"), rng.integers(0, 3, 10)
    one = _mlp()
    effgrad.build_train_step(one, _LOSS, keras.optimizers.SGD(1.0), per_example_clip=0.5, noise_multiplier=0.0)(x, y)
    with strategy.scope():
        two, optimizer = _mlp(), keras.optimizers.SGD(1.0)
    step = effgrad.build_train_step(
        two, _LOSS, optimizer, micro_batches=2, strategy=strategy, per_example_clip=0.5, noise_multiplier=0.0
    )
    step(x, y)
    assert_variables_close(two.trainable_variables, one.trainable_variables, rtol=1e-5, atol=1e-6)


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


def _noise(rng, *, sigma, clip, seed, steps=1, strategy=None, micro_batches=1):
    """What the noise added to the update: the update minus the noiseless one, per step (SGD, lr 1)."""
    x, y = rng.normal(size=(8, 5)).astype("float32"), rng.integers(0, 3, 8)
    draws = []
    for _ in range(steps):
        results = []
        for multiplier in (sigma, 0.0):
            scope = strategy.scope() if strategy is not None else tf.init_scope()
            with scope:
                model, optimizer = _mlp(width=256), keras.optimizers.SGD(1.0)
                optimizer.build(model.trainable_variables)
            optimizer.iterations.assign(len(draws))  # the step number the noise is drawn for
            before = numpy_vars(model.trainable_variables)
            step = effgrad.build_train_step(
                model, _LOSS, optimizer, per_example_clip=clip, noise_multiplier=multiplier, seed=seed,
                strategy=strategy, micro_batches=micro_batches,
            )  # fmt: skip
            step(x, y)
            results.append([b - a for a, b in zip(numpy_vars(model.trainable_variables), before)])
        draws.append(np.concatenate([(n - q).ravel() for n, q in zip(*results)]))
    return draws, len(x)


def test_noise_has_the_dp_sgd_scale_once_per_batch_and_fresh_every_step(rng):
    (first, second), rows = _noise(rng, sigma=1.5, clip=0.5, seed=7, steps=2)
    assert first.size > 2000
    expected = 1.5 * 0.5 / rows  # sigma * C, then divided by the batch size
    assert abs(first.mean()) < 0.05 * expected
    assert first.std() == pytest.approx(expected, rel=0.05)
    assert abs(np.corrcoef(first, second)[0, 1]) < 0.05  # a new draw at every step
    again, _ = _noise(rng, sigma=1.5, clip=0.5, seed=7, steps=1)
    np.testing.assert_allclose(again[0], first, atol=1e-6)  # the seed makes it reproducible
    other, _ = _noise(rng, sigma=1.5, clip=0.5, seed=8, steps=1)
    assert abs(np.corrcoef(first, other[0])[0, 1]) < 0.05


def test_noise_is_added_once_across_micro_batches_and_replicas(rng, strategy):
    (noise,), rows = _noise(rng, sigma=2.0, clip=1.0, seed=3, strategy=strategy, micro_batches=2)
    # Noise drawn per replica (or per micro-batch) and summed would be sqrt(2) (or 2) times larger.
    assert noise.std() == pytest.approx(2.0 * 1.0 / rows, rel=0.05)


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
    for start in (0, 6):
        step(x[start : start + 6], y[start : start + 6])
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
