"""The gradient noise scale B_simple = tr(Sigma) / |G|^2 from micro-batch gradients."""

import keras
import numpy as np
import pytest

import effgrad

N, D = 8192, 4


def _problem(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(N, D)).astype("float32") * np.array([1.0, 2.0, 0.5, 1.5], "float32")
    y = (x @ np.ones((D, 1), "float32") + rng.normal(size=(N, 1)).astype("float32")).astype("float32")
    return x, y


def _true_components(x, y, kernel, bias):
    """Exact ``(tr(Sigma), |G|^2)`` of the mean-squared-error gradient over the dataset, from per-example gradients."""
    residual = (x @ kernel + bias - y)[:, 0]  # d l_j / d f = 2 r_j
    per_example = np.concatenate([2 * residual[:, None] * x, 2 * residual[:, None]], axis=1).astype("float64")
    mean = per_example.mean(axis=0)
    return per_example.var(axis=0).sum(), mean @ mean


def _true_noise_scale(x, y, kernel, bias):
    """Exact B_simple = tr(Sigma) / |G|^2."""
    trace, grad_sq = _true_components(x, y, kernel, bias)
    return trace / grad_sq


def _linear(kernel, bias):
    model = keras.Sequential([keras.Input((D,)), keras.layers.Dense(1)])
    model.layers[0].kernel.assign(kernel)
    model.layers[0].bias.assign(bias)
    return model


@pytest.mark.parametrize(
    "micro_batches, batch, weighted, loss_scale",
    [(8, 256, False, None), (5, 203, True, None), (4, 256, False, "dynamic")],
    ids=["even", "uneven_last_and_unit_weights", "loss_scaled"],
)
def test_matches_the_exact_value_from_per_example_gradients(micro_batches, batch, weighted, loss_scale):
    x, y = _problem()
    kernel, bias = np.zeros((D, 1), "float32"), np.full((1,), 0.5, "float32")
    expected = _true_noise_scale(x, y, kernel, bias)
    model = _linear(kernel, bias)
    step = effgrad.build_train_step(
        model, "mse", keras.optimizers.SGD(0.0), micro_batches=micro_batches, noise_scale=True, loss_scale=loss_scale
    )
    rng = np.random.default_rng(1)
    for _ in range(60):  # weights stay fixed (learning rate 0): the true value is constant
        rows = rng.choice(N, size=batch, replace=False)
        w = np.ones(batch, "float32") if weighted else None
        logs = step(x[rows], y[rows], w)
    estimate = float(logs["noise_scale"])
    print(f"noise scale {estimate:.2f} vs exact {expected:.2f}")
    assert abs(estimate - expected) / expected < 0.3, (estimate, expected)
    # each component estimates its own exact value (their ratio alone could hide a common factor)
    trace, grad_sq = _true_components(x, y, kernel, bias)
    assert float(logs["noise_scale_trace"]) == pytest.approx(trace, rel=0.3)
    assert float(logs["noise_scale_grad_sq"]) == pytest.approx(grad_sq, rel=0.3)


def test_replicas_count_as_small_batches(strategy):
    x, y = _problem()
    kernel, bias = np.zeros((D, 1), "float32"), np.full((1,), 0.5, "float32")
    expected = _true_noise_scale(x, y, kernel, bias)
    with strategy.scope():
        model = _linear(kernel, bias)
        opt = keras.optimizers.SGD(0.0)
    step = effgrad.build_train_step(model, "mse", opt, micro_batches=2, noise_scale=True, strategy=strategy)
    rng = np.random.default_rng(2)
    for _ in range(50):
        rows = rng.choice(N, size=256, replace=False)
        logs = step(x[rows], y[rows])
    assert abs(float(logs["noise_scale"]) - expected) / expected < 0.3


def test_skipped_steps_do_not_update_it():
    x, y = _problem()
    step = effgrad.build_train_step(
        _linear(np.zeros((D, 1)), np.zeros(1)), "mse", keras.optimizers.SGD(0.0), micro_batches=4, noise_scale=True
    )
    step(x[:64], y[:64])
    before = {k: float(v) for k, v in step(x[64:128], y[64:128]).items() if k.startswith("noise")}
    bad = x[:64].copy()
    bad[3, 0] = np.inf
    logs = step(bad, y[:64])
    assert not bool(logs["grads_finite"])
    assert {k: float(v) for k, v in logs.items() if k.startswith("noise")} == before


def test_needs_smaller_batches_to_compare():
    model = _linear(np.zeros((D, 1)), np.zeros(1))
    with pytest.raises(ValueError, match="micro_batches >= 2"):
        effgrad.build_train_step(model, "mse", keras.optimizers.SGD(), noise_scale=True)
    with pytest.raises(ValueError, match="MEAN"):
        effgrad.build_train_step(
            model, "mse", keras.optimizers.SGD(), micro_batches=2, noise_scale=True, reduction="sum"
        )


def test_attach_puts_it_in_fit_history():
    x, y = _problem()
    kernel, bias = np.zeros((D, 1), "float32"), np.full((1,), 0.5, "float32")
    model = _linear(kernel, bias)
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")  # fixed weights: one exact value to estimate
    effgrad.attach(model, micro_batches=4, noise_scale=True)
    history = model.fit(x, y, batch_size=256, epochs=2, verbose=0)
    assert len(history.history["noise_scale"]) == 2
    assert history.history["noise_scale"][-1] == pytest.approx(_true_noise_scale(x, y, kernel, bias), rel=0.3)
