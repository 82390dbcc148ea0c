"""Per-example gradient norms equal those of per-example gradients (one backward pass per example)."""

import gc
import warnings
import weakref

import keras
import numpy as np
import pytest
import tensorflow as tf

import effgrad
from helpers import channels_first_unsupported, per_example_norms_naive, tiny_gpt2_lm

_SCE = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _check(model, loss, x, y, sample_weight=None, rtol=1e-5, closed_form=True):
    """effgrad's norms equal the naive ones; ``closed_form``: and no layer fell back."""
    with warnings.catch_warnings():
        if closed_form:
            warnings.filterwarnings("error", message=".*no closed form.*")
        got = effgrad.per_example_norms(model, loss, x, y, sample_weight).numpy()
    expected = per_example_norms_naive(model, loss, x, y, sample_weight)
    assert expected.min() > 0 and np.ptp(expected) > 0  # distinct, non-zero norms: a real check
    np.testing.assert_allclose(got, expected, rtol=rtol, atol=1e-6)


def test_mlp_normalizations_and_sample_weights(rng):
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((6,)), keras.layers.Dense(8, activation="tanh"), keras.layers.GroupNormalization(groups=2),
         keras.layers.Dense(8, use_bias=False), keras.layers.RMSNormalization(),
         keras.layers.LayerNormalization(axis=[1]), keras.layers.Dense(3)]
    )  # fmt: skip
    x, y = rng.normal(size=(7, 6)).astype("float32"), rng.integers(0, 3, 7)
    w = rng.uniform(0.5, 2.0, 7).astype("float32")
    _check(model, _SCE, x, y, w)


@pytest.mark.parametrize("data_format", ["channels_last", "channels_first"])
def test_convolutions_strided_padded_dilated_causal_grouped_and_depthwise(rng, data_format):
    if data_format == "channels_first" and channels_first_unsupported():
        pytest.skip(f"TensorFlow here cannot train channels_first convolutions: {channels_first_unsupported()}")
    keras.utils.set_random_seed(0)
    conv = {"data_format": data_format}
    image = keras.Input((9, 9, 4) if data_format == "channels_last" else (4, 9, 9))
    a = keras.layers.Conv2D(4, 3, strides=2, padding="same", activation="relu", **conv)(image)
    a = keras.layers.Conv2D(6, 2, dilation_rate=2, groups=2, **conv)(a)
    a = keras.layers.DepthwiseConv2D(2, depth_multiplier=2, padding="same", **conv)(a)
    if data_format == "channels_first":
        a = keras.layers.Conv2D(3, 2, **conv)(a)  # last axis 3 == filters: Keras adds the bias along it
    series = keras.Input((12, 4) if data_format == "channels_last" else (4, 12))
    s = keras.layers.Conv1D(4, 3, padding="causal" if data_format == "channels_last" else "same",
                            dilation_rate=2, groups=2, activation="tanh", **conv)(series)  # fmt: skip
    s = keras.layers.DepthwiseConv1D(3, strides=2, **conv)(s)
    parts = [keras.layers.Flatten()(a), keras.layers.Flatten()(s)]
    inputs = [image, series]
    if data_format == "channels_last":
        volume = keras.Input((4, 5, 6, 2))
        parts.append(keras.layers.Flatten()(keras.layers.Conv3D(2, 2, strides=(1, 2, 1), padding="same")(volume)))
        inputs.append(volume)
    model = keras.Model(inputs, keras.layers.Dense(2)(keras.layers.Concatenate()(parts)))
    x = [rng.normal(size=(4, *t.shape[1:])).astype("float32") for t in inputs]
    _check(model, "mse", x, rng.normal(size=(4, 2)).astype("float32"))


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
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*does not support masking.*")
        _check(model, _SCE, ids, y, rtol=2e-5)


def test_recurrent_layers_sum_over_time_inside_each_example(rng):
    keras.utils.set_random_seed(0)
    tokens = keras.Input((4,), dtype="int32")  # (each unrolled step is traced again: few steps)
    h = keras.layers.Embedding(9, 5, mask_zero=True)(tokens)
    a = keras.layers.Bidirectional(keras.layers.LSTM(4, return_sequences=True))(h)  # a loop each way
    a = keras.layers.GRU(4, go_backwards=True, unroll=True)(a)  # (unrolled: Python steps, quicker to trace)
    b, state = keras.layers.GRU(3, reset_after=False, return_state=True, unroll=True)(h)
    c = keras.layers.SimpleRNN(3, unroll=True)(h)
    model = keras.Model(tokens, keras.layers.Dense(3)(keras.layers.Concatenate()([a, b, state, c])))
    ids = rng.integers(1, 9, size=(5, 4)).astype("int32")
    ids[0, 3:], ids[2, 2:] = 0, 0  # padding: masked steps keep the state
    _check(model, _SCE, ids, rng.integers(0, 3, 5))


def test_keras_hub_bert_classifier_with_padding(rng):
    import keras_hub

    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=30, num_layers=1, num_heads=2, hidden_dim=8, intermediate_dim=16, max_sequence_length=6
    )  # one transformer layer: a second has the same layers, and only lengthens the trace
    model = keras_hub.models.BertTextClassifier(backbone=backbone, num_classes=3, preprocessor=None)
    mask = np.ones((4, 6), "int32")
    mask[1, 4:] = 0
    x = {
        "token_ids": rng.integers(1, 30, (4, 6)).astype("int32") * mask,
        "segment_ids": np.zeros((4, 6), "int32"),
        "padding_mask": mask,
    }
    _check(model, _SCE, x, rng.integers(0, 3, 4), rtol=2e-5)  # every layer of BERT has a closed form


def test_tied_embedding_norms_are_not_added_but_summed_per_example(rng):
    model = tiny_gpt2_lm(dropout=0.0, layers=1)  # the token embedding is also the output projection
    ids = rng.integers(1, 50, size=(3, 8)).astype("int32")
    x = {"token_ids": ids, "padding_mask": np.ones((3, 8), "int32")}
    _check(model, _SCE, x, np.roll(ids, -1, 1), rtol=2e-5)


class _Scale(keras.layers.Layer):
    """A layer with weights and no closed form: the fallback's per-example gradients."""

    def build(self, shape):
        self.w = self.add_weight(shape=shape[-1:], initializer="ones")

    def call(self, x):
        return x * self.w + tf.sin(x)


class _HalfDense(keras.layers.Dense):
    def call(self, x):  # not Dense.call: the closed form must not stand in for it
        return super().call(x) * 0.5


class _RenamedDense(keras.layers.Dense):
    pass  # Dense.call inherited unchanged: the closed form applies


def test_other_layers_and_overriding_subclasses_fall_back_exactly_with_one_warning_each(rng):
    keras.utils.set_random_seed(0)
    tokens = keras.Input((6,))
    h = _Scale()(_HalfDense(5)(_RenamedDense(5)(tokens)))
    cells = [keras.layers.LSTMCell(3), keras.layers.GRUCell(2)]
    stacked = keras.layers.RNN(keras.layers.StackedRNNCells(cells), unroll=True)  # no closed form: a fallback
    r = stacked(keras.layers.Reshape((2, 5))(keras.layers.Dense(10)(h)))  # (2 steps: each is traced again)
    model = keras.Model(tokens, keras.layers.Dense(2)(r))
    x, y = rng.normal(size=(6, 6)).astype("float32"), rng.normal(size=(6, 2)).astype("float32")
    with pytest.warns(UserWarning, match="no closed form") as caught:
        _check(model, "mse", x, y, closed_form=False)
    messages = [str(w.message) for w in caught if "no closed form" in str(w.message)]
    assert sorted(m.split(" layers")[0].split()[-1] for m in messages) == ["RNN", "_HalfDense", "_Scale"]
    assert any("overrides call of Dense" in m for m in messages)  # says why


class _DoubledKernel(keras.layers.Dense):
    @property
    def kernel(self):  # call, inherited, reads this
        return super().kernel * 2.0


class _ScaledTable(keras.layers.Embedding):
    @property
    def embeddings(self):
        return super().embeddings * 3.0


class _PadsTheFuture(keras.layers.Conv1D):
    def _compute_causal_padding(self):
        return [[0, 0], [0, (self.kernel_size[0] - 1) * self.dilation_rate[0]], [0, 0]]


class _HalfForget(keras.layers.LSTMCell):
    def _compute_carry_and_output_fused(self, z, c_tm1):
        z0, z1, z2, z3 = z
        return super()._compute_carry_and_output_fused((z0, z1 * 0.5, z2, z3), c_tm1)


def test_subclasses_redefining_what_the_inherited_call_reads_fall_back_exactly(rng):
    # Each inherits call, which reads a property or calls a helper the subclass redefines: a closed form
    # of the base class would compute the base class's layer.
    keras.utils.set_random_seed(0)
    tokens = keras.Input((6,), dtype="int32")
    h = _PadsTheFuture(4, 3, padding="causal")(_ScaledTable(20, 5)(tokens))
    h = keras.layers.RNN(_HalfForget(3))(h)
    model = keras.Model(tokens, keras.layers.Dense(2)(_DoubledKernel(4)(h)))
    x, y = rng.integers(0, 20, (5, 6)).astype("int32"), rng.normal(size=(5, 2)).astype("float32")
    with pytest.warns(UserWarning, match="no closed form") as caught:
        _check(model, "mse", x, y, closed_form=False)
    said = " ".join(str(w.message) for w in caught)
    for redefined in ("kernel", "embeddings", "_compute_causal_padding", "_compute_carry_and_output_fused"):
        assert redefined in said


class _ReadsAnotherLayersKernel(keras.layers.Layer):
    def __init__(self, dense, **kwargs):
        super().__init__(**kwargs)
        self.dense = dense

    def call(self, x):
        return keras.ops.matmul(x, keras.ops.transpose(self.dense.kernel))


def test_what_per_example_norms_cannot_see_is_refused_with_what_to_do(rng):
    x, y = np.ones((3, 4), "float32"), np.ones((3, 2), "float32")
    model = keras.Sequential([keras.Input((4,)), keras.layers.BatchNormalization(), keras.layers.Dense(2)])
    with pytest.raises(ValueError, match="LayerNormalization or GroupNormalization"):
        effgrad.per_example_norms(model, "mse", x, y)
    wrapped = keras.Sequential([keras.Input((4,)), effgrad.Checkpoint(keras.layers.Dense(3)), keras.layers.Dense(2)])
    with pytest.raises(ValueError, match="without checkpointing"):
        effgrad.per_example_norms(wrapped, "mse", x, y)
    stateful = keras.Sequential([keras.Input((2, 2), batch_size=3), keras.layers.LSTM(2, stateful=True)])
    with pytest.raises(ValueError, match="stateful=False"):
        effgrad.per_example_norms(stateful, "mse", x.reshape(3, 2, 2), y)
    dense = keras.layers.Dense(4)
    inputs = keras.Input((4,))
    tied = keras.Model(inputs, _ReadsAnotherLayersKernel(dense)(dense(inputs)))  # dense's kernel, used twice
    with pytest.raises(ValueError, match="dense.*kernel.*call of the layer that owns it"):
        effgrad.per_example_norms(tied, "mse", x, np.ones((3, 4), "float32"))


def test_norms_are_traced_once_per_signature_build_an_unbuilt_model_and_do_not_keep_it(rng):
    traces = []

    def loss(y, y_pred):  # runs while tracing only
        traces.append(1)
        return keras.losses.mean_squared_error(y, y_pred)

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(2)])  # not built
    x, y = rng.normal(size=(9, 3)).astype("float32"), rng.normal(size=(9, 2)).astype("float32")
    first = effgrad.per_example_norms(model, loss, x[:4], y[:4]).numpy()
    effgrad.per_example_norms(model, loss, x[:7], y[:7])  # a second batch size: traced once more, for any size
    traced = len(traces)
    for rows in (4, 9, 5, 6, 8, 3):  # TensorFlow warns after 5 retraces
        effgrad.per_example_norms(model, loss, x[:rows], y[:rows])
    assert len(traces) == traced
    np.testing.assert_allclose(first, per_example_norms_naive(model, loss, x[:4], y[:4]), rtol=1e-5)
    gone = weakref.ref(model)
    del model
    gc.collect()
    assert gone() is None  # the cached function lives and dies with the model
