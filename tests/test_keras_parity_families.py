"""attach + fit equals stock Keras fit in the families a red team found different, and a random harness over them.

Every comparison is with stock ``model.fit`` on an identical model (weights,
optimizer iterations, non-trainable state, logged loss), never with effgrad.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import effgrad
from conftest import assert_variables_close


def _fit_both(make, compile_kwargs, x, y, sample_weight=None, batch_size=12, **attach_options):
    stock, ours = make(), make()
    for model in (stock, ours):
        model.compile(**compile_kwargs())
    effgrad.attach(ours, **attach_options)
    kwargs = dict(batch_size=batch_size, epochs=1, shuffle=False, verbose=0, sample_weight=sample_weight)
    h_stock = stock.fit(x, y, **kwargs).history
    h_ours = ours.fit(x, y, **kwargs).history
    return stock, ours, h_stock, h_ours


def _assert_same_training(stock, ours, h_stock, h_ours, atol=1e-6):
    assert_variables_close(ours.variables, stock.variables, atol=atol)  # trainable and non-trainable state
    assert int(ours.optimizer.iterations) == int(stock.optimizer.iterations)
    np.testing.assert_allclose(h_ours["loss"], h_stock["loss"], rtol=1e-5, atol=1e-7)


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


@pytest.mark.parametrize("micro_batches", [1, 3])
def test_loss_weights_scale_the_loss_as_in_keras(rng, micro_batches):
    x, y = rng.normal(size=(24, 5)).astype("float32"), rng.normal(size=(24, 3)).astype("float32")
    compile_kwargs = lambda: {"optimizer": keras.optimizers.SGD(0.05), "loss": "mse", "loss_weights": [5.0]}  # noqa: E731
    result = _fit_both(_mlp, compile_kwargs, x, y, micro_batches=micro_batches)
    _assert_same_training(*result)
    assert result[3]["loss"][0] > 3.0  # 5x the plain MSE of ~1: the weight is really applied


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_one_loss_for_several_outputs_is_summed_over_them(rng, micro_batches):
    x = rng.normal(size=(24, 5)).astype("float32")
    y = [rng.normal(size=(24, 1)).astype("float32") for _ in range(2)]
    compile_kwargs = lambda: {"optimizer": keras.optimizers.SGD(0.05), "loss": "mse"}  # noqa: E731
    _assert_same_training(*_fit_both(_two_heads, compile_kwargs, x, y, micro_batches=micro_batches))


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_dict_of_losses_with_loss_weights_and_outputs_of_different_shapes(rng, micro_batches):
    x = rng.normal(size=(24, 5)).astype("float32")
    y = {"a": rng.normal(size=(24, 1)).astype("float32"), "b": rng.integers(0, 4, size=(24,))}
    w = rng.uniform(0.2, 2.0, size=24).astype("float32")
    compile_kwargs = lambda: {  # noqa: E731
        "optimizer": keras.optimizers.Adam(0.01),
        "loss": {"a": "mse", "b": keras.losses.SparseCategoricalCrossentropy(from_logits=True)},
        "loss_weights": {"a": 0.3, "b": 2.0},
    }
    make = lambda: _two_heads(second=4, as_dict=True)  # noqa: E731
    _assert_same_training(*_fit_both(make, compile_kwargs, x, y, w, micro_batches=micro_batches), atol=1e-5)


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


def test_embedding_with_adam_gets_the_same_update_for_every_micro_batches(rng):
    """Duplicate ids: every k gives Adam the summed (dense) gradient; stock Keras k=1 squares duplicates apart."""
    tokens = rng.integers(0, 5, size=(24, 6)).astype("int32")  # 6 ids from 5: every row repeats one
    labels = rng.integers(0, 3, size=24)
    reference = _dense_gradient_adam_reference(tokens, labels)
    compile_kwargs = lambda: {  # noqa: E731
        "optimizer": keras.optimizers.Adam(0.1),
        "loss": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    }
    for k in (1, 2, 4):
        stock, ours, *_ = _fit_both(_embedding_classifier, compile_kwargs, tokens, labels, micro_batches=k)
        assert_variables_close(ours.trainable_variables, reference.trainable_variables, atol=1e-5)
    # Stock fit differs here: its Adam squares each duplicate row of the IndexedSlices separately.
    assert not np.allclose(stock.get_weights()[0], ours.get_weights()[0], atol=1e-4)


@pytest.mark.parametrize("micro_batches", [1, 2, 4])
def test_embedding_with_sgd_equals_stock_fit_for_every_micro_batches(rng, micro_batches):
    """SGD is linear in the gradient: summing duplicate rows first changes nothing."""
    tokens, labels = rng.integers(0, 5, size=(24, 6)).astype("int32"), rng.integers(0, 3, size=24)
    compile_kwargs = lambda: {  # noqa: E731
        "optimizer": keras.optimizers.SGD(0.1),
        "loss": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    }
    _assert_same_training(
        *_fit_both(_embedding_classifier, compile_kwargs, tokens, labels, micro_batches=micro_batches)
    )


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_embedding_with_adam_equals_stock_fit_without_duplicate_ids(rng, micro_batches):
    """Without a duplicate id in a batch, the summed gradient and Keras's IndexedSlices are the same rows."""
    tokens = np.concatenate([rng.permutation(5) for _ in range(4)])[:, None].astype("int32")  # batches of 5 ids
    labels = rng.integers(0, 3, size=20)
    compile_kwargs = lambda: {  # noqa: E731
        "optimizer": keras.optimizers.Adam(0.1),
        "loss": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    }
    result = _fit_both(_embedding_one_token, compile_kwargs, tokens, labels, batch_size=5, micro_batches=micro_batches)
    _assert_same_training(*result, atol=1e-5)


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


@pytest.mark.parametrize("micro_batches", [1, 3])
def test_sample_weight_of_shape_batch_by_one(rng, micro_batches):
    x, y = rng.normal(size=(24, 5)).astype("float32"), rng.normal(size=(24, 3)).astype("float32")
    w = rng.uniform(0.0, 2.0, size=(24, 1)).astype("float32")
    compile_kwargs = lambda: {"optimizer": keras.optimizers.SGD(0.1), "loss": "mse"}  # noqa: E731
    _assert_same_training(*_fit_both(_mlp, compile_kwargs, x, y, w, micro_batches=micro_batches))


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
FAMILIES = ["loss_weights", "multi_output", "embedding_sgd", "zero_weight_batch", "weights_b1", "stateful_rnn"]


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
    make, y, extra = _mlp, r.normal(size=(n, 3)).astype("float32"), {}
    if family == "loss_weights":
        extra = {"loss_weights": [float(r.uniform(0.1, 5.0))]}
    elif family == "multi_output":
        make, single = (lambda: _two_heads(second=2)), loss  # noqa: E731
        y = [r.normal(size=(n, 1)).astype("float32"), r.normal(size=(n, 2)).astype("float32")]
        loss = lambda: [single(), keras.losses.MeanAbsoluteError(reduction=reduction)]  # noqa: E731
        extra = {"loss_weights": [float(r.uniform(0.1, 2)), float(r.uniform(0.1, 2))]}
    elif family == "embedding_sgd":
        make, opt = _embedding_classifier, keras.optimizers.SGD  # Adam: see the dense-gradient test
        x, y = r.integers(0, 5, size=(n, 6)).astype("int32"), r.integers(0, 3, size=n)
        loss = lambda: keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=reduction)  # noqa: E731
    elif family == "zero_weight_batch":
        make, w = (_bn_regularized if k == 1 else _regularized), r.uniform(0.0, 2.0, size=n).astype("float32")
        w[:bs] = 0.0
    elif family == "weights_b1":
        w = r.uniform(0.0, 2.0, size=(n, 1)).astype("float32")
    elif family == "stateful_rnn":
        make, k, n = _stateful_rnn, 1, 24
        x, y = r.normal(size=(n, 4, 2)).astype("float32"), r.normal(size=(n, 3)).astype("float32")
        w = None if w is None else w[:n]
    compile_kwargs = lambda: {"optimizer": opt(lr), "loss": loss(), **extra}  # noqa: E731
    return family, make, compile_kwargs, x, y, w, bs, k


@pytest.mark.parametrize("seed", range(12))
def test_random_configurations_of_the_families_equal_stock_fit(seed):
    family, make, compile_kwargs, x, y, w, bs, k = _random_case(seed)
    _assert_same_training(*_fit_both(make, compile_kwargs, x, y, w, batch_size=bs, micro_batches=k), atol=2e-5)


def _token_tagger():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((6,), dtype="int32"), keras.layers.Embedding(7, 4), keras.layers.Dense(4)])


@pytest.mark.parametrize("micro_batches", [1, 3])
def test_ignore_class_masks_the_loss_as_keras_does(rng, micro_batches):
    """The loss's own mask (ignore_class) joins y_pred's: ignored tokens weigh nothing, normalization included."""
    tokens = rng.integers(0, 7, size=(12, 6)).astype("int32")
    labels = rng.integers(0, 4, size=(12, 6))
    labels[:, 3:] = 0  # half the positions are the ignored class
    compile_kwargs = lambda: {  # noqa: E731
        "optimizer": keras.optimizers.SGD(0.5),
        "loss": keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=0),
    }
    _assert_same_training(*_fit_both(_token_tagger, compile_kwargs, tokens, labels, micro_batches=micro_batches))
