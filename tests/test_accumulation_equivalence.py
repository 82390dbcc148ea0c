"""Accumulated micro-batch updates equal the plain full-batch update."""

import functools

import keras
import numpy as np
import pytest
import tensorflow as tf

import effgrad
from conftest import assert_variables_close
from helpers import mlp, numpy_vars, plain_step, sequence_model


def _data(rng, batch, zeros=(0,)):
    x = rng.normal(size=(batch, 5)).astype("float32")
    y = rng.normal(size=(batch, 3)).astype("float32")
    w = rng.uniform(0.1, 2.0, size=batch).astype("float32")
    w[[z for z in zeros if z < batch - 1]] = 0.0  # some zero weights, never all of them
    return x, y, w


def _regularizer(regularized):
    return keras.regularizers.L2(0.05) if regularized else None


# Every micro-batch count and mode of one batch is compared with the same full-batch step: computed
# once per process (its data from a fresh rng(0), as each test's rng fixture gives them).
@functools.cache
def _full_batch_step(batch, weighted, optimizer, regularized):
    """``((x, y, w), loss, model variables, optimizer variables)`` of the plain full-batch update (NumPy)."""
    x, y, w = _data(np.random.default_rng(0), batch, zeros=(0, 3))
    w = w if weighted else None
    reference, ref_opt = mlp(regularizer=_regularizer(regularized)), optimizer(learning_rate=0.1)
    expected = plain_step(reference, keras.losses.mean_squared_error, ref_opt, x, y, w)
    return (x, y, w), expected, numpy_vars(reference.trainable_variables), numpy_vars(ref_opt.variables)


def _compare(micro_batches, batch, jit_compile=False, optimizer=keras.optimizers.SGD, regularized=False, weighted=True):
    model, opt = mlp(regularizer=_regularizer(regularized)), optimizer(learning_rate=0.1)
    step = effgrad.build_train_step(
        model, keras.losses.MeanSquaredError(), opt, micro_batches=micro_batches, jit_compile=jit_compile
    )
    _check_update(step, batch, weighted, optimizer, regularized)
    return step


def _check_update(step, batch, weighted, optimizer=keras.optimizers.SGD, regularized=False):
    (x, y, w), expected, reference, ref_opt = _full_batch_step(batch, weighted, optimizer, regularized)
    logs = step(x, y, sample_weight=w)
    np.testing.assert_allclose(float(logs["loss"]), expected, rtol=1e-5)
    assert_variables_close(step.model.trainable_variables, reference)
    assert_variables_close(step.optimizer.variables, ref_opt)


# Every equivalence runs with and without sample weights: a normalizer
# computed wrongly only in the unweighted path once passed weighted tests.
weighted = pytest.mark.parametrize("weighted", [True, False], ids=["weighted", "unweighted"])


@weighted
def test_accumulated_update_equals_full_batch(weighted):
    """Each split of a batch: even, uneven, more micro-batches than rows. Without XLA the number of
    micro-batches and the batch size are tensors: every k >= 2 and batch size runs one trace (as training
    changing micro_batches between calls runs it), each case from the initial weights and optimizer state.
    micro_batches=1 goes first: on a step without accumulators it is the plain step (no loop)."""
    step = _compare(1, 13, weighted=weighted)
    model, opt = step.model, step.optimizer
    fresh_model, fresh_opt = mlp(), keras.optimizers.SGD(learning_rate=0.1)
    fresh_opt.build(fresh_model.trainable_variables)
    initial = numpy_vars(fresh_model.trainable_variables + fresh_opt.variables)
    for micro_batches, batch in [(2, 16), (3, 13), (5, 4), (8, 1), (8, 13), (8, 16)]:
        for variable, value in zip(model.trainable_variables + opt.variables, initial):
            variable.assign(value)
        step.micro_batches = micro_batches
        try:
            _check_update(step, batch, weighted)
        except AssertionError as err:
            raise AssertionError(f"micro_batches={micro_batches}, batch={batch}: {err}") from None


@weighted
@pytest.mark.parametrize("micro_batches", [1, 4, 8])
def test_accumulated_update_equals_full_batch_under_xla(micro_batches, weighted):
    _compare(micro_batches, 16 if micro_batches == 4 else 13, jit_compile=True, weighted=weighted)


@weighted
@pytest.mark.parametrize("jit_compile", [False, True])
def test_adam_slots_equal_full_batch(jit_compile, weighted):
    _compare(5, 13, jit_compile=jit_compile, optimizer=keras.optimizers.Adam, weighted=weighted)


@weighted
@pytest.mark.parametrize("micro_batches", [1, 4])
def test_kernel_regularizer_counted_once(micro_batches, weighted):
    _compare(micro_batches, 11, regularized=True, weighted=weighted)


def _sequence_data(rng, weights):
    batch, steps = 7, 5
    x = rng.normal(size=(batch, steps, 4)).astype("float32")
    y = rng.integers(0, 6, size=(batch, steps))
    if weights == "per_token":
        w = (rng.uniform(size=(batch, steps)) > 0.3).astype("float32")  # padding mask
    elif weights == "per_example":
        w = rng.uniform(0.0, 1.0, size=batch).astype("float32")
    else:
        w = None
    return x, y, w


@functools.cache
def _keras_reduction_step(reduction, weighted):
    """``((x, y, w), loss, model variables)``: Keras's own Loss.__call__ on the whole batch, one SGD step
    (the reference of every micro-batch count and mode; its data from a fresh rng(0))."""
    x, y, w = _sequence_data(np.random.default_rng(0), "per_token" if weighted else None)
    w = None if w is None else w * 1.5
    keras_loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=reduction)
    reference = sequence_model()
    with tf.GradientTape() as tape:
        expected = keras_loss(y, reference(x, training=True), sample_weight=w)
    keras.optimizers.SGD(0.5).apply(
        tape.gradient(expected, reference.trainable_variables), reference.trainable_variables
    )
    return (x, y, w), float(expected), numpy_vars(reference.trainable_variables)


@pytest.mark.parametrize("micro_batches, jit_compile", [(1, True), (3, False), (3, True)])
@pytest.mark.parametrize("reduction", ["sum_over_batch_size", "sum", "mean_with_sample_weight"])
@weighted
def test_keras_reductions_computed_over_the_whole_batch(reduction, micro_batches, jit_compile, weighted):
    """Keras's own Loss.__call__ on the whole batch is the reference for each reduction name."""
    (x, y, w), expected, reference = _keras_reduction_step(reduction, weighted)
    model = sequence_model()
    step = effgrad.build_train_step(
        model,
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        keras.optimizers.SGD(0.5),
        micro_batches=micro_batches,
        jit_compile=jit_compile,
        reduction=reduction,
    )
    np.testing.assert_allclose(float(step(x, y, w)["loss"]), expected, rtol=1e-5)
    assert_variables_close(model.trainable_variables, reference)


def test_unknown_reduction_is_refused():
    with pytest.raises(ValueError, match="reduction must be one of"):
        effgrad.build_train_step(mlp(), "mse", keras.optimizers.SGD(), reduction="none")


class _WithUnusedWeight(keras.layers.Layer):
    """A Dense-like layer with a trainable weight that never reaches its output (an unused head)."""

    def build(self, input_shape):
        self.kernel = self.add_weight(shape=(input_shape[-1], 3), initializer="glorot_uniform")
        self.unused = self.add_weight(shape=(4,), initializer="ones")

    def call(self, x):
        return x @ self.kernel


@pytest.mark.parametrize("micro_batches", [1, 3])
def test_variable_that_does_not_reach_the_loss_is_left_alone(rng, micro_batches):
    """BERT's unused pooler, a multi-head model: no crash, no update, as in Keras."""

    def make():
        keras.utils.set_random_seed(0)
        return keras.Sequential([keras.Input((5,)), _WithUnusedWeight()])

    model, reference = make(), make()
    x, y, _ = _data(rng, 10)
    opt = keras.optimizers.Adam(0.1)
    with pytest.warns(UserWarning, match="do not reach"):
        effgrad.build_train_step(model, "mse", opt, micro_batches=micro_batches)(x, y)
    plain_step(reference, keras.losses.mean_squared_error, keras.optimizers.Adam(0.1), x, y)
    assert_variables_close(model.trainable_variables, reference.trainable_variables)
    np.testing.assert_array_equal(model.layers[0].unused.numpy(), np.ones(4))
    assert int(opt.iterations.numpy()) == 1


@functools.cache
def _masked_full_batch_step(mask_shape):
    """``((x, y, w), loss, model variables)`` of the plain full-batch step (NumPy; data from a fresh rng(0))."""
    x, y, w = _sequence_data(np.random.default_rng(0), mask_shape)
    reference = sequence_model()
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    expected = plain_step(reference, loss.call, keras.optimizers.SGD(0.5), x, y, w)
    return (x, y, w), expected, numpy_vars(reference.trainable_variables)


@pytest.mark.parametrize("jit_compile", [False, True])
@pytest.mark.parametrize("mask_shape", ["per_token", "per_example"])
def test_masked_sequence_loss_normalized_over_all_tokens(jit_compile, mask_shape):
    (x, y, w), expected, reference = _masked_full_batch_step(mask_shape)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model = sequence_model()
    step = effgrad.build_train_step(model, loss, keras.optimizers.SGD(0.5), micro_batches=3, jit_compile=jit_compile)
    np.testing.assert_allclose(float(step(x, y, w)["loss"]), expected, rtol=1e-5)
    assert_variables_close(model.trainable_variables, reference)


def test_callable_loss_and_nested_inputs(rng):
    inp_a, inp_b = keras.Input((3,), name="a"), keras.Input((2,), name="b")
    keras.utils.set_random_seed(1)
    out = keras.layers.Dense(2)(keras.layers.Concatenate()([inp_a, inp_b]))
    make = lambda: keras.Model({"a": inp_a, "b": inp_b}, out)  # noqa: E731
    reference = make()
    model = keras.models.clone_model(reference)
    model.set_weights(reference.get_weights())
    x = {"a": rng.normal(size=(9, 3)).astype("float32"), "b": rng.normal(size=(9, 2)).astype("float32")}
    y = rng.normal(size=(9, 2)).astype("float32")

    def loss(y_true, y_pred):
        return keras.ops.sum(keras.ops.abs(y_true - y_pred), axis=-1)

    plain_step(reference, loss, keras.optimizers.SGD(0.1), x, y)
    effgrad.build_train_step(model, loss, keras.optimizers.SGD(0.1), micro_batches=4)(x, y)
    assert_variables_close(model.trainable_variables, reference.trainable_variables)


@pytest.mark.parametrize("micro_batches", [1, 3])
def test_zero_total_weight_changes_nothing(rng, micro_batches):
    x, y, _ = _data(rng, 6)
    model, opt = mlp(), keras.optimizers.Adam(0.1)
    step = effgrad.build_train_step(model, "mse", opt, micro_batches=micro_batches)
    before = [v.numpy().copy() for v in model.trainable_variables + opt.variables]
    logs = step(x, y, np.zeros(6, "float32"))
    assert np.isfinite(float(logs["loss"]))
    assert_variables_close(model.trainable_variables + opt.variables, before, atol=0, rtol=0)
