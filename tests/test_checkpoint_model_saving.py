"""Every model checkpoint_model returns saves, loads and computes what it computed (shared layers included)."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import effgrad
from conftest import assert_variables_close


def _shared_dense():
    keras.utils.set_random_seed(0)
    inputs, shared = keras.Input((8,)), keras.layers.Dense(8, activation="tanh")
    h = inputs
    for _ in range(3):  # the same layer in every segment
        h = shared(keras.layers.Dense(8, activation="relu")(h))
    return keras.Model(inputs, keras.layers.Dense(2)(h))


def _shared_submodel():
    keras.utils.set_random_seed(0)
    sub = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(8)])
    inputs = keras.Input((8,))
    h = keras.layers.Dense(8)(keras.layers.Dense(8, activation="relu")(sub(inputs)))
    return keras.Model(inputs, sub(h))


def _shared_attention():
    keras.utils.set_random_seed(0)
    inputs, attention = keras.Input((5, 8)), keras.layers.MultiHeadAttention(2, 4)
    h = inputs
    for _ in range(3):
        h = keras.layers.Dense(8)(h + attention(h, h))
    return keras.Model(inputs, h)


@pytest.mark.parametrize(
    "make, shape",
    [(_shared_dense, (4, 8)), (_shared_submodel, (4, 8)), (_shared_attention, (2, 5, 8))],
    ids=["shared_layer", "shared_submodel", "shared_attention"],
)
def test_models_with_layers_shared_across_segments_load_with_their_weights(rng, tmp_path, make, shape):
    x = rng.normal(size=shape).astype("float32")
    checkpointed = effgrad.checkpoint_model(make(), segments=3)
    assert sum(isinstance(layer, effgrad.Checkpoint) for layer in checkpointed.layers) == 3
    checkpointed.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    # Built before fit: a train function whose trace creates the optimizer's variables is traced twice (a
    # fresh optimizer's first fit, through a checkpointed model, is the GPT-2 test's below).
    checkpointed.optimizer.build(checkpointed.trainable_variables)
    checkpointed.fit(x, np.zeros_like(checkpointed(x)), verbose=0)  # trained weights, not the initial ones
    checkpointed.save(tmp_path / "ck.keras")
    loaded = keras.models.load_model(tmp_path / "ck.keras")
    np.testing.assert_allclose(loaded(x), checkpointed(x), atol=1e-6)
    assert len(loaded.weights) == len(checkpointed.weights)  # shared layers are shared again, not copied
    assert sum(isinstance(layer, effgrad.Checkpoint) for layer in loaded.layers) == 3
    assert_variables_close(loaded.optimizer.variables, checkpointed.optimizer.variables, atol=0, rtol=0)
    # And it trains on, optimizer state restored. Eagerly: the traced fit of these layers is the one above;
    # a second trace, of the loaded copy, costs 1-3 s.
    loaded.run_eagerly = True
    loaded.fit(x, np.zeros_like(loaded(x)), verbose=0)
    assert int(loaded.optimizer.iterations) == 2


def _tiny_gpt2_lm():
    import keras_hub

    keras.utils.set_random_seed(0)
    # One transformer layer: what is tested is the tied embedding (used in the first segment and in the
    # projection outside every segment), not the depth; each layer more lengthens every trace.
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=64, num_layers=1, num_heads=2, hidden_dim=16, intermediate_dim=32, max_sequence_length=16
    )
    return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)


def test_gpt2_causal_lm_with_tied_embedding_loads_and_the_task_object_keeps_generating(rng, tmp_path):
    pytest.importorskip("keras_hub")
    lm = _tiny_gpt2_lm()
    tokens = {"token_ids": rng.integers(1, 64, size=(2, 16)).astype("int32"), "padding_mask": np.ones((2, 16), "int32")}
    checkpointed = effgrad.checkpoint_model(lm, segments=3)  # cut inside the backbone: embeddings | layer | norm
    assert sum(isinstance(layer, effgrad.Checkpoint) for layer in checkpointed.layers) == 3
    checkpointed.compile(
        optimizer=keras.optimizers.SGD(0.5), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    before = np.array(lm.backbone.token_embedding.embeddings.numpy())
    checkpointed.fit(tokens, tokens["token_ids"], verbose=0)
    # The one-line way to keep the task object: train the checkpointed graph, the task shares its weights.
    assert not np.allclose(lm.backbone.token_embedding.embeddings.numpy(), before)
    generated = lm.generate(tokens, stop_token_ids=None)
    assert generated["token_ids"].shape == (2, 16)
    checkpointed.save(tmp_path / "lm.keras")
    loaded = keras.models.load_model(tmp_path / "lm.keras")
    np.testing.assert_allclose(loaded(tokens), checkpointed(tokens), atol=1e-5)
    assert len(loaded.weights) == len(checkpointed.weights)


def test_checkpointing_a_function_around_an_unbuilt_layer_is_a_clear_error(rng):
    x = tf.constant(rng.normal(size=(4, 5)).astype("float32"))
    layer = keras.layers.Dense(3)
    f = effgrad.checkpoint(lambda t: layer(t))
    with pytest.raises(ValueError, match="not built yet.*Build the layers"):
        with tf.GradientTape():
            f(x)
    # Built now (the error left it built): gradients equal the plain call's.
    with tf.GradientTape(persistent=True) as tape:
        plain, checkpointed = tf.reduce_sum(layer(x) ** 2), tf.reduce_sum(f(x) ** 2)
    for a, b in zip(
        tape.gradient(plain, layer.trainable_variables), tape.gradient(checkpointed, layer.trainable_variables)
    ):
        np.testing.assert_allclose(a, b, rtol=1e-6)
