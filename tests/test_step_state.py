"""Forward-pass state (BatchNorm statistics, seeds) is committed only when a step is applied."""

import keras
import numpy as np
import pytest

import effgrad
from conftest import assert_variables_close


def _bn_model(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((5,)),
            keras.layers.Dense(8),
            keras.layers.BatchNormalization(),
            keras.layers.Dropout(0.3),
            keras.layers.Dense(3),
        ]
    )


def _state(model):
    return [v.numpy().copy() for v in model.non_trainable_variables]


def _data(rng, n=12):
    return rng.normal(size=(n, 5)).astype("float32"), rng.normal(size=(n, 3)).astype("float32")


@pytest.mark.parametrize("jit_compile", [False, True])
@pytest.mark.parametrize("micro_batches", [1, 3])
def test_skipped_step_leaves_state_alone_and_the_next_commits_what_plain_passes_do(rng, micro_batches, jit_compile):
    model, reference = _bn_model(), _bn_model()
    step = effgrad.build_train_step(
        model, "mse", keras.optimizers.SGD(0.1), micro_batches=micro_batches, jit_compile=jit_compile
    )
    x, y = _data(rng)
    bad = x.copy()
    bad[4, 2] = np.inf  # one bad row poisons the batch statistics
    before, weights = _state(model), model.get_weights()
    assert not bool(step(bad, y)["grads_finite"])
    assert_variables_close(model.non_trainable_variables, before, atol=0, rtol=0)
    assert all(np.isfinite(v).all() for v in model.get_weights())
    for a, b in zip(model.get_weights(), weights):
        np.testing.assert_array_equal(a, b)
    assert bool(step(x, y)["grads_finite"])  # the next good step trains normally
    # ...and commits the BatchNorm statistics and seed state of the plain per-micro-batch forward passes
    # (of the weights and seeds the skipped step left as they were).
    rows = -(-12 // micro_batches)
    for start in range(0, 12, rows):
        reference(x[start : start + rows], training=True)
    assert_variables_close(model.non_trainable_variables, reference.non_trainable_variables)
    assert np.isfinite(model(x, training=False).numpy()).all()


def test_skipped_step_keeps_replicas_identical(strategy, rng):
    with strategy.scope():
        model = _bn_model()
        opt = keras.optimizers.SGD(0.1)
    step = effgrad.build_train_step(model, "mse", opt, micro_batches=2, strategy=strategy)
    x, y = _data(rng, 8)
    x[6, 1] = np.inf  # a row of replica 1 only
    bn = model.layers[1]
    before = bn.moving_mean.numpy().copy()
    assert not bool(step(x, y)["grads_finite"])
    for copy in strategy.experimental_local_results(bn.moving_mean.value):
        np.testing.assert_array_equal(copy.numpy(), before)
