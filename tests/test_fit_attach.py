"""effgrad.attach makes model.fit train with the effgrad step."""

import keras
import numpy as np
import pytest

import effgrad
from conftest import assert_variables_close
from helpers import mlp


def _regression(rng, n=256):
    x = rng.normal(size=(n, 5)).astype("float32")
    y = np.stack([x[:, 0] * 2 - x[:, 1], np.sin(x[:, 2]), x[:, 3] * x[:, 4]], axis=1).astype("float32")
    return x, y


def test_fit_trains_what_stock_fit_trains_over_epochs(rng):
    """Uneven batches (256 rows by 37) and micro-batches (37 by 4), unequal sample weights: a mean of
    micro-batch means, or of batch means, would drift from stock fit. One stock fit serves both."""
    x, y = _regression(rng)
    w = rng.uniform(0.2, 3.0, len(x)).astype("float32")
    compile_kwargs = lambda: {"optimizer": keras.optimizers.Adam(0.01), "loss": "mse", "weighted_metrics": ["mae"]}  # noqa: E731
    stock = mlp(hidden=32)
    stock.compile(**compile_kwargs())
    stock.optimizer.build(stock.trainable_variables)  # stock fit then traces once, not twice
    expected = stock.fit(x, y, sample_weight=w, batch_size=37, epochs=3, shuffle=False, verbose=0).history
    for micro_batches in (1, 4):
        ours = mlp(hidden=32)
        ours.compile(**compile_kwargs())
        effgrad.attach(ours, micro_batches=micro_batches)
        history = ours.fit(x, y, sample_weight=w, batch_size=37, epochs=3, shuffle=False, verbose=0).history
        case = f"micro_batches={micro_batches}"
        assert history["loss"][-1] < 0.8 * history["loss"][0], case  # it trains
        np.testing.assert_allclose(history["loss"], expected["loss"], rtol=1e-4, err_msg=case)
        np.testing.assert_allclose(history["mae"], expected["mae"], rtol=1e-4, err_msg=case)
        assert_variables_close(ours.trainable_variables, stock.trainable_variables, rtol=1e-4, atol=1e-5)
        assert ours.effgrad_step.micro_batches == micro_batches


def test_fit_update_equals_plain_fit_update(rng):
    """One fit step with micro-batches equals one stock Keras fit step."""
    x, y = _regression(rng, n=29)
    plain, accumulated = mlp(), mlp()
    # Stock fit's step run eagerly: the same step as traced (test_keras_parity's
    # test_tf_function_and_eager_reference_match_fit), without a trace for one step.
    for model, eager in ((plain, True), (accumulated, False)):
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", metrics=["mae"], run_eagerly=eager)
    effgrad.attach(accumulated, micro_batches=5)
    h_plain = plain.fit(x, y, batch_size=29, epochs=1, verbose=0, shuffle=False)
    h_acc = accumulated.fit(x, y, batch_size=29, epochs=1, verbose=0, shuffle=False)
    assert_variables_close(accumulated.trainable_variables, plain.trainable_variables)
    np.testing.assert_allclose(h_acc.history["loss"], h_plain.history["loss"], rtol=1e-5)
    np.testing.assert_allclose(h_acc.history["mae"], h_plain.history["mae"], rtol=1e-5)


def test_attach_needs_a_compiled_model():
    with pytest.raises(ValueError, match="compile"):
        effgrad.attach(mlp())


def test_per_output_losses_are_logged_as_stock_keras_logs_them_with_uneven_micro_batches(rng):
    # Keras weights each output's loss tracker by the batch's static size, unknown in a micro-batch.
    x, classes, values = rng.normal(size=(10, 8)), rng.integers(0, 3, 10), rng.normal(size=(10, 2))

    def model():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((8,))
        h = keras.layers.Dense(16, activation="tanh")(inputs)
        outputs = {"cls": keras.layers.Dense(3, name="cls")(h), "reg": keras.layers.Dense(2, name="reg")(h)}
        built = keras.Model(inputs, outputs)
        loss = {"cls": keras.losses.SparseCategoricalCrossentropy(from_logits=True), "reg": "mse"}
        built.compile(optimizer=keras.optimizers.SGD(0.0), loss=loss)
        return built

    stock, ours = model(), effgrad.attach(model(), micro_batches=4)  # rows 3, 3, 3, 1
    y = {"cls": classes, "reg": values}
    expected, got = (m.train_on_batch(x, y, return_dict=True) for m in (stock, ours))
    assert set(expected) <= set(got)
    for name in expected:
        np.testing.assert_allclose(float(got[name]), expected[name], rtol=1e-5, err_msg=name)


@pytest.mark.parametrize("method", ["train_step", "compute_loss", "compute_metrics"])
def test_a_model_class_with_its_own_train_step_code_is_refused_not_replaced(method):
    def own(self, *args, **kwargs):
        return getattr(keras.Model, method)(self, *args, **kwargs)

    Subclassed = type("Subclassed", (keras.Model,), {method: own})
    inputs = keras.Input((4,))
    model = Subclassed(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(TypeError, match=method):
        effgrad.attach(model)
