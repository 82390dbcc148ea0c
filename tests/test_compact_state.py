"""compact_state: int8 block-wise / bfloat16 optimizer slots, updated like float32's, saved and resumed exactly."""

import contextlib

import keras
import numpy as np
import pytest
import tensorflow as tf

import effgrad
from conftest import assert_variables_close
from effgrad.train import parts as train_parts
from effgrad.train.compact import CompactSlot, dequantize, quantize
from effgrad.train.optimizers import PER_VARIABLE as SUPPORTED
from helpers import bag_of_embeddings, counting, in_fresh_processes, plain_step, tiny_gpt2_lm


def _model(seed=0, features=32, hidden=256):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [keras.Input((features,)), keras.layers.Dense(hidden, activation="tanh"), keras.layers.Dense(3)]
    )


def _data(rng, n=16, features=32):
    return rng.normal(size=(n, features)).astype("float32"), rng.normal(size=(n, 3)).astype("float32")


def _changes(make_optimizer, x, y, steps, first=None, **options):
    """The weights' change from the start, after each of ``steps`` steps; ``first(step)`` is called
    after the first."""
    model, optimizer = _model(), make_optimizer()
    start = [w.copy() for w in model.get_weights()]
    step = effgrad.build_train_step(model, "mse", optimizer, **options)
    changes = []
    for i in range(steps):
        step(x, y)
        if i == 0 and first is not None:
            first(step)
        changes.append([w - s for w, s in zip(model.get_weights(), start)])
    return changes


@pytest.fixture(scope="module")
def shared():
    """``shared(key, compute)``: ``compute()`` once in this module for each key, for the reference runs that
    several tests (or parameters) compare against. Each computes from the first draw of ``rng``."""
    done = {}

    def get(key, compute):
        if key not in done:
            done[key] = compute()
        return done[key]

    return get


def _sparse(**options):
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True, **options)


def _assert_close_in_norm(got, expected, tolerance=1e-3):
    # A float difference in the last bit can move an entry to the next int8 code: compare in norm.
    for a, b in zip(got, expected):
        assert np.linalg.norm(a - b) <= tolerance * np.linalg.norm(b) + 1e-7


def _state_bytes(optimizer):
    return sum(v.numpy().nbytes for v in optimizer.variables)


@pytest.mark.parametrize("signs", ["mixed", "nonnegative"])
def test_quantization_error_is_bounded_per_block_on_the_fourth_root_scale(rng, signs):
    # Magnitudes over 8 decades, as an Adam second moment has; some blocks all zero.
    x = 10.0 ** rng.uniform(-8, 0, size=(5, 1000)) * rng.uniform(0.5, 2, size=(5, 1))
    if signs == "mixed":
        x *= rng.choice([-1.0, 1.0], size=x.shape)
    x[2] = 0.0
    x = x.astype("float32").ravel()
    codes, scales = quantize(tf.constant(x), 1000)
    assert codes.dtype == tf.int8 and codes.shape == (5, 1000) and scales.shape == (5,)
    back = dequantize(codes, scales, x.shape).numpy()
    levels = 255.0 if signs == "nonnegative" else 127.0
    assert np.all(((scales.numpy() < 0) == (signs == "nonnegative")) | (scales.numpy() == 0))  # the map used
    blocks, back_blocks = x.reshape(5, 1000), back.reshape(5, 1000)
    absmax = np.abs(blocks).max(1, keepdims=True)
    # Rounding t = u**(1/4) by at most 1/(2L) moves x = t**4 by at most 4 * (1/(2L)) (times the scale)...
    assert np.all(np.abs(back_blocks - blocks) <= 2.01 / levels * absmax + 1e-12)
    np.testing.assert_array_equal(back_blocks[2], 0.0)
    assert np.all(np.sign(back) * np.sign(x) >= 0)  # never the wrong sign
    # ...and relatively by (1 + 1/(2 L t))**4 - 1: small entries keep their size (linear codes round them to 0).
    u = np.abs(blocks) / np.where(absmax > 0, absmax, 1)
    kept = u >= 1e-4
    relative = np.abs(back_blocks - blocks)[kept] / np.abs(blocks)[kept]
    assert np.all(relative <= 1.01 * ((1 + 0.5 / (levels * u[kept] ** 0.25)) ** 4 - 1))
    assert np.all(back_blocks[kept] != 0)


def test_padding_and_shapes_round_trip():
    x = tf.reshape(tf.range(-35.0, 35.0), [7, 10])  # 70 numbers: blocks of 32 with padding
    codes, scales = quantize(x, 32)
    assert codes.shape == (3, 32)
    back = dequantize(codes, scales, (7, 10))
    assert back.shape == (7, 10)
    np.testing.assert_allclose(back.numpy(), x.numpy(), atol=2.01 / 127 * 35)


@pytest.mark.parametrize("dtype, ratio", [("int8", 0.27), ("bfloat16", 0.5)])
def test_state_bytes_shrink_to_the_documented_ratio(dtype, ratio):
    model = keras.Sequential([keras.Input((256,)), keras.layers.Dense(512), keras.layers.Dense(256)])
    plain, compact = keras.optimizers.Adam(), effgrad.compact_state(keras.optimizers.Adam(), dtype=dtype)
    plain.build(model.trainable_variables)
    compact.build(model.trainable_variables)
    small = sum(v.numpy().nbytes for v in plain.variables if v.shape.num_elements() < 4096)
    large = _state_bytes(plain) - small
    assert _state_bytes(compact) - small <= ratio * large + 64
    assert isinstance(compact._momentums[0], CompactSlot) and not isinstance(compact._momentums[1], CompactSlot)


# bfloat16 storage is the same code for every optimizer: four kinds of slot suffice there.
BFLOAT16 = (keras.optimizers.AdamW, keras.optimizers.Lion, keras.optimizers.Adagrad, keras.optimizers.Adafactor)


@pytest.mark.parametrize(
    "base, dtype",
    [(base, "int8") for base in SUPPORTED] + [(base, "bfloat16") for base in BFLOAT16],
    ids=lambda v: getattr(v, "__name__", v),
)
def test_every_supported_optimizer_updates_like_its_float32_self(rng, shared, base, dtype):
    kwargs = {"momentum": 0.9} if base is keras.optimizers.SGD else {}
    x, y = _data(rng)
    min_size = 0 if base is keras.optimizers.Adafactor else 4096  # its unfactored slots are the vectors

    def make(compact=False):
        opt = base(learning_rate=0.01, **kwargs)
        return effgrad.compact_state(opt, dtype=dtype, min_size=min_size) if compact else opt

    # One float32 run per optimizer: its int8 and bfloat16 cases compare against the same.
    # (The reference is traced as the compact step is: with oneDNN's kernels an eager tape rounds the
    # gradient otherwise, and Adam's first step, g / |g|, shows it where g is near zero.)
    ref_first, *_, ref = shared(("float32", base), lambda: _changes(make, x, y, 5))
    got_first, *_, got = _changes(lambda: make(True), x, y, 5)
    # From zero state the first update uses the exact float32 moments: the same step (Adagrad's
    # and Ftrl's initial 0.1 is not a bfloat16 number).
    if dtype == "int8" or base not in (keras.optimizers.Adagrad, keras.optimizers.Ftrl):
        assert_variables_close(got_first, ref_first, rtol=1e-5, atol=1e-7)
    # Then the stored moments differ by their rounding: the change over 5 steps stays close.
    tolerance = {"int8": 0.03, "bfloat16": 0.015}[dtype]
    if base is keras.optimizers.Lion:  # a sign per entry: those whose moment is near 0 may flip
        assert all(np.mean(np.abs(a - b) > 1e-6) <= 3 * tolerance for a, b in zip(got, ref))
    else:
        _assert_close_in_norm(got, ref, tolerance)


@pytest.mark.parametrize("mode, dtype", [("function", "bfloat16"), ("xla", "int8"), ("mirrored", "int8")])
def test_large_variables_updated_in_parts_equal_the_whole_update(rng, monkeypatch, strategy, shared, dtype, mode):
    x = rng.normal(size=(16, 40)).astype("float32")
    y = rng.normal(size=(16, 3)).astype("float32")

    def run(part_elements, mode=mode):
        monkeypatch.setattr(train_parts, "PART_ELEMENTS", part_elements)
        with strategy.scope() if mode == "mirrored" else contextlib.nullcontext():
            model = _model(features=40)  # a [40, 256] kernel: 5 blocks of 2048, parts of 2, 2 and 1
            opt = effgrad.compact_state(keras.optimizers.AdamW(0.01, weight_decay=0.1), dtype=dtype)
        options = {"strategy": strategy} if mode == "mirrored" else {"jit_compile": mode == "xla"}
        step = effgrad.build_train_step(model, "mse", opt, **options)
        for _ in range(3):
            step(x, y)
        assert any(str(v.dtype) == dtype for v in opt.variables)
        return [v.numpy() for v in [*model.variables, *opt.variables]]

    def one_device():  # XLA's whole int8 update, which the replicas' must equal too
        return shared("whole int8 update", lambda: run(10**9, "xla"))

    whole = one_device() if mode == "xla" else run(10**9)
    if mode == "mirrored":  # in norm: the sums over replicas round otherwise
        start = _model(features=40).get_weights()
        _assert_close_in_norm(*[[w - s for w, s in zip(got, start)] for got in (whole, one_device())])
    calls = []
    monkeypatch.setattr(train_parts, "Part", counting(train_parts.Part, calls))
    parts = run(4096)
    # The kernel's update (per replica) traced once: the loop's part of 2 blocks and the last block.
    assert [tuple(value.shape) for _, value in calls if value.shape.rank == 1] == [(4096,), (2048,)] * (
        2 if mode == "mirrored" else 1
    )
    for a, b in zip(parts, whole):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_an_embeddings_sparse_gradient_is_updated_in_parts_of_rows_like_the_whole_update(rng, monkeypatch):
    # One micro-batch on one device: the embedding's IndexedSlices reach the optimizer (as in Keras's
    # step), whose update of repeated rows (Adam squares each slice apart) the parts keep, row by row.
    tokens = rng.integers(0, 7, size=(16, 6)).astype("int32")  # 6 ids of 7: rows repeat
    y = rng.normal(size=(16, 3)).astype("float32")

    def run(part_elements):
        monkeypatch.setattr(train_parts, "PART_ELEMENTS", part_elements)
        model = bag_of_embeddings(512, 48, 6)
        opt = effgrad.compact_state(keras.optimizers.AdamW(0.01, weight_decay=0.1), dtype="int8", min_size=4096)
        step = effgrad.build_train_step(model, "mse", opt)  # (its update is compiled by XLA either way)
        for _ in range(3):
            step(tokens, y)
        return [v.numpy() for v in [*model.variables, *opt.variables]]

    whole = run(10**9)
    calls = []
    monkeypatch.setattr(train_parts, "Part", counting(train_parts.Part, calls))
    parts = run(4096)
    # The table [512, 48] in parts of 128 rows (128 * 48 numbers: whole blocks of 2048): 4 of them, one trace.
    assert [tuple(value.shape) for _, value in calls if value.shape.rank == 2] == [(128, 48)]
    for a, b in zip(parts, whole):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_an_embeddings_sparse_update_in_parts_holds_a_fraction_of_the_whole_one(rng, monkeypatch):
    table = keras.Variable(rng.normal(size=(16384, 64)).astype("float32"))  # 4 MiB
    rows = tf.IndexedSlices(
        tf.constant(rng.normal(size=(64, 64)).astype("float32")),
        tf.constant(rng.integers(0, 100, 64).astype("int32")),
        tf.constant([16384, 64]),
    )

    def extra(part_elements):
        monkeypatch.setattr(train_parts, "PART_ELEMENTS", part_elements)
        opt = effgrad.compact_state(keras.optimizers.Adam(1e-3), dtype="int8")
        opt.build([table])
        apply = tf.function(lambda: opt.apply([rows], [table]), autograph=False)
        apply()
        return min(effgrad.memory.measure(apply).extra_bytes for _ in range(2))

    # Whole, the update expands both slots to float32 and more (Keras's op-by-op update of the table).
    whole, parts = extra(10**9), extra(2**16)
    assert parts <= 0.4 * whole, (parts / 2**20, whole / 2**20)


def _compact_adam():
    return effgrad.compact_state(keras.optimizers.Adam(0.01))


def _compact_adam_steps(x, y):
    """Compact Adam's changes after each of 3 steps; after the first, the first kernel's second moment
    (the dtypes it is stored in, its value); whether "auto" fused the updates with backprop."""
    seen = []

    def velocity(step):
        slot = step.optimizer._velocities[0]
        seen.append(([str(v.dtype) for v in slot._storage], tf.convert_to_tensor(slot).numpy(), step.fused_update))

    changes = _changes(_compact_adam, x, y, 3, first=velocity)
    return changes, seen[0][:2], seen[0][2]


def test_the_stored_state_is_compact_and_holds_the_moments(rng, shared):
    x, y = _data(rng)
    dtypes, velocity = shared("compact adam", lambda: _compact_adam_steps(x, y))[1]
    reference, ref_opt = _model(), keras.optimizers.Adam(0.01)
    plain_step(reference, keras.losses.MeanSquaredError(reduction=None), ref_opt, x, y)
    assert dtypes == ["int8", "float32"]
    v = ref_opt._velocities[0].numpy()
    np.testing.assert_allclose(velocity, v, atol=2.01 / 255 * np.abs(v).max())


@pytest.mark.parametrize("mode, steps", [("eager", 2), ("xla", 3)])  # against the tf.function's steps
def test_compact_steps_agree_in_eager_function_and_xla(rng, shared, mode, steps):
    # (Eager, each op of the compact update runs on its own: two steps, from zero and from compact state.)
    x, y = _data(rng)
    reference = shared("compact adam", lambda: _compact_adam_steps(x, y))[0][steps - 1]
    tf.config.run_functions_eagerly(mode == "eager")
    try:
        got = _changes(_compact_adam, x, y, steps, jit_compile=mode == "xla")[-1]
    finally:
        tf.config.run_functions_eagerly(False)
    _assert_close_in_norm(got, reference)


@pytest.mark.parametrize(
    "options",
    [{"fused_update": True, "loss_scale": 1024.0}, {"micro_batches": 2, "clip_norm": 0.1}],
    ids=lambda o: "-".join(o),
)
def test_compact_state_composes_with_the_steps_options(rng, shared, options):
    # Fused and loss-scaled, against updates after backprop ("auto" fuses this model's: the
    # reference asks for fused_update=False). Clipped (the micro-batches gather their gradients),
    # against the whole batch clipped, fused: the clipped gradient is the micro-batches' sum's.
    x, y = _data(rng)

    def make():
        return effgrad.compact_state(keras.optimizers.AdamW(0.01, weight_decay=0.1))

    reference = {"clip_norm": 0.1} if "clip_norm" in options else {"fused_update": False}
    plain = shared(("compact adamw", *reference), lambda: _changes(make, x, y, 3, **reference)[-1])
    _assert_close_in_norm(_changes(make, x, y, 3, **options)[-1], plain)


def test_embedding_rows_get_sparse_updates_like_float32(rng, monkeypatch):
    monkeypatch.setattr(train_parts, "PART_ELEMENTS", 4096)  # the table in parts, as a large one is
    tokens = rng.integers(0, 1000, size=(8, 5)).astype("int32")
    labels = rng.integers(0, 4, size=(8, 5))

    def run(optimizer, plain=False):
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [keras.Input((5,), dtype="int32"), keras.layers.Embedding(1000, 16), keras.layers.Dense(4)]
        )
        table = model.layers[0].embeddings.numpy().copy()
        if plain:  # float32 Keras on a plain tape, eager: nothing to trace
            for _ in range(3):
                plain_step(model, _sparse(reduction=None), optimizer, tokens, labels)
        else:
            step = effgrad.build_train_step(model, _sparse(), optimizer)
            for _ in range(3):
                step(tokens, labels)
        return model.layers[0].embeddings.numpy() - table

    plain = run(keras.optimizers.Adam(0.01), plain=True)
    compressed = run(effgrad.compact_state(keras.optimizers.Adam(0.01)))
    unused = np.setdiff1d(np.arange(1000), tokens)
    np.testing.assert_array_equal(compressed[unused], 0.0)  # rows never looked up never move
    assert np.linalg.norm(compressed - plain) <= 0.03 * np.linalg.norm(plain)


def _fit_then_continue(model, x, y, steps=2):
    for _ in range(steps):
        model.train_on_batch(x, y)
    return [w.copy() for w in model.get_weights()]


def test_keras_file_saves_the_compact_state_and_resumes_bit_identically(rng, tmp_path):
    x, y = _data(rng)
    model = _model()
    model.compile(effgrad.compact_state(keras.optimizers.Adam(0.01)), "mse")
    model.optimizer.build(model.trainable_variables)  # else the first train_on_batch traces twice
    _fit_then_continue(model, x, y)
    path = tmp_path / "model.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    assert type(loaded.optimizer).__name__ == "CompactAdam" and loaded.optimizer.compact_dtype == "int8"
    for a, b in zip(loaded.optimizer.variables, model.optimizer.variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    for a, b in zip(_fit_then_continue(loaded, x, y), _fit_then_continue(model, x, y)):
        np.testing.assert_array_equal(a, b)


def test_tf_train_checkpoint_restores_the_compact_state_bit_identically(rng, tmp_path):
    # With a learning-rate schedule: kept, followed, and resumed at the step the checkpoint holds.
    x, y = _data(rng)

    def fresh():
        schedule = keras.optimizers.schedules.ExponentialDecay(0.05, decay_steps=1, decay_rate=0.5)
        model, opt = _model(), effgrad.compact_state(keras.optimizers.Adam(schedule), dtype="bfloat16")
        assert opt._learning_rate is schedule
        return model, opt, effgrad.build_train_step(model, "mse", opt)

    model, opt, step = fresh()
    step(x, y)
    path = tf.train.Checkpoint(model=model, optimizer=opt).save(str(tmp_path / "ckpt"))
    step(x, y)
    np.testing.assert_allclose(float(opt.learning_rate), 0.05 * 0.25, rtol=1e-6)
    expected = [w.copy() for w in model.get_weights()]
    model2, opt2, step2 = fresh()
    opt2.build(model2.trainable_variables)
    tf.train.Checkpoint(model=model2, optimizer=opt2).restore(path).assert_consumed()
    step2(x, y)
    for a, b in zip(model2.get_weights(), expected):
        np.testing.assert_array_equal(a, b)


def test_attach_and_fit_train_with_compact_state(rng):
    x, y = _data(rng, n=64)
    model = _model()
    model.compile(effgrad.compact_state(keras.optimizers.Adam(0.01)), "mse")
    effgrad.attach(model, micro_batches=2)
    history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0).history["loss"]
    reference, optimizer = _model(), keras.optimizers.Adam(0.01)  # float32 on a plain tape, eager
    loss = keras.losses.MeanSquaredError(reduction=None)
    epochs = [[plain_step(reference, loss, optimizer, x[i : i + 16], y[i : i + 16]) for i in range(0, 64, 16)]
              for _ in range(2)]  # fmt: skip
    expected = np.mean(epochs, axis=1)  # fit's loss: the mean over the epoch's batches
    assert any(str(v.dtype) == "int8" for v in model.optimizer.variables)
    np.testing.assert_allclose(history, expected, rtol=0.02)


def test_bad_optimizers_and_arguments_are_refused_with_the_fix():
    with pytest.raises(TypeError, match="keras.optimizers.Optimizer"):
        effgrad.compact_state("adam")
    with pytest.raises(TypeError, match="inner optimizer"):
        effgrad.compact_state(keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam()))
    with pytest.raises(TypeError, match="per-variable optimizers"):
        effgrad.compact_state(keras.optimizers.Muon())
    with pytest.raises(TypeError, match="already keeps compact state"):
        effgrad.compact_state(effgrad.compact_state(keras.optimizers.Adam()))
    built = keras.optimizers.Adam()
    built.build(_model().trainable_variables)
    with pytest.raises(ValueError, match="before the first step"):
        effgrad.compact_state(built)
    with pytest.raises(ValueError, match="one of"):
        effgrad.compact_state(keras.optimizers.Adam(), dtype="float16")
    with pytest.raises(ValueError, match="block_size"):
        effgrad.compact_state(keras.optimizers.Adam(), block_size=0)
    with pytest.raises(ValueError, match="min_size"):
        effgrad.compact_state(keras.optimizers.Adam(), min_size=-1)


_CHILD = """
import json, sys
import keras, numpy as np, tensorflow as tf
import effgrad
# One inter-op thread: the order ops run in is then the graph's, not a race between two cores
# that three side-by-side processes share (unpinned, the int8 fused peak of six such layers
# measured 64-79 MiB over runs).
tf.config.threading.set_inter_op_parallelism_threads(1)
state, fused = sys.argv[1], sys.argv[2] == "1"
keras.utils.set_random_seed(0)
# Four 4 MiB kernels: both savings the test asks for clear their bounds by over 5 MiB (the peaks
# repeat to 0.1 MiB), and every kernel is one more XLA compile of its update in every process.
model = keras.Sequential([keras.Input((1024,))] + [keras.layers.Dense(1024) for _ in range(4)])
x, y = tf.random.normal((16, 1024)), tf.random.normal((16, 1024))
opt = keras.optimizers.Adam(1e-4)
if state != "float32":
    opt = effgrad.compact_state(opt, dtype=state)
step = effgrad.build_train_step(model, "mse", opt, fused_update=fused)
step(x, y)
peaks = [effgrad.memory.measure(lambda: step(x, y)["loss"]).peak_bytes for _ in range(3)]
held = sum(v.numpy().nbytes for v in model.variables + opt.variables + [x, y])
after = tf.config.experimental.get_memory_info("CPU:0")["current"]  # what stays between steps
print("@@" + json.dumps({"peak": min(peaks), "held": held, "after": after}))
"""


def test_the_step_peak_falls_by_most_of_the_state_it_no_longer_keeps():
    runs = in_fresh_processes(_CHILD, {**{s: [s, 0] for s in ("float32", "int8")}, "int8 fused": ["int8", 1]})
    peaks = {k: run["peak"] for k, run in runs.items()}
    kernel = 1024 * 1024 * 4
    slots = 4 * 2 * kernel  # Adam's two float32 moments of four 4 MiB kernels
    print({k: f"{v / 2**20:.1f} MiB" for k, v in peaks.items()})
    # int8 keeps a quarter of them; expanding every slot at once (nothing ordering the updates)
    # would give back most of the saving. (float32 Adam is at its floor here, each update compiled
    # in place, effgrad.train.inplace: 64.3 MiB against int8's 47.0.)
    assert peaks["int8"] <= peaks["float32"] - 0.5 * 0.75 * slots, peaks
    # Fused, most gradients go too: each is consumed by its compact update (two kernels' worth of
    # updates in flight, updates_in_flight), where gathered holds all four at once (measured 35.4
    # MiB fused against 47.0 gathered).
    assert peaks["int8 fused"] <= peaks["int8"] - 0.35 * 4 * kernel, peaks
    # Each compact update reads and writes the variable and its codes inside XLA, the variable in
    # place (the codes into new buffers): the fused step holds 2.8 kernels beyond weights, state
    # and batch (11.2 MiB; returning new values to be assigned made 4.4, and left 3-6 MiB of XLA's
    # output buffers held by the variables after the step, against 0.8 now).
    fused = runs["int8 fused"]
    assert fused["peak"] <= fused["held"] + 3.5 * kernel, (fused["peak"] - fused["held"]) / 2**20
    for key, run in runs.items():
        assert run["after"] <= run["held"] + 2 * 2**20, (key, (run["after"] - run["held"]) / 2**20)


def test_the_optimizer_round_trips_through_its_config_as_the_planner_rebuilds_it():
    # effgrad.plan rebuilds the optimizer from its config for every candidate and counts
    # optimizer.variables: compact, it counts the int8 state.
    opt = effgrad.compact_state(keras.optimizers.AdamW(1e-3, weight_decay=0.1), dtype="bfloat16", block_size=512)
    again = keras.optimizers.deserialize(keras.optimizers.serialize(opt))
    assert type(again) is type(opt) and again.get_config() == opt.get_config()
    again.build(_model().trainable_variables)
    assert any(str(v.dtype) == "bfloat16" for v in again.variables)


def test_auto_fuses_the_updates_of_compact_state_as_of_float32(rng, shared):
    # Weights outweigh activations: both fuse (backprop waits for the compact updates: they hold less).
    x, y = _data(rng)
    step = effgrad.build_train_step(_model(), "mse", keras.optimizers.Adam(0.01))
    step(x, y)
    fused = {"float32": step.fused_update, "int8": shared("compact adam", lambda: _compact_adam_steps(x, y))[2]}
    assert fused == {"float32": True, "int8": True}


def test_a_keras_hub_lm_updates_its_token_table_in_parts_like_float32(rng, monkeypatch):
    # GPT-2's tied table gets a dense gradient with no static shape (a lookup's, densified, plus
    # the output projection's): the compiled update of its parts takes the table's shape.
    monkeypatch.setattr(train_parts, "PART_ELEMENTS", 256)
    tokens = rng.integers(0, 50, (4, 8)).astype("int32")
    x = {"token_ids": tokens, "padding_mask": np.ones((4, 8), "int32")}
    tables = {}
    for state in ("float32", "int8"):
        model = tiny_gpt2_lm(dropout=0.0, layers=1)
        start = model.backbone.token_embedding.embeddings.numpy()
        if state == "float32":  # Keras on a plain tape, eager: no second trace of the model
            opt = keras.optimizers.Adam(0.01)
            for _ in range(3):
                plain_step(model, _sparse(reduction=None), opt, x, tokens)
        else:
            opt = effgrad.compact_state(keras.optimizers.Adam(0.01), min_size=800)
            step = effgrad.build_train_step(model, _sparse(), opt, fused_loss=False)
            for _ in range(3):
                step(x, tokens)
        tables[state] = model.backbone.token_embedding.embeddings.numpy() - start
    assert np.linalg.norm(tables["int8"] - tables["float32"]) <= 0.03 * np.linalg.norm(tables["float32"])


@pytest.mark.parametrize("dtype", ["int8", "bfloat16"])
def test_what_the_optimizer_holds_outside_its_config_is_kept(dtype):
    # exclude_from_weight_decay(...) and a callable learning rate are not in get_config.
    excluded, decayed = (keras.Variable(np.ones((128, 64), "float32"), name=n) for n in ("no_decay", "decay"))
    optimizer = keras.optimizers.AdamW(lambda: 0.01, weight_decay=0.5)
    optimizer.exclude_from_weight_decay(var_names=["no_decay"])
    compact = effgrad.compact_state(optimizer, dtype=dtype)
    for _ in range(3):
        compact.apply([tf.zeros((128, 64))] * 2, [excluded, decayed])
    np.testing.assert_array_equal(excluded.numpy(), 1.0)
    np.testing.assert_allclose(decayed.numpy(), (1 - 0.01 * 0.5) ** 3, rtol=1e-6)
