"""tf.distribute: the step equals the single-device update; one reduction; agreed skips."""

import json
import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf

import effgrad
from conftest import assert_variables_close
from helpers import mlp, plain_step, run_cluster, sequence_model


def _replica_values(variable, strategy):
    return [t.numpy() for t in strategy.experimental_local_results(variable.value)]


def _count_reductions(strategy, monkeypatch) -> list:
    """The number of values each cross-replica batch reduction carries, appended as they are made."""
    calls = []
    extended = type(strategy.extended)
    original = extended.batch_reduce_to

    def counting(self, reduce_op, value_destination_pairs, options=None):
        calls.append(len(value_destination_pairs))
        return original(self, reduce_op, value_destination_pairs, options)

    monkeypatch.setattr(extended, "batch_reduce_to", counting)
    return calls


@pytest.mark.parametrize("weighted", [True, False], ids=["weighted", "unweighted"])
@pytest.mark.parametrize("micro_batches", [1, 3])
def test_mirrored_step_equals_single_device_full_batch_with_one_reduction(
    strategy, rng, monkeypatch, micro_batches, weighted
):
    x = rng.normal(size=(11, 5)).astype("float32")  # 6 rows on one replica, 5 on the other
    y = rng.normal(size=(11, 3)).astype("float32")
    w = np.concatenate([rng.uniform(0, 0.2, 6), rng.uniform(1, 3, 5)]).astype("float32")  # uneven per replica
    w = w if weighted else None
    reference = mlp()
    plain_step(reference, keras.losses.mean_squared_error, keras.optimizers.Adam(0.1), x, y, w)
    calls = _count_reductions(strategy, monkeypatch)
    with strategy.scope():
        model, opt = mlp(), keras.optimizers.Adam(0.1)
    step = effgrad.build_train_step(model, "mse", opt, micro_batches=micro_batches, strategy=strategy)
    step(x, y, w)
    for variable, expected in zip(model.trainable_variables, reference.trainable_variables):
        for value in _replica_values(variable, strategy):
            np.testing.assert_allclose(value, expected.numpy(), rtol=1e-5, atol=1e-6)
    # One batched reduction for all replicas (in the cross-replica merge), carrying every
    # gradient plus the two loss sums.
    assert calls == [len(model.trainable_variables) + 2]


def test_mirrored_per_token_mask_and_distributed_dataset(strategy, rng):
    x = rng.normal(size=(8, 5, 4)).astype("float32")
    y = rng.integers(0, 6, size=(8, 5))
    mask = (rng.uniform(size=(8, 5)) > 0.4).astype("float32")
    mask[:4] *= 0.0  # the first replica's rows are almost all padding
    mask[0, 0] = 1.0
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    reference = sequence_model()
    plain_step(reference, loss.call, keras.optimizers.SGD(0.5), x, y, mask)
    with strategy.scope():
        model = sequence_model()
        opt = keras.optimizers.SGD(0.5)
    step = effgrad.build_train_step(model, loss, opt, micro_batches=3, strategy=strategy)
    dataset = strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices((x, y, mask)).batch(8))
    step(*next(iter(dataset)))
    for variable, expected in zip(model.trainable_variables, reference.trainable_variables):
        for value in _replica_values(variable, strategy):
            np.testing.assert_allclose(value, expected.numpy(), rtol=1e-5, atol=1e-6)


def test_inf_on_one_replica_skips_the_step_everywhere(strategy, rng):
    with strategy.scope():
        model, opt = mlp(), keras.optimizers.Adam(0.1)
    ls = None
    step = effgrad.build_train_step(model, "mse", opt, micro_batches=2, loss_scale="dynamic", strategy=strategy)
    ls = step.loss_scale
    x = rng.normal(size=(8, 5)).astype("float32")
    y = rng.normal(size=(8, 3)).astype("float32")
    x[6, 1] = np.inf  # a row of replica 1 only
    before = [v.numpy().copy() for v in model.trainable_variables]
    logs = step(x, y)
    assert not bool(logs["grads_finite"])
    for variable, old in zip(model.trainable_variables, before):
        for value in _replica_values(variable, strategy):
            np.testing.assert_array_equal(value, old)
    assert int(opt.iterations.numpy()) == 0
    assert float(ls.value) == 2.0**14


def test_clipping_acts_on_the_reduced_gradient(strategy):
    """Replica gradients [10, 0] and [0, 10]: clip the mean [5, 5], not each one."""
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")])
        opt = keras.optimizers.SGD(1.0)
    step = effgrad.build_train_step(model, lambda y, p: p[:, 0], opt, clip_norm=1.0, strategy=strategy)
    x = np.array([[10.0, 0.0], [0.0, 10.0]], "float32")  # one row per replica
    step(x, np.zeros((2, 1), "float32"))
    # L = (10 w0 + 10 w1) / 2 -> grad [5, 5], norm 7.07 -> clipped [0.707, 0.707]
    expected = -np.full((2, 1), np.sqrt(0.5), "float32")
    for value in _replica_values(model.trainable_variables[0], strategy):
        np.testing.assert_allclose(value, expected, rtol=1e-5)


def test_distributed_saliency_equals_single_device(strategy, rng):
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input((6, 6, 2)),
                keras.layers.Conv2D(3, 3, activation="tanh"),
                keras.layers.Flatten(),
                keras.layers.Dense(4),
            ]
        )
    x = rng.normal(size=(21, 6, 6, 2)).astype("float32")
    # The gradient against the tape's (no single-device job to trace); SmoothGrad's noise, a function of
    # each row's index, against the single-device job's.
    inputs = tf.constant(x)
    with tf.GradientTape() as tape:
        tape.watch(inputs)
        score = tf.reduce_sum(tf.reduce_max(model(inputs), axis=-1))  # the default target: the arg-max
    expected = {"gradient": tape.gradient(score, inputs).numpy()}
    expected["smoothgrad"] = effgrad.saliency(model, x, method="smoothgrad", batch_size=8, samples=3, progress=False)
    for method, options in [("gradient", {}), ("smoothgrad", {"samples": 3})]:
        sharded = effgrad.saliency(model, x, method=method, batch_size=8, strategy=strategy, progress=False, **options)
        np.testing.assert_allclose(sharded, expected[method], rtol=1e-5, atol=1e-6, err_msg=method)


_WORKER = textwrap.dedent(
    """
    import json, os, sys
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    import numpy as np, tensorflow as tf, keras, effgrad
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(12, 5)).astype("float32")
    y = rng.normal(size=(12, 3)).astype("float32")
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(7, activation="tanh"), keras.layers.Dense(3)])
        optimizer = keras.optimizers.Adam(0.1)
    step = effgrad.build_train_step(model, "mse", optimizer, micro_batches=3, strategy=strategy)
    for _ in range(2):
        step(x, y)  # the same global batch on every worker; each takes its replica's rows
    json.dump([v.numpy().tolist() for v in model.trainable_variables], open(sys.argv[1], "w"))
    """
)


def test_multi_worker_mirrored_strategy_on_loopback(tmp_path, rng):
    run_cluster(_WORKER, [tmp_path / "w{index}.json"])
    results = [json.loads((tmp_path / f"w{i}.json").read_text()) for i in range(2)]
    data = np.random.default_rng(0)
    x = data.normal(size=(12, 5)).astype("float32")
    y = data.normal(size=(12, 3)).astype("float32")
    keras.utils.set_random_seed(0)
    reference = keras.Sequential([keras.Input((5,)), keras.layers.Dense(7, activation="tanh"), keras.layers.Dense(3)])
    opt = keras.optimizers.Adam(0.1)
    for _ in range(2):
        plain_step(reference, keras.losses.mean_squared_error, opt, x, y)
    for a, b in zip(results[0], results[1]):
        np.testing.assert_array_equal(np.array(a), np.array(b))  # identical on both workers
    assert_variables_close([np.array(v) for v in results[0]], reference.trainable_variables, atol=1e-5)


@pytest.mark.parametrize("how", ["checkpoint_sequential", "checkpoint_model"])
def test_checkpointed_model_under_mirrored_strategy_equals_plain(strategy, rng, how):
    def make(checkpointed):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((5,))
        h = keras.layers.Dense(6)(inputs)
        for _ in range(2):  # residual blocks for checkpoint_model, a plain stack for checkpoint_sequential
            branch = keras.layers.Dense(6, activation="tanh")(h)
            h = keras.layers.Add()([h, branch]) if how == "checkpoint_model" else branch
        model = keras.Model(inputs, keras.layers.Dense(3)(h))
        return getattr(effgrad, how)(model, segments=2) if checkpointed else model

    x = rng.normal(size=(9, 5)).astype("float32")
    y = rng.normal(size=(9, 3)).astype("float32")
    reference = make(False)
    plain_step(reference, keras.losses.mean_squared_error, keras.optimizers.SGD(0.1), x, y)
    with strategy.scope():
        model, opt = make(True), keras.optimizers.SGD(0.1)
    effgrad.build_train_step(model, "mse", opt, micro_batches=2, strategy=strategy)(x, y)
    for variable, expected in zip(model.trainable_variables, reference.trainable_variables):
        for value in _replica_values(variable, strategy):
            np.testing.assert_allclose(value, expected.numpy(), rtol=1e-5, atol=1e-6)
