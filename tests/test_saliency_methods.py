"""Saliency methods equal their definitions; reductions equal NumPy."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import effgrad
from helpers import assert_summary_equals_numpy, png_pixels


def _cnn(seed=0, classes=4):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((6, 6, 3)),
            keras.layers.Conv2D(4, 3, activation="tanh"),
            keras.layers.Flatten(),
            keras.layers.Dense(classes),
        ]
    )


def _reference_gradients(model, x, target=None):
    x = tf.constant(x)
    with tf.GradientTape() as tape:
        tape.watch(x)
        out = model(x)
        idx = tf.argmax(out, axis=-1) if target is None else tf.constant(np.broadcast_to(target, [len(x)]))
        score = tf.gather(out, idx, batch_dims=1)
    return tape.gradient(score, x).numpy()


@pytest.fixture(scope="module")
def data():
    return np.random.default_rng(0).uniform(-1, 1, size=(13, 6, 6, 3)).astype("float32")


# Saliency reads the model and never changes it: the tests that only compare maps share one model, and
# the plain gradient maps (the default method; equal to the tape's in test_gradient_equals_tape_reference)
# are computed once, not traced again as the reference of every reduction, dtype and summary.
@pytest.fixture(scope="module")
def cnn():
    return _cnn()


@pytest.fixture(scope="module")
def gradient_maps(cnn, data):
    return effgrad.saliency(cnn, data, progress=False)


def test_gradient_equals_tape_reference(cnn, data):
    model = cnn
    np.testing.assert_allclose(
        effgrad.saliency(model, data, batch_size=4, progress=False),
        _reference_gradients(model, data),
        rtol=1e-5,
        atol=1e-7,
    )
    np.testing.assert_allclose(
        effgrad.saliency(model, data, target=2, batch_size=5, progress=False),
        _reference_gradients(model, data, 2),
        rtol=1e-5,
        atol=1e-7,
    )
    per_example = np.arange(13) % 4
    np.testing.assert_allclose(
        effgrad.saliency(model, data, target=per_example, batch_size=6, progress=False),
        _reference_gradients(model, data, per_example),
        rtol=1e-5,
        atol=1e-7,
    )
    by_callable = effgrad.saliency(model, data, target=lambda out: out[:, 1] - out[:, 0], progress=False)
    expected = _reference_gradients(model, data, 1) - _reference_gradients(model, data, 0)
    np.testing.assert_allclose(by_callable, expected, rtol=1e-4, atol=1e-6)


def test_gradient_x_input_equals_reference(cnn, data):
    maps = effgrad.saliency(cnn, data, method="gradient_x_input", batch_size=4, progress=False)
    np.testing.assert_allclose(maps, data * _reference_gradients(cnn, data), rtol=1e-5, atol=1e-7)


def test_single_output_unit_is_its_own_target(rng):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(1, activation="sigmoid")])
    x = rng.normal(size=(7, 5)).astype("float32")
    maps = effgrad.saliency(model, x, progress=False)
    np.testing.assert_allclose(maps, _reference_gradients(model, x, 0), rtol=1e-5)


def test_smoothgrad_zero_noise_is_gradient_and_seeded_noise_reproduces(cnn, data, gradient_maps):
    model, plain = cnn, gradient_maps
    zero = effgrad.saliency(model, data, method="smoothgrad", noise=0.0, samples=3, progress=False)
    np.testing.assert_allclose(zero, plain, rtol=1e-5, atol=1e-7)
    a = effgrad.saliency(model, data, method="smoothgrad", samples=4, seed=7, batch_size=4, progress=False)
    b = effgrad.saliency(model, data, method="smoothgrad", samples=4, seed=7, batch_size=13, progress=False)
    c = effgrad.saliency(model, data, method="smoothgrad", samples=4, seed=8, batch_size=4, progress=False)
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)  # noise depends on the row, not the batching
    assert not np.allclose(a, c)
    assert not np.allclose(a, plain)


def _elementwise_model(fn, features):
    """A model whose single output is ``sum(fn(x))``: its gradients are known in closed form."""
    return keras.Sequential(
        [keras.Input((features,)), keras.layers.Lambda(lambda t: tf.reduce_sum(fn(t), -1, keepdims=True))]
    )


def test_smoothgrad_observes_sigma_on_a_cubic_score(rng):
    """For score = sum(x^3): E[3 (x + sigma n)^2] = 3 x^2 + 3 sigma^2, so the map reveals sigma.

    sigma = noise * (max(x) - min(x)); a method that drew no noise, the wrong scale, or noise
    correlated across samples misses by many standard errors.
    """
    x = np.array([[0.0, 0.5, 1.0, 2.0, -1.0, 1.5]], "float32")  # range 3: sigma = 0.2 * 3 = 0.6
    model = _elementwise_model(lambda t: t**3, 6)
    samples, sigma = 4096, 0.6
    maps = effgrad.saliency(
        model, x, method="smoothgrad", samples=samples, noise=0.2, samples_per_pass=512, progress=False
    )
    expected = 3 * x**2 + 3 * sigma**2
    # Var[3 (x + s n)^2] = 9 (4 x^2 s^2 + 2 s^4): the mean's standard error per element.
    stderr = np.sqrt(9 * (4 * x**2 * sigma**2 + 2 * sigma**4) / samples)
    assert np.all(np.abs(maps - expected) < 5 * stderr), (maps, expected, stderr)
    assert np.all(np.abs(maps - 3 * x**2) > 5 * stderr)  # sigma really is there (3 sigma^2 = 1.08)


def test_smoothgrad_noise_is_standard_normal_and_independent_per_row():
    from effgrad.explain.methods import counter_normal

    z = counter_normal(3, tf.range(4), tf.range(1000, dtype=tf.int64) + 2**33, (8, 8), tf.float32).numpy()
    assert z.shape == (4, 1000, 8, 8)
    flat = z.reshape(-1)
    assert abs(flat.mean()) < 0.01 and abs(flat.std() - 1) < 0.01
    assert abs(np.mean(flat**4) - 3) < 0.1  # normal kurtosis, not uniform (1.8)
    corr = np.corrcoef(z.reshape(4000, 64).T)
    assert np.abs(corr - np.eye(64)).max() < 0.1  # elements of a row are independent
    again = counter_normal(3, tf.constant([2]), tf.constant([2**33 + 5], tf.int64), (8, 8), tf.float32).numpy()
    np.testing.assert_array_equal(again[0, 0], z[2, 5])  # a pure function of (seed, sample, row)


@pytest.mark.parametrize("method, options", [("smoothgrad", {"samples": 5}), ("integrated_gradients", {"steps": 6})])
def test_several_points_per_pass_give_the_same_maps(data, method, options):
    model = _cnn()
    one = effgrad.saliency(model, data, method=method, batch_size=5, progress=False, **options)
    key = "samples_per_pass" if method == "smoothgrad" else "steps_per_pass"
    for per_pass in (2, 7):  # 7 > samples: clamped; 2: a padded last pass
        many = effgrad.saliency(model, data, method=method, batch_size=5, progress=False, **options, **{key: per_pass})
        np.testing.assert_allclose(many, one, rtol=1e-5, atol=1e-6, err_msg=f"{key}={per_pass}")
    jobs = list(effgrad._compat.model_state(model)["saliency_jobs"].values())
    clamped = 7 if key == "steps_per_pass" else 5  # at most steps + 1 points, at most samples
    assert sorted(job.method.options[key] for job in jobs) == [1, 2, clamped]  # each its own job


def test_integrated_gradients_is_exact_for_a_quadratic(rng):
    """score = sum(x^2): the path gradient 2 a x is linear in a, the trapezoid rule is exact,
    and the map is x^2 - x0^2... with a zero baseline exactly x^2 (sum = f(x) - f(0))."""
    x = rng.uniform(-2, 2, size=(7, 12)).astype("float32")
    model = _elementwise_model(tf.square, 12)
    for steps in (1, 32):  # the fewest points (the two ends), and many
        maps = effgrad.saliency(model, x, method="integrated_gradients", steps=steps, progress=False)
        np.testing.assert_allclose(maps, x**2, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(maps.sum(-1), (x**2).sum(-1), rtol=1e-6)


def test_integrated_gradients_completeness(rng):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((10,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(3)])
    x = rng.normal(size=(9, 10)).astype("float32")
    baseline = np.full((10,), 0.1, "float32")
    maps = effgrad.saliency(model, x, method="integrated_gradients", steps=64, baseline=baseline, progress=False)
    out, out_base = model(x).numpy(), model(np.broadcast_to(baseline, x.shape)).numpy()
    idx = out.argmax(-1)
    expected = out[np.arange(9), idx] - out_base[np.arange(9), idx]
    np.testing.assert_allclose(maps.reshape(9, -1).sum(-1), expected, rtol=0.01, atol=1e-4)


@pytest.mark.parametrize(
    "reduce, numpy_fn",
    [
        ("abs", np.abs),
        ("abs_max", lambda m: np.abs(m).max(-1)),
        ("abs_sum", lambda m: np.abs(m).sum(-1)),
        ("l2", lambda m: np.sqrt((m**2).sum(-1))),
        ("sum", lambda m: m.sum(-1)),
    ],
)
def test_reductions_equal_numpy(cnn, data, gradient_maps, reduce, numpy_fn):
    reduced = effgrad.saliency(cnn, data, reduce=reduce, progress=False)
    np.testing.assert_allclose(reduced, numpy_fn(gradient_maps), rtol=1e-5, atol=1e-7)


def test_float16_output(cnn, data, gradient_maps):
    maps = effgrad.saliency(cnn, data, dtype="float16", reduce="abs_sum", progress=False)
    assert maps.dtype == np.float16
    # (the float32 abs_sum maps: NumPy's reduction of the full maps, test_reductions_equal_numpy)
    np.testing.assert_allclose(maps, np.abs(gradient_maps).sum(-1), rtol=2e-3, atol=1e-4)


def test_short_last_batch_does_not_retrace(data):
    from effgrad.explain.plan import prepare

    job = prepare(_cnn(), data, method="smoothgrad", samples=2, reduce="l2").job
    for n in (5, 5, 3, 1):
        job.maps(tf.constant(data[:n]), tf.zeros([n], tf.int32), tf.constant(0, tf.int64))
    assert job.trace_count == 1


def test_summary_equals_numpy_per_class(cnn, data, gradient_maps):
    model, maps = cnn, np.abs(gradient_maps).sum(-1)  # the abs_sum maps (test_reductions_equal_numpy)
    classes = model(data).numpy().argmax(-1)
    summary = effgrad.saliency_summary(model, data, reduce="abs_sum", batch_size=4, progress=False)
    assert_summary_equals_numpy(summary, maps, classes)
    overall = effgrad.saliency_summary(model, data, by_class=False, reduce="abs_sum", progress=False)
    np.testing.assert_allclose(overall.mean["all"], maps.mean(0), rtol=1e-4, atol=1e-6)
    assert overall.count["all"] == len(data)


def test_visualizations(tmp_path, data, gradient_maps):
    from effgrad.explain import visualize

    maps = gradient_maps
    gray = visualize.grayscale(maps[0])
    assert gray.shape == (6, 6) and gray.min() >= 0 and gray.max() == 1
    spike = np.zeros((6, 6), "float32")
    spike[0, 0], spike[1:, 1:] = 1000.0, 1.0
    assert visualize.grayscale(spike, percentile=95).mean() > 0.5  # the outlier does not black out the rest
    div = visualize.diverging(maps[0])
    assert div.min() >= -1 and div.max() <= 1
    png = visualize.save_grid(tmp_path / "grid.png", data[:4], maps[:4], titles=list(range(4)), columns=2)
    other = visualize.save_grid(tmp_path / "other.png", data[:4], maps[:4][::-1], titles=list(range(4)), columns=2)
    assert not np.allclose(png_pixels(png), png_pixels(other))  # the maps are drawn, in their places


class _ForwardTraces(keras.layers.Layer):
    """Counts how often the model's forward pass is traced into a graph."""

    count = 0

    def call(self, x):
        if not tf.executing_eagerly():  # eager calls (output-size probing) are not the job's passes
            type(self).count += 1
        return x


@pytest.mark.parametrize("method, forwards", [("gradient", 1), ("gradient_x_input", 1), ("smoothgrad", 2)])
def test_default_target_reads_the_argmax_off_the_differentiated_pass(data, method, forwards):
    """The arg-max needs no second forward pass when the score is taken at the input itself."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6, 6, 3)), _ForwardTraces(), keras.layers.Flatten(), keras.layers.Dense(4)])
    model(data[:1])
    _ForwardTraces.count = 0
    options = {"samples": 2} if method == "smoothgrad" else {}
    maps = effgrad.saliency(model, data, method=method, batch_size=8, progress=False, **options)
    assert _ForwardTraces.count == forwards  # one trace of the job (SmoothGrad: + its clean arg-max pass)
    if method == "gradient":
        np.testing.assert_allclose(maps, _reference_gradients(model, data), rtol=1e-5, atol=1e-7)


def test_no_reference_to_the_model_is_kept_and_jobs_are_bounded(data):
    import gc
    import weakref

    model = _cnn()
    for i in range(6):  # a new callable target per call: a new compiled job each time (2 past the bound)
        effgrad.saliency(model, data, target=lambda out, i=i: out[:, i % 4], progress=False)
    assert len(effgrad._compat.model_state(model)["saliency_jobs"]) <= 4
    alive = weakref.ref(model)
    del model
    gc.collect()
    assert alive() is None  # effgrad kept no reference: the model and its jobs are freed
