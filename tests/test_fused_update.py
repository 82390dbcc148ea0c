"""fused_update: each variable's update as backprop makes its gradient, the same update as the gathered step."""

import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf

import effgrad
from conftest import assert_variables_close
from effgrad.train import fused_update
from helpers import bytes_left_after, in_fresh_processes, mlp, plain_step, tiny_gpt2_lm


def _masked_model(seed=0):
    keras.utils.set_random_seed(seed)
    tokens = keras.Input((None,), dtype="int32")
    h = keras.layers.Embedding(9, 6, mask_zero=True)(tokens)
    h = keras.layers.Dense(6, activation="tanh", kernel_regularizer=keras.regularizers.L2(0.01))(h)
    return keras.Model(tokens, keras.layers.Dense(4)(h))


def _bn_dropout_model(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((5,)),
            keras.layers.Dense(8, kernel_regularizer=keras.regularizers.L2(0.05)),
            keras.layers.BatchNormalization(),
            keras.layers.Dropout(0.3),
            keras.layers.Dense(3),
        ]
    )


def _shared_layer_model(seed=0):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((5,))
    shared = keras.layers.Dense(5, activation="tanh")
    return keras.Model(inputs, keras.layers.Dense(3)(shared(shared(inputs))))  # one weight, two uses in sequence


def _tied_embedding_model(seed=0, counter=None):
    import keras_hub

    keras.utils.set_random_seed(seed)
    tokens = keras.Input((None,), dtype="int32")
    embedding = keras_hub.layers.ReversibleEmbedding(9, 6)
    h = keras.layers.Dense(6, activation="tanh")(embedding(tokens))
    h = h if counter is None else counter(h)
    return keras.Model(tokens, embedding(h, reverse=True))  # one table: a gather and a matmul


def _state(model, optimizer):
    return [v.numpy().copy() for v in [*model.variables, *optimizer.variables]]


def _run(fused, make, optimizer, batches, jit_compile, seed_offset=0, **options):
    model, opt = make(), optimizer()
    keras.utils.set_random_seed(1 + seed_offset)  # the same dropout draws for both steps
    step = effgrad.build_train_step(
        model, options.pop("loss", "mse"), opt, fused_update=fused, jit_compile=jit_compile, **options
    )
    logs = [step(*batch) for batch in batches]
    assert step.fused_update is fused
    return model, opt, logs


CASES = {
    "adam-weights-bn-dropout-l2": (_bn_dropout_model, lambda: keras.optimizers.Adam(0.05), {}, "dense"),
    "sgd-clip": (mlp, lambda: keras.optimizers.SGD(0.5), {"clip_norm": 0.05}, "dense"),
    "adamw-mask-l2-embedding": (
        _masked_model,
        lambda: keras.optimizers.AdamW(0.05, weight_decay=0.1),
        {"loss": keras.losses.SparseCategoricalCrossentropy(from_logits=True)},
        "tokens",
    ),
    "lion-static-scale": (mlp, lambda: keras.optimizers.Lion(0.01), {"loss_scale": 128.0}, "dense"),
    "rmsprop-sum-shared-layer": (
        _shared_layer_model,
        lambda: keras.optimizers.RMSprop(0.01),
        {"reduction": "sum"},
        "dense",
    ),
    "sgd-tied-embedding": (
        _tied_embedding_model,
        lambda: keras.optimizers.SGD(0.5),
        {"loss": keras.losses.SparseCategoricalCrossentropy(from_logits=True)},
        "tokens",
    ),
    "adam-tied-embedding-fused-loss": (
        # The table is read by the fused loss inside its custom gradient: no use to make its gradient
        # from, so it keeps pass 1's; the other weights are still made from their uses, and backprop
        # runs once a step (a second whole pass, as for a checkpointed model, would count 2).
        lambda: _tied_embedding_model(counter=_CountsBackprop()),
        lambda: keras.optimizers.Adam(0.05),
        {"loss": keras.losses.SparseCategoricalCrossentropy(from_logits=True), "fused_loss": True},
        "tokens",
    ),
}


def _batches(rng, kind, rows=(12, 7)):
    if kind == "tokens":
        out = []
        for _ in range(2):
            x = rng.integers(1, 9, size=(6, 5)).astype("int32")
            x[:, 3:] = 0  # padding, masked out of the loss
            out.append((x, rng.integers(0, 4, size=(6, 5)), rng.uniform(0.5, 2, size=6).astype("float32")))
        return out
    return [
        (
            rng.normal(size=(n, 5)).astype("float32"),
            rng.normal(size=(n, 3)).astype("float32"),
            rng.uniform(0.0, 2.0, size=n).astype("float32"),
        )
        for n in rows  # a second, smaller batch: no retrace, same result
    ]


@pytest.mark.parametrize(
    "case, jit_compile",
    [(case, False) for case in sorted(CASES)] + [("adam-weights-bn-dropout-l2", True), ("sgd-clip", True)],
)
def test_fused_update_equals_the_gathered_step(rng, case, jit_compile):
    make, optimizer, options, kind = CASES[case]
    # Under XLA a batch of another size is another compile of the graph traced once (XLA's shapes
    # are static): the second batch keeps the first one's size there.
    batches = _batches(rng, kind, (12, 12) if jit_compile else (12, 7))
    fused_model, fused_opt, fused_logs = _run(True, make, optimizer, batches, jit_compile, **dict(options))
    model, opt, logs = _run(False, make, optimizer, batches, jit_compile, **dict(options))
    counts = [int(layer.count.numpy()) for layer in fused_model.layers if isinstance(layer, _CountsBackprop)]
    assert counts == ([len(batches)] if case == "adam-tied-embedding-fused-loss" else []), counts
    assert_variables_close(fused_model.variables, model.variables, rtol=1e-5, atol=1e-6)
    assert_variables_close(fused_opt.variables, opt.variables, rtol=1e-5, atol=1e-6)
    for a, b in zip(fused_logs, logs):
        np.testing.assert_allclose(float(a["loss"]), float(b["loss"]), rtol=1e-5)


def test_fused_update_equals_a_plain_tape_in_eager_too(rng):
    x, y = rng.normal(size=(10, 5)).astype("float32"), rng.normal(size=(10, 3)).astype("float32")
    reference, ref_opt = mlp(), keras.optimizers.Adam(0.1)
    plain_step(reference, keras.losses.MeanSquaredError(reduction=None), ref_opt, x, y)
    tf.config.run_functions_eagerly(True)
    try:
        model = mlp()
        step = effgrad.build_train_step(model, "mse", keras.optimizers.Adam(0.1), fused_update=True)
        step(x, y)
    finally:
        tf.config.run_functions_eagerly(False)
    assert step.fused_update
    assert_variables_close(model.trainable_variables, reference.trainable_variables, rtol=1e-5, atol=1e-6)


class _CountsBackprop(keras.layers.Layer):
    """The identity, counting how many times backprop passes through it."""

    def build(self, shape):
        self.count = self.add_weight(shape=(), initializer="zeros", trainable=False, dtype="int32")

    def call(self, x):
        @tf.custom_gradient
        def counted(x):
            def grad(dy):
                with tf.control_dependencies([self.count.assign_add(1)]):
                    return tf.identity(dy)

            return tf.identity(x), grad

        return counted(x)


@pytest.mark.parametrize("clip_norm", [None, 1.0])
def test_fused_step_runs_the_activation_chain_of_backprop_once(rng, clip_norm):
    # Pass 2 makes each weight gradient from the output gradients pass 1 kept: it does not
    # backprop through the layers again (which doubled the fused step's backward time).
    keras.utils.set_random_seed(0)
    counter = _CountsBackprop()
    layers = [keras.layers.Dense(8, activation="tanh"), counter, keras.layers.Dense(3)]
    model = keras.Sequential([keras.Input((5,)), *layers])
    step = effgrad.build_train_step(model, "mse", keras.optimizers.Adam(0.01), fused_update=True, clip_norm=clip_norm)
    x, y = rng.normal(size=(6, 5)).astype("float32"), rng.normal(size=(6, 3)).astype("float32")
    before = [v.numpy() for v in model.trainable_variables]
    assert bool(step(x, y)["grads_finite"]) and int(counter.count.numpy()) == 1
    assert all(not np.array_equal(a, v.numpy()) for a, v in zip(before, model.trainable_variables))


def test_a_checkpointed_model_fused_equals_the_plain_gathered_step(rng):
    # Its weights are used inside recomputed blocks, where the tape keeps no output gradient:
    # the fused step must see that and backprop twice, not drop those weights' gradients.
    def make():
        keras.utils.set_random_seed(0)
        return keras.Sequential(
            [keras.Input((5,))] + [keras.layers.Dense(6, activation="tanh") for _ in range(4)] + [keras.layers.Dense(3)]
        )

    x, y = rng.normal(size=(8, 5)).astype("float32"), rng.normal(size=(8, 3)).astype("float32")
    plain, checkpointed = make(), effgrad.checkpoint_model(make(), segments=2)
    step = effgrad.build_train_step(checkpointed, "mse", keras.optimizers.Adam(0.05), fused_update=True)
    plain_opt = keras.optimizers.Adam(0.05)
    for _ in range(2):
        step(x, y)
        plain_step(plain, keras.losses.MeanSquaredError(reduction=None), plain_opt, x, y)  # a tape, eager
    assert step.fused_update
    assert_variables_close(checkpointed.trainable_variables, plain.trainable_variables, rtol=1e-5, atol=1e-6)


def _recurrent(embedding, steps, seed=0, grus=2):
    keras.utils.set_random_seed(seed)
    layers = [keras.Input((steps,), dtype="int32"), keras.layers.Embedding(embedding, 16)]
    layers += [keras.layers.GRU(48, return_sequences=True) for _ in range(grus - 1)] + [keras.layers.GRU(48)]
    return keras.Sequential([*layers, keras.layers.Dense(2)])


def test_a_recurrent_model_fused_holds_no_more_than_gathered(rng):
    # Its GRU weights are read inside loops, whose gradients pass 1 keeps; the embedding's is made in
    # pass 2. Under a persistent tape the loops kept the weights once per time step (100 copies).
    x, y = rng.integers(1, 5000, (2, 100)).astype("int32"), rng.integers(0, 2, 2)
    peaks, models = {}, {}
    for fused in (True, False):
        models[fused] = model = _recurrent(5000, 100)
        step = effgrad.build_train_step(model, _sparse(), keras.optimizers.SGD(0.1), fused_update=fused)
        step(x, y)
        peaks[fused] = effgrad.memory.measure(step, x, y).extra_bytes
        assert step.fused_update is fused
    # What overlaps backprop varies from run to run (fused 0.4-1.1 MiB above gathered, 2 MiB at most
    # here): less than a copy of the loops' weights per 4 time steps, a quarter of what they kept.
    loop_weights = sum(int(np.prod(v.shape)) for v in models[True].trainable_variables[1:-2]) * 4
    assert peaks[True] <= peaks[False] + 100 / 4 * loop_weights, {k: v / 2**20 for k, v in peaks.items()}
    assert_variables_close(models[True].trainable_variables, models[False].trainable_variables)


def test_a_recurrent_model_that_needs_a_second_backward_pass_is_not_fused(rng, caplog):
    # Without a large embedding the loop-read weights are most of the gradient: fusing would need a
    # second backward pass through the loops. "auto" falls back and says why; True refuses. (One
    # recurrent layer: every step built here traces it.)
    x, y = rng.integers(1, 50, (2, 40)).astype("int32"), rng.integers(0, 2, 2)
    model, reference = _recurrent(50, 40, grus=1), _recurrent(50, 40, grus=1)
    with caplog.at_level("INFO", logger="effgrad"):
        step = effgrad.build_train_step(model, _sparse(), keras.optimizers.SGD(0.1), fused_update="auto")
        step(x, y)
    assert step.fused_update is False and "loop" in caplog.text
    # The step it fell back to is the plain one (a tape, eager: no second trace of the loops).
    plain_step(reference, _sparse(reduction=None), keras.optimizers.SGD(0.1), x, y)
    assert_variables_close(model.trainable_variables, reference.trainable_variables)
    forced = effgrad.build_train_step(
        _recurrent(50, 40, grus=1), _sparse(), keras.optimizers.SGD(0.1), fused_update=True
    )
    with pytest.raises(ValueError, match="loop"):
        forced(x, y)


def _sparse(**options):
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True, **options)


@pytest.mark.parametrize("jit_compile", [False, True], ids=["function", "xla"])
def test_fused_non_finite_step_changes_nothing_and_backs_off(rng, jit_compile):
    model, opt = _bn_dropout_model(), keras.optimizers.Adam(0.01)
    step = effgrad.build_train_step(model, "mse", opt, fused_update=True, loss_scale="dynamic", jit_compile=jit_compile)
    x, y = rng.normal(size=(8, 5)).astype("float32"), rng.normal(size=(8, 3)).astype("float32")
    step(x, y)
    before, iterations, scale = _state(model, opt), int(opt.iterations), float(step.loss_scale.value)
    bad = x.copy()
    bad[3, 1] = np.inf
    logs = step(bad, y)
    assert not bool(logs["grads_finite"])
    for a, b in zip(_state(model, opt), before):  # BatchNorm statistics and Adam moments included
        np.testing.assert_array_equal(a, b)
    assert int(opt.iterations) == iterations and float(step.loss_scale.value) == scale / 2
    assert bool(step(x, y)["grads_finite"]) and int(opt.iterations) == iterations + 1


def test_float16_gradients_that_underflow_without_the_scale_are_kept(rng):
    """Under mixed_float16 the fused step scales the loss: without it these gradients are 0 in float16."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1, kernel_initializer="zeros")])
        step = effgrad.build_train_step(model, "mse", keras.optimizers.SGD(1.0), fused_update=True)
        x, y = np.full((4, 4), 1e-4, "float32"), np.full((4, 1), 1e-4, "float32")
        step(x, y)  # d loss / d kernel = -2e-8: 0 in float16 unless the loss is scaled
        assert step.fused_update and float(step.loss_scale.value) > 1
        np.testing.assert_allclose(model.layers[0].kernel.numpy(), 2e-8, rtol=0.05)
    finally:
        keras.mixed_precision.set_global_policy("float32")


def test_auto_fuses_where_weights_outweigh_activations():
    wide = keras.Sequential([keras.Input((256,)), keras.layers.Dense(256), keras.layers.Dense(256)])
    step = effgrad.build_train_step(wide, "mse", keras.optimizers.SGD(0.1))
    step(np.ones((4, 256), "float32"), np.ones((4, 256), "float32"))  # 4 rows: weights dominate
    assert step.fused_update is True
    narrow = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8), keras.layers.Dense(8)])
    step = effgrad.build_train_step(narrow, "mse", keras.optimizers.SGD(0.1))
    step(np.ones((512, 8), "float32"), np.ones((512, 8), "float32"))  # activations dominate
    assert step.fused_update is False
    step = effgrad.build_train_step(wide, "mse", keras.optimizers.SGD(0.1), micro_batches=2)
    step(np.ones((4, 256), "float32"), np.ones((4, 256), "float32"))
    assert step.fused_update is False  # the accumulators are the one gradient-sized buffer already


def test_attach_with_fused_update_trains_like_stock_fit(rng):
    x, y = rng.normal(size=(24, 5)).astype("float32"), rng.normal(size=(24, 3)).astype("float32")
    stock, ours = mlp(), mlp()
    for model in (stock, ours):
        model.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse")
    stock.optimizer.build(stock.trainable_variables)  # stock fit then traces once, not twice
    effgrad.attach(ours, fused_update=True)
    h_stock = stock.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history
    h_ours = ours.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history
    assert ours.effgrad_step.fused_update
    assert_variables_close(ours.trainable_variables, stock.trainable_variables, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(h_ours["loss"], h_stock["loss"], rtol=1e-5)


def test_what_cannot_be_fused_is_refused_with_the_reason(strategy):
    with pytest.raises(ValueError, match="fused_update must be"):
        effgrad.build_train_step(mlp(), "mse", keras.optimizers.SGD(0.1), fused_update="yes")
    step = effgrad.build_train_step(mlp(), "mse", keras.optimizers.SGD(0.1, global_clipnorm=1.0), fused_update=True)
    with pytest.raises(ValueError, match="global_clipnorm"):
        step(np.ones((4, 5), "float32"), np.ones((4, 3), "float32"))
    with strategy.scope():
        model, opt = mlp(), keras.optimizers.SGD(0.1)
    step = effgrad.build_train_step(model, "mse", opt, fused_update=True, strategy=strategy)
    with pytest.raises(ValueError, match="several replicas"):
        step(np.ones((4, 5), "float32"), np.ones((4, 3), "float32"))
    auto = effgrad.build_train_step(model, "mse", opt, strategy=strategy)  # auto: gathers, and says nothing
    auto(np.ones((4, 5), "float32"), np.ones((4, 3), "float32"))
    assert auto.fused_update is False


# ------------------------------------------------------------------ memory
_CHILD = textwrap.dedent(
    """
    import json, sys
    import effgrad, keras, tensorflow as tf
    method, optimizer = sys.argv[1], sys.argv[2]
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((1024,))] + [keras.layers.Dense(1024, activation="relu") for _ in range(6)])
    x, y = tf.random.normal([16, 1024]), tf.random.normal([16, 1024])  # weights (24 MiB) >> activations
    opt = keras.optimizers.SGD(1e-3) if optimizer == "sgd" else keras.optimizers.Adam(1e-3)
    if method == "keras":
        model.compile(optimizer=opt, loss="mse")
        run = lambda: model.train_on_batch(x, y)
    else:
        step = effgrad.build_train_step(model, "mse", opt, fused_update={"fused": True, "gathered": False}[method])
        run = lambda: step(x, y)["loss"]
    run()
    # The overlap of updates with backprop depends on the executor's threads (a loaded machine lets
    # backprop run a gradient or two ahead): the least of three calls is the step's own peak.
    print("@@" + json.dumps(min(effgrad.memory.measure(run).peak_bytes for _ in range(3))))
    """
)


@pytest.mark.parametrize("optimizer", ["sgd"])  # Adam: the same, with slots (benchmarks/step_floor.py)
def test_fused_step_holds_no_more_than_keras_where_gathering_holds_a_gradient_more(optimizer):
    peaks = in_fresh_processes(_CHILD, {m: [m, optimizer] for m in ("keras", "fused", "gathered")})
    gradients = 6 * (1024 * 1024 + 1024) * 4
    print({k: f"{v / 2**20:.1f} MiB" for k, v in peaks.items()})
    largest = (1024 * 1024 + 1024) * 4
    # Which updates overlap varies from run to run (Keras's own peak: 34.3-38.2 MB here): two gradients' slack.
    assert peaks["fused"] <= peaks["keras"] + 2 * largest, peaks
    assert peaks["gathered"] >= peaks["fused"] + 0.4 * gradients, peaks  # the feature is what saves it


def test_pacing_adds_no_edge_that_could_deadlock():
    # An update that reads another gradient first (a global norm in the optimizer) must not make
    # that gradient wait for it: the edge would close a cycle.
    with tf.Graph().as_default() as graph:
        a, b, c = (tf.Variable(tf.ones([2])) for _ in range(3))
        made = [tf.identity(tf.ones([2]), name=f"grad{i}") for i in range(3)]
        known = len(graph.get_operations())
        norm = tf.add_n([tf.reduce_sum(g**2) for g in made])
        _ = [v.assign_sub(g * norm, read_value=False) for v, g in zip((a, b, c), made)]
        fused_update.pace([[g.op] for g in made], made, graph.get_operations()[known:], [2, 2, 2])
        assert all(not g.op.control_inputs for g in made)  # every update reads every gradient

        def paced(overlap):
            independent = [tf.identity(tf.ones([2])) for _ in range(3)]
            known = len(graph.get_operations())
            writes = [v.assign_sub(g, read_value=False) for v, g in zip((a, b, c), independent)]
            ops = graph.get_operations()[known:]
            fused_update.pace([[g.op] for g in independent], independent, ops, [2, 2, 2], overlap)
            waits = [fused_update._ancestors(g.op.control_inputs) for g in independent]
            return [[j for j, w in enumerate(writes) if id(w) in waited] for waited in waits]

        # Backprop's order is the reverse of the variables'. One update at a time: each gradient
        # waits for every update before it; with one in flight, for all but the last one.
        assert paced(0) == [[1, 2], [2], []]
        assert paced(1) == [[2], [], []]


def test_keras_hub_gpt2_with_padding_and_dropout_fused_equals_gathered(rng):
    # Against "auto", which counts the sequence length of token models: per token a language model
    # looks weight-dominated (it would fuse); per sequence of 64 its logits are not, and it gathers.
    tokens = rng.integers(1, 1000, size=(4, 64)).astype("int32")
    mask = np.ones((4, 64), "int32")
    mask[:, 48:] = 0
    x, y, w = {"token_ids": tokens, "padding_mask": mask}, np.roll(tokens, -1, axis=1), mask.astype("float32")
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    results = []
    for fused in (True, "auto"):
        model, opt = tiny_gpt2_lm(vocabulary=1000, length=64, layers=1), keras.optimizers.AdamW(1e-2)
        keras.utils.set_random_seed(3)  # the same dropout draws
        step = effgrad.build_train_step(model, loss, opt, fused_update=fused)
        logs = step(x, y, w)
        assert step.fused_update is (fused is True)
        results.append((model, float(logs["loss"])))
    assert step.batch_hint == (4, 64)
    (fused_model, fused_loss), (model, loss_value) = results
    assert fused_loss == pytest.approx(loss_value, rel=1e-6)
    assert_variables_close(fused_model.trainable_variables, model.trainable_variables, rtol=1e-5, atol=1e-6)


def test_a_deleted_model_and_its_fused_step_free_their_weights():
    # Asked for a Dense's MatMul and BiasAdd outputs in one call, TensorFlow's tape would keep the step's
    # graph, and with it every weight, for good.
    width = 2048
    x, y = tf.ones((8, width)), tf.zeros((8, width))

    def trained():
        model = keras.Sequential([keras.Input((width,)), keras.layers.Dense(width), keras.layers.Dense(width)])
        step = effgrad.build_train_step(model, "mse", keras.optimizers.SGD(0.1), fused_update=True)
        step(x, y)
        assert step.fused_update
        return model, step

    assert bytes_left_after(trained) < width * width * 4 / 4
