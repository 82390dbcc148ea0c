"""Keras and keras_hub attention layers routed to effgrad.attention train exactly as with their own attention."""

import logging
import types

import keras
import keras_hub
import numpy as np
import pytest
import tensorflow as tf

import effgrad
from helpers import plain_step

MODES = {
    "eager": lambda f: f,
    "function": lambda f: tf.function(f, autograph=False),
    "xla": lambda f: tf.function(f, jit_compile=True, autograph=False),
}


def assert_all_close(actual, expected, rtol=1e-5):
    """Relative 1e-5, with the absolute floor at 1e-5 of the result's largest value (a gradient that is
    exactly zero, e.g. of a key projection's bias, is computed as rounding noise both ways)."""
    actual, expected = [np.asarray(tf.convert_to_tensor(a)) for a in actual], [np.asarray(e) for e in expected]
    scale = max(float(np.abs(e).max()) for e in expected)
    assert len(actual) == len(expected)
    for i, (a, e) in enumerate(zip(actual, expected)):
        np.testing.assert_allclose(a, e, rtol=rtol, atol=rtol * scale, err_msg=f"item {i}")


def _value_and_grads(model, inputs, call, weights):
    with tf.GradientTape() as tape:
        tape.watch(inputs)
        out = call(*inputs)
        loss = tf.reduce_sum(out * weights)
    grads = tape.gradient(loss, [*model.trainable_variables, *inputs])
    return [out, *[tf.convert_to_tensor(g) for g in grads if g is not None]]


def _both(model, inputs, call, weights, mode="eager", routing_mode=True):
    """(routed, own): the same computation run (in ``mode``) inside an efficient_attention block, and eagerly
    outside it (the reference: tracing it too would only cost time)."""
    with effgrad.efficient_attention(model, routing_mode) as routing:
        routed = MODES[mode](lambda *x: _value_and_grads(model, list(x), call, weights))(*inputs)
    own = _value_and_grads(model, list(inputs), call, weights)
    return routed, own, routing


# --------------------------------------------------------------- keras.layers.MultiHeadAttention
def _padding(batch, length, pad):
    keep = np.ones((batch, length), bool)
    keep[1, length - pad :] = False
    return keep


MHA_CASES = {
    # padded queries see no key at all: Keras's dot-product path gives them the mean of the values
    "padding": dict(t=13, s=13, kwargs=lambda q, s: {"attention_mask": q[:, :, None] & s[:, None, :]}),
    "causal": dict(t=13, s=13, kwargs=lambda q, s: {"use_causal_mask": True}),
    "causal_and_padding": dict(
        t=13, s=13, kwargs=lambda q, s: {"attention_mask": s[:, None, :], "use_causal_mask": True}
    ),
    "cross": dict(t=9, s=14, kwargs=lambda q, s: {"attention_mask": np.broadcast_to(s[:, None, :], (2, 9, 14))}),
}


# (The kernel itself is compared under XLA in test_attention.py.)
MHA_RUNS = [("padding", "eager"), ("causal", "function"), ("cross", "eager"), ("causal_and_padding", "function")]


@pytest.mark.parametrize("name, mode", MHA_RUNS)
def test_multi_head_attention_equals_its_own_computation(name, mode):
    case, rng = MHA_CASES[name], np.random.default_rng(0)
    keras.utils.set_random_seed(0)
    layer = keras.layers.MultiHeadAttention(num_heads=4, key_dim=8, value_dim=6)
    query = tf.constant(rng.normal(size=(2, case["t"], 16)), tf.float32)
    value = tf.constant(rng.normal(size=(2, case["s"], 12)), tf.float32)
    layer(query, value)
    kwargs = case["kwargs"](_padding(2, case["t"], 3), _padding(2, case["s"], 4))
    kwargs = {k: tf.constant(v) if isinstance(v, np.ndarray) else v for k, v in kwargs.items()}
    weights = tf.constant(rng.normal(size=(2, case["t"], 16)), tf.float32)

    def call(q, v):
        return layer(q, v, training=True, **kwargs)

    routed, own, routing = _both(layer, [query, value], call, weights, mode)
    assert routing.applied, routing.reason
    assert_all_close(routed, own)


def test_dropout_on_the_probabilities_is_routed_with_the_layers_own_seed_generator():
    """Keras's dropout path (masked Softmax, Dropout layer): effgrad draws its own mask per block, from the
    layer's SeedGenerator advanced exactly as Keras advances it; inference calls keep Keras's path."""
    keras.utils.set_random_seed(0)
    layer = keras.layers.MultiHeadAttention(num_heads=2, key_dim=8, dropout=0.5)
    x = tf.random.normal([2, 16, 8])
    plain = layer(x, x)  # inference: no dropout
    before = [v.numpy() for v in layer.non_trainable_variables]  # the seed generator's state
    with effgrad.efficient_attention(layer) as routing:
        inference = layer(x, x, training=False)
        assert not routing.decisions  # an inference call is not routed
        dropped = layer(x, x, training=True)
    assert routing.applied
    after_routed = [v.numpy() for v in layer.non_trainable_variables]
    for variable, value in zip(layer.non_trainable_variables, before):
        variable.assign(value)
    layer(x, x, training=True)  # Keras's own dropout
    after_own = [v.numpy() for v in layer.non_trainable_variables]
    assert any(not np.array_equal(a, b) for a, b in zip(after_own, before))
    for a, b in zip(after_routed, after_own):
        np.testing.assert_array_equal(a, b)  # the generator advanced as Keras advances it
    np.testing.assert_array_equal(inference, plain)
    assert not np.allclose(dropped, plain)
    assert "_compute_attention" not in vars(layer)  # nothing left on the layer


# --------------------------------------------------------------- keras_hub's own attention layers
def _backbone(kind):
    keras.utils.set_random_seed(0)
    common = dict(vocabulary_size=40, num_layers=1, num_query_heads=4, num_key_value_heads=2, hidden_dim=16)
    common["intermediate_dim"] = 32
    if kind == "llama":
        return keras_hub.models.LlamaBackbone(**common)
    if kind == "mistral":
        return keras_hub.models.MistralBackbone(**common, sliding_window=5)
    if kind == "qwen_sliding_window":
        return keras_hub.models.QwenBackbone(**common, use_sliding_window_attention=True, sliding_window_size=5)
    return keras_hub.models.GemmaBackbone(  # Gemma 2's soft cap, its sliding window, grouped heads
        **common, head_dim=8, attention_logit_soft_cap=2.0, use_sliding_window_attention=True, sliding_window_size=5
    )


# (Llama: its whole LM step below.)
@pytest.mark.parametrize("kind", ["mistral", "qwen_sliding_window", "gemma_soft_cap"])
def test_keras_hub_attention_layers_equal_their_own_computation(kind):
    model, rng = _backbone(kind), np.random.default_rng(1)
    tokens = tf.constant(rng.integers(1, 40, (2, 12)), tf.int32)
    padding = tf.constant(_padding(2, 12, 4).astype("int32"))
    weights = tf.constant(rng.normal(size=(2, 12, 16)), tf.float32) * tf.cast(padding[..., None], tf.float32)

    def call():
        return model({"token_ids": tokens, "padding_mask": padding}, training=True)

    routed, own, routing = _both(model, [], call, weights, "eager")
    assert routing.applied and all(routed for routed, _ in routing.decisions.values()), routing.reason
    assert_all_close(routed, own)


# --------------------------------------------------------------- whole train steps
def _lm_batch(vocabulary, batch=4, length=16, seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, vocabulary, (batch, length)).astype("int32")
    padding = np.ones((batch, length), "int32")
    padding[1, -5:] = 0
    x = {"token_ids": tf.constant(tokens), "padding_mask": tf.constant(padding)}
    return x, tf.constant(np.roll(tokens, -1, axis=1)), tf.constant(padding.astype("float32"))


_LM_LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _train(model, **options):
    """One effgrad step on :func:`_lm_batch`: the step and the weights after it."""
    step = effgrad.build_train_step(model, _LM_LOSS, keras.optimizers.Adam(1e-2), **options)
    step(*_lm_batch(50))
    return step, [v.numpy() for v in model.trainable_variables]


def _unpatched(model):
    """The weights after the same update as a plain GradientTape step, with Keras's own attention: an eager
    run (a second traced effgrad step would cost several times more)."""
    plain_step(model, _LM_LOSS.call, keras.optimizers.Adam(1e-2), *_lm_batch(50))
    return [v.numpy() for v in model.trainable_variables]


def _gpt2_lm():
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=50, num_layers=1, num_heads=2, hidden_dim=16, intermediate_dim=32, max_sequence_length=16,
        dropout=0.0,
    )  # fmt: skip
    return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)


@pytest.mark.slow
def test_gpt2_lm_step_equals_the_unpatched_step_also_with_the_fused_loss_and_checkpointing():
    """The unpatched step against the routed one composed with the fused loss and effgrad's checkpointing."""
    plain = _unpatched(_gpt2_lm())
    step, routed = _train(effgrad.checkpoint_model(_gpt2_lm(), segments=2), attention=True, fused_loss=True)
    assert step.attention and step.fused_loss, step.attention_reason
    assert "transformer_layer_0/self_attention" in step.attention_reason
    assert_all_close(routed, plain)


def _llama_lm():
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=50, num_layers=1, num_query_heads=4, num_key_value_heads=2, hidden_dim=16, intermediate_dim=32
    )
    return keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)


@pytest.mark.slow
def test_llama_lm_step_equals_the_unpatched_step():
    """Grouped-query attention (keras_hub repeats the key/value heads before its attention)."""
    plain = _unpatched(_llama_lm())
    step, routed = _train(_llama_lm(), attention=True)
    assert step.attention, step.attention_reason
    assert_all_close(routed, plain)


def _attention_classifier(length=12, causal=True):
    tokens = keras.Input((length,), dtype="int32")
    h = keras.layers.Embedding(30, 16)(tokens)
    h = keras.layers.MultiHeadAttention(num_heads=4, key_dim=8)(h, h, use_causal_mask=causal)
    return keras.Model(tokens, keras.layers.Dense(30)(h))


def test_mirrored_strategy_step_equals_one_device(strategy):
    rng = np.random.default_rng(0)
    x = tf.constant(rng.integers(0, 30, (8, 12)), tf.int32)
    y = tf.constant(rng.integers(0, 30, (8, 12)), tf.int32)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    keras.utils.set_random_seed(0)
    single = _attention_classifier()
    plain_step(single, loss.call, keras.optimizers.SGD(0.5), x, y)  # one device, Keras's own attention
    keras.utils.set_random_seed(0)
    with strategy.scope():
        mirrored = _attention_classifier()
        optimizer = keras.optimizers.SGD(0.5)
    step = effgrad.build_train_step(mirrored, loss, optimizer, attention=True, strategy=strategy)
    step(x, y)
    assert step.attention, step.attention_reason
    for a, b in zip(mirrored.trainable_variables, single.trainable_variables):
        for replica in strategy.experimental_local_results(a.value):
            np.testing.assert_allclose(replica, b.numpy(), rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------- what is not routed, and why
class OwnAttention(keras.layers.MultiHeadAttention):
    def _compute_attention(self, *args, **kwargs):
        return super()._compute_attention(*args, **kwargs)


class TwoAttentions(keras.Model):
    """One layer that overrides _compute_attention, one called with return_attention_scores=True."""

    def __init__(self):
        super().__init__()
        self.own = OwnAttention(num_heads=2, key_dim=8)
        self.scores = keras.layers.MultiHeadAttention(num_heads=2, key_dim=8)

    def call(self, x, training=None):
        return self.own(x, x, training=training) + self.scores(x, x, training=training, return_attention_scores=True)[0]


def test_a_layer_it_cannot_prove_equal_keeps_its_own_path_and_says_why(caplog):
    keras.utils.set_random_seed(0)
    x = tf.random.normal([2, 8, 16])
    model = TwoAttentions()
    expected = model(x, training=True)
    with caplog.at_level(logging.INFO, logger="effgrad"):
        with effgrad.efficient_attention(model, "auto") as routing:
            np.testing.assert_array_equal(model(x, training=True), expected)
            model(x, training=True)
    assert not routing.applied
    assert "overrides _compute_attention" in routing.decisions[model.own.path][1]
    assert "returns its attention scores" in routing.decisions[model.scores.path][1]
    said = [r.getMessage() for r in caplog.records if "own attention" in r.getMessage()]
    assert len(said) == 2, said  # once per layer, though called twice
    with pytest.raises(ValueError, match="overrides _compute_attention") as err:
        effgrad.build_train_step(model, "mse", keras.optimizers.SGD(), attention=True)(x, x)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="returns its attention scores") as err:
        with effgrad.efficient_attention(model.scores):
            model.scores(x, x, training=True, return_attention_scores=True)
    assert "\n" not in str(err.value)


_KERAS_ATTENTION = keras.layers.MultiHeadAttention._compute_attention


def _scaled_queries(self, query, key, value, *args, **kwargs):
    # a user's (or a library's) patch: queries scaled up, then Keras's own computation
    return _KERAS_ATTENTION(self, query * 3.0, key, value, *args, **kwargs)


@pytest.mark.parametrize("where", ["instance", "class"])
def test_a_patched_attention_method_is_not_replaced_by_the_kernel(where, monkeypatch):
    x = np.random.default_rng(0).normal(size=(2, 64, 16)).astype("float32")
    losses, steps = [], []
    for mode in ("auto", False):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((64, 16))
        layer = keras.layers.MultiHeadAttention(2, 8)
        model = keras.Model(inputs, layer(inputs, inputs, use_causal_mask=True))
        with monkeypatch.context() as patch:
            if where == "instance":
                patch.setattr(layer, "_compute_attention", types.MethodType(_scaled_queries, layer), raising=False)
            else:
                patch.setattr(keras.layers.MultiHeadAttention, "_compute_attention", _scaled_queries)
            steps.append(effgrad.build_train_step(model, "mse", keras.optimizers.SGD(0.1), attention=mode))
            losses.append(float(steps[-1](x, x)["loss"]))
    assert steps[0].attention is False
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)


def test_auto_decides_from_the_layers_shapes():
    """ "auto": a layer whose scores weigh less than its q, k, v and output keeps its path (short sequences)."""
    for length, applied, words in ((8, False, "weigh less"), (64, True, "outweigh")):
        model = _attention_classifier(length)
        with effgrad.efficient_attention(model, "auto") as routing:
            model(tf.zeros([2, length], tf.int32), training=True)
        assert routing.decisions and routing.applied is applied and words in routing.reason, routing.reason


def test_attach_routes_fit_by_default_and_bad_options_get_one_line_errors():
    model = _attention_classifier(32)  # 4 heads of 8: the scores (4 x 32 x 32) weigh as much as q, k, v, output
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    effgrad.attach(model)  # attention="auto"
    model.fit(np.zeros((4, 32), "int32"), np.zeros((4, 32), "int32"), epochs=1, verbose=0)
    assert model.effgrad_step.attention and "outweigh" in model.effgrad_step.attention_reason
    plain = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    for bad, words in (("yes", "True, False"), (True, "no attention layer")):
        with pytest.raises(ValueError, match=words) as err:
            effgrad.build_train_step(plain, "mse", keras.optimizers.SGD(), attention=bad)
        assert "\n" not in str(err.value)
