"""Activation functions recomputed in backprop: the same step, less held (effgrad.recompute_activations)."""

import contextlib
import json
import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf

import effgrad
from conftest import assert_variables_close
from helpers import in_fresh_processes, tiny_gpt2_lm


def _steps(model_fn, x, y, recompute, jit_compile=False, strategy=None, steps=2):
    with strategy.scope() if strategy else contextlib.nullcontext():
        keras.utils.set_random_seed(0)
        model = model_fn()
        optimizer = keras.optimizers.Adam(0.01)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    step = effgrad.build_train_step(
        model, loss, optimizer, recompute_activations=recompute, jit_compile=jit_compile, strategy=strategy
    )
    losses = [float(step(x, y)["loss"]) for _ in range(steps)]
    return model, step, losses


def _assert_equal_steps(*args, rel=1e-6, **kwargs):
    plain, plain_step, plain_losses = _steps(*args, False, **kwargs)
    model, step, losses = _steps(*args, "auto", **kwargs)
    assert step.recompute_activations and not plain_step.recompute_activations
    assert losses == pytest.approx(plain_losses, rel=rel)
    assert_variables_close(model.trainable_variables, plain.trainable_variables, atol=rel)


def _mlp():
    layers = [keras.layers.Dense(32, activation="gelu"), keras.layers.Dropout(0.2), keras.layers.Dense(4)]
    return keras.Sequential([keras.Input((8,)), *layers])


_MLP_DATA = (np.random.default_rng(0).normal(size=(16, 8)).astype("float32"), np.arange(16) % 4)


def test_a_keras_hub_lm_step_equals_the_step_without_recompute():
    tokens = np.random.default_rng(0).integers(0, 50, (4, 8)).astype("int32")
    x = {"token_ids": tokens, "padding_mask": np.ones((4, 8), "int32")}
    _assert_equal_steps(lambda: tiny_gpt2_lm(dropout=0.1, layers=1), x, np.roll(tokens, -1, axis=1))


def test_under_xla_equals_the_step_without_recompute():
    _assert_equal_steps(_mlp, *_MLP_DATA, jit_compile=True)


def test_under_mirrored_strategy_equals_the_step_without_recompute(strategy):
    # MirroredStrategy traces each replica in a thread of its own: each decides and recomputes.
    _assert_equal_steps(_mlp, *_MLP_DATA, strategy=strategy, rel=1e-5)


def test_eager_gradients_equal_the_layers_own(rng):
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="gelu"), keras.layers.Dense(2)])
    x = rng.normal(size=(5, 6)).astype("float32")

    def gradients():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(x, training=True) ** 2)
        return tape.gradient(loss, model.trainable_variables)

    plain = gradients()
    gelu = model.layers[0].activation
    with effgrad.recompute_activations(model, "auto") as block:
        recomputed = gradients()
    assert block.applied
    assert_variables_close(recomputed, plain, atol=1e-7)
    assert model.layers[0].activation is gelu  # the layer's own again: inference and saved files see it


def test_a_decision_first_made_inside_a_checkpointed_block_is_right(rng):
    # A checkpointed block's forward pass runs with the tapes paused: deciding there must not see "keeps 0".
    def gelu(t):  # a function no other test has decided on (decisions are cached per function)
        return keras.activations.gelu(t)

    inner = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8, activation=gelu)])
    light = effgrad.Checkpoint(inner)
    x = tf.constant(rng.normal(size=(3, 8)).astype("float32"))
    with effgrad.recompute_activations(inner, "auto") as block, tf.GradientTape() as tape:
        loss = tf.reduce_sum(light(x, training=True))
    grads = tape.gradient(loss, inner.trainable_variables)
    assert [done for done, _ in block.decisions.values()] == [True]
    assert all(g is not None for g in grads)


class _OwnCall(keras.layers.Dense):
    def call(self, inputs):
        return super().call(inputs) * 2.0


def test_auto_recomputes_only_what_keeps_more_than_its_input(rng):
    inputs = keras.Input((8,))
    h = keras.layers.Dense(8, activation="gelu", name="gelu")(inputs)
    h = keras.layers.Dense(8, activation="relu", name="relu")(h)
    h = keras.layers.Dense(8, activation="tanh", name="tanh")(h)
    h = _OwnCall(8, activation="gelu", name="own_call")(h)
    h = keras.layers.Activation(lambda t: keras.activations.gelu(t, approximate=True), name="activation")(h)
    model = keras.Model(inputs, keras.layers.Dense(1, name="linear")(h))
    x = rng.normal(size=(3, 8)).astype("float32")
    with effgrad.recompute_activations(model, "auto") as block:
        model(x, training=True)
        model(x, training=False)  # inference calls recompute nothing and decide nothing
    decided = {name.split("/")[-1]: done for name, (done, _) in block.decisions.items()}
    assert decided == {"gelu": True, "relu": False, "tanh": False, "activation": True}
    with effgrad.recompute_activations(model, True) as block:
        model(x, training=True)
    assert all(done for done, _ in block.decisions.values()) and len(block.decisions) == 4


_CONSTANT = tf.constant(1.5)
_PER_UNIT = np.linspace(0.5, 1.5, 8).astype("float32")
_VARIABLE = keras.Variable(1.5, trainable=False)


@pytest.mark.parametrize("mode", ["auto", True])
@pytest.mark.parametrize(
    "activation, recomputable",
    [
        (lambda t: keras.activations.gelu(t * _CONSTANT), True),  # an eager constant, captured
        (lambda t: keras.activations.gelu(t * _PER_UNIT), True),  # needs the layer's own width
        (lambda t: keras.activations.gelu(t * _VARIABLE), False),  # state: not proven to read the same again
    ],
    ids=["constant", "per-unit", "variable"],
)
def test_a_user_activation_is_recomputed_only_where_proven_and_the_step_is_unchanged(activation, recomputable, mode):
    x = np.random.default_rng(0).normal(size=(16, 8)).astype("float32")
    steps = []
    for recompute in (mode, False):
        keras.utils.set_random_seed(0)
        layers = [keras.Input((8,)), keras.layers.Dense(8, activation=activation), keras.layers.Dense(1)]
        model = keras.Sequential(layers)
        steps.append(effgrad.build_train_step(model, "mse", keras.optimizers.SGD(0.1), recompute_activations=recompute))
        steps[-1](x, x[:, :1])
    assert steps[0].recompute_activations is recomputable
    assert_variables_close(steps[0].model.trainable_variables, steps[1].model.trainable_variables, atol=1e-7)


def test_an_activation_drawing_random_numbers_is_not_recomputed_even_in_eager_loops(rng):
    def noisy(t):
        return keras.activations.gelu(t) * (1.0 + 0.1 * tf.random.uniform(tf.shape(t)))

    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation=noisy), keras.layers.Dense(1)])
    x = rng.normal(size=(4, 8)).astype("float32")

    def gradients(mode):
        tf.random.set_seed(5)  # the same draws in the forward pass of both
        with effgrad.recompute_activations(model, mode) as block, tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(x, training=True))
        return tape.gradient(loss, model.trainable_variables), block

    plain, _ = gradients(False)
    kept, block = gradients(True)  # True too: a second run would draw other numbers
    assert block.decisions and not block.applied
    assert_variables_close(kept, plain, atol=0)


@pytest.mark.parametrize(
    "options",
    [{"recompute_activations": "yes"}, {"recompute_activations": True, "per_example_clip": 1.0, "noise_multiplier": 1}],
)
def test_bad_options_get_a_one_line_error(options):
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1, activation="gelu")])
    with pytest.raises(ValueError, match="recompute_activations") as err:
        effgrad.build_train_step(model, "mse", "sgd", **options)
    assert "\n" not in str(err.value)


_MEMORY = textwrap.dedent(
    """
    import json, sys
    import effgrad, keras, numpy as np
    mode = {"off": False, "auto": "auto"}[sys.argv[1]]
    keras.utils.set_random_seed(0)
    gelu = lambda t: keras.activations.gelu(t, approximate=True)
    model = keras.Sequential([keras.Input((128,))] + [keras.layers.Dense(1024, activation=gelu) for _ in range(4)]
                             + [keras.layers.Dense(1)])
    x, y = np.ones((1024, 128), "float32"), np.zeros((1024, 1), "float32")
    step = effgrad.build_train_step(model, "mse", keras.optimizers.SGD(0.01), recompute_activations=mode)
    step(x, y)
    print("@@" + json.dumps(effgrad.memory.measure(step, x, y).extra_bytes))
    """
)


def test_recomputing_the_gelu_frees_what_its_backprop_kept():
    extra = in_fresh_processes(_MEMORY, {m: [m] for m in ("off", "auto")})
    tensor = 1024 * 1024 * 4  # one [batch, 1024] float32 activation: 4 MiB
    # The tanh GELU's backprop keeps four tensors beyond its output; recomputed, it keeps one (its
    # input): three fewer per layer while backprop works on another (the one it works on makes them
    # again for a while): at least 3 x 3 at the peak of 4 layers.
    print(json.dumps({k: v / tensor for k, v in extra.items()}))
    assert extra["auto"] <= extra["off"] - 7 * tensor, json.dumps(extra)
