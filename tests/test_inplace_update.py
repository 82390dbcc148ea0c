"""A large variable's optimizer update runs as one XLA function: Keras's arithmetic, no temporaries."""

import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf

import effgrad
from conftest import assert_variables_close
from effgrad.train import inplace, parts
from helpers import bag_of_embeddings, counting, in_fresh_processes, numpy_vars, plain_step

OPTIMIZERS = {
    "adam": lambda: keras.optimizers.Adam(0.01),
    "adamw": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.1),
    "sgd-momentum": lambda: keras.optimizers.SGD(0.05, momentum=0.9, nesterov=True),
    "rmsprop": lambda: keras.optimizers.RMSprop(0.01),
    "lion": lambda: keras.optimizers.Lion(0.001),
    "adafactor": lambda: keras.optimizers.Adafactor(0.01),
}


def _model():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, activation="tanh"), keras.layers.Dense(8)])


# Adam in every step; the other optimizers in the gathered one (their update_step is what differs).
CASES = [("adam", fused, jit) for fused in (False, True) for jit in (False, True)]
CASES += [(name, False, False) for name in sorted(OPTIMIZERS) if name != "adam"]


def _batch():
    rng = np.random.default_rng(0)
    return rng.normal(size=(12, 16)).astype("float32"), rng.normal(size=(12, 8)).astype("float32")


@pytest.fixture(scope="module")
def keras_op_by_op():
    """``name -> (weights, optimizer variables but iterations)`` after 3 steps of Keras's optimizer on a
    plain tape, eager (each op on its own), made once per optimizer: the four Adam cases share one."""
    done = {}

    def result(name):
        if name not in done:
            model, optimizer = _model(), OPTIMIZERS[name]()
            for _ in range(3):
                plain_step(model, keras.losses.MeanSquaredError(reduction=None), optimizer, *_batch())
            done[name] = numpy_vars(model.trainable_variables), numpy_vars(optimizer.variables[1:])
        return done[name]

    return result


@pytest.mark.parametrize(
    "name, fused_update, jit_compile",
    CASES,
    ids=[f"{n}-{'fused' if f else 'gathered'}-{'xla' if j else 'function'}" for n, f, j in CASES],
)
def test_a_compiled_update_equals_keras_op_by_op(keras_op_by_op, monkeypatch, name, fused_update, jit_compile):
    monkeypatch.setattr(inplace, "MIN_ELEMENTS", 256)  # the 16x32 and 32x8 kernels: compiled; biases: not
    weights, slots = keras_op_by_op(name)
    ours, opt = _model(), OPTIMIZERS[name]()
    step = effgrad.build_train_step(ours, "mse", opt, fused_update=fused_update, jit_compile=jit_compile)
    x, y = _batch()
    for _ in range(3):
        step(x, y)
    assert len(opt.__dict__.get("_effgrad_compiled_updates", {})) == 2  # the feature ran: one per kernel
    assert_variables_close(ours.trainable_variables, weights, atol=1e-6, rtol=1e-5)
    assert_variables_close(opt.variables[1:], slots, atol=1e-6, rtol=1e-5)


def test_a_subclass_of_a_keras_optimizer_updates_op_by_op(rng, monkeypatch):
    monkeypatch.setattr(inplace, "MIN_ELEMENTS", 1)

    class Custom(keras.optimizers.Adam):  # its update_step may compute what XLA cannot: left alone
        pass

    x, y = rng.normal(size=(12, 16)).astype("float32"), rng.normal(size=(12, 8)).astype("float32")
    for opt, compiled in ((Custom(0.01), 0), (keras.optimizers.Adam(0.01), 4)):
        effgrad.build_train_step(_model(), "mse", opt)(x, y)
        assert len(opt.__dict__.get("_effgrad_compiled_updates", {})) == compiled


_CHILD = textwrap.dedent(
    """
    import json, sys
    import effgrad, keras, tensorflow as tf
    from effgrad.train import inplace
    tf.config.threading.set_inter_op_parallelism_threads(1)  # the graph's order, not a race
    if sys.argv[1] == "op by op":
        inplace.MIN_ELEMENTS = 2**40
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((2048,)), keras.layers.Dense(2048)])  # a 16 MiB kernel
    x, y = tf.random.normal([8, 2048]), tf.random.normal([8, 2048])
    step = effgrad.build_train_step(model, "mse", keras.optimizers.Adam(1e-3), fused_update=False)
    step(x, y)
    print("@@" + json.dumps(min(effgrad.memory.measure(lambda: step(x, y)["loss"]).peak_bytes for _ in range(3))))
    """
)


def test_a_compiled_update_holds_no_temporaries():
    peaks = in_fresh_processes(_CHILD, {m: [m] for m in ("op by op", "compiled")})
    kernel = 2048 * 2048 * 4
    print({k: f"{v / 2**20:.1f} MiB" for k, v in peaks.items()})
    # The floor: the kernel, Adam's two moments and the gradient (measured: 64.3 MiB compiled; op by
    # op a kernel-sized temporary more, 80.2).
    assert peaks["compiled"] <= 4.1 * kernel, peaks
    assert peaks["op by op"] >= peaks["compiled"] + 0.75 * kernel, peaks


# ---------------------------------------------------------------- an embedding's sparse gradient
SPARSE = {
    "adam": lambda: keras.optimizers.Adam(0.01),
    "adamw-amsgrad": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.1, amsgrad=True),
}


def _embedding_model():
    return bag_of_embeddings(500, 48, 6)


# Adam in every mode; AdamW with amsgrad (a third slot, weight decay outside update_step) under XLA.
@pytest.mark.parametrize("name, modes", [("adam", ("eager", "function", "xla")), ("adamw-amsgrad", ("xla",))])
def test_an_embeddings_sparse_gradient_is_updated_by_rows_like_keras_op_by_op(rng, monkeypatch, name, modes):
    # One micro-batch on one device: the table's IndexedSlices reach Adam, which squares each slice
    # apart (repeated rows: 6 ids of 7); the parts keep that, row by row, in eager, graph and XLA steps.
    tokens = rng.integers(0, 7, size=(16, 6)).astype("int32")
    y = rng.normal(size=(16, 3)).astype("float32")
    reference, optimizer = _embedding_model(), SPARSE[name]()
    for _ in range(3):
        plain_step(reference, keras.losses.MeanSquaredError(reduction=None), optimizer, tokens, y)
    monkeypatch.setattr(inplace, "MIN_ELEMENTS", 4096)  # the [500, 48] table (24,000 numbers): compiled
    monkeypatch.setattr(parts, "PART_ELEMENTS", 48 * 128)  # in parts of 128 rows: 3 whole ones and 116 rows
    window = parts.Window
    for mode in modes:
        windows = []
        monkeypatch.setattr(parts, "Window", counting(window, windows))
        ours, opt = _embedding_model(), SPARSE[name]()
        step = effgrad.build_train_step(ours, "mse", opt, jit_compile=mode == "xla")
        tf.config.run_functions_eagerly(mode == "eager")  # (each op on its own, the compiled update's too)
        try:
            for _ in range(3):
                step(tokens, y)
        finally:
            tf.config.run_functions_eagerly(False)
        assert_variables_close(ours.trainable_variables, reference.trainable_variables, atol=1e-6, rtol=1e-5)
        assert_variables_close(opt.variables[1:], optimizer.variables[1:], atol=1e-6, rtol=1e-5)
        assert {tuple(shape) for *_, shape in windows} == {(128, 48), (116, 48)}, mode  # the table went by rows


# 256 slices of a 16,384-row table, and 8,192 (half its rows, 4 MiB of slices): every part reads every
# slice, and the update must still hold less than Keras's (measured 11.1 MiB against 24.1).
@pytest.mark.parametrize("batch, length", [(32, 8), (64, 128)], ids=["few slices", "many slices"])
def test_an_embeddings_sparse_update_holds_a_part_of_the_table_not_copies_of_it(rng, monkeypatch, batch, length):
    tokens = rng.integers(0, 16384, size=(batch, length)).astype("int32")
    y = rng.normal(size=(batch, 3)).astype("float32")

    def extra(min_elements):
        monkeypatch.setattr(inplace, "MIN_ELEMENTS", min_elements)
        step = effgrad.build_train_step(bag_of_embeddings(16384, 128, length), "mse", keras.optimizers.Adam(1e-3))
        step(tokens, y)
        return min(effgrad.memory.measure(lambda: step(tokens, y)["loss"]).extra_bytes for _ in range(2))

    table, slices = 16384 * 128 * 4, batch * length * 128 * 4  # 8 MiB; 128 KiB or 4 MiB
    by_rows, op_by_op = extra(inplace.MIN_ELEMENTS), extra(2**40)
    print(f"op by op {op_by_op / 2**20:.1f} MiB, by rows {by_rows / 2**20:.1f} MiB")
    # Keras's update densifies the gradient and its square and makes table-sized temporaries of them;
    # by rows, one part (1 MiB) of each exists at a time, beside slice-sized tensors: the gradient
    # the lookup's backprop makes, the slices, their square.
    assert op_by_op >= 1.5 * table, op_by_op / 2**20
    assert by_rows <= 0.5 * table + 3 * slices, by_rows / 2**20
    assert by_rows <= op_by_op - 0.5 * table, (by_rows / 2**20, op_by_op / 2**20)
