"""An automatic path stands in for user code only where it is proven to be that code; else it falls back.

Each case is a model or loss a new user brought that the fused loss once replaced silently: a loss
subclass with its own ``call``, a ``Dense`` subclass as the head, labels outside the vocabulary.
Every comparison is with stock Keras on an identical model.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import effgrad
from conftest import assert_variables_close

VOCABULARY, T, BATCH = 5000, 128, 8  # 1,024 positions x 5,000 classes: "auto" fuses a plain head


class Focal(keras.losses.SparseCategoricalCrossentropy):
    def call(self, y_true, y_pred):
        return 2.0 * super().call(y_true, y_pred)


class HalfDense(keras.layers.Dense):
    def call(self, inputs):
        return super().call(inputs) * 0.5


class HalfKernel(keras.layers.Dense):  # inherits call, which reads this property
    @property
    def kernel(self):
        return super().kernel * 0.5


def _lm(head=keras.layers.Dense):
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [keras.Input((T,), dtype="int32"), keras.layers.Embedding(64, 16), keras.layers.Dense(16), head(VOCABULARY)]
    )


def _data(rng, high=VOCABULARY):
    tokens = rng.integers(0, 64, (BATCH, T)).astype("int32")
    return tokens, rng.integers(0, high, (BATCH, T)).astype("int32")


def _fit_both(rng, loss, head=keras.layers.Dense):
    tokens, labels = _data(rng)
    stock, ours = _lm(head), _lm(head)
    for model in (stock, ours):
        model.compile(optimizer=keras.optimizers.SGD(0.5), loss=loss())
    stock.optimizer.build(stock.trainable_variables)  # stock fit then traces once, not twice
    effgrad.attach(ours)
    kwargs = dict(batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    h_stock, h_ours = stock.fit(tokens, labels, **kwargs).history, ours.fit(tokens, labels, **kwargs).history
    np.testing.assert_allclose(h_ours["loss"], h_stock["loss"], rtol=1e-5)
    assert_variables_close(ours.trainable_variables, stock.trainable_variables, atol=1e-5)
    return ours.effgrad_step


def test_a_plain_head_and_loss_are_fused_so_the_cases_below_would_be_too(rng):
    step = _fit_both(rng, lambda: keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    assert step.fused_loss


def test_a_loss_subclass_with_its_own_call_is_not_fused(rng):
    step = _fit_both(rng, lambda: Focal(from_logits=True))
    assert step.fused_loss is False
    assert "Focal" in step.fused_loss_reason and "call" in step.fused_loss_reason


def test_a_dense_subclass_with_its_own_call_is_not_fused_as_a_dense(rng):
    step = _fit_both(rng, lambda: keras.losses.SparseCategoricalCrossentropy(from_logits=True), head=HalfDense)
    assert step.fused_loss is False
    assert "HalfDense" in step.fused_loss_reason


def test_a_dense_subclass_redefining_what_call_reads_is_not_fused_as_a_dense(rng):
    step = _fit_both(rng, lambda: keras.losses.SparseCategoricalCrossentropy(from_logits=True), head=HalfKernel)
    assert step.fused_loss is False
    assert "kernel" in step.fused_loss_reason


_DENSE_CALL = keras.layers.Dense.call


def _halved_call(self, inputs, *args, **kwargs):  # a patch a user or a library applied to the class
    return _DENSE_CALL(self, inputs, *args, **kwargs) * 0.5


def test_a_head_whose_class_method_was_patched_is_not_fused(rng, monkeypatch):
    monkeypatch.setattr(keras.layers.Dense, "call", _halved_call)
    step = _fit_both(rng, lambda: keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    assert step.fused_loss is False


def test_a_subclass_that_inherits_the_code_is_still_fused(rng):
    class Named(keras.losses.SparseCategoricalCrossentropy):  # only its defaults differ
        def __init__(self, **kwargs):
            super().__init__(from_logits=True, name="named", **kwargs)

    assert _fit_both(rng, Named).fused_loss


def test_a_name_or_a_probability_loss_is_not_fused_and_says_which_loss(rng):
    model = _lm()
    for loss in ("sparse_categorical_crossentropy", keras.losses.SparseCategoricalCrossentropy()):
        step = effgrad.build_train_step(model, loss, keras.optimizers.SGD(0.1))
        step(*_data(rng))
        assert step.fused_loss is False and "from_logits=True" in step.fused_loss_reason


def test_labels_outside_the_vocabulary_raise_as_keras_does_and_change_nothing(rng):
    tokens, labels = _data(rng)
    labels[3, 7] = VOCABULARY + 5
    stock = _lm()
    stock.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    stock.optimizer.build(stock.trainable_variables)  # one trace of stock's step, not two
    with pytest.raises(tf.errors.InvalidArgumentError):
        stock.train_on_batch(tokens, labels)
    model = _lm()
    before = [v.numpy() for v in model.variables]
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    step = effgrad.build_train_step(model, loss, keras.optimizers.SGD(0.1), fused_loss=True)
    with pytest.raises(tf.errors.InvalidArgumentError, match=rf"\[0, {VOCABULARY}\).*{VOCABULARY + 5}"):
        step(tokens, labels)
    for v, b in zip(model.variables, before):
        np.testing.assert_array_equal(v.numpy(), b)


def test_the_kernel_refuses_them_eagerly_too(rng):
    hidden, kernel = tf.random.normal([4, 8]), tf.random.normal([8, 10])
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"\[0, 10\)"):
        effgrad.fused_sparse_cross_entropy(hidden, kernel, tf.constant([1, 2, 10, 3]))


def test_labels_outside_the_vocabulary_under_xla_skip_the_step_with_a_nan_loss(rng):
    """Keras's loss under XLA is NaN there (no error kernel): the fused one is too, and nothing moves."""
    tokens, labels = _data(rng)
    labels[0, 0] = -3
    model = _lm()
    before = [v.numpy() for v in model.variables]
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    step = effgrad.build_train_step(model, loss, keras.optimizers.SGD(0.1), fused_loss=True, jit_compile=True)
    logs = step(tokens, labels)
    assert step.fused_loss and np.isnan(float(logs["loss"])) and not bool(logs["grads_finite"])
    for v, b in zip(model.variables, before):
        np.testing.assert_array_equal(v.numpy(), b)


def test_ignored_labels_may_lie_outside_the_vocabulary(rng):
    tokens, labels = _data(rng)
    labels[:, ::2] = -100
    model = _lm()
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=-100)
    step = effgrad.build_train_step(model, loss, keras.optimizers.SGD(0.1), fused_loss=True)
    assert np.isfinite(float(step(tokens, labels)["loss"]))


def test_build_train_step_honours_a_loss_objects_reduction(rng):
    tokens, labels = _data(rng, high=VOCABULARY)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum")
    model = _lm()
    expected = float(loss(labels, model(tokens)))
    step = effgrad.build_train_step(model, loss, keras.optimizers.SGD(0.0))
    assert step.reduction == "sum"
    np.testing.assert_allclose(float(step(tokens, labels)["loss"]), expected, rtol=1e-5)


def test_a_loss_that_overrides_dunder_call_is_refused_in_one_line(rng):
    class Clipped(keras.losses.MeanSquaredError):
        def __call__(self, y_true, y_pred, sample_weight=None):
            return tf.minimum(super().__call__(y_true, y_pred, sample_weight), 1.0)

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    with pytest.raises(ValueError, match="__call__") as err:
        effgrad.build_train_step(model, Clipped(), keras.optimizers.SGD(0.1))
    assert "\n" not in str(err.value)
