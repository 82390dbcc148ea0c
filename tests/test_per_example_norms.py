"""Per-example gradient norms equal those of per-example gradients (one backward pass per example)."""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import effgrad
from helpers import naive_per_example_gradients, tiny_gpt2_lm


def _naive_norms(model, loss, x, y, sample_weight=None):
    grads = naive_per_example_gradients(model, loss, x, y, sample_weight)
    return np.array([np.sqrt(sum(float(np.sum(np.square(g))) for g in example)) for example in grads])


def _check(model, loss, x, y, sample_weight=None, rtol=1e-5):
    got = effgrad.per_example_norms(model, loss, x, y, sample_weight).numpy()
    expected = _naive_norms(model, loss, x, y, sample_weight)
    assert expected.min() > 0 and np.ptp(expected) > 0  # distinct, non-zero norms: a real check
    np.testing.assert_allclose(got, expected, rtol=rtol, atol=1e-6)


def test_mlp_with_sample_weights(rng):
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((6,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(8, use_bias=False),
         keras.layers.Dense(3)]
    )  # fmt: skip
    x, y = rng.normal(size=(7, 6)).astype("float32"), rng.integers(0, 3, 7)
    w = rng.uniform(0.5, 2.0, 7).astype("float32")
    _check(model, keras.losses.SparseCategoricalCrossentropy(from_logits=True), x, y, w)


def test_convolutions_strided_padded_dilated_causal_and_channels_first(rng):
    keras.utils.set_random_seed(0)
    image = keras.Input((9, 9, 2))
    a = keras.layers.Conv2D(4, 3, strides=2, padding="same", activation="relu")(image)
    b = keras.layers.Conv2D(3, 2, dilation_rate=2, padding="valid")(a)
    c = keras.layers.Permute((3, 1, 2))(b)
    c = keras.layers.Conv2D(2, 2, data_format="channels_first")(c)
    series = keras.Input((12, 3))
    s = keras.layers.Conv1D(4, 3, padding="causal", dilation_rate=2, activation="tanh")(series)
    s = keras.layers.Conv1D(2, 2, strides=2)(s)
    out = keras.layers.Concatenate()([keras.layers.Flatten()(c), keras.layers.Flatten()(s)])
    model = keras.Model([image, series], keras.layers.Dense(2)(out))
    x = [rng.normal(size=(5, 9, 9, 2)).astype("float32"), rng.normal(size=(5, 12, 3)).astype("float32")]
    _check(model, "mse", x, rng.normal(size=(5, 2)).astype("float32"))


@pytest.mark.parametrize("length", [3, 40])  # 3: T^2 < d_in x d_out (Gram matrices); 40: the direct form
def test_sequences_embeddings_attention_and_layer_norm(rng, length):
    keras.utils.set_random_seed(0)
    tokens = keras.Input((length,), dtype="int32")
    h = keras.layers.Embedding(11, 6, mask_zero=True)(tokens)
    h = keras.layers.LayerNormalization()(h)
    h = keras.layers.MultiHeadAttention(num_heads=2, key_dim=3)(h, h)  # EinsumDense inside
    h = keras.layers.EinsumDense("abc,cd->abd", output_shape=(None, 5), bias_axes="d", activation="relu")(h)
    model = keras.Model(tokens, keras.layers.Dense(4)(h))
    ids = rng.integers(1, 4, size=(4, length)).astype("int32")  # few ids: each repeats within an example
    ids[0, -2:] = 0  # padding: masked out of the loss
    y = rng.integers(0, 4, size=(4, length))
    _check(model, keras.losses.SparseCategoricalCrossentropy(from_logits=True), ids, y, rtol=2e-5)


def test_keras_hub_bert_classifier_with_padding(rng):
    import keras_hub

    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=30, num_layers=2, num_heads=2, hidden_dim=8, intermediate_dim=16, max_sequence_length=6
    )
    model = keras_hub.models.BertTextClassifier(backbone=backbone, num_classes=3, preprocessor=None)
    mask = np.ones((4, 6), "int32")
    mask[1, 4:] = 0
    x = {
        "token_ids": rng.integers(1, 30, (4, 6)).astype("int32") * mask,
        "segment_ids": np.zeros((4, 6), "int32"),
        "padding_mask": mask,
    }
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*no closed form.*")  # every layer of BERT has one
        _check(model, keras.losses.SparseCategoricalCrossentropy(from_logits=True), x, rng.integers(0, 3, 4), rtol=2e-5)


def test_tied_embedding_norms_are_not_added_but_summed_per_example(rng):
    model = tiny_gpt2_lm(dropout=0.0)  # the token embedding is also the output projection
    ids = rng.integers(1, 50, size=(3, 8)).astype("int32")
    x = {"token_ids": ids, "padding_mask": np.ones((3, 8), "int32")}
    _check(model, keras.losses.SparseCategoricalCrossentropy(from_logits=True), x, np.roll(ids, -1, 1), rtol=2e-5)


class _Scale(keras.layers.Layer):
    """A layer with weights and no closed form: the fallback's per-example gradients."""

    def build(self, shape):
        self.w = self.add_weight(shape=shape[-1:], initializer="ones")

    def call(self, x):
        return x * self.w + tf.sin(x)


def test_other_layers_fall_back_with_one_warning_naming_them(rng):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(5), _Scale(), keras.layers.Dense(2)])
    x, y = rng.normal(size=(6, 4)).astype("float32"), rng.normal(size=(6, 2)).astype("float32")
    with pytest.warns(UserWarning, match="_Scale") as caught:
        _check(model, "mse", x, y)
    assert sum("_Scale" in str(w.message) for w in caught) == 1


def test_what_per_example_norms_cannot_see_is_refused_with_what_to_do(rng):
    x, y = np.ones((3, 4), "float32"), np.ones((3, 2), "float32")
    model = keras.Sequential([keras.Input((4,)), keras.layers.BatchNormalization(), keras.layers.Dense(2)])
    with pytest.raises(ValueError, match="LayerNormalization or GroupNormalization"):
        effgrad.per_example_norms(model, "mse", x, y)
    wrapped = keras.Sequential([keras.Input((4,)), effgrad.Checkpoint(keras.layers.Dense(3)), keras.layers.Dense(2)])
    with pytest.raises(ValueError, match="without checkpointing"):
        effgrad.per_example_norms(wrapped, "mse", x, y)
