"""attach + fit equals stock Keras fit in the families a red team found different, and a random harness over them.

Every comparison is with stock Keras's training of one epoch on an identical model (weights, optimizer
iterations, non-trainable state, logged loss), never with effgrad: its train step on each batch in order
(``stock_fit``: fit without its tf.data pipeline). Options that train the same thing (micro-batches,
XLA) are compared with one stock run.
"""

import functools

import keras
import numpy as np
import pytest
import tensorflow as tf

import effgrad
from conftest import assert_variables_close
from test_keras_parity import attached_fit, stock_fit


def _stock(make, compile_kwargs, x, y, sample_weight=None, batch_size=12):
    """Stock Keras's train step run eagerly: the same step as traced (test_keras_parity's
    test_tf_function_and_eager_reference_match_fit checks it), without a trace per reference. Traced for
    _bn_regularized: the bias before its BatchNorm has a gradient of zero up to rounding, which Adam
    scales to full steps, and eager rounding differs from the graph's."""
    stock = make()
    stock.compile(**compile_kwargs(), run_eagerly=make is not _bn_regularized)
    if not stock.run_eagerly:  # its slots made now: train_on_batch traces once, not twice
        stock.optimizer.build(stock.trainable_variables)
    return stock, stock_fit(stock, x, y, sample_weight, batch_size)


def _fit_both(make, compile_kwargs, x, y, sample_weight=None, batch_size=12, **attach_options):
    stock, h_stock = _stock(make, compile_kwargs, x, y, sample_weight, batch_size)
    ours, h_ours = attached_fit(make, compile_kwargs, x, y, sample_weight, batch_size, **attach_options)
    return stock, ours, h_stock, h_ours


def _assert_same_training(stock, ours, h_stock, h_ours, atol=1e-6, case=None):
    try:
        assert_variables_close(ours.variables, stock.variables, atol=atol)  # trainable and non-trainable state
        assert int(ours.optimizer.iterations) == int(stock.optimizer.iterations)
        np.testing.assert_allclose(h_ours["loss"], h_stock["loss"], rtol=1e-5, atol=1e-7)
    except AssertionError as err:
        if case is None:
            raise
        raise AssertionError(f"{case}: {err}") from None


def _assert_each_trains_as_stock(make, compile_kwargs, x, y, sample_weight=None, atol=1e-6, micro_batches=(1, 2)):
    """attach(micro_batches=k) + fit equals one stock run, for each k; the attached histories."""
    stock, h_stock = _stock(make, compile_kwargs, x, y, sample_weight)
    histories = []
    for k in micro_batches:
        ours, h_ours = attached_fit(make, compile_kwargs, x, y, sample_weight, micro_batches=k)
        _assert_same_training(stock, ours, h_stock, h_ours, atol, case=f"micro_batches={k}")
        histories.append(h_ours)
    return histories


def _mlp(outputs=3, seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((5,)), keras.layers.Dense(7, activation="tanh"), keras.layers.Dense(outputs)])


def _two_heads(seed=0, second=1, names=("a", "b"), as_dict=False):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((5,))
    h = keras.layers.Dense(7, activation="tanh")(inputs)
    a = keras.layers.Dense(1, name=names[0])(h)
    b = keras.layers.Dense(second, name=names[1])(h)
    return keras.Model(inputs, {names[0]: a, names[1]: b} if as_dict else [a, b])


def test_loss_weights_scale_the_loss_as_in_keras(rng):
    x, y = rng.normal(size=(24, 5)).astype("float32"), rng.normal(size=(24, 3)).astype("float32")
    compile_kwargs = lambda: {"optimizer": keras.optimizers.SGD(0.05), "loss": "mse", "loss_weights": [5.0]}  # noqa: E731
    for history in _assert_each_trains_as_stock(_mlp, compile_kwargs, x, y, micro_batches=(1, 3)):
        assert history["loss"][0] > 3.0  # 5x the plain MSE of ~1: the weight is really applied


def test_one_loss_for_several_outputs_is_summed_over_them(rng):
    x = rng.normal(size=(24, 5)).astype("float32")
    y = [rng.normal(size=(24, 1)).astype("float32") for _ in range(2)]
    compile_kwargs = lambda: {"optimizer": keras.optimizers.SGD(0.05), "loss": "mse"}  # noqa: E731
    _assert_each_trains_as_stock(_two_heads, compile_kwargs, x, y)


def test_dict_of_losses_with_loss_weights_and_outputs_of_different_shapes(rng):
    x = rng.normal(size=(24, 5)).astype("float32")
    y = {"a": rng.normal(size=(24, 1)).astype("float32"), "b": rng.integers(0, 4, size=(24,))}
    w = rng.uniform(0.2, 2.0, size=24).astype("float32")
    compile_kwargs = lambda: {  # noqa: E731
        "optimizer": keras.optimizers.Adam(0.01),
        "loss": {"a": "mse", "b": keras.losses.SparseCategoricalCrossentropy(from_logits=True)},
        "loss_weights": {"a": 0.3, "b": 2.0},
    }
    make = lambda: _two_heads(second=4, as_dict=True)  # noqa: E731
    _assert_each_trains_as_stock(make, compile_kwargs, x, y, w, atol=1e-5)


def test_list_of_losses_with_mean_with_sample_weight_and_micro_batches(rng):
    x = rng.normal(size=(25, 5)).astype("float32")  # uneven last micro-batch
    y = [rng.normal(size=(25, 1)).astype("float32"), rng.normal(size=(25, 2)).astype("float32")]
    w = rng.uniform(0.0, 2.0, size=25).astype("float32")
    compile_kwargs = lambda: {  # noqa: E731
        "optimizer": keras.optimizers.SGD(0.1),
        "loss": [
            keras.losses.MeanSquaredError(reduction="mean_with_sample_weight"),
            keras.losses.MeanAbsoluteError(reduction="mean_with_sample_weight"),
        ],
        "loss_weights": [1.0, 0.5],
    }
    make = lambda: _two_heads(second=2)  # noqa: E731
    _assert_same_training(*_fit_both(make, compile_kwargs, x, y, w, batch_size=25, micro_batches=4))


def _masked_two_outputs():
    keras.utils.set_random_seed(0)
    tokens = keras.Input((6,), dtype="int32")
    h = keras.layers.Embedding(7, 4, mask_zero=True)(tokens)
    return keras.Model(tokens, [keras.layers.Dense(3, name="a")(h), keras.layers.Dense(1, name="b")(h)])


def test_terms_that_cannot_be_combined_exactly_are_refused_before_any_update(rng):
    tokens = rng.integers(0, 7, size=(12, 6)).astype("int32")
    y = [rng.integers(0, 3, size=(12, 6)), rng.normal(size=(12, 6, 1)).astype("float32")]
    loss = [keras.losses.SparseCategoricalCrossentropy(from_logits=True), "mse"]
    compile_kwargs = lambda: {"optimizer": keras.optimizers.SGD(0.1), "loss": loss}  # noqa: E731
    _assert_same_training(*_fit_both(_masked_two_outputs, compile_kwargs, tokens, y))  # one micro-batch: exact
    model = _masked_two_outputs()
    model.compile(**compile_kwargs())
    effgrad.attach(model, micro_batches=2)
    before = model.get_weights()
    with pytest.raises(ValueError, match="normalized by different quantities"):
        model.fit(tokens, y, batch_size=12, verbose=0)
    for a, b in zip(model.get_weights(), before):
        np.testing.assert_array_equal(a, b)


def _embedding_classifier():
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((6,), dtype="int32"),
            keras.layers.Embedding(5, 4),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(3),
        ]
    )


def _dense_gradient_adam_reference(tokens, labels, batch_size=12):
    """Keras's Adam fed the dense embedding gradient (duplicate token rows summed: the gradient itself)."""
    model, optimizer = _embedding_classifier(), keras.optimizers.Adam(0.1)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    for start in range(0, len(tokens), batch_size):
        with tf.GradientTape() as tape:
            loss = loss_fn(labels[start : start + batch_size], model(tokens[start : start + batch_size]))
        grads = [tf.convert_to_tensor(g) for g in tape.gradient(loss, model.trainable_variables)]
        optimizer.apply(grads, model.trainable_variables)
    return model


@pytest.mark.parametrize("fused_update", [True, False], ids=["fused", "gathered"])
def test_an_optimizers_loss_scale_factor_gives_keras_update(rng, fused_update):
    # Keras multiplies the loss by it and its optimizer's apply divides the gradients by it.
    x, y = rng.normal(size=(24, 5)).astype("float32"), rng.normal(size=(24, 3)).astype("float32")
    compile_kwargs = lambda: {"optimizer": keras.optimizers.SGD(0.05, loss_scale_factor=128.0), "loss": "mse"}  # noqa: E731
    stock, ours, h_stock, h_ours = _fit_both(_mlp, compile_kwargs, x, y, fused_update=fused_update)
    assert ours.effgrad_step.fused_update is fused_update
    _assert_same_training(stock, ours, h_stock, h_ours)


def _table_looked_up_twice(seed=0):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((6,), dtype="int32")
    table = keras.layers.Embedding(50, 8)
    h = keras.layers.Add()([table(inputs), table(inputs + 1)])
    return keras.Model(inputs, keras.layers.Dense(4)(keras.layers.GlobalAveragePooling1D()(h)))


@pytest.mark.parametrize("fused_update", [True, False], ids=["fused", "gathered"])
def test_a_table_looked_up_twice_gets_keras_update_with_adam(rng, fused_update):
    # Adam's per-row state sees each lookup's rows as Keras hands them over, not their dense sum.
    x, y = rng.integers(0, 40, (24, 6)).astype("int32"), rng.integers(0, 4, 24)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    compile_kwargs = lambda: {"optimizer": keras.optimizers.Adam(0.01), "loss": loss}  # noqa: E731
    stock, ours, h_stock, h_ours = _fit_both(_table_looked_up_twice, compile_kwargs, x, y, fused_update=fused_update)
    assert ours.effgrad_step.fused_update is fused_update
    _assert_same_training(stock, ours, h_stock, h_ours)


def test_embedding_with_repeated_ids_gets_keras_update_at_one_micro_batch(rng):
    """One micro-batch on one device: the embedding's IndexedSlices reach the optimizer as in stock fit
    (Keras's Adam squares each duplicate row apart), over several steps: each optimizer, mode and update
    path, each pair of them once, against one stock run (without XLA) per optimizer."""
    tokens = rng.integers(0, 5, size=(48, 6)).astype("int32")  # 6 ids from 5: every row repeats one
    labels = rng.integers(0, 3, size=48)
    summed = _dense_gradient_adam_reference(tokens, labels).get_weights()[0]

    def compile_kwargs(optimizer, jit_compile=False):
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        return {"optimizer": optimizer(0.1), "loss": loss, "jit_compile": jit_compile}

    cases = {
        keras.optimizers.Adam: [(False, False), (True, True)],
        keras.optimizers.AdamW: [(True, False), (False, True)],
    }
    for optimizer, modes in cases.items():
        stock, h_stock = _stock(_embedding_classifier, functools.partial(compile_kwargs, optimizer), tokens, labels)
        for jit_compile, fused_update in modes:
            options = functools.partial(compile_kwargs, optimizer, jit_compile)
            ours, h_ours = attached_fit(_embedding_classifier, options, tokens, labels, fused_update=fused_update)
            case = f"{optimizer.__name__}, XLA: {jit_compile}, fused_update: {fused_update}"
            assert ours.effgrad_step.options.jit_compile is jit_compile, case
            _assert_same_training(stock, ours, h_stock, h_ours, atol=1e-5, case=case)
            assert not np.allclose(ours.get_weights()[0], summed), case


def test_embedding_with_adam_and_micro_batches_gets_the_summed_gradient(rng):
    """With micro-batches the gradients are summed in a dense accumulator (as Keras's own
    gradient_accumulation_steps sums them): Adam gets duplicate rows summed, for every k >= 2 (one traced
    loop serves every k >= 2: k=4 stands for them, its duplicates split over the most micro-batches)."""
    tokens = rng.integers(0, 5, size=(24, 6)).astype("int32")
    labels = rng.integers(0, 3, size=24)
    reference = _dense_gradient_adam_reference(tokens, labels)
    compile_kwargs = lambda: {  # noqa: E731
        "optimizer": keras.optimizers.Adam(0.1),
        "loss": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    }
    ours, _ = attached_fit(_embedding_classifier, compile_kwargs, tokens, labels, micro_batches=4)
    assert_variables_close(ours.trainable_variables, reference.trainable_variables, atol=1e-5)


def test_embedding_with_sgd_equals_stock_fit_for_every_micro_batches(rng):
    """SGD is linear in the gradient: summing duplicate rows first changes nothing (k=1: the IndexedSlices;
    k=4: the dense accumulator, one traced loop for every k >= 2)."""
    tokens, labels = rng.integers(0, 5, size=(24, 6)).astype("int32"), rng.integers(0, 3, size=24)
    compile_kwargs = lambda: {  # noqa: E731
        "optimizer": keras.optimizers.SGD(0.1),
        "loss": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    }
    _assert_each_trains_as_stock(_embedding_classifier, compile_kwargs, tokens, labels, micro_batches=(1, 4))


def test_embedding_with_adam_equals_stock_fit_without_duplicate_ids(rng):
    """Without a duplicate id in a batch, the summed gradient and Keras's IndexedSlices are the same rows."""
    tokens = np.concatenate([rng.permutation(5) for _ in range(4)])[:, None].astype("int32")  # batches of 5 ids
    labels = rng.integers(0, 3, size=20)
    compile_kwargs = lambda: {  # noqa: E731
        "optimizer": keras.optimizers.Adam(0.1),
        "loss": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    }
    stock, h_stock = _stock(_embedding_one_token, compile_kwargs, tokens, labels, batch_size=5)
    for k in (1, 2):
        ours, h_ours = attached_fit(_embedding_one_token, compile_kwargs, tokens, labels, batch_size=5, micro_batches=k)
        _assert_same_training(stock, ours, h_stock, h_ours, atol=1e-5, case=f"micro_batches={k}")


def _embedding_one_token():
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [keras.Input((1,), dtype="int32"), keras.layers.Embedding(5, 4), keras.layers.Flatten(), keras.layers.Dense(3)]
    )


def _bn_regularized():
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((5,)),
            keras.layers.Dense(7, kernel_regularizer="l2"),
            keras.layers.BatchNormalization(),
            keras.layers.Dense(3),
        ]
    )


def _regularized():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((5,)), keras.layers.Dense(7, kernel_regularizer="l2"), keras.layers.Dense(3)])


# BatchNorm normalizes by micro-batch statistics, so it is compared at one micro-batch only.
@pytest.mark.parametrize("make, micro_batches", [(_bn_regularized, 1), (_regularized, 3)], ids=["batchnorm", "k3"])
def test_all_zero_weight_batch_is_applied_as_stock_fit_applies_it(rng, make, micro_batches):
    x, y = rng.normal(size=(24, 5)).astype("float32"), rng.normal(size=(24, 3)).astype("float32")
    w = np.zeros(24, "float32")
    w[12:] = rng.uniform(0.5, 1.5, size=12)  # the first batch weighs nothing, the second does
    compile_kwargs = lambda: {  # noqa: E731
        "optimizer": keras.optimizers.Adam(0.01),
        "loss": keras.losses.MeanSquaredError(reduction="mean_with_sample_weight"),
    }
    stock, ours, h_stock, h_ours = _fit_both(make, compile_kwargs, x, y, w, micro_batches=micro_batches)
    assert int(ours.optimizer.iterations) == 2  # the zero-weight batch counted
    _assert_same_training(stock, ours, h_stock, h_ours, atol=1e-5)


def test_build_train_step_still_skips_an_all_zero_weight_batch(rng):
    model = _bn_regularized()
    step = effgrad.build_train_step(
        model, keras.losses.MeanSquaredError(), keras.optimizers.Adam(0.01), reduction="mean_with_sample_weight"
    )
    before = [v.numpy().copy() for v in model.variables]
    step(rng.normal(size=(8, 5)).astype("float32"), np.zeros((8, 3), "float32"), np.zeros(8, "float32"))
    for v, b in zip(model.variables, before):
        np.testing.assert_array_equal(v.numpy(), b)
    assert int(step.optimizer.iterations) == 0


def test_sample_weight_of_shape_batch_by_one(rng):
    x, y = rng.normal(size=(24, 5)).astype("float32"), rng.normal(size=(24, 3)).astype("float32")
    w = rng.uniform(0.0, 2.0, size=(24, 1)).astype("float32")
    compile_kwargs = lambda: {"optimizer": keras.optimizers.SGD(0.1), "loss": "mse"}  # noqa: E731
    _assert_each_trains_as_stock(_mlp, compile_kwargs, x, y, w, micro_batches=(1, 3))


def _stateful_rnn():
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [keras.Input((4, 2), batch_size=12), keras.layers.SimpleRNN(3, stateful=True), keras.layers.Dense(3)]
    )


def test_stateful_rnn_trains_and_carries_its_state_as_in_keras(rng):
    x, y = rng.normal(size=(36, 4, 2)).astype("float32"), rng.normal(size=(36, 3)).astype("float32")
    compile_kwargs = lambda: {"optimizer": keras.optimizers.SGD(0.1), "loss": "mse"}  # noqa: E731
    stock, ours, h_stock, h_ours = _fit_both(_stateful_rnn, compile_kwargs, x, y)
    _assert_same_training(stock, ours, h_stock, h_ours)
    state = ours.layers[0].states[0].numpy()
    assert np.abs(state).max() > 0  # the state was written, and equals stock's
    np.testing.assert_allclose(state, stock.layers[0].states[0].numpy(), atol=1e-6)


def test_stateful_rnn_with_micro_batches_is_refused_clearly(rng):
    model = _stateful_rnn()
    model.compile(optimizer="sgd", loss="mse")
    effgrad.attach(model, micro_batches=2)
    with pytest.raises(ValueError, match="stateful RNN.*micro_batches=1"):
        model.fit(rng.normal(size=(12, 4, 2)), rng.normal(size=(12, 3)), batch_size=12, verbose=0)


def test_labels_that_do_not_fit_the_output_get_one_clear_error(rng):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(10)])
    model.compile(optimizer="adam", loss="mse")
    effgrad.attach(model, micro_batches=2)
    with pytest.raises(ValueError, match=r"y \(shape \[None\]\).*output \(shape \[None, 10\]\)"):
        model.fit(rng.normal(size=(24, 5)), rng.integers(0, 10, size=24), verbose=0)
    step = effgrad.build_train_step(model, "mse", keras.optimizers.SGD())
    with pytest.raises(ValueError, match="SparseCategoricalCrossentropy"):
        step(rng.normal(size=(8, 5)).astype("float32"), rng.integers(0, 10, size=8))


# --------------------------------------------------------------------------- random harness
FAMILIES = [
    "loss_weights", "multi_output", "embedding_sgd", "zero_weight_batch", "weights_b1", "stateful_rnn",
    "embedding_adam", "loss_subclass", "head_subclass", "custom_layer", "bad_labels", "unbuilt",
]  # fmt: skip


class _ScaledLoss(keras.losses.SparseCategoricalCrossentropy):
    """A user's loss subclass with its own call: never replaced by the plain cross-entropy."""

    def call(self, y_true, y_pred):
        return 1.5 * super().call(y_true, y_pred)


class _ScaledDense(keras.layers.Dense):
    """A user's Dense subclass with its own call: never fused as a plain Dense."""

    def call(self, inputs):
        return super().call(inputs) * 0.5


class _Residual(keras.layers.Layer):
    """A custom layer with its own weights and call."""

    def build(self, shape):
        self.w = self.add_weight(shape=(shape[-1],), initializer="ones")

    def call(self, x):
        return x + keras.ops.tanh(x * self.w)


def _tagger(head=keras.layers.Dense, classes=40, built=True, middle=None):
    keras.utils.set_random_seed(0)
    layers = [keras.layers.Embedding(9, 8), *([middle()] if middle else []), head(classes)]
    return keras.Sequential(([keras.Input((6,), dtype="int32")] if built else []) + layers)


def _random_case(seed):
    r = np.random.default_rng(seed)
    family = FAMILIES[seed % len(FAMILIES)]
    k = int(r.choice([1, 2, 3]))
    n, bs = int(r.choice([24, 25])), 12
    x = r.normal(size=(n, 5)).astype("float32")
    opt = [keras.optimizers.SGD, keras.optimizers.Adam][int(r.integers(2))]
    lr = float(r.choice([0.01, 0.1]))
    reduction = str(r.choice(["sum_over_batch_size", "mean_with_sample_weight", "sum"]))
    w = r.uniform(0.0, 2.0, size=n).astype("float32") if r.random() < 0.5 else None
    loss = lambda: keras.losses.MeanSquaredError(reduction=reduction)  # noqa: E731
    make, y, extra, options = _mlp, r.normal(size=(n, 3)).astype("float32"), {}, {}
    sparse = lambda: keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=reduction)  # noqa: E731
    tokens, tags = r.integers(0, 9, size=(n, 6)).astype("int32"), r.integers(0, 40, size=(n, 6))
    fused = {"fused_loss": str(r.choice(["auto", "true"])) == "true" or "auto"}  # forced: nothing stops it
    if family == "loss_weights":
        extra = {"loss_weights": [float(r.uniform(0.1, 5.0))]}
    elif family == "multi_output":
        make, single = (lambda: _two_heads(second=2)), loss  # noqa: E731
        y = [r.normal(size=(n, 1)).astype("float32"), r.normal(size=(n, 2)).astype("float32")]
        loss = lambda: [single(), keras.losses.MeanAbsoluteError(reduction=reduction)]  # noqa: E731
        extra = {"loss_weights": [float(r.uniform(0.1, 2)), float(r.uniform(0.1, 2))]}
    elif family in ("embedding_sgd", "embedding_adam"):
        make = _embedding_classifier
        opt = keras.optimizers.SGD if family == "embedding_sgd" else keras.optimizers.Adam
        k = k if family == "embedding_sgd" else 1  # Adam with k >= 2: the summed gradient (own test)
        x, y, loss = r.integers(0, 5, size=(n, 6)).astype("int32"), r.integers(0, 3, size=n), sparse
    elif family == "zero_weight_batch":
        make, w = (_bn_regularized if k == 1 else _regularized), r.uniform(0.0, 2.0, size=n).astype("float32")
        w[:bs] = 0.0
    elif family == "weights_b1":
        w = r.uniform(0.0, 2.0, size=(n, 1)).astype("float32")
    elif family == "stateful_rnn":
        make, k, n = _stateful_rnn, 1, 24
        x, y = r.normal(size=(n, 4, 2)).astype("float32"), r.normal(size=(n, 3)).astype("float32")
        w = None if w is None else w[:n]
    elif family == "loss_subclass":
        make, x, y, options = _tagger, tokens, tags, fused
        loss = lambda: _ScaledLoss(from_logits=True, reduction=reduction)  # noqa: E731
    elif family == "head_subclass":
        make, x, y, loss, options = (lambda: _tagger(head=_ScaledDense)), tokens, tags, sparse, fused  # noqa: E731
    elif family == "custom_layer":
        make, x, y, loss, options = (lambda: _tagger(middle=_Residual)), tokens, tags, sparse, fused  # noqa: E731
    elif family == "bad_labels":
        tags[int(r.integers(bs)), int(r.integers(6))] = int(r.choice([-1, 40, 47]))  # in the first batch
        make, x, y, loss, options = _tagger, tokens, tags, sparse, fused
    elif family == "unbuilt":
        make = lambda: _tagger(built=False)  # noqa: E731  (fit builds it from the first batch, as in Keras)
        x, y, loss = tokens, tags, sparse
    if family in ("loss_subclass", "head_subclass", "custom_layer", "bad_labels", "unbuilt"):
        w = None if w is None else w[:, None]  # per example, against per-token losses
        k = 1 if opt is keras.optimizers.Adam else k  # repeated ids, Adam, k >= 2: the summed gradient (own test)
    options = {**options, "micro_batches": k}
    compile_kwargs = lambda: {"optimizer": opt(lr), "loss": loss(), **extra}  # noqa: E731
    return family, make, compile_kwargs, x, y, w, bs, options


@pytest.mark.parametrize("seed", range(len(FAMILIES)))  # each family once, its options drawn
def test_random_configurations_of_the_families_equal_stock_fit_or_are_refused_with_a_reason(seed):
    """Every draw trains as stock fit trains, or fails as stock fails, or is refused with a reason
    (fused_loss=True where the loss or head is not proven to be what the fused loss computes)."""
    family, make, compile_kwargs, x, y, w, bs, options = _random_case(seed)
    try:
        result = _fit_both(make, compile_kwargs, x, y, w, batch_size=bs, **options)
    except tf.errors.InvalidArgumentError as err:  # stock fit raised it first, on the same batch
        assert family == "bad_labels", err
        ours = make()
        ours.compile(**compile_kwargs())
        effgrad.attach(ours, **options)
        before = ours.get_weights()
        with pytest.raises(tf.errors.InvalidArgumentError, match="valid range"):
            ours.fit(x, y, batch_size=bs, shuffle=False, verbose=0, sample_weight=w)
        for a, b in zip(ours.get_weights(), before):
            np.testing.assert_array_equal(a, b)
        return
    except ValueError as err:  # refused, saying why
        assert options.get("fused_loss") is True and family in ("loss_subclass", "head_subclass"), err
        assert "cannot apply" in str(err) and "\n" not in str(err)
        return
    assert family != "bad_labels", "stock fit trained on labels outside the classes"
    _assert_same_training(*result, atol=2e-5)


def _token_tagger():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((6,), dtype="int32"), keras.layers.Embedding(7, 4), keras.layers.Dense(4)])


def test_ignore_class_masks_the_loss_as_keras_does(rng):
    """The loss's own mask (ignore_class) joins y_pred's: ignored tokens weigh nothing, normalization included."""
    tokens = rng.integers(0, 7, size=(12, 6)).astype("int32")
    labels = rng.integers(0, 4, size=(12, 6))
    labels[:, 3:] = 0  # half the positions are the ignored class
    compile_kwargs = lambda: {  # noqa: E731
        "optimizer": keras.optimizers.SGD(0.5),
        "loss": keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=0),
    }
    _assert_each_trains_as_stock(_token_tagger, compile_kwargs, tokens, labels, micro_batches=(1, 3))


def test_per_example_weights_of_token_losses_are_normalized_as_keras_does(rng):
    """[batch, 1] weights of [batch, T] token losses: Keras's mean_with_sample_weight divides by the sum of
    the weights as given (over the batch), not broadcast to every token (T times more)."""
    tokens, tags = rng.integers(0, 9, size=(24, 6)).astype("int32"), rng.integers(0, 40, size=(24, 6))
    w = rng.uniform(0.1, 2.0, size=(24, 1)).astype("float32")
    compile_kwargs = lambda: {  # noqa: E731
        "optimizer": keras.optimizers.SGD(0.1),
        "loss": keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="mean_with_sample_weight"),
    }
    _assert_each_trains_as_stock(_tagger, compile_kwargs, tokens, tags, w)
