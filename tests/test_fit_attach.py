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


@pytest.mark.parametrize("micro_batches", [1, 4])
def test_fit_trains_and_loss_falls(rng, micro_batches):
    x, y = _regression(rng)
    model = mlp(hidden=32)
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"])
    effgrad.attach(model, micro_batches=micro_batches)
    history = model.fit(x, y, batch_size=37, epochs=5, verbose=0)
    losses = history.history["loss"]
    assert losses[-1] < 0.6 * losses[0]
    assert "mae" in history.history and np.isfinite(history.history["mae"]).all()
    assert model.effgrad_step.micro_batches == micro_batches


def test_fit_update_equals_plain_fit_update(rng):
    """One fit step with micro-batches equals one stock Keras fit step."""
    x, y = _regression(rng, n=29)
    plain, accumulated = mlp(), mlp()
    for model in (plain, accumulated):
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", metrics=["mae"])
    effgrad.attach(accumulated, micro_batches=5)
    h_plain = plain.fit(x, y, batch_size=29, epochs=1, verbose=0, shuffle=False)
    h_acc = accumulated.fit(x, y, batch_size=29, epochs=1, verbose=0, shuffle=False)
    assert_variables_close(accumulated.trainable_variables, plain.trainable_variables)
    np.testing.assert_allclose(h_acc.history["loss"], h_plain.history["loss"], rtol=1e-5)
    np.testing.assert_allclose(h_acc.history["mae"], h_plain.history["mae"], rtol=1e-5)


def test_attach_needs_a_compiled_model():
    with pytest.raises(ValueError, match="compile"):
        effgrad.attach(mlp())
