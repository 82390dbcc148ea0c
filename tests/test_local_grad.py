"""Weight gradients made from the uses' output gradients equal the tape's, and the finiteness bound is sound."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from effgrad.train import local_grad


def _shared_twice():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    shared = keras.layers.Dense(6, activation="tanh")
    return keras.Model(inputs, keras.layers.Dense(2)(shared(shared(inputs))))  # the trap: one layer in sequence


def _tied_tokens():
    keras.utils.set_random_seed(0)
    import keras_hub

    tokens = keras.Input((5,), dtype="int32")
    embedding = keras_hub.layers.ReversibleEmbedding(11, 4)
    h = keras.layers.LayerNormalization()(embedding(tokens))
    h = keras.layers.EinsumDense("btd,de->bte", output_shape=(None, 4), activation="relu")(h)
    return keras.Model(tokens, embedding(h, reverse=True))  # tied table: a gather and a matmul


def _conv():
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((6, 6, 2)),
            keras.layers.Conv2D(3, 3, padding="same", activation="relu"),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(2),
        ]  # fmt: skip
    )


MODELS = {
    "shared-layer": (_shared_twice, lambda rng: rng.normal(size=(4, 6)).astype("float32")),
    "tied-embedding-einsum-norm": (_tied_tokens, lambda rng: rng.integers(0, 11, size=(3, 5)).astype("int32")),
    "conv": (_conv, lambda rng: rng.normal(size=(2, 6, 6, 2)).astype("float32")),
}


def _local_and_tape(model, x):
    variables = model.trainable_variables

    @tf.function
    def grads(x):
        graph = tf.compat.v1.get_default_graph()
        known = len(graph.get_operations())
        with tf.GradientTape(persistent=True) as tape:
            loss = tf.reduce_sum(tf.sin(model(x)))
        uses = local_grad.uses_of(graph.get_operations()[known:], variables)
        assert uses is not None and all(uses)
        outputs = list({id(u.output): u.output for us in uses for u in us}.values())
        dz = dict(zip(map(id, outputs), tape.gradient(loss, outputs)))
        made = [local_grad.weight_gradient(us, dz) for us in uses]
        return made, [tf.convert_to_tensor(g) for g in tape.gradient(loss, variables)]

    return grads(x)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_weight_gradients_from_the_uses_equal_the_tape(rng, name):
    make, data = MODELS[name]
    made, reference = _local_and_tape(make(), data(rng))
    for a, b in zip(made, reference):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-6)


def test_mixed_precision_views_are_followed_back_to_the_float32_variable(rng):
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        made, reference = _local_and_tape(_shared_twice(), rng.normal(size=(4, 6)).astype("float32"))
    finally:
        keras.mixed_precision.set_global_policy("float32")
    for a, b in zip(made, reference):
        assert a.dtype == tf.float32
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-3, atol=1e-4)


def _bound(x, dz, dtype=tf.float32):
    w = tf.Variable(tf.ones([x.shape[1], dz.shape[1]], dtype))

    @tf.function
    def run(x, dz):
        graph = tf.compat.v1.get_default_graph()
        known = len(graph.get_operations())
        z = tf.matmul(tf.cast(x, dtype), w)
        (uses,) = local_grad.uses_of(graph.get_operations()[known:], [w])
        made = tf.matmul(tf.cast(x, dtype), tf.cast(dz, dtype), transpose_a=True)
        exact = tf.math.is_finite(tf.reduce_sum(tf.cast(made, tf.float32)))
        return local_grad.finite_bound(uses, {id(z): tf.cast(dz, dtype)}, int(np.prod(w.shape))), exact

    bound, exact = run(tf.constant(x, tf.float32), tf.constant(dz, tf.float32))
    return bool(bound), bool(exact)


def test_the_bound_never_calls_a_non_finite_gradient_finite():
    ones = np.ones((4, 3), "float32")
    assert _bound(ones, ones) == (True, True)  # the usual case: no weight gradient made
    huge = np.full((4, 3), 1e20, "float32")
    assert _bound(huge, huge) == (False, False)  # 4e40 overflows: made and found non-finite
    apart = np.ones((2, 3), "float32")
    apart[0], dz = 1e30, np.ones((2, 3), "float32")
    dz[1] = 1e30  # the large numbers never meet: the bound cannot tell, the made gradient (2e30) is finite
    assert _bound(apart, dz) == (False, True)
    inf = ones.copy()
    inf[1, 1] = np.inf
    assert _bound(inf, ones)[0] is False
    # float16: 64 rows of 100 x 100 = 640,000 overflows float16's 65,504 though every input is small
    small = np.full((64, 3), 100.0, "float32")
    assert _bound(small, small, tf.float16) == (False, False)
