"""Bad input is rejected with a message that names the fix, before any update."""

import keras
import numpy as np
import pytest

import effgrad
from helpers import mlp


def _xy(rng, batch=6):
    return rng.normal(size=(batch, 5)).astype("float32"), rng.normal(size=(batch, 3)).astype("float32")


@pytest.mark.parametrize("bad", [0, -2, 1.5, "4", True, None])
def test_micro_batches_must_be_positive_int(bad):
    with pytest.raises(ValueError, match="micro_batches must be a positive int"):
        effgrad.build_train_step(mlp(), "mse", keras.optimizers.SGD(), micro_batches=bad)


def _assert_untouched(model, optimizer, before):
    after = [v.numpy() for v in model.trainable_variables] + [int(optimizer.iterations.numpy())]
    for a, b in zip(after, before):
        np.testing.assert_array_equal(a, b)


def _snapshot(model, optimizer):
    return [v.numpy().copy() for v in model.trainable_variables] + [int(optimizer.iterations.numpy())]


def test_batch_sizes_must_agree(rng):
    model, opt = mlp(), keras.optimizers.SGD(0.1)
    step = effgrad.build_train_step(model, "mse", opt)
    x, y = _xy(rng)
    before = _snapshot(model, opt)
    with pytest.raises(ValueError, match="same batch size"):
        step(x, y[:5])
    with pytest.raises(ValueError, match="same batch size"):
        step(x, y, np.ones(4, "float32"))
    _assert_untouched(model, opt, before)


def test_reduced_loss_is_rejected(rng):
    model, opt = mlp(), keras.optimizers.SGD(0.1)
    step = effgrad.build_train_step(model, lambda y, p: keras.ops.mean((y - p) ** 2), opt, micro_batches=2)
    before = _snapshot(model, opt)
    with pytest.raises(ValueError, match="already reduced"):
        step(*_xy(rng))
    _assert_untouched(model, opt, before)


def test_model_without_trainable_variables(rng):
    model = mlp()
    model.trainable = False
    with pytest.raises(ValueError, match="no trainable variables"):
        effgrad.build_train_step(model, "mse", keras.optimizers.SGD())


def test_sample_weight_that_does_not_broadcast(rng):
    model, opt = mlp(), keras.optimizers.SGD(0.1)
    step = effgrad.build_train_step(model, "mse", opt, micro_batches=2)
    x, y = _xy(rng)
    before = _snapshot(model, opt)
    with pytest.raises(ValueError, match="does not broadcast|more axes"):
        step(x, y, np.ones((6, 4), "float32"))  # the mse loss is per example: [6]
    _assert_untouched(model, opt, before)


def test_unknown_loss_scale_and_bad_types():
    with pytest.raises(ValueError, match="Unknown loss_scale"):
        effgrad.build_train_step(mlp(), "mse", keras.optimizers.SGD(), loss_scale="sometimes")
    with pytest.raises(TypeError, match="optimizer"):
        effgrad.build_train_step(mlp(), "mse", "sgd")
    with pytest.raises(TypeError, match="loss"):
        effgrad.build_train_step(mlp(), 3, keras.optimizers.SGD())
    with pytest.raises(ValueError, match="clip_norm"):
        effgrad.build_train_step(mlp(), "mse", keras.optimizers.SGD(), clip_norm=0)


def test_losses_added_in_forward_pass_are_refused(rng):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(3, activity_regularizer="l2")])
    step = effgrad.build_train_step(model, "mse", keras.optimizers.SGD(), micro_batches=2)
    with pytest.raises(NotImplementedError, match="add_loss"):
        step(*_xy(rng))
