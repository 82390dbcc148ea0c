"""effgrad.attention equals the plain computation (forward and every gradient) and never makes the scores."""

import json
import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf

import effgrad
from effgrad.attention import dropout_keep_mask
from helpers import bytes_left_after, in_fresh_processes

MODES = {
    "eager": lambda f: f,
    "function": lambda f: tf.function(f, autograph=False),
    "xla": lambda f: tf.function(f, jit_compile=True, autograph=False),
}

# Lengths 21 and 30 with blocks of 8: neither divides; causal, causal with a mask (rows that see no key at
# all), grouped-query with key padding, soft cap, one query and one key.
CASES = {
    "causal": dict(t=21, s=21, heads=4, kv_heads=4, causal=True),
    "causal_and_mask": dict(t=21, s=21, heads=4, kv_heads=4, causal=True, mask="full"),
    "grouped_query": dict(t=21, s=30, heads=4, kv_heads=2, causal=True, mask="keys"),
    "soft_cap": dict(t=21, s=21, heads=2, kv_heads=1, soft_cap=2.0, mask="full"),
    "length_1": dict(t=1, s=1, heads=2, kv_heads=2),
    # Under XLA (a compile takes seconds): every feature at once.
    "everything": dict(t=21, s=30, heads=4, kv_heads=2, causal=True, soft_cap=2.0, mask="full"),
}


def _inputs(t, s, heads, kv_heads, mask=None, depth=8, batch=2, seed=0, **_):
    rng = np.random.default_rng(seed)
    q = tf.constant(rng.normal(size=(batch, t, heads, depth)), tf.float32)
    k = tf.constant(rng.normal(size=(batch, s, kv_heads, depth)), tf.float32)
    v = tf.constant(rng.normal(size=(batch, s, kv_heads, depth + 2)), tf.float32)
    w = tf.constant(rng.normal(size=(batch, t, heads, depth + 2)), tf.float32)
    if mask == "keys":
        keys = np.ones((batch, 1, 1, s), bool)
        keys[1, ..., -max(1, s // 4) :] = False
        mask = tf.constant(keys)
    elif mask == "full":
        full = rng.random((batch, 1, t, s)) > 0.4
        full[0, 0, 3] = False  # a query row that sees no key
        mask = tf.constant(full)
    return q, k, v, w, mask


def _plain(q, k, v, mask=None, causal=False, soft_cap=None, keep=None, rate=0.0):
    """The textbook computation: scores, (soft cap), mask, softmax, (dropout), values."""
    groups = q.shape[2] // k.shape[2]
    k, v = tf.repeat(k, groups, axis=2), tf.repeat(v, groups, axis=2)
    scores = tf.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(q.shape[-1])
    if soft_cap is not None:
        scores = soft_cap * tf.tanh(scores / soft_cap)
    allowed = tf.ones_like(scores, tf.bool)
    if mask is not None:
        allowed &= mask
    if causal:
        allowed &= tf.linalg.band_part(tf.ones(scores.shape[2:], tf.bool), -1, 0)
    probs = tf.nn.softmax(tf.where(allowed, scores, -1e30), axis=-1)  # a row with no key: uniform, as Keras
    if keep is not None:
        probs = tf.where(keep, probs / (1 - rate), 0.0)
    return tf.einsum("bnts,bsnh->btnh", probs, v)


def _reference(case, q, k, v, mask):
    """Keras's own attention where it has the feature (it ignores a soft cap on TensorFlow), else the plain one."""
    if case.get("soft_cap"):
        return _plain(q, k, v, mask, case.get("causal", False), case["soft_cap"])
    groups = q.shape[2] // k.shape[2]
    k, v = tf.repeat(k, groups, axis=2), tf.repeat(v, groups, axis=2)
    return keras.ops.dot_product_attention(q, k, v, mask=mask, is_causal=case.get("causal", False))


def _value_and_grads(fn, q, k, v, w):
    with tf.GradientTape() as tape:
        tape.watch([q, k, v])
        out = fn(q, k, v)
        loss = tf.reduce_sum(out * w)
    return [out, *tape.gradient(loss, [q, k, v])]


def assert_all_close(actual, expected, rtol=1e-5):
    """Relative 1e-5, elementwise, with the absolute floor at 1e-5 of the largest value of the whole result
    (an exactly-zero gradient, e.g. of a single key's scores, is computed as rounding noise)."""
    scale = max(float(np.abs(np.asarray(e)).max()) for e in expected)
    for i, (a, e) in enumerate(zip(actual, expected)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=rtol, atol=rtol * scale, err_msg=f"item {i}")


# Each feature in eager (the custom gradient's eager path) and in a graph; all of them at once under XLA
# (a compile takes seconds).
COMPILED = [(n, "eager") for n in ("causal_and_mask", "length_1", "everything")]
COMPILED += [(n, "function") for n in ("causal", "grouped_query", "soft_cap")]
COMPILED += [pytest.param("everything", "xla", marks=pytest.mark.slow)]


@pytest.mark.parametrize("name, mode", COMPILED)
def test_equals_the_plain_computation_forward_and_gradients(name, mode):
    case = CASES[name]
    q, k, v, w, mask = _inputs(**case)
    kwargs = {key: case[key] for key in ("causal", "soft_cap") if key in case}

    def ours(q, k, v):
        return _value_and_grads(lambda *a: effgrad.attention(*a, mask=mask, block_size=8, **kwargs), q, k, v, w)

    # The reference runs eagerly whatever the mode: tracing (and compiling) it too would only cost time.
    reference = _value_and_grads(lambda *a: _reference(case, *a, mask), q, k, v, w)
    assert_all_close(MODES[mode](ours)(q, k, v), reference)


@pytest.mark.parametrize("mode", ["function"])
def test_dropout_equals_the_plain_computation_with_the_same_mask(mode):
    """The keep mask is drawn per block from (seed, block): the backward pass redraws the forward's."""
    q, k, v, w, mask = _inputs(t=21, s=30, heads=4, kv_heads=2, mask="keys")  # every row sees a key
    rate = 0.3

    def attend(q, k, v):
        return effgrad.attention(q, k, v, mask=mask, causal=True, dropout_rate=rate, seed=7, block_size=8)

    def ours(q, k, v):
        return _value_and_grads(attend, q, k, v, w)

    # The mask and the reference eagerly (a graph draws the same bits: the next test): a traced mask is
    # one Python loop step per block.
    keep = dropout_keep_mask(q, k, v, dropout_rate=rate, seed=7, block_size=8)
    plain = _value_and_grads(lambda *a: _plain(*a, mask=mask, causal=True, keep=keep, rate=rate), q, k, v, w)
    assert_all_close(MODES[mode](ours)(q, k, v), plain)


def test_dropout_draws_the_same_mask_in_eager_graph_and_xla():
    """(TensorFlow's stateless Philox ops draw other bits under XLA: the kernel hashes its own.)"""
    q, k, v, _, _ = _inputs(t=21, s=30, heads=4, kv_heads=2)
    seed = tf.constant([5, 9], tf.int64)  # a tensor, as a SeedGenerator gives: nothing is constant-folded

    def draw(q, k, v, seed):
        return dropout_keep_mask(q, k, v, dropout_rate=0.5, seed=seed, block_size=8)

    eager = draw(q, k, v, seed)
    for mode in ("function", "xla"):
        np.testing.assert_array_equal(MODES[mode](draw)(q, k, v, seed), eager)


def test_dropout_keeps_the_right_share_and_changes_with_the_seed():
    q, k, v, _, _ = _inputs(t=96, s=128, heads=4, kv_heads=4, batch=4)
    keep = dropout_keep_mask(q, k, v, dropout_rate=0.25, seed=3)
    assert keep.shape == (4, 4, 96, 128)
    assert abs(float(tf.reduce_mean(tf.cast(keep, tf.float32))) - 0.75) < 0.01
    again = dropout_keep_mask(q, k, v, dropout_rate=0.25, seed=3)
    other = dropout_keep_mask(q, k, v, dropout_rate=0.25, seed=4)
    assert bool(tf.reduce_all(keep == again)) and not bool(tf.reduce_all(keep == other))
    out = effgrad.attention(q, k, v, dropout_rate=0.25, seed=3)
    assert not np.allclose(out, effgrad.attention(q, k, v))  # dropout did something


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_float64_inputs_equal_the_plain_computation_in_float64(mode):
    case = CASES["causal_and_mask"]
    q, k, v, w, mask = _inputs(**case)
    q, k, v, w = (tf.cast(t, tf.float64) for t in (q, k, v, w))

    def ours(q, k, v):
        return _value_and_grads(lambda *a: effgrad.attention(*a, mask=mask, causal=True, block_size=8), q, k, v, w)

    # The plain computation in float64 (keras.ops.dot_product_attention rounds float64 to float32 on TF).
    reference = _value_and_grads(lambda *a: _plain(*a, mask, causal=True), q, k, v, w)
    result = MODES[mode](ours)(q, k, v)
    assert all(t.dtype == tf.float64 for t in result)
    assert_all_close(result, reference, rtol=1e-9)


def test_half_precision_inputs_accumulate_in_float32():
    q, k, v, _, mask = _inputs(t=40, s=40, heads=2, kv_heads=2, mask="keys")
    out = effgrad.attention(*(tf.cast(x, tf.bfloat16) for x in (q, k, v)), mask=mask, causal=True)
    assert out.dtype == tf.bfloat16
    exact = _plain(q, k, v, mask, causal=True)
    rounded = _plain(*(tf.cast(tf.cast(x, tf.bfloat16), tf.float32) for x in (q, k, v)), mask, causal=True)
    # Only the inputs' and the output's rounding: no error of its own beyond bfloat16's.
    np.testing.assert_allclose(tf.cast(out, tf.float32), rounded, atol=2e-2)
    assert float(tf.reduce_max(tf.abs(tf.cast(out, tf.float32) - exact))) < 0.1


BAD = [
    (dict(query=tf.zeros([2, 5, 8])), "rank 4"),
    (dict(key=tf.zeros([2, 5, 3, 8]), value=tf.zeros([2, 5, 3, 8])), "multiple of key/value heads"),
    (dict(key=tf.zeros([2, 5, 2, 4])), "depths differ"),
    (dict(value=tf.zeros([2, 6, 2, 8])), "same length"),
    (dict(mask=tf.ones([2, 1, 4, 5], tf.bool)), "broadcast"),
    (dict(mask=tf.ones([2, 5, 5])), "boolean"),
    (dict(dropout_rate=0.1), "seed"),
    (dict(dropout_rate=1.0, seed=1), "dropout_rate"),
    (dict(block_size=0), "block_size"),
    (dict(soft_cap=-1.0), "soft_cap"),
    (dict(key=tf.zeros([2, 0, 2, 8]), value=tf.zeros([2, 0, 2, 8])), "at least 1"),
]


@pytest.mark.parametrize("changes, words", BAD, ids=[w for _, w in BAD])
def test_bad_input_gets_a_one_line_error(changes, words):
    args = {"query": tf.zeros([2, 5, 4, 8]), "key": tf.zeros([2, 5, 2, 8]), "value": tf.zeros([2, 5, 2, 8])}
    args.update(changes)
    with pytest.raises(ValueError, match=words) as err:
        effgrad.attention(args.pop("query"), args.pop("key"), args.pop("value"), **args)
    assert "\n" not in str(err.value)


_MEMORY = textwrap.dedent(
    """
    import json, sys
    import effgrad, tensorflow as tf
    t = int(sys.argv[1])
    q, k, v = (tf.random.normal([1, t, 4, 16]) for _ in range(3))

    @tf.function
    def step(q, k, v):
        with tf.GradientTape() as tape:
            tape.watch([q, k, v])
            out = effgrad.attention(q, k, v, causal=True)
            loss = tf.reduce_sum(out * out)
        return tf.add_n([tf.reduce_sum(g) for g in tape.gradient(loss, [q, k, v])])

    step(q, k, v)
    print("@@" + json.dumps(effgrad.memory.measure(step, q, k, v).extra_bytes))
    """
)


@pytest.mark.slow
def test_the_scores_never_exist_memory_grows_linearly_in_length():
    extra = in_fresh_processes(_MEMORY, {t: [t] for t in (1024, 2048)})
    scores = 4 * 2048 * 2048 * 4  # [1, 4, T, T] float32: what the plain computation keeps at T = 2048
    assert extra[2048] < 0.1 * scores, json.dumps(extra)
    # Linear: doubling T about doubles the peak (quadratic would quadruple it).
    assert extra[2048] < 2.8 * extra[1024], json.dumps(extra)


def test_a_deleted_model_with_routed_attention_frees_its_weights():
    # The kernel's loops are traced once per shape for every layer; traced inside the first step's graph,
    # the cached trace would keep that graph, and the model's weights, alive. (Shapes of this test only:
    # a shape traced by an earlier test would not be traced here.)
    width = 1536

    def trained():
        inputs = keras.Input((11, 40))
        attended = keras.layers.MultiHeadAttention(2, 20)(inputs, inputs)
        model = keras.Model(inputs, keras.layers.Dense(width)(keras.layers.Flatten()(attended)))
        step = effgrad.build_train_step(model, "mse", keras.optimizers.SGD(0.1), attention=True)
        step(tf.ones((4, 11, 40)), tf.zeros((4, width)))
        assert step.attention
        return model, step

    assert bytes_left_after(trained) < 11 * 40 * width * 4 / 4
