"""shard_state=True: each replica keeps 1/N of the optimizer state and reduced gradients, same updates."""

import json
import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf

import effgrad
from helpers import in_fresh_processes, plain_step, run_cluster


def _model(regularizer=None):
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((40,)),
            keras.layers.Dense(150, activation="tanh", kernel_regularizer=regularizer),
            keras.layers.Dense(3),  # its bias (3 numbers) stays replicated: the plan's 1%
        ]
    )


OPTIMIZERS = {
    "adam": lambda: keras.optimizers.Adam(0.01),
    "adamw": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.1),
    "sgd_momentum": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
    "compact_int8": lambda: effgrad.compact_state(keras.optimizers.Adam(0.01), "int8", block_size=256, min_size=1024),
}


def _train(strategy, shard, optimizer, micro_batches, x, y, policy="float32", regularizer=None, after=None, **options):
    """5 steps; ``after(steps done, model, optimizer)`` after each."""
    keras.config.set_dtype_policy(policy)
    with strategy.scope():
        model, opt = _model(regularizer), OPTIMIZERS[optimizer]()
    step = effgrad.build_train_step(
        model, "mse", opt, micro_batches=micro_batches, strategy=strategy, shard_state=shard, **options
    )
    logs = []
    for i in range(5):
        batch = x.copy()
        if policy == "mixed_float16" and i == 2:
            batch[9, 1] = np.inf  # a row of replica 1: the step is skipped on both
        logs.append({k: float(v) for k, v in step(batch, y).items()})
        if after is not None:
            after(i + 1, model, opt)
    return model, opt, step, logs


def _close(actual, expected, what, scale=None):
    # Within 1e-6 of the largest magnitude of that kind of state: the sums over replicas (and a clip
    # norm from shards) add in another order, which moves the last bits.
    scale = max(np.abs(expected).max() if scale is None else scale, 1e-30)
    np.testing.assert_allclose(actual, expected, rtol=0, atol=1e-6 * scale, err_msg=what)


def _slot_scales(optimizer) -> dict:
    """The largest magnitude of each kind of slot (``..._momentum``, ``..._velocity``) over all variables."""
    scales = {}
    for slot in optimizer.variables:
        kind = slot.path.rsplit("_", 1)[-1]
        scales[kind] = max(scales.get(kind, 0.0), float(np.abs(np.asarray(slot.numpy(), "float64")).max()))
    return scales


def _data(rng):
    x = rng.normal(size=(13, 40)).astype("float32")  # 7 rows on one replica, 6 on the other
    return x, rng.normal(size=(13, 3)).astype("float32")


# compact_state's sharded steps (XLA compiles each update: ~10 s) are compared as these are in
# test_checkpoint_saved_with_2_replicas_restores_with_1_and_continues_equal, which saves them.
@pytest.mark.parametrize(
    "optimizer, micro_batches, options",
    [
        ("adamw", 4, {"clip_norm": 0.5, "regularizer": keras.regularizers.L2(0.01), "policy": "mixed_float16"}),
        ("sgd_momentum", 1, {"per_example_clip": 1.0, "noise_multiplier": 1.1, "seed": 3, "clip_norm": 0.3}),
    ],
    ids=["adamw-k4-clip_norm-regularizer-float16-skip", "sgd_momentum-dp_sgd-clip_norm"],
)
def test_sharded_steps_equal_the_unsharded_step(strategy, rng, optimizer, micro_batches, options):
    x, y = _data(rng)
    unsharded = _train(strategy, False, optimizer, micro_batches, x, y, **options)
    sharded = _train(strategy, True, optimizer, micro_batches, x, y, **options)
    _assert_sharded_equals_unsharded(strategy, optimizer, options, unsharded, sharded)


def _assert_sharded_equals_unsharded(strategy, optimizer, options, unsharded, sharded):
    (model, opt, _, logs), (sharded_model, sharded_opt, step, sharded_logs) = unsharded, sharded
    assert step.shard_state is True and "2 replicas" in step.shard_state_reason
    if options.get("policy"):
        assert [entry["grads_finite"] for entry in sharded_logs] == [1, 1, 0, 1, 1]
    for entry, expected in zip(sharded_logs, logs):
        assert entry == pytest.approx(expected, rel=1e-6)
    for variable, expected in zip(sharded_model.trainable_variables, model.trainable_variables):
        for copy in strategy.experimental_local_results(variable.value):  # every replica's copy
            _close(copy.numpy(), expected.numpy(), variable.path)
    sharded_slots, scales = 0, _slot_scales(opt)
    for slot, expected in zip(sharded_opt.variables, opt.variables):
        whole = np.asarray(expected.numpy(), "float64")
        kind = expected.path.rsplit("_", 1)[-1]
        _close(np.asarray(slot.numpy(), "float64"), whole, slot.path, scales[kind])  # gathered
        shards = [c.numpy() for c in strategy.experimental_local_results(slot.value)]
        if shards[0].size < whole.size:  # each replica holds its part only, and the parts differ
            sharded_slots += 1
            assert all(s.size <= whole.size // 2 + 256 * 2 for s in shards)
            assert not np.array_equal(shards[0], shards[1])
    assert sharded_slots >= 3 * (1 if optimizer == "sgd_momentum" else 2)


_FOUR_REPLICAS = textwrap.dedent(
    """
    import json, sys
    import numpy as np, tensorflow as tf, keras, effgrad
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 4)
    strategy = tf.distribute.MirroredStrategy([f"CPU:{i}" for i in range(4)])
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(32, 64)).astype("float32"), rng.normal(size=(32, 3)).astype("float32")
    out = {}
    for shard in (False, True):
        with strategy.scope():
            keras.utils.set_random_seed(0)
            layers = [keras.Input((64,)), keras.layers.Dense(96, activation="relu"), keras.layers.Dense(3)]
            model, optimizer = keras.Sequential(layers), keras.optimizers.Adam(0.01)
        step = effgrad.build_train_step(model, "mse", optimizer, strategy=strategy, shard_state=shard, micro_batches=2)
        checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer)
        for i in range(5):
            step(x, y)
            if shard and i == 1:
                path = checkpoint.write(sys.argv[1])
        out[str(shard)] = {"sharded": bool(step.shard_state), "weights": [v.numpy().tolist() for v in model.weights]}
    checkpoint.read(path).assert_consumed()  # saved with 4 replicas after 2 steps, restored with 4
    for _ in range(3):
        step(x, y)
    out["restored"] = {"sharded": bool(step.shard_state), "weights": [v.numpy().tolist() for v in model.weights]}
    print("@@" + json.dumps(out))
    """
)


@pytest.mark.slow
def test_four_replicas_equal_the_unsharded_step(tmp_path):
    # Four logical CPUs need a process of their own (the suite's has two). Adam only: the shards'
    # code does not depend on the optimizer (Keras's own update runs on each shard), and SGD with
    # momentum on shards is test_sharded_steps_equal_the_unsharded_step's and the multi-worker test's.
    # Its checkpoint after 2 steps, restored into the sharded step on 4 replicas after 5, continues equal.
    run = in_fresh_processes(_FOUR_REPLICAS, {"adam": [tmp_path / "four"]})["adam"]
    assert run["True"]["sharded"] and run["restored"]["sharded"] and not run["False"]["sharded"]
    for how in ("True", "restored"):
        for a, b in zip(run[how]["weights"], run["False"]["weights"]):
            _close(np.array(a), np.array(b), how)


@pytest.mark.slow  # XLA compiles each compact update
def test_checkpoint_saved_with_2_replicas_restores_with_1_and_continues_equal(strategy, rng, tmp_path):
    # compact_state's 5 sharded steps equal the unsharded ones; saved after 2 of them.
    x, y = _data(rng)
    saved = []

    def save(steps, model, opt):
        if steps == 2:
            saved.append(tf.train.Checkpoint(model=model, optimizer=opt).save(str(tmp_path / "sharded")))
            model.compile(optimizer=opt, loss="mse")
            model.save(tmp_path / "sharded.keras")

    unsharded = _train(strategy, False, "compact_int8", 1, x, y)
    sharded = _train(strategy, True, "compact_int8", 1, x, y, after=save)
    _assert_sharded_equals_unsharded(strategy, "compact_int8", {}, unsharded, sharded)
    model, sharded_path = sharded[0], saved[0]

    # The file is the unsharded optimizer's: same keys, same shapes.
    plain, plain_opt = _model(), OPTIMIZERS["compact_int8"]()
    plain_opt.build(plain.trainable_variables)
    plain_path = tf.train.Checkpoint(model=plain, optimizer=plain_opt).save(str(tmp_path / "plain"))
    assert dict(tf.train.list_variables(sharded_path)) == dict(tf.train.list_variables(plain_path))

    # One device, no strategy: tf.train.Checkpoint (and .keras); 3 more steps.
    restored, restored_opt = _model(), OPTIMIZERS["compact_int8"]()
    one = effgrad.build_train_step(restored, "mse", restored_opt)
    tf.train.Checkpoint(model=restored, optimizer=restored_opt).restore(sharded_path).assert_consumed()
    loaded = keras.models.load_model(tmp_path / "sharded.keras")  # the same state as the checkpoint's
    for a, b in zip(loaded.trainable_variables + loaded.optimizer.variables, restored.trainable_variables
                    + restored_opt.variables):  # fmt: skip
        np.testing.assert_array_equal(np.asarray(a.numpy()), np.asarray(b.numpy()), err_msg=a.path)
    for _ in range(3):
        one(x, y)
    for a, b in zip(model.trainable_variables, restored.trainable_variables):
        _close(b.numpy(), a.numpy(), a.path)
    assert int(restored_opt.iterations) == 5

    # Back onto 2 replicas, sharded: restored before the step exists (deferred) or after it is built.
    with strategy.scope():
        again, again_opt = _model(), OPTIMIZERS["compact_int8"]()
    status = tf.train.Checkpoint(model=again, optimizer=again_opt).restore(sharded_path)
    again_step = effgrad.build_train_step(again, "mse", again_opt, strategy=strategy, shard_state=True)
    status.assert_consumed()
    for _ in range(3):
        again_step(x, y)
    for a, b in zip(model.trainable_variables, again.trainable_variables):
        _close(b.numpy(), a.numpy(), a.path)


def test_fit_with_shard_state_trains_as_one_device(strategy, rng):
    x = rng.normal(size=(48, 40)).astype("float32")
    y = rng.normal(size=(48, 3)).astype("float32")
    with strategy.scope():
        model = _model()
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"])
    effgrad.attach(model, shard_state=True, micro_batches=2)
    history = model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False).history
    assert model.effgrad_step.shard_state is True
    reference, optimizer = _model(), keras.optimizers.Adam(0.01)
    losses = [plain_step(reference, keras.losses.mean_squared_error, optimizer, x[i : i + 16], y[i : i + 16])
              for i in range(0, 48, 16)]  # fmt: skip
    assert history["loss"][0] == pytest.approx(np.mean(losses), rel=1e-5)
    # Adam divides by sqrt(v): the replicas' sums round a near-zero gradient otherwise, which shows at up
    # to ~1e-4 of the 0.01 step (measured 1.4e-6 on 1 of 6,000 numbers in one run of four); a wrong
    # update moves whole steps.
    for a, b in zip(model.trainable_variables, reference.trainable_variables):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-5, err_msg=a.path)


def test_what_cannot_be_sharded_is_refused_or_said(strategy):
    # No strategy, or one replica: the unsharded step runs, and says so.
    for one in (None, tf.distribute.OneDeviceStrategy("CPU:0")):
        with (one or tf.distribute.get_strategy()).scope():
            model, optimizer = _model(), keras.optimizers.Adam()
        step = effgrad.build_train_step(model, "mse", optimizer, strategy=one, shard_state=True)
        assert step.shard_state is False and "one replica" in step.shard_state_reason
    assert effgrad.build_train_step(_model(), "mse", keras.optimizers.Adam()).shard_state_reason == "shard_state=False"
    central = tf.distribute.experimental.CentralStorageStrategy(["CPU:0", "CPU:1"])
    with pytest.raises(ValueError, match="MirroredStrategy"):
        effgrad.build_train_step(_model(), "mse", keras.optimizers.Adam(), strategy=central, shard_state=True)
    refused = [
        (keras.optimizers.Lamb(), {}, "Lamb"),
        (keras.optimizers.Adafactor(), {}, "Adafactor"),
        (keras.optimizers.Adam(global_clipnorm=1.0), {}, "clip_norm"),
        (keras.optimizers.Adam(use_ema=True), {}, "use_ema"),
        (keras.optimizers.Adam(), {"noise_scale": True}, "noise_scale"),
        (keras.optimizers.Adam(), {"micro_batches": "auto", "memory_budget": "1GiB"}, "micro_batches"),
        (keras.optimizers.Adam(), {"shard_state": "yes"}, "True or False"),
    ]
    for optimizer, options, words in refused:
        with strategy.scope():
            model = _model()
        with pytest.raises(ValueError, match=words):
            effgrad.build_train_step(model, "mse", optimizer, strategy=strategy, **{"shard_state": True, **options})
    with strategy.scope():
        model, optimizer = _model(), keras.optimizers.Adam()
        optimizer.build(model.trainable_variables)  # the whole state exists already
    with pytest.raises(ValueError, match="not built"):
        effgrad.build_train_step(model, "mse", optimizer, strategy=strategy, shard_state=True)
    with strategy.scope():
        unbuilt = keras.Sequential([keras.layers.Dense(3)])
        unbuilt.compile(optimizer="adam", loss="mse")
    with pytest.raises(ValueError, match="built model"):
        effgrad.attach(unbuilt, shard_state=True)


_WORKER = textwrap.dedent(
    """
    import json, os, sys
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    import numpy as np, tensorflow as tf, keras, effgrad
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(12, 40)).astype("float32")
    y = rng.normal(size=(12, 3)).astype("float32")
    with strategy.scope():
        keras.utils.set_random_seed(0)
        layers = [keras.Input((40,)), keras.layers.Dense(150, activation="tanh"), keras.layers.Dense(3)]
        model, optimizer = keras.Sequential(layers), keras.optimizers.SGD(0.05, momentum=0.9)
    step = effgrad.build_train_step(model, "mse", optimizer, micro_batches=2, strategy=strategy, shard_state=True)
    for _ in range(3):
        step(x, y)  # the same global batch on every worker; each takes its replica's rows
    result = {
        "weights": [v.numpy().tolist() for v in model.trainable_variables],
        "slots": [np.asarray(v.numpy()).tolist() for v in optimizer.variables],  # every worker reads together
        "held": [sum(int(np.prod(c.shape)) for c in strategy.experimental_local_results(v.value))
                 for v in optimizer.variables],
        "shard_state": step.shard_state,
    }
    chief = json.loads(os.environ["TF_CONFIG"])["task"]["index"] == 0
    tf.train.Checkpoint(model=model, optimizer=optimizer).write(sys.argv[2] if chief else sys.argv[2] + "-other")
    json.dump(result, open(sys.argv[1], "w"))
    """
)


@pytest.mark.slow
def test_multi_worker_shards_state_across_processes_and_checkpoints_whole(tmp_path):
    run_cluster(_WORKER, [tmp_path / "w{index}.json", tmp_path / "ckpt"])
    results = [json.loads((tmp_path / f"w{i}.json").read_text()) for i in range(2)]
    # The same 3 steps on one device, unsharded: a plain tape, eager.
    data = np.random.default_rng(0)
    x, y = data.normal(size=(12, 40)).astype("float32"), data.normal(size=(12, 3)).astype("float32")
    model, optimizer = _model(), keras.optimizers.SGD(0.05, momentum=0.9)  # linear: replica sums' bits stay small
    for _ in range(3):
        plain_step(model, keras.losses.MeanSquaredError(reduction=None), optimizer, x, y)
    for result in results:
        assert result["shard_state"] is True
        for a, b in zip(result["weights"] + result["slots"], model.trainable_variables + optimizer.variables):
            np.testing.assert_allclose(np.array(a), np.asarray(b.numpy()), rtol=1e-5, atol=1e-7, err_msg=b.path)
        moments = [int(np.prod(v.shape)) for v in optimizer.variables[2:]]
        held = result["held"][2:]  # half of each cut variable's momentum; the plan leaves a 3-number bias whole
        assert sum(held) <= sum(moments) / 2 + 3 + 3 * 4  # + that bias + padding
    # The chief's checkpoint restores on one device, no strategy: what the workers held, whole.
    restored, restored_opt = _model(), keras.optimizers.SGD(0.05, momentum=0.9)
    restored_opt.build(restored.trainable_variables)
    tf.train.Checkpoint(model=restored, optimizer=restored_opt).read(str(tmp_path / "ckpt")).assert_consumed()
    for a, b in zip(restored.trainable_variables + restored_opt.variables, results[0]["weights"] + results[0]["slots"]):
        np.testing.assert_array_equal(np.asarray(a.numpy()), np.array(b, a.dtype), err_msg=a.path)


_PIECES = textwrap.dedent(
    """
    import json
    import tensorflow as tf, effgrad
    from effgrad.train.shard_slots import Group, Layout
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    strategy = tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"])
    shape = (4096, 2048)
    layout, group = Layout(shape, 4096 * 2048 // 2, 2), Group(strategy)

    def one():
        rank = tf.cast(tf.distribute.get_replica_context().replica_id_in_sync_group, tf.float32)
        return tf.reduce_sum(group.reduce_scatter(layout.padded(tf.fill(shape, rank + 1.0)), scale=2.0))

    compiled = tf.function(lambda: strategy.run(one), autograph=False)

    def reduce():
        return [float(t) for t in strategy.experimental_local_results(compiled())]

    sums = reduce()
    peak = effgrad.memory.measure(reduce).peak_mib
    print("@@" + json.dumps({"sums": sums, "peak_mib": peak, "part_mib": 4 * layout.shard / 2**20}))
    """
)


def test_reduce_scatter_receives_in_pieces_no_larger_than_a_part():
    # Each of 2 replicas reduces a 32 MiB gradient (in a process of its own: a long-lived one's allocator
    # may hand out chunks up to twice the size asked). Received whole, the all-to-all's buffer is that
    # size again and the sum half of it: 3 parts beyond the gradient; in pieces, the part being summed
    # and one piece sent and received: 2.25 parts.
    run = in_fresh_processes(_PIECES, {"pieces": []})["pieces"]
    assert run["sums"] == [2.0 * 3 * 4096 * 2048 / 2] * 2  # each number: 2 x (1 + 2)
    added = run["peak_mib"] - 2 * 2 * run["part_mib"]  # beyond the two gradients
    assert added <= 2 * 2.5 * run["part_mib"], (added, run["part_mib"])


_RESIDENT = textwrap.dedent(
    """
    import json, sys
    import keras, numpy as np, tensorflow as tf, effgrad
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    strategy = tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"])
    before = tf.config.experimental.get_memory_info("CPU:0")["current"]
    with strategy.scope():
        model = keras.Sequential([keras.Input((2048,)), keras.layers.Dense(2048), keras.layers.Dense(1)])
        optimizer = keras.optimizers.Adam(1e-3)
    step = effgrad.build_train_step(model, "mse", optimizer, strategy=strategy, shard_state=True,
                                    jit_compile=sys.argv[1] == "xla")
    x, y = np.ones((8, 2048), "float32"), np.ones((8, 1), "float32")
    after = []
    for _ in range(5):
        step(x, y)
        after.append((tf.config.experimental.get_memory_info("CPU:0")["current"] - before) / 2**20)
    print("@@" + json.dumps(min(after)))
    """
)


def test_the_shard_each_replica_updates_holds_no_memory_between_steps():
    # A 16 MiB kernel, 2 replicas (logical CPUs of one allocator): each holds the weights (16 MiB) and
    # its half of Adam's two moments (16 MiB). The 8 MiB shard of the kernel each replica's optimizer
    # updates is written from the weights for the update and emptied after it: kept, it adds 16 MiB.
    # (What a step leaves behind varies by up to 12 MiB from step to step: the least of 5 steps.)
    resident = in_fresh_processes(_RESIDENT, {"graph": ["graph"], "xla": ["xla"]})
    for how, mib in resident.items():
        assert mib <= 2 * 16 + 2 * 16 + 8, (how, mib, resident)
