"""attach + fit trains exactly what stock Keras fit trains, in every case Keras handles."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import effgrad
from conftest import assert_variables_close
from helpers import mlp


def stock_fit(model, x, y, sample_weight=None, batch_size=12):
    """Stock Keras's training of one epoch as ``fit(..., shuffle=False)`` runs it: its train step on
    each batch in order (``train_on_batch``: the same step, without the tf.data pipeline fit builds
    around it), and fit's history: the batches' losses averaged over their examples."""
    n = len(tf.nest.flatten(x)[0])
    losses, sizes = [], []
    for start in range(0, n, batch_size):
        rows = slice(start, start + batch_size)
        batch = [
            None if t is None else tf.nest.map_structure(lambda a, rows=rows: a[rows], t) for t in (x, y, sample_weight)
        ]
        losses.append(model.train_on_batch(*batch, return_dict=True)["loss"])
        sizes.append(min(batch_size, n - start))
    return {"loss": [float(np.average(losses, weights=sizes))]}


def attached_fit(make, compile_kwargs, x, y, sample_weight=None, batch_size=12, **attach_options):
    """A new model compiled with ``compile_kwargs()``, attached, trained one epoch by ``fit``; its history."""
    ours = make()
    ours.compile(**compile_kwargs())
    effgrad.attach(ours, **attach_options)
    kwargs = dict(batch_size=batch_size, epochs=1, shuffle=False, verbose=0, sample_weight=sample_weight)
    return ours, ours.fit(x, y, **kwargs).history


def _stock(make, compile_kwargs, x, y, sample_weight=None, batch_size=12):
    """Stock Keras's update, its train step run eagerly: the same step as traced (the reference's own check,
    test_tf_function_and_eager_reference_match_fit), without a trace (two, with its optimizer not built)."""
    stock = make()
    stock.compile(**compile_kwargs(), run_eagerly=True)
    return stock, stock_fit(stock, x, y, sample_weight, batch_size)


def _assert_same_update(stock, ours, h_stock, h_ours, case=""):
    try:
        assert_variables_close(ours.trainable_variables, stock.trainable_variables)
        np.testing.assert_allclose(h_ours["loss"], h_stock["loss"], rtol=1e-5)
    except AssertionError as err:
        raise AssertionError(f"{case}: {err}") from None


def _regression(rng, n=24):
    x = rng.normal(size=(n, 5)).astype("float32")
    y = rng.normal(size=(n, 3)).astype("float32")
    w = rng.uniform(0.0, 2.0, size=n).astype("float32")
    return x, y, w


@pytest.mark.parametrize(
    "loss, reduction",
    [
        ("mse", "sum_over_batch_size"),
        (keras.losses.MeanSquaredError(reduction="sum"), "sum"),
        (keras.losses.MeanAbsoluteError(reduction="mean_with_sample_weight"), "mean_with_sample_weight"),
    ],
    ids=["default", "sum", "mean_with_sample_weight"],
)
def test_compiled_loss_reduction_with_sample_weights(rng, loss, reduction):
    x, y, w = _regression(rng)
    compile_kwargs = lambda: {"optimizer": keras.optimizers.SGD(0.05), "loss": loss}  # noqa: E731
    stock, h_stock = _stock(mlp, compile_kwargs, x, y, w)  # the reference of every micro_batches
    for micro_batches in (1, 3):
        ours, h_ours = attached_fit(mlp, compile_kwargs, x, y, w, micro_batches=micro_batches)
        assert ours.effgrad_step.reduction == reduction
        _assert_same_update(stock, ours, h_stock, h_ours, f"micro_batches={micro_batches}")


def _masked_lm(vocab=7, width=8):
    keras.utils.set_random_seed(0)
    tokens = keras.Input((None,), dtype="int32")
    h = keras.layers.Embedding(vocab, width, mask_zero=True)(tokens)  # y_pred carries the padding mask
    h = keras.layers.Dense(width, activation="tanh")(h)
    return keras.Model(tokens, keras.layers.Dense(vocab)(h))


@pytest.mark.parametrize("weighted", [False, True])
def test_keras_mask_on_y_pred_weights_the_loss(rng, weighted):
    tokens = rng.integers(1, 7, size=(12, 6)).astype("int32")
    lengths = rng.integers(1, 7, size=12)
    tokens[np.arange(6)[None, :] >= lengths[:, None]] = 0  # padding of uneven lengths
    labels = rng.integers(0, 7, size=(12, 6))
    w = rng.uniform(0.5, 2.0, size=(12, 6)).astype("float32") if weighted else None  # Keras needs per-token
    compile_kwargs = lambda: {  # noqa: E731
        "optimizer": keras.optimizers.SGD(0.5),
        "loss": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    }
    stock, h_stock = _stock(_masked_lm, compile_kwargs, tokens, labels, w)
    for micro_batches in (1, 3):
        ours, h_ours = attached_fit(_masked_lm, compile_kwargs, tokens, labels, w, micro_batches=micro_batches)
        _assert_same_update(stock, ours, h_stock, h_ours, f"micro_batches={micro_batches}")


def test_compile_jit_compile_with_micro_batches_and_no_weights(rng):
    x, y, _ = _regression(rng)
    compile_kwargs = lambda: {"optimizer": keras.optimizers.SGD(0.1), "loss": "mse"}  # noqa: E731
    stock, h_stock = _stock(mlp, compile_kwargs, x, y)  # without XLA: the same update
    ours, h_ours = attached_fit(mlp, lambda: {**compile_kwargs(), "jit_compile": True}, x, y, micro_batches=4)
    assert ours.effgrad_step.options.jit_compile
    _assert_same_update(stock, ours, h_stock, h_ours)


@pytest.mark.parametrize("optimizer", [keras.optimizers.SGD, keras.optimizers.Adam])
def test_mixed_float16_has_one_loss_scale(rng, optimizer):
    """compile wraps the optimizer in a LossScaleOptimizer; effgrad must not unscale twice."""
    keras.config.set_dtype_policy("mixed_float16")
    x, y, w = _regression(rng)
    compile_kwargs = lambda: {"optimizer": optimizer(0.01), "loss": "mse"}  # noqa: E731
    stock, _ = _stock(lambda: mlp(hidden=16), compile_kwargs, x, y, w)
    ours, _ = attached_fit(lambda: mlp(hidden=16), compile_kwargs, x, y, w, micro_batches=2)
    assert isinstance(ours.optimizer, keras.optimizers.LossScaleOptimizer)
    step = ours.effgrad_step
    assert step.optimizer is ours.optimizer.inner_optimizer
    assert step.loss_scale._scale is ours.optimizer.dynamic_scale.value  # one scale: the wrapper's variable
    initial = mlp(hidden=16).get_weights()
    moved_stock = [a - b for a, b in zip(stock.get_weights(), initial)]
    moved_ours = [a - b for a, b in zip(ours.get_weights(), initial)]
    for a, b in zip(moved_ours, moved_stock):
        np.testing.assert_allclose(a, b, rtol=2e-2, atol=1e-5)  # float16 forward: rounding only
    assert np.abs(moved_ours[0]).max() > 1e-4  # updates are not divided by the scale a second time


def test_loss_scale_state_is_saved_with_the_model(rng, tmp_path):
    keras.config.set_dtype_policy("mixed_float16")
    x, y, _ = _regression(rng, 36)
    x[:12, 0] = np.inf  # the first of three batches overflows: the scale backs off
    model = mlp(hidden=16)
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    effgrad.attach(model, micro_batches=2)
    model.fit(x, y, batch_size=12, shuffle=False, verbose=0)
    step = model.effgrad_step
    saved = (float(step.loss_scale.value), int(step.loss_scale.counter))
    assert saved == (2.0**14, 2)
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    effgrad.attach(loaded, micro_batches=2)
    restored = loaded.effgrad_step.loss_scale
    assert (float(restored.value), int(restored.counter)) == saved


def test_dynamic_scale_on_a_float32_model_is_saved_too(rng, tmp_path):
    x, y, _ = _regression(rng)
    model = mlp()
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    effgrad.attach(model, loss_scale="dynamic")
    model.effgrad_step.loss_scale.update(False)  # 2**14
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    effgrad.attach(loaded, loss_scale="dynamic")
    assert float(loaded.effgrad_step.loss_scale.value) == 2.0**14


def test_recompile_after_attach_trains_the_new_configuration(rng):
    x, y, _ = _regression(rng)
    model = mlp()
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    effgrad.attach(model, micro_batches=2)
    model.fit(x, y, batch_size=12, verbose=0)
    new_optimizer = keras.optimizers.SGD(0.0)  # a learning rate of 0: nothing may move
    model.compile(optimizer=new_optimizer, loss="mae")
    before = [w.copy() for w in model.get_weights()]
    history = model.fit(x, y, batch_size=12, verbose=0, shuffle=False)
    assert model.effgrad_step.optimizer is new_optimizer
    assert model.effgrad_step.micro_batches == 2  # attach's options are kept
    for a, b in zip(model.get_weights(), before):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(history.history["loss"][0], float(np.mean(np.abs(y - model(x).numpy()))), rtol=1e-5)


class _ForwardCounter(keras.layers.Layer):
    """Counts forward passes in a non-trainable variable (state written in the forward pass)."""

    def build(self, input_shape):
        self.calls = self.add_weight(shape=(), initializer="zeros", trainable=False, name="calls")

    def call(self, x, training=None):
        if training:
            self.calls.assign_add(1.0)
        return x


def test_attach_runs_one_forward_pass_per_micro_batch(rng):
    """An effect only effgrad has: k forward passes per fit step, state committed once per step."""
    x, y, _ = _regression(rng, 24)

    def make():
        keras.utils.set_random_seed(0)
        return keras.Sequential([keras.Input((5,)), _ForwardCounter(), keras.layers.Dense(3)])

    compile_kwargs = lambda: {"optimizer": "sgd", "loss": "mse"}  # noqa: E731
    stock, _ = _stock(make, compile_kwargs, x, y)
    ours, _ = attached_fit(make, compile_kwargs, x, y, micro_batches=4)
    assert float(stock.layers[0].calls.numpy()) == 2  # two batches of 12
    assert float(ours.layers[0].calls.numpy()) == 8  # two batches x four micro-batches


def test_attach_refuses_bad_options_before_touching_the_model():
    model = mlp()
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(ValueError, match="micro_batches"):
        effgrad.attach(model, micro_batches=0)
    assert not hasattr(model, "effgrad_step")
    with pytest.raises(TypeError):
        effgrad.attach(model, no_such_option=1)


def test_micro_batches_accepts_numpy_ints():
    step = effgrad.build_train_step(mlp(), "mse", keras.optimizers.SGD(), micro_batches=np.int64(3))
    assert step.micro_batches == 3 and isinstance(step.micro_batches, int)
    assert effgrad.DynamicLossScale(growth_interval=np.int32(5)).growth_interval == 5


def test_optimizer_that_cannot_be_kept_from_reducing_twice_is_refused():
    with pytest.raises(TypeError, match="all-reducing"):
        with effgrad._compat.gradients_already_reduced(object()):
            pass


def test_tf_function_and_eager_reference_match_fit(rng):
    """Sanity: the stock references (traced fit, and _stock's eager stock_fit batch by batch) really are
    Keras's update and its logged loss (SGD steps by hand)."""
    x, y, w = _regression(rng)
    fitted, stepped, reference = mlp(), mlp(), mlp()
    fitted.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    stepped.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", run_eagerly=True)  # as _stock runs it
    history = fitted.fit(x, y, sample_weight=w, batch_size=12, shuffle=False, verbose=0).history
    np.testing.assert_allclose(stock_fit(stepped, x, y, w)["loss"], history["loss"], rtol=1e-6)
    optimizer, losses = keras.optimizers.SGD(0.05), []
    for rows in (slice(0, 12), slice(12, 24)):
        with tf.GradientTape() as tape:
            per_example = keras.losses.mean_squared_error(y[rows], reference(x[rows]))
            loss = tf.reduce_sum(w[rows] * per_example) / 12  # sum_over_batch_size
        optimizer.apply(tape.gradient(loss, reference.trainable_variables), reference.trainable_variables)
        losses.append(float(loss))
    np.testing.assert_allclose(history["loss"], [np.mean(losses)], rtol=1e-5)
    for model in (fitted, stepped):
        assert_variables_close(model.trainable_variables, reference.trainable_variables)
