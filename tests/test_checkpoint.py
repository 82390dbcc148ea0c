"""Checkpointed computations equal the plain ones: outputs, gradients, randomness, state."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import effgrad
from conftest import assert_variables_close
from helpers import plain_step

MODES = ["eager", "function", "xla"]


def _compile(fn, mode):
    if mode == "eager":
        return fn
    return tf.function(fn, jit_compile=mode == "xla")


def _grads_function(model, mode, **call_kwargs):
    def fn(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = model(x, **call_kwargs)
            loss = tf.reduce_sum(tf.sin(y))
        return y, tape.gradient(loss, [x] + model.trainable_variables)

    return _compile(fn, mode)


def _grads(model, x, mode, **call_kwargs):
    return _grads_function(model, mode, **call_kwargs)(tf.convert_to_tensor(x))


def _dense_stack(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((6,))] + [keras.layers.Dense(6, activation="tanh") for _ in range(5)])


def _conv_block(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((8, 8, 3)),
            keras.layers.Conv2D(4, 3, padding="same", activation="relu"),
            keras.layers.Conv2D(4, 3, padding="same"),
            keras.layers.GlobalAveragePooling2D(),
        ]
    )


class Residual(keras.layers.Layer):
    def __init__(self, width=6, **kwargs):
        super().__init__(**kwargs)
        self.inner = keras.layers.Dense(width, activation="tanh")
        self.outer = keras.layers.Dense(width)

    def call(self, x):
        return x + self.outer(self.inner(x))


def _residual(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((6,)), Residual(), Residual()])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("make, shape", [(_dense_stack, (4, 6)), (_conv_block, (2, 8, 8, 3)), (_residual, (4, 6))])
def test_gradients_equal_unwrapped(rng, mode, make, shape):
    x = rng.normal(size=shape).astype("float32")
    plain = make()
    wrapped = effgrad.checkpoint(make())
    y0, g0 = _grads(plain, x, mode)
    y1, g1 = _grads(wrapped, x, mode)
    np.testing.assert_allclose(y1, y0, rtol=1e-6)
    assert_variables_close(g1, g0)


@pytest.mark.parametrize("mode", MODES)
def test_checkpoint_sequential_gradients_equal_plain(rng, mode):
    x = rng.normal(size=(4, 6)).astype("float32")
    plain, source = _dense_stack(), _dense_stack()
    segmented = effgrad.checkpoint_sequential(source, segments="sqrt")
    assert len(segmented.layers) == 3  # ceil(sqrt(5))
    _, g0 = _grads(plain, x, mode)
    _, g1 = _grads(segmented, x, mode)
    assert_variables_close(g1, g0)


@pytest.mark.parametrize("mode", MODES)
def test_function_with_nested_io_and_kwargs(rng, mode):
    dense = keras.layers.Dense(3)
    dense.build((None, 4))

    def f(inputs, *, scale, shift=None):
        h = dense(inputs["a"]) * scale + inputs["b"]
        return {"sum": h + (0.0 if shift is None else shift), "sq": h * h}

    g = effgrad.checkpoint(f)
    a = tf.constant(rng.normal(size=(2, 4)).astype("float32"))
    b = tf.constant(rng.normal(size=(2, 3)).astype("float32"))

    def run(fn):
        def inner(a, b):
            with tf.GradientTape() as tape:
                tape.watch([a, b])
                out = fn({"a": a, "b": b}, scale=2.0, shift=tf.ones([3]))
                loss = tf.reduce_sum(out["sum"]) + tf.reduce_sum(tf.cos(out["sq"]))
            return tape.gradient(loss, [a, b] + dense.trainable_variables)

        return _compile(inner, mode)(a, b)

    assert_variables_close(run(g), run(f))


# ---------------------------------------------------------------- Dropout
def _dropout_block(seed=3):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((64,)), keras.layers.Dropout(0.5), keras.layers.Dense(4)])


@pytest.mark.parametrize("mode", MODES)
def test_dropout_gradient_uses_the_forward_mask(rng, mode):
    keras.utils.set_random_seed(3)
    dropout = effgrad.checkpoint(keras.Sequential([keras.Input((64,)), keras.layers.Dropout(0.5)]))
    x = rng.uniform(1.0, 2.0, size=(8, 64)).astype("float32")
    c = rng.uniform(1.0, 2.0, size=(64,)).astype("float32")

    def fn(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = dropout(x, training=True)
            loss = tf.reduce_sum(y * c)
        return y, tape.gradient(loss, x)

    y, grad_x = _compile(fn, mode)(tf.constant(x))
    mask = y.numpy() != 0  # the mask the forward pass actually used
    np.testing.assert_allclose(grad_x, mask * 2.0 * c, rtol=1e-6)  # d sum(c * x * mask / 0.5) / dx
    assert 0.3 < mask.mean() < 0.7


@pytest.mark.parametrize("mode", MODES)
def test_dropout_random_state_advances_as_without_checkpointing(rng, mode):
    plain, source = _dropout_block(), _dropout_block()
    wrapped = effgrad.checkpoint(source)
    x = tf.constant(rng.uniform(size=(8, 64)).astype("float32"))
    # One traced function per model, called for every step as training calls its step: the state is read
    # when it runs, not when it was traced (and XLA compiles each model once, not three times).
    plain_grads, wrapped_grads = (_grads_function(model, mode, training=True) for model in (plain, wrapped))
    for grads in (plain_grads, wrapped_grads):
        for _ in range(2):  # two steps: the second starts from the state the first left
            grads(x)
    np.testing.assert_array_equal(
        source.layers[0].seed_generator.state.numpy(), plain.layers[0].seed_generator.state.numpy()
    )
    y0, g0 = plain_grads(x)
    y1, g1 = wrapped_grads(x)
    np.testing.assert_allclose(y1, y0, rtol=1e-6)
    assert_variables_close(g1, g0)


# ---------------------------------------------------------------- BatchNorm
def _bn_block(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((5,)), keras.layers.Dense(5), keras.layers.BatchNormalization(momentum=0.5)])


@pytest.mark.parametrize("mode", MODES)
def test_batchnorm_statistics_updated_exactly_once(rng, mode):
    plain, source = _bn_block(), _bn_block()
    wrapped = effgrad.checkpoint(source)
    x = rng.normal(3.0, 2.0, size=(16, 5)).astype("float32")
    _, g0 = _grads(plain, x, mode, training=True)
    _, g1 = _grads(wrapped, x, mode, training=True)
    assert_variables_close(g1, g0)
    bn_plain, bn_wrapped = plain.layers[-1], source.layers[-1]
    np.testing.assert_allclose(bn_wrapped.moving_mean.numpy(), bn_plain.moving_mean.numpy(), rtol=1e-6)
    np.testing.assert_allclose(bn_wrapped.moving_variance.numpy(), bn_plain.moving_variance.numpy(), rtol=1e-6)
    assert not np.allclose(bn_plain.moving_mean.numpy(), 0.0)  # it did move


# ---------------------------------------------------------------- kwargs, nesting, saving
class Gated(keras.layers.Layer):
    """A layer whose call needs keyword arguments."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(6)
        self.dropout = keras.layers.Dropout(0.3)

    def call(self, x, training=None, gate=None):
        h = self.dropout(self.dense(x), training=training)
        return h if gate is None else h * gate


def test_training_kwarg_passes_through_in_graph_mode(rng):
    keras.utils.set_random_seed(0)
    layer = Gated()
    wrapped = effgrad.Checkpoint(layer)
    x = tf.constant(rng.normal(size=(32, 6)).astype("float32"))
    gate = tf.constant(rng.uniform(size=(32, 6)).astype("float32"))

    @tf.function
    def step(x, gate):
        with tf.GradientTape() as tape:
            y = wrapped(x, training=True, gate=gate)
            loss = tf.reduce_sum(y)
        return y, tape.gradient(loss, layer.trainable_variables)

    y, grads = step(x, gate)
    assert np.mean(y.numpy() == 0) > 0.1  # dropout was on: training=True arrived
    assert all(np.isfinite(g.numpy()).all() for g in grads)
    y_eval = wrapped(x, training=False, gate=gate)
    assert np.mean(y_eval.numpy() == 0) < 0.01


class DropoutInside(keras.layers.Layer):
    """Its call() has no `training` argument: Dropout gets it from Keras's call context."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dropout = keras.layers.Dropout(0.5)

    def call(self, x):
        return self.dropout(x)


@pytest.mark.parametrize("mode", MODES)
def test_training_reaches_sublayers_in_the_recompute(mode):
    wrapped = effgrad.Checkpoint(DropoutInside())
    x = tf.ones((8, 100))

    def fn(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = wrapped(x, training=True)
            loss = tf.reduce_sum(y)
        return y, tape.gradient(loss, x)

    y, grad = _compile(fn, mode)(x)
    np.testing.assert_array_equal(grad.numpy() != 0, y.numpy() != 0)  # same mask in the recompute
    assert 0.3 < np.mean(y.numpy() == 0) < 0.7


@pytest.mark.parametrize("mode", MODES)
def test_nested_checkpoints_equal_plain(rng, mode):
    def make():
        keras.utils.set_random_seed(1)
        inner = keras.Sequential([keras.layers.Dense(6, activation="tanh"), keras.layers.Dropout(0.2)])
        return inner, keras.Sequential([keras.Input((6,)), keras.layers.Dense(6), inner, keras.layers.Dense(2)])

    _, plain = make()
    inner, same_layers = make()  # same weights as `plain`, re-wired below
    first, _, last = same_layers.layers
    # A checkpoint inside a checkpoint: Dense -> [Dense, Dropout] nested.
    nested = keras.Sequential(
        [keras.Input((6,)), effgrad.Checkpoint(keras.Sequential([first, effgrad.Checkpoint(inner)])), last]
    )
    x = rng.normal(size=(4, 6)).astype("float32")
    y0, g0 = _grads(plain, x, mode, training=True)
    y1, g1 = _grads(nested, x, mode, training=True)
    np.testing.assert_allclose(y1, y0, rtol=1e-6)
    assert_variables_close(g1, g0)


def test_keras_file_round_trip(rng, tmp_path):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    h = effgrad.Checkpoint(keras.layers.Dense(8, activation="relu"), name="ckpt_dense")(inputs)
    h = effgrad.Checkpoint(keras.Sequential([keras.layers.Dense(8), keras.layers.BatchNormalization()]))(h)
    model = keras.Model(inputs, keras.layers.Dense(2)(h))
    x = rng.normal(size=(5, 6)).astype("float32")
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    assert isinstance(loaded.get_layer("ckpt_dense"), effgrad.Checkpoint)
    np.testing.assert_allclose(loaded(x), model(x), rtol=1e-6)


# ---------------------------------------------------------------- in training
def test_inside_train_step_with_micro_batches_and_fit(rng):
    def make():
        keras.utils.set_random_seed(0)
        return keras.Sequential([keras.Input((6,))] + [keras.layers.Dense(6, activation="tanh") for _ in range(4)])

    x = rng.normal(size=(11, 6)).astype("float32")
    y = rng.normal(size=(11, 6)).astype("float32")
    plain, checkpointed = make(), effgrad.checkpoint_sequential(make(), segments=2)
    effgrad.build_train_step(checkpointed, "mse", keras.optimizers.SGD(0.1), micro_batches=3)(x, y)
    # The reference: the plain model's full-batch update, by a tape (eagerly: no second trace).
    plain_step(plain, keras.losses.mean_squared_error, keras.optimizers.SGD(0.1), x, y)
    assert_variables_close(checkpointed.trainable_variables, plain.trainable_variables)
    # fit with attach on the checkpointed model == stock fit on the plain one (values, not just finiteness);
    # the stock one eagerly, a reference whose trace and retrace (the short last batch) cost 3 s.
    plain.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", run_eagerly=True)
    checkpointed.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    effgrad.attach(checkpointed, micro_batches=2)
    h_plain = plain.fit(x, y, epochs=3, batch_size=4, verbose=0, shuffle=False)
    h_checkpointed = checkpointed.fit(x, y, epochs=3, batch_size=4, verbose=0, shuffle=False)
    np.testing.assert_allclose(h_checkpointed.history["loss"], h_plain.history["loss"], rtol=1e-4)
    assert_variables_close(checkpointed.trainable_variables, plain.trainable_variables, atol=1e-5, rtol=1e-4)


# ---------------------------------------------------------------- bad input
class Lazy(keras.layers.Layer):
    """Creates its variable in call(): no symbolic build can help."""

    def call(self, x):
        if not hasattr(self, "w"):
            self.w = self.add_weight(shape=(x.shape[-1],), initializer="ones")
        return x * self.w


def test_unbuilt_layers_are_built_before_the_checkpointed_call(rng):
    keras.utils.set_random_seed(0)
    layer = Gated()  # no build(): its sublayers only get variables from a call
    x = tf.constant(rng.normal(size=(4, 6)).astype("float32"))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(effgrad.Checkpoint(layer)(x, training=False))
    assert all(g is not None for g in tape.gradient(loss, layer.trainable_variables))
    lazy = Lazy()
    lazy.built = True  # claims to be built, creates its variable in call anyway
    with pytest.raises(ValueError, match="created variables inside a checkpointed call"):
        effgrad.Checkpoint(lazy)(x)


def test_bad_input_errors():
    with pytest.raises(TypeError, match="function, keras.Layer"):
        effgrad.checkpoint(42)
    with pytest.raises(TypeError, match="keras.Layer"):
        effgrad.Checkpoint(lambda x: x)
    stack = _dense_stack()
    with pytest.raises(ValueError, match="at least 1"):
        effgrad.checkpoint_sequential(stack, segments=0)
    with pytest.warns(UserWarning, match="at most 5 segments"):
        assert len(effgrad.checkpoint_sequential(stack, segments=6).layers) == 5
    with pytest.raises(ValueError, match='"sqrt" or an int'):
        effgrad.checkpoint_sequential(stack, segments="half")


# ---------------------------------------------------------------- the recompute happens
def count_calls(layer):
    """Counts ``layer.call`` runs (Python calls: once per eager run or per trace)."""
    calls = []
    inner = layer.call
    layer.call = lambda *args, **kwargs: calls.append(1) or inner(*args, **kwargs)
    return calls


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_checkpointed_layers_run_again_in_backprop(rng, mode):
    # A wrapper that only called the function would pass every equality test;
    # this one counts: forward once, recompute once - and no recompute
    # without a gradient.
    x = rng.normal(size=(4, 6)).astype("float32")
    plain = _dense_stack()
    checkpointed = effgrad.checkpoint_sequential(_dense_stack(), segments=2)
    plain_calls, checkpointed_calls = count_calls(plain.layers[0]), count_calls(checkpointed.layers[0].layer.layers[0])
    _grads(plain, x, mode)
    _grads(checkpointed, x, mode)
    assert (len(plain_calls), len(checkpointed_calls)) == (1, 2)
    checkpointed(x)
    assert len(checkpointed_calls) == 3


class _TFNoise(keras.layers.Layer):
    """Noise from TensorFlow's stateful random op: a recompute would draw other numbers."""

    def call(self, x, training=False):
        out = x + tf.random.uniform(tf.shape(x)) if training else x
        self.__dict__.setdefault("calls", []).append(out)  # each call's draw
        return out


def test_a_block_drawing_from_stateful_tf_random_ops_is_not_checkpointed_and_says_why():
    keras.utils.set_random_seed(0)
    noise, last = _TFNoise(), keras.layers.Dense(2)
    block = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4), noise, last])
    wrapped = effgrad.Checkpoint(block)

    @tf.function
    def gradient_and_expected(x):
        with tf.GradientTape() as tape:
            y = wrapped(x, training=True)
            drawn = noise.calls[-1]  # what the forward pass that made y drew
            loss = tf.reduce_sum(y**2)
        # dL/dW of the last layer from the activations this very forward pass drew
        return tape.gradient(loss, last.kernel), tf.matmul(drawn, 2 * y, transpose_a=True)

    with pytest.warns(UserWarning, match="stateful.*RandomUniform"):
        gradient, expected = gradient_and_expected(tf.random.normal([3, 4]))
    np.testing.assert_allclose(gradient.numpy(), expected.numpy(), rtol=1e-5, atol=1e-6)


class _NoiseInALoop(keras.layers.Layer):
    """Draws its noise inside tf.map_fn (a while loop's body): the graph's top level shows no random op."""

    def call(self, x, training=None):
        return tf.map_fn(lambda row: row + tf.random.uniform(tf.shape(row)), x) if training else x


def test_stateful_random_ops_inside_a_loop_body_are_found_too():
    block = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4), _NoiseInALoop(), keras.layers.Dense(2)])
    wrapped = effgrad.Checkpoint(block)

    @tf.function
    def gradients(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(wrapped(x, training=True) ** 2)
        return tape.gradient(loss, block.trainable_variables)

    with pytest.warns(UserWarning, match="stateful.*RandomUniform"):
        gradients(tf.random.normal([3, 4]))


def test_a_block_adding_losses_is_refused_not_trained_without_them():
    # An activity regularizer's loss made with the tapes paused would reach Keras's loss with no gradient.
    block = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4, activity_regularizer="l2")])
    wrapped = effgrad.Checkpoint(block)
    with pytest.raises(ValueError, match="adds losses"):
        with tf.GradientTape():
            wrapped(tf.ones([2, 4]), training=True)
    # Inference needs no gradient: the losses are handed on as the plain block adds them (predict works).
    wrapped(tf.ones([2, 4]), training=False)
    expected = [float(v) for v in (block(tf.ones([2, 4]), training=False), block.losses)[1]]
    assert [float(v) for v in wrapped.losses] == pytest.approx(expected) and expected


class _DropPath(keras.layers.Layer):
    """Stochastic depth as Keras's ConvNeXt draws it: keras.random with no seed (Keras's global generator)."""

    def call(self, x, training=None):
        return x * keras.ops.floor(0.7 + keras.random.uniform((keras.ops.shape(x)[0], 1))) / 0.7 if training else x


def test_a_block_drawing_from_keras_global_seed_generator_before_it_exists_equals_the_plain_model():
    def make():
        keras.utils.set_random_seed(0)  # also forgets the global generator: the first draw makes it
        inputs = keras.Input((8,))
        h = inputs
        for _ in range(4):
            h = keras.layers.Add()([h, _DropPath()(keras.layers.Dense(8)(h))])
        return keras.Model(inputs, keras.layers.Dense(1)(h))

    x, y = np.ones((8, 8), "float32"), np.zeros((8, 1), "float32")
    losses = []
    for wrap in (lambda m: m, lambda m: effgrad.checkpoint_model(m, segments=2)):
        model = wrap(make())
        model.compile(keras.optimizers.SGD(1e-3), "mse")  # Keras's own step (effgrad's makes the generator first)
        losses.append(model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0).history["loss"])
    assert losses[1] == pytest.approx(losses[0], rel=1e-6)


@pytest.mark.parametrize("mode", MODES)
def test_a_tensor_closed_over_that_the_tape_differentiates_is_refused_not_left_without_gradient(mode):
    # tf.custom_gradient differentiates a block's arguments and the variables it reads: a weight-dependent
    # tensor it closes over (or reads as a global) would silently get no gradient.
    dense = keras.layers.Dense(4)
    dense.build((None, 4))
    x, c = tf.ones((2, 4)), tf.fill((4, 4), 0.5)

    def gradient(closed_over: bool):
        with tf.GradientTape() as tape:
            w = dense.kernel * 2.0
            if closed_over:
                f = effgrad.checkpoint(lambda x: tf.matmul(x, w))
                y = f(x)
            else:  # passed as an argument; a constant closed over has no gradient to lose
                y = effgrad.checkpoint(lambda x, w: tf.matmul(x, w) + tf.matmul(x, c))(x, w)
            loss = tf.reduce_sum(y)
        return tape.gradient(loss, dense.kernel)

    with pytest.raises(ValueError, match="argument"):
        _compile(lambda: gradient(True), mode)()
    np.testing.assert_allclose(_compile(lambda: gradient(False), mode)(), np.full((4, 4), 4.0))
