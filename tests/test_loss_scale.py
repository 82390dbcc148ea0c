"""Dynamic loss scaling: skipped bad steps, growth, bounds, checkpoints, mixed precision."""

import functools

import keras
import numpy as np
import pytest
import tensorflow as tf

import effgrad
from conftest import assert_variables_close
from helpers import mlp, plain_step


def _xy(rng, batch=12):
    return rng.normal(size=(batch, 5)).astype("float32"), rng.normal(size=(batch, 3)).astype("float32")


def _state(model, optimizer):
    return [v.numpy().copy() for v in model.trainable_variables + optimizer.variables]


# ------------------------------------------------------------ the object alone
def test_dynamic_algorithm_backoff_growth_and_bounds():
    ls = effgrad.DynamicLossScale(initial_scale=8.0, growth_interval=3, min_scale=2.0, max_scale=32.0)
    ls.update(False)
    assert float(ls.value) == 4.0 and int(ls.counter) == 0
    ls.update(False), ls.update(False)
    assert float(ls.value) == 2.0  # never below min_scale
    assert int(ls.overflow_streak) == 1  # one overflow while already at the minimum
    for _ in range(2):
        ls.update(True)
    assert float(ls.value) == 2.0 and int(ls.counter) == 2 and int(ls.overflow_streak) == 0
    ls.update(True)  # third finite step in a row: grow
    assert float(ls.value) == 4.0 and int(ls.counter) == 0
    for _ in range(30):
        ls.update(True)
    assert float(ls.value) == 32.0  # never above max_scale


def test_checkpoint_round_trip_restores_every_field(tmp_path):
    ls = effgrad.DynamicLossScale(initial_scale=64.0, growth_interval=5)
    ls.update(False)  # scale 32
    ls.update(True), ls.update(True)  # counter 2
    path = tf.train.Checkpoint(loss_scale=ls).write(str(tmp_path / "ckpt"))
    fields = (float(ls.value), int(ls.counter), int(ls.overflow_streak))
    ls.update(False), ls.update(False), ls.update(True)
    assert (float(ls.value), int(ls.counter)) != fields[:2]
    restored = effgrad.DynamicLossScale(initial_scale=64.0, growth_interval=5)
    tf.train.Checkpoint(loss_scale=restored).read(path).assert_consumed()
    assert (float(restored.value), int(restored.counter), int(restored.overflow_streak)) == fields
    static = effgrad.StaticLossScale(128.0)
    path = tf.train.Checkpoint(loss_scale=static).write(str(tmp_path / "static"))
    other = effgrad.StaticLossScale(1.0)
    tf.train.Checkpoint(loss_scale=other).read(path).assert_consumed()
    assert float(other.value) == 128.0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"initial_scale": 0}, "initial_scale"),
        ({"initial_scale": -4.0}, "initial_scale"),
        ({"growth_factor": 1.0}, "growth_factor"),
        ({"backoff_factor": 1.0}, "backoff_factor"),
        ({"backoff_factor": 0}, "backoff_factor"),
        ({"min_scale": 8.0, "max_scale": 4.0, "initial_scale": 4.0}, "min_scale"),
        ({"growth_interval": 0}, "growth_interval"),
        ({"initial_scale": float("inf")}, "initial_scale"),
    ],
)
def test_bad_dynamic_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        effgrad.DynamicLossScale(**kwargs)


def test_bad_static_scale_and_unknown_names():
    with pytest.raises(ValueError, match="scale"):
        effgrad.StaticLossScale(0.0)
    with pytest.raises(ValueError, match="Unknown loss_scale"):
        effgrad.build_train_step(mlp(), "mse", keras.optimizers.SGD(), loss_scale="fp16")
    with pytest.raises(ValueError, match="scale"):
        effgrad.build_train_step(mlp(), "mse", keras.optimizers.SGD(), loss_scale=-1.0)


# ------------------------------------------------------------ inside the step
@pytest.mark.parametrize("jit_compile", [False, True])
@pytest.mark.parametrize("micro_batches", [1, 3])
def test_non_finite_step_changes_nothing_and_backs_off(rng, jit_compile, micro_batches):
    model, opt = mlp(), keras.optimizers.Adam(0.01)
    opt.build(model.trainable_variables)
    ls = effgrad.DynamicLossScale(initial_scale=2.0**10, growth_interval=2)
    step = effgrad.build_train_step(
        model, "mse", opt, micro_batches=micro_batches, loss_scale=ls, jit_compile=jit_compile
    )
    x, y = _xy(rng)
    bad = x.copy()
    bad[-1, 2] = np.inf  # only the last micro-batch is poisoned
    before = _state(model, opt)
    logs = step(bad, y)
    assert not bool(logs["grads_finite"])
    assert_variables_close(_state(model, opt), before, atol=0, rtol=0)
    assert int(opt.iterations.numpy()) == 0
    assert float(ls.value) == 2.0**9 and float(logs["loss_scale"]) == 2.0**9
    bad[-1, 2] = np.nan
    step(bad, y)
    assert float(ls.value) == 2.0**8 and int(opt.iterations.numpy()) == 0
    for _ in range(2):  # finite steps train normally, then the scale grows
        logs = step(x, y)
        assert bool(logs["grads_finite"])
    assert int(opt.iterations.numpy()) == 2
    assert float(ls.value) == 2.0**9
    assert not np.allclose(model.trainable_variables[0].numpy(), before[0])


@pytest.mark.parametrize("jit_compile", [False, True])
def test_static_scale_with_micro_batches_equals_unscaled_full_batch(rng, jit_compile):
    x, y = _xy(rng, 13)
    w = rng.uniform(size=13).astype("float32")
    reference, model = mlp(), mlp()
    plain_step(reference, keras.losses.mean_squared_error, keras.optimizers.SGD(0.1), x, y, w)
    step = effgrad.build_train_step(
        model, "mse", keras.optimizers.SGD(0.1), micro_batches=4, loss_scale=2.0**10, jit_compile=jit_compile
    )
    logs = step(x, y, w)
    assert float(logs["loss_scale"]) == 1024.0
    assert_variables_close(model.trainable_variables, reference.trainable_variables)


@pytest.mark.parametrize("jit_compile", [False, True])
def test_clipping_acts_on_the_unscaled_gradient(rng, jit_compile):
    x, y = _xy(rng)
    y = y * 100.0  # a gradient norm far above 1
    model = mlp()
    before = [v.numpy().copy() for v in model.trainable_variables]
    step = effgrad.build_train_step(
        model,
        "mse",
        keras.optimizers.SGD(1.0),
        micro_batches=3,
        loss_scale=2.0**10,
        clip_norm=1.0,
        jit_compile=jit_compile,
    )
    step(x, y)
    moved = np.sqrt(sum(np.sum((v.numpy() - b) ** 2) for v, b in zip(model.trainable_variables, before)))
    np.testing.assert_allclose(moved, 1.0, rtol=1e-4)  # a norm-1 gradient times lr 1


def test_clipping_matches_a_clipped_full_batch_step(rng):
    x, y = _xy(rng)
    reference, model = mlp(), mlp()
    plain_step(reference, keras.losses.mean_squared_error, keras.optimizers.SGD(0.1), x, y, clip_norm=0.5)
    effgrad.build_train_step(
        model, "mse", keras.optimizers.SGD(0.1), micro_batches=5, loss_scale="dynamic", clip_norm=0.5
    )(x, y)
    assert_variables_close(model.trainable_variables, reference.trainable_variables)


def test_auto_picks_dynamic_only_for_float16():
    assert isinstance(effgrad.build_train_step(mlp(), "mse", keras.optimizers.SGD()).loss_scale, effgrad.NoLossScale)
    for policy, expected in [("mixed_float16", effgrad.DynamicLossScale), ("mixed_bfloat16", effgrad.NoLossScale)]:
        keras.config.set_dtype_policy(policy)
        step = effgrad.build_train_step(mlp(), "mse", keras.optimizers.SGD())
        assert isinstance(step.loss_scale, expected), policy
        keras.config.set_dtype_policy("float32")


def _train(rng, policy, jit_compile, steps=40):
    keras.config.set_dtype_policy(policy)
    x = rng.normal(size=(64, 5)).astype("float32")
    y = np.stack([x[:, 0] - x[:, 1], np.tanh(x[:, 2]), x[:, 3]], axis=1).astype("float32")
    step = effgrad.build_train_step(
        mlp(hidden=32), "mse", keras.optimizers.Adam(0.01), micro_batches=2, jit_compile=jit_compile
    )
    losses = [float(step(x, y)["loss"]) for _ in range(steps)]
    keras.config.set_dtype_policy("float32")
    return step, losses


@functools.cache
def _float32_losses():
    # One float32 run (tf.function) is the reference of both mixed runs: XLA's float32 round-off is
    # orders of magnitude below the tolerance.
    return _train(np.random.default_rng(1), "float32", False)[1]


@pytest.mark.parametrize("jit_compile", [False, True])
def test_mixed_float16_trains_like_float32(jit_compile):
    step16, mixed = _train(np.random.default_rng(1), "mixed_float16", jit_compile)
    full = _float32_losses()
    assert isinstance(step16.loss_scale, effgrad.DynamicLossScale)
    assert step16.model.layers[0].compute_dtype == "float16"
    assert mixed[-1] < 0.3 * mixed[0]
    np.testing.assert_allclose(mixed[-1], full[-1], rtol=0.1, atol=0.02)


def test_collapsed_scale_warns_once(rng):
    model = mlp()
    step = effgrad.build_train_step(
        model, "mse", keras.optimizers.SGD(0.1), loss_scale=effgrad.DynamicLossScale(initial_scale=1.0)
    )
    x, y = _xy(rng)
    x[0, 0] = np.nan  # the loss itself is NaN: no scale can fix that
    with pytest.warns(RuntimeWarning, match="min_scale") as record:
        for _ in range(40):
            step(x, y)
    assert len([w for w in record if "min_scale" in str(w.message)]) == 1


def test_fit_shows_loss_scale_and_skips_bad_steps(rng):
    x, y = _xy(rng, 48)
    x[:16, 0] = np.inf  # the first of three batches is bad
    model = mlp()
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    ls = effgrad.DynamicLossScale(initial_scale=2.0**8)
    effgrad.attach(model, micro_batches=2, loss_scale=ls)
    history = model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    assert "loss_scale" in history.history
    assert float(ls.value) == 2.0**7
    assert int(model.optimizer.iterations.numpy()) == 2
    assert all(np.isfinite(v.numpy()).all() for v in model.trainable_variables)


def test_float16_gradients_that_underflow_without_scaling_survive_with_it(rng):
    """A loss scale of 1 is a no-op: these gradients are below float16's smallest subnormal (6e-8)."""
    x = rng.normal(size=(16, 5)).astype("float32")
    y = rng.normal(size=(16, 3)).astype("float32") * 0.01

    def tiny_loss(y_true, y_pred):  # d loss / d y_pred ~ 1e-10 per element
        return 1e-8 * keras.losses.mean_squared_error(y_true, y_pred)

    def update(policy, loss_scale):
        keras.config.set_dtype_policy(policy)
        model = mlp(seed=3)
        before = model.trainable_variables[0].numpy().copy()
        if policy == "float32":  # the reference: a plain tape, eager
            plain_step(model, tiny_loss, keras.optimizers.SGD(1e6), x, y)
        else:
            step = effgrad.build_train_step(model, tiny_loss, keras.optimizers.SGD(1e6), loss_scale=loss_scale)
            step(x, y)
        keras.config.set_dtype_policy("float32")
        return model.trainable_variables[0].numpy() - before

    reference = update("float32", None)
    assert np.abs(reference).max() > 1e-4
    unscaled = update("mixed_float16", None)
    scaled = update("mixed_float16", "auto")
    assert np.abs(unscaled).max() == 0.0  # underflow: every float16 gradient flushed to zero
    np.testing.assert_allclose(scaled, reference, rtol=0.05, atol=0.02 * np.abs(reference).max())
