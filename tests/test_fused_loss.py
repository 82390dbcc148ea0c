"""The fused projection + sparse cross-entropy equals the plain one and never makes the logits."""

import functools
import logging
import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf

import effgrad
from conftest import assert_variables_close
from effgrad.train import fused_loss
from effgrad.train.fused_loss import kernel as fused_kernel
from helpers import in_fresh_processes, plain_step, tiny_gpt2_lm
from test_checkpoint import count_calls


def _plain(hidden, kernel, labels, bias, transposed, soft_cap, ignore_class):
    z = tf.matmul(hidden, kernel, transpose_b=transposed)
    if bias is not None:
        z = z + bias
    if soft_cap is not None:
        z = soft_cap * tf.tanh(z / soft_cap)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None, ignore_class=ignore_class)
    return loss(labels, z)


@pytest.mark.parametrize(
    "transposed, soft_cap, with_bias, ignore_class, classes",
    [
        (False, None, True, None, 100),
        (True, None, False, 3, 100),
        (True, 5.0, False, None, 100),
        (False, 2.0, True, 0, 100),
        # 4,096 + 4,096 + 808 classes: the logsumexp and the gradients combined over class chunks
        (False, None, True, 3, 9000),
        (True, 5.0, False, None, 9000),
        (True, 2.0, True, 0, 9000),  # a [V, d] kernel's backprop runs [classes, rows]: the bias there too
    ],
    ids=[
        "dense",
        "tied-ignore",
        "tied-softcap",
        "dense-softcap-ignore",
        "dense-3-class-chunks",
        "tied-3-class-chunks",
        "tied-bias-softcap-ignore-3-class-chunks",
    ],
)
def test_loss_and_gradients_equal_the_plain_cross_entropy(rng, transposed, soft_cap, with_bias, ignore_class, classes):
    hidden = tf.constant(rng.normal(size=(3, 7, 16)).astype("float32"))
    kernel = tf.Variable(rng.normal(size=(classes, 16) if transposed else (16, classes)).astype("float32"))
    bias = tf.Variable(rng.normal(size=(classes,)).astype("float32")) if with_bias else None
    labels = rng.integers(0, classes, (3, 7))
    labels[:, -2:] = 3 if ignore_class is None else ignore_class  # some ignored positions
    labels = tf.constant(labels)
    weights = tf.constant(rng.uniform(size=(3, 7)).astype("float32"))
    sources = [hidden, kernel] + ([bias] if with_bias else [])

    def loss_and_gradients(loss_of, hidden):
        with tf.GradientTape() as tape:
            tape.watch(hidden)
            losses = loss_of(hidden)
            total = tf.reduce_sum(losses * weights)
        return losses, tape.gradient(total, [hidden, *sources[1:]])

    def fused(hidden):
        return loss_and_gradients(
            lambda h: effgrad.fused_sparse_cross_entropy(
                h,
                kernel,
                labels,
                bias=bias,
                transposed=transposed,
                soft_cap=soft_cap,
                ignore_class=ignore_class,
                chunk_rows=4,  # 21 rows: 6 chunks, the last one short
            ),
            hidden,
        )

    # The plain loss is the reference, computed once (eagerly); the fused one runs in each mode.
    plain, plain_grads = loss_and_gradients(
        lambda h: _plain(h, kernel, labels, bias, transposed, soft_cap, ignore_class), hidden
    )
    for mode in ("eager", "function", "xla"):
        run = fused if mode == "eager" else tf.function(fused, jit_compile=mode == "xla", autograph=False)
        losses, grads = run(hidden)
        np.testing.assert_allclose(losses, plain, rtol=1e-5, atol=1e-5, err_msg=mode)
        for a, b in zip(grads, plain_grads):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=mode)
        if ignore_class is not None:
            ignored = labels.numpy() == ignore_class
            assert ignored.any() and np.all(losses.numpy()[ignored] == 0), mode


def test_bad_arguments_are_refused_clearly():
    hidden, labels = tf.zeros([2, 8]), tf.zeros([2], tf.int32)
    with pytest.raises(ValueError, match="from_logits=True"):
        effgrad.fused_sparse_cross_entropy(hidden, tf.zeros([8, 5]), labels, from_logits=False)
    with pytest.raises(ValueError, match=r"last axis \(8\) must equal the kernel's input size \(5"):
        effgrad.fused_sparse_cross_entropy(hidden, tf.zeros([5, 8]), labels)
    with pytest.raises(ValueError, match="chunk_rows"):
        effgrad.fused_sparse_cross_entropy(hidden, tf.zeros([8, 5]), labels, chunk_rows=0)


def _classifier(seed=0):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((12,))
    h = keras.layers.Dense(16, activation="relu")(inputs)
    return keras.Model(inputs, keras.layers.Dense(300)(h))  # a 300-class head with a bias


def _lm_batch(rng):
    tokens = rng.integers(1, 50, size=(6, 8)).astype("int32")
    mask = np.ones((6, 8), "int32")
    mask[:, 6:] = 0
    return {"token_ids": tokens, "padding_mask": mask}, np.roll(tokens, -1, axis=1), mask.astype("float32")


@pytest.mark.parametrize(
    "model, modes",
    [("gpt2", [(False, 3)]), ("gpt2", [(True, 1)]), ("classifier", [(False, 3), (True, 3)])],
    ids=["gpt2-function-3", "gpt2-xla-1", "classifier-function-3-xla-3"],
)
def test_step_with_the_fused_loss_equals_the_unfused_step(rng, monkeypatch, model, modes, caplog):
    """Each ``(jit_compile, micro_batches)`` in ``modes`` with the fused loss equals the unfused step of
    the first. The classifier has no dropout: one unfused step without XLA is the reference of both
    its fused steps. GPT-2's dropout draws differ under XLA: each of its modes has its own reference."""
    # Chunks of 16 classes: the first one alone, the loop, a shorter last one (50 and 300 classes).
    monkeypatch.setattr(fused_kernel, "_VOCAB_CHUNK", 16)
    if model == "gpt2":
        # No transformer layer: the tied head, the embeddings' dropout and their gradients are what the
        # fused loss meets; a layer would only lengthen every trace and XLA compile (the checkpointed
        # LM below has one).
        make, (x, y, w) = functools.partial(tiny_gpt2_lm, layers=0), _lm_batch(rng)
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=7)  # padding masks too
    else:
        make = _classifier
        x, y, w = rng.normal(size=(10, 12)).astype("float32"), rng.integers(0, 300, 10), rng.uniform(size=10)
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    results = []
    for fused, (jit_compile, micro_batches) in [(False, modes[0])] + [(True, mode) for mode in modes]:
        net, opt = make(), keras.optimizers.AdamW(1e-2)
        keras.utils.set_random_seed(3)  # the same dropout draws
        with caplog.at_level(logging.INFO, logger="effgrad"):
            step = effgrad.build_train_step(
                net, loss, opt, fused_loss=fused, micro_batches=micro_batches, jit_compile=jit_compile
            )
            logs = step(x, y, w)
        assert step.fused_loss is fused
        results.append((net, float(logs["loss"])))
    assert "fused loss: " in caplog.text and "the logits are never made" in caplog.text  # one line says so
    (net, loss_value), *fused_results = results
    for mode, (fused_net, fused_value) in zip(modes, fused_results):
        assert fused_value == pytest.approx(loss_value, rel=1e-5), mode
        # Adam divides by sqrt(v): float32 round-off of a near-zero gradient shows at ~1e-6 of the 1e-2 step
        assert_variables_close(fused_net.trainable_variables, net.trainable_variables, rtol=1e-5, atol=1e-5)


def test_a_checkpointed_lm_fuses_its_loss_and_recomputes_its_backbone(rng, monkeypatch):
    # checkpoint_model cuts the task model inside its backbone and leaves the tied projection
    # outside the segments: the fused loss finds it, and the step equals the plain unfused one.
    # The segment's dense embedding gradient is the kernel's buffer, written in chunks of 16 classes.
    # The reference is the plain unfused loss on a tape, eager (no trace): both models' dropout layers
    # draw from the seeds they were built with, the same draws.
    monkeypatch.setattr(fused_kernel, "_VOCAB_CHUNK", 16)
    (x, y, w), loss = _lm_batch(rng), keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    ours = tiny_gpt2_lm(dropout=0.1, layers=1)  # segments: the embeddings, then the transformer layer
    layers = ours.backbone.transformer_layers
    calls = [count_calls(layer) for layer in layers]
    keras.utils.set_random_seed(3)
    step = effgrad.build_train_step(
        effgrad.checkpoint_model(ours, segments=2), loss, keras.optimizers.AdamW(1e-2), fused_loss=True
    )
    ours_loss = float(step(x, y, w)["loss"])
    assert step.fused_loss, step.fused_loss_reason
    assert [len(c) for c in calls] == [2] * len(layers)  # one trace: forward, and the recompute in backprop
    plain = tiny_gpt2_lm(dropout=0.1, layers=1)
    plain_loss = plain_step(plain, keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None),
                            keras.optimizers.AdamW(1e-2), x, y, w)  # fmt: skip
    assert ours_loss == pytest.approx(plain_loss, rel=1e-5)
    assert_variables_close(ours.trainable_variables, plain.trainable_variables, rtol=1e-5, atol=1e-5)


def test_a_head_also_called_inside_the_model_fuses_and_equals_the_unfused_step(rng):
    # Its kernel's gradient from the other call is the buffer the fused loss adds its own into.
    x, y = rng.normal(size=(2, 24, 8)).astype("float32"), rng.integers(0, 300, (2, 24))

    def model():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((24, 8))
        h = keras.layers.Dense(8, activation="tanh")(inputs)
        head = keras.layers.Dense(300)
        z = keras.layers.Dense(8)(head(h))
        return keras.Model(inputs, head(keras.layers.Add()([h, z])))

    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    steps = [
        effgrad.build_train_step(model(), loss, keras.optimizers.SGD(0.1), fused_loss=fused, fused_update=False)
        for fused in (True, False)
    ]
    for step in steps:
        step(x, y)
    assert steps[0].fused_loss and not steps[1].fused_loss
    assert_variables_close(steps[0].model.trainable_variables, steps[1].model.trainable_variables, atol=1e-6)


def test_mixed_float16_fused_loss_is_computed_in_float32(rng):
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        x, y, w = rng.normal(size=(10, 12)).astype("float32"), rng.integers(0, 300, 10), None
        losses = []
        for fused in (True, False):
            net = _classifier()
            step = effgrad.build_train_step(
                net,
                keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                keras.optimizers.SGD(0.1),
                fused_loss=fused,
            )
            losses.append(float(step(x, y, w)["loss"]))
            assert step.fused_loss is fused and float(step.loss_scale.value) > 1
        assert losses[0] == pytest.approx(losses[1], rel=1e-2)  # float16 logits vs float32 chunks
    finally:
        keras.mixed_precision.set_global_policy("float32")


def test_fused_loss_under_mirrored_strategy_equals_one_device(strategy, rng):
    x, y = rng.normal(size=(8, 12)).astype("float32"), rng.integers(0, 300, 8)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    with strategy.scope():
        net, opt = _classifier(), keras.optimizers.SGD(0.1)
    step = effgrad.build_train_step(net, loss, opt, strategy=strategy, micro_batches=2, fused_loss=True)
    step(x, y)
    assert step.fused_loss
    reference = _classifier()  # unfused, on a plain tape, eager
    plain_step(reference, keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None),
               keras.optimizers.SGD(0.1), x, y)  # fmt: skip
    for variable, expected in zip(net.trainable_variables, reference.trainable_variables):
        np.testing.assert_allclose(variable.numpy(), expected.numpy(), rtol=1e-5, atol=1e-6)


def test_auto_says_why_it_does_not_apply_and_true_refuses(rng, caplog):
    activated = keras.Sequential([keras.Input((4,)), keras.layers.Dense(5, activation="softmax")])
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    x, y = np.ones((4, 4), "float32"), np.zeros(4, "int32")
    with caplog.at_level(logging.INFO, logger="effgrad"):
        step = effgrad.build_train_step(activated, loss, keras.optimizers.SGD(0.1))
        step(x, y)
    assert step.fused_loss is False and "applies an activation" in caplog.text
    step = effgrad.build_train_step(activated, "mse", keras.optimizers.SGD(0.1))
    step(x, np.zeros((4, 5), "float32"))
    assert "not SparseCategoricalCrossentropy(from_logits=True)" in step.fused_loss_reason
    with pytest.raises(ValueError, match="fused_loss=True cannot apply: .*applies an activation"):
        effgrad.build_train_step(activated, loss, keras.optimizers.SGD(0.1), fused_loss=True)(x, y)


@pytest.mark.parametrize("rows, fused", [(64, False), (65, True)])
def test_auto_fuses_when_the_batch_has_more_positions_than_four_times_the_projection_inputs(
    rng, monkeypatch, rows, fused
):
    monkeypatch.setattr(fused_kernel, "CHUNK_ELEMENTS", 1000)  # these logits fill several chunks
    net = _classifier()  # the head projects 16 features: fused from 65 rows
    x, y = rng.normal(size=(rows, 12)).astype("float32"), rng.integers(0, 300, rows)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    step = effgrad.build_train_step(net, loss, keras.optimizers.SGD(0.1))
    step(x, y)
    assert step.fused_loss is fused
    assert fused or "too few next to the projection's 16 inputs" in step.fused_loss_reason


@pytest.mark.parametrize("rows, fused", [(128, False), (130, True)])
def test_auto_counts_the_positions_each_replica_makes(strategy, rng, monkeypatch, rows, fused):
    monkeypatch.setattr(fused_kernel, "CHUNK_ELEMENTS", 1000)
    with strategy.scope():  # 2 replicas: 64 or 65 rows each, against the head's 4 x 16 inputs
        net = _classifier()
    x, y = rng.normal(size=(rows, 12)).astype("float32"), rng.integers(0, 300, rows)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    step = effgrad.build_train_step(net, loss, keras.optimizers.SGD(0.1), strategy=strategy)
    step(x, y)
    assert step.fused_loss is fused


def test_auto_does_not_fuse_logits_that_fit_in_one_chunk(rng):
    x, y = rng.normal(size=(65, 12)).astype("float32"), rng.integers(0, 300, 65)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    step = effgrad.build_train_step(_classifier(), loss, keras.optimizers.SGD(0.1))
    step(x, y)
    assert step.fused_loss is False and "(65 x 300) fit in one chunk" in step.fused_loss_reason


def test_attach_fuses_with_accuracy_and_top_k_metrics_equal_to_stock_keras(rng):
    """Compiled accuracy and top-k are computed from the chunks: same history as stock Keras's logits.

    One stock fit (without XLA) is the reference of both attached fits."""
    x, y = rng.normal(size=(16, 12)).astype("float32"), rng.integers(0, 300, 16)
    w = rng.uniform(0, 1, 16).astype("float32")
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def compiled(jit_compile):
        net = _classifier()
        net.compile(
            optimizer=keras.optimizers.Adam(0.01),
            loss=loss,
            metrics=["accuracy", keras.metrics.SparseTopKCategoricalAccuracy(k=20, name="top20")],
            weighted_metrics=["sparse_categorical_accuracy"],
            jit_compile=jit_compile,
        )
        return net

    fit = dict(sample_weight=w, batch_size=8, epochs=3, shuffle=False, verbose=0)
    stock = compiled(False)
    stock.optimizer.build(stock.trainable_variables)  # else fit traces its train function twice
    h_stock = stock.fit(x, y, **fit).history
    assert max(h_stock["top20"]) > 0  # the metrics saw something to count
    for jit_compile, micro_batches in [(False, 1), (True, 2)]:
        ours = compiled(jit_compile)
        effgrad.attach(ours, fused_loss=True, micro_batches=micro_batches)  # 8 rows: "auto" would not fuse
        h_ours = ours.fit(x, y, **fit).history
        assert ours.effgrad_step.fused_loss and ours.effgrad_step.options.jit_compile is jit_compile
        assert_variables_close(ours.trainable_variables, stock.trainable_variables, rtol=1e-5, atol=1e-6)
        assert set(h_ours) == set(h_stock)
        for name in h_stock:
            np.testing.assert_allclose(h_ours[name], h_stock[name], rtol=1e-5, err_msg=f"{name}, XLA: {jit_compile}")


def test_a_metric_that_reads_the_logits_keeps_the_loss_unfused_and_says_so(rng, monkeypatch):
    monkeypatch.setattr(fused_kernel, "CHUNK_ELEMENTS", 1000)  # "auto" would fuse these 80 rows
    x, y = rng.normal(size=(80, 12)).astype("float32"), rng.integers(0, 300, 80)
    ours = _classifier()
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    entropy = keras.metrics.SparseCategoricalCrossentropy(from_logits=True, name="xent")
    ours.compile(optimizer=keras.optimizers.Adam(0.01), loss=loss, metrics=["accuracy", entropy])
    effgrad.attach(ours)
    with pytest.warns(UserWarning, match="not fused with .*'xent' read the logits"):
        history = ours.fit(x, y, batch_size=80, verbose=0).history
    assert not ours.effgrad_step.fused_loss and "'xent' read the logits" in ours.effgrad_step.fused_loss_reason
    np.testing.assert_allclose(history["xent"], history["loss"], rtol=1e-5)  # computed on the real logits
    effgrad.attach(ours, fused_loss=True)
    with pytest.raises(ValueError, match="fused_loss=True cannot apply: the metrics 'xent' read the logits"):
        ours.fit(x, y, batch_size=80, verbose=0)
    # Empty metric lists (how a keras_hub task drops its default accuracy) read no logits: fused.
    ours.compile(optimizer=keras.optimizers.Adam(0.01), loss=loss, metrics=[], weighted_metrics=[])
    effgrad.attach(ours)
    ours.fit(x, y, batch_size=80, verbose=0)
    assert ours.effgrad_step.fused_loss


def test_ranks_count_ties_as_keras_argmax_and_in_top_k_do():
    """Tied logits (duplicate kernel columns) and labels outside the vocabulary (an ignored class)."""
    hidden = tf.constant(np.random.default_rng(0).normal(size=(40, 8)), tf.float32)
    columns = np.random.default_rng(1).normal(size=(8, 6))
    kernel = tf.constant(np.concatenate([columns, columns[:, :4]], axis=1), tf.float32)  # classes 6-9 copy 0-3
    labels = tf.constant(np.random.default_rng(2).integers(-1, 10, 40), tf.int32)  # -1: outside [0, 10)
    _, ranks = fused_kernel.cross_entropy(hidden, kernel, labels, None, False, None, -1, 7, True)
    logits = hidden @ kernel
    accuracy = keras.metrics.sparse_categorical_accuracy(labels, logits).numpy()
    np.testing.assert_array_equal((ranks[:, 0] == 0) & (ranks[:, 1] == 0), accuracy == 1)
    for k in (1, 2, 3, 5):
        top = keras.metrics.sparse_top_k_categorical_accuracy(labels, logits, k=k).numpy()
        np.testing.assert_array_equal(ranks[:, 0] < k, top == 1, err_msg=f"k={k}")
    assert 0 < accuracy.sum() < 40 and (labels.numpy() >= 6).sum() > 0  # ties and misses both occur


def test_the_model_is_unchanged_it_still_generates_and_saves(rng, tmp_path):
    model = tiny_gpt2_lm(layers=1)
    x, y, w = _lm_batch(rng)
    step = effgrad.build_train_step(
        model,
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        keras.optimizers.Adam(1e-3),
        fused_loss=True,
    )
    step(x, y, w)
    assert step.fused_loss
    logits = model(x)
    assert logits.shape == (6, 8, 50)  # inference still gives the logits
    model.save(tmp_path / "lm.keras")
    loaded = keras.models.load_model(tmp_path / "lm.keras")
    np.testing.assert_allclose(loaded(x), logits, rtol=1e-5, atol=1e-5)
    out = model.generate(
        {"token_ids": x["token_ids"][:1], "padding_mask": x["padding_mask"][:1]}, max_length=8, stop_token_ids=None
    )
    assert np.asarray(out["token_ids"]).shape == (1, 8)


_CHILD = textwrap.dedent(
    """
    import json, sys
    import effgrad, keras, numpy as np, tensorflow as tf
    fused = sys.argv[1] == "fused"
    keras.utils.set_random_seed(0)
    inputs = keras.Input((64,))
    model = keras.Model(inputs, keras.layers.Dense(50_000)(inputs))  # 12 MiB of weights
    x = tf.random.normal([512, 64]); y = tf.random.uniform([512], 0, 50_000, tf.int32)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    step = effgrad.build_train_step(model, loss, keras.optimizers.SGD(0.1), fused_loss=fused)
    step(x, y)
    print("@@" + json.dumps(effgrad.memory.measure(lambda: step(x, y)["loss"]).extra_bytes))
    """
)


_KERNEL_CHILD = textwrap.dedent(
    """
    import json, sys
    import effgrad, numpy as np, tensorflow as tf
    transposed = sys.argv[1] == "transposed"
    depth, vocabulary = 256, 50_000  # a 49 MiB kernel; 64 rows: each chunk's logits are 1 MiB
    kernel = tf.Variable(tf.random.normal([vocabulary, depth] if transposed else [depth, vocabulary], stddev=0.02))
    hidden = tf.random.normal([64, depth]); labels = tf.random.uniform([64], 0, vocabulary, tf.int32)

    @tf.function
    def gradient():
        with tf.GradientTape() as tape:
            loss = effgrad.fused_sparse_cross_entropy(hidden, kernel, labels, transposed=transposed)
        return tape.gradient(loss, kernel)

    gradient()
    # The least of three calls: where the allocator places the 49 MiB result (a free chunk up to twice
    # its size counts whole) varies from call to call, and only ever adds.
    print("@@" + json.dumps(min(effgrad.memory.measure(gradient).extra_bytes for _ in range(3))))
    """
)


def test_the_kernel_gradient_is_assembled_in_one_buffer():
    # Each vocabulary chunk's gradient is written in place into the kernel-sized result. Joining
    # the chunks at the end (tf.concat) holds the chunks and the result: two kernels. Measured in 12
    # processes x 6 calls: in place 1.13-1.50 kernels (a least of three at 1.495 once failed a bound
    # of 1.4); each write made on a copy of the buffer (tf.raw_ops.DeepCopy) 2.54-3.12.
    peaks = in_fresh_processes(_KERNEL_CHILD, {"dense": ["dense"], "transposed": ["transposed"]})
    kernel = 256 * 50_000 * 4
    assert all(peak < 1.8 * kernel for peak in peaks.values()), {k: v / kernel for k, v in peaks.items()}


def test_the_kernel_gradient_is_made_after_every_other_gradient(rng):
    # Backprop meets the loss first: a kernel gradient made there is held through the backward pass of
    # every layer below (GPT-2 LM, T=256: 456 -> 388 MiB, `python -m benchmarks run fused_loss`). In
    # the step it is left out of backprop and made after it, from a number per row, to the same value.
    # Measured peaks cannot show it reliably in a test: with two inter-op threads the executor may run
    # an eager kernel gradient beside or after the layers' backward passes (242-275 MiB in one model).
    inputs = keras.Input((12,))
    hidden = keras.layers.Dense(16, activation="gelu")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(300)(hidden))
    head = model.layers[-1]
    trunk = keras.Model(inputs, hidden)
    x, y = tf.constant(rng.normal(size=(10, 12)), tf.float32), tf.constant(rng.integers(0, 300, 10))
    variables = model.trainable_variables
    kernel_at = next(i for i, v in enumerate(variables) if v is head.kernel)
    seen = []

    def loss():
        return tf.reduce_sum(effgrad.fused_sparse_cross_entropy(trunk(x), head.kernel, y, bias=head.bias))

    @tf.function
    def later():
        with fused_loss.kernel_gradients_later(variables) as finish:
            with tf.GradientTape() as tape:
                value = loss()
            raw = tape.gradient(value, variables)
            seen.append(raw[kernel_at])
            return finish(raw)

    graph = later.get_concrete_function().graph
    assert seen == [None]  # backprop made no kernel gradient
    grads = later()
    with tf.GradientTape() as tape:
        value = loss()
    for ours, plain in zip(grads, tape.gradient(value, variables)):
        np.testing.assert_allclose(ours, plain, rtol=1e-5, atol=1e-6)

    # ... and the ops that make it wait for every other gradient (control dependencies).
    def source(t):  # a function's outputs pass through Identity ops
        while t.op.type == "Identity":
            t = t.op.inputs[0]
        return t

    ancestors, todo = set(), [source(graph.structured_outputs[kernel_at]).op]
    while todo:
        op = todo.pop()
        if op.name not in ancestors:
            ancestors.add(op.name)
            todo.extend([t.op for t in op.inputs] + list(op.control_inputs))
    others = [g for i, g in enumerate(graph.structured_outputs) if i not in (kernel_at, kernel_at + 1)]
    assert others and all(source(g).op.name in ancestors for g in others), [source(g).op.name for g in others]


def test_the_logits_are_never_made():
    peaks = in_fresh_processes(_CHILD, {"fused": ["fused"], "plain": ["plain"]})
    logits = 512 * 50_000 * 4  # 98 MiB: one copy
    print({k: f"{v / 2**20:.0f} MiB" for k, v in peaks.items()})
    assert peaks["plain"] > logits
    # a 16 MiB chunk's logits and their gradient, the kernel's gradient (12 MiB) and its update
    assert peaks["fused"] < 0.6 * logits, peaks


def test_the_graph_does_not_grow_with_the_vocabulary(monkeypatch):
    """The class chunks are a loop, not unrolled: a bigger vocabulary is the same graph (at GPT-2's
    13 chunks, unrolled, a step's trace took 3.0 s against 1.7)."""
    monkeypatch.setattr(fused_kernel, "_VOCAB_CHUNK", 16)

    def nodes(vocabulary):
        hidden, labels = tf.zeros([6, 8]), tf.zeros([6], tf.int32)
        kernel = tf.Variable(tf.zeros([vocabulary, 8]))

        @tf.function
        def loss_and_gradients():
            with tf.GradientTape() as tape:
                tape.watch(hidden)
                loss = tf.reduce_sum(effgrad.fused_sparse_cross_entropy(hidden, kernel, labels, transposed=True))
            return tape.gradient(loss, [hidden, kernel])

        graph = loss_and_gradients.get_concrete_function().graph.as_graph_def()
        return len(graph.node) + sum(len(f.node_def) for f in graph.library.function)

    # 41 chunks and 5 (first, loop, last): the same but for a few constants; unrolled, dozens of nodes a chunk
    assert abs(nodes(16 * 40 + 5) - nodes(16 * 4 + 5)) < 10
