"""The step never uses more memory than the Keras feature it replaces (fresh process per measurement)."""

import textwrap

import keras
import numpy as np
import pytest

import effgrad
from helpers import in_fresh_processes

_CHILD = textwrap.dedent(
    """
    import json, sys
    import effgrad, keras, numpy as np, tensorflow as tf
    method, k = sys.argv[1], int(sys.argv[2])
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((512,))] + [keras.layers.Dense(512, activation="gelu") for _ in range(8)])
    x = tf.random.normal([1024, 512]); y = tf.random.normal([1024, 512])
    if method == "effgrad":
        step = effgrad.build_train_step(model, "mse", keras.optimizers.SGD(1e-3), micro_batches=k)
        run = lambda: step(x, y)["loss"]
    else:
        opt = keras.optimizers.SGD(1e-3, gradient_accumulation_steps=k if k > 1 else None)
        model.compile(optimizer=opt, loss="mse")
        opt.build(model.trainable_variables)  # train_on_batch then traces once, not twice
        rows = 1024 // k
        run = lambda: [model.train_on_batch(x[i:i + rows], y[i:i + rows]) for i in range(0, 1024, rows)][-1]
    run()
    print("@@" + json.dumps(effgrad.memory.measure(run).peak_bytes))
    """
)


@pytest.fixture(scope="module")
def peaks():
    configs = [("effgrad", 1), ("keras", 1), ("effgrad", 8), ("keras", 8)]
    return in_fresh_processes(_CHILD, {c: list(c) for c in configs})


def test_plain_step_peak_is_at_most_keras_train_on_batch(peaks):
    assert peaks["effgrad", 1] <= 1.05 * peaks["keras", 1], peaks


def test_accumulation_peak_is_at_most_keras_gradient_accumulation(peaks):
    """In-place accumulation: a loop-carried accumulator keeps ~3 gradient buffers and fails this."""
    assert peaks["effgrad", 8] <= 1.05 * peaks["keras", 8], peaks


def test_micro_batches_lower_the_peak(peaks):
    assert peaks["effgrad", 8] <= 0.7 * peaks["effgrad", 1], peaks


@pytest.mark.parametrize("micro_batches", [1, 2])
@pytest.mark.parametrize("custom_gradient", [None, "checkpointed", "fused_loss"])
def test_a_discarded_step_frees_what_it_allocated(micro_batches, custom_gradient):
    """Accumulators, gradients, traced graphs: nothing of a step outlives it (ReplicaContext.all_reduce's
    custom gradient kept each traced step graph, and every buffer it captured, in a global registry).

    A graph holding a custom gradient (checkpointing, the fused loss) is still kept by TensorFlow
    itself; its accumulators are emptied when the step goes (they leaked a weight-sized set each).
    """
    import gc

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((512,))] + [keras.layers.Dense(512) for _ in range(4)])
    optimizer = keras.optimizers.SGD(0.01)
    optimizer.build(model.trainable_variables)
    x, y = np.ones((64, 512), "float32"), np.ones((64, 512), "float32")
    loss, options = "mse", {}
    if custom_gradient == "fused_loss":
        y = np.arange(64) % 512
        loss, options = keras.losses.SparseCategoricalCrossentropy(from_logits=True), {"fused_loss": True}
    gc.collect()
    before = effgrad.memory.current_bytes()
    net = effgrad.checkpoint_sequential(model, segments=2) if custom_gradient == "checkpointed" else model
    step = effgrad.build_train_step(net, loss, optimizer, micro_batches=micro_batches, fused_update=False, **options)
    step(x, y)
    assert step.fused_loss == (custom_gradient == "fused_loss")
    assert micro_batches == 1 or effgrad.memory.current_bytes() - before >= 4 * 2**20  # its accumulators exist
    del step, net
    gc.collect()
    assert effgrad.memory.current_bytes() - before < 2**20


def test_a_step_collected_during_a_trace_is_emptied_later_not_inside_the_trace():
    """A collection can run in the middle of tracing another step, with the graph's lock held (planning
    deadlocked there): the accumulators wait for the next eager safe point instead of adding ops to it."""
    import tensorflow as tf

    from effgrad.train import accumulate

    owner = accumulate.Accumulators([tf.Variable(tf.zeros([256, 256]))])
    buffers = owner.buffers

    @tf.function
    def another_trace():
        accumulate._release(buffers)  # what the finalizer runs when the collection happens here
        return tf.constant(1.0)

    another_trace()
    assert int(tf.size(buffers[0])) == 256 * 256  # untouched by the trace
    accumulate.free_released()  # e.g. the next Accumulators made
    assert int(tf.size(buffers[0])) == 0


def test_each_gradient_is_added_to_its_buffer_as_backprop_makes_it():
    """A micro-batch's gradients are never all alive at once (measured: 0.17 of them; if the additions
    waited for the whole backward pass, 1.0)."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((512,))] + [keras.layers.Dense(512) for _ in range(12)])
    x = np.random.default_rng(0).normal(size=(8, 512)).astype("float32")
    step = effgrad.build_train_step(model, "mse", keras.optimizers.SGD(1e-3), micro_batches=2)
    step(x, x)
    gradient_bytes = sum(4 * int(np.prod(v.shape)) for v in model.trainable_variables)
    assert effgrad.memory.measure(lambda: step(x, x)["loss"]).extra_bytes < 0.5 * gradient_bytes


def test_a_recurrent_model_holds_no_more_than_keras_step():
    """Backprop through a recurrent layer's loop runs one iteration at a time. With Keras's 32 iterations
    in flight the gradient loop held each iteration's weight-gradient temporaries while the step waited to
    see every gradient finite (measured on this model: 2.7x Keras's step; one at a time, 0.90-0.92x)."""
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x, y = rng.integers(1, 1000, (8, 64)).astype("int32"), rng.integers(0, 2, 8)

    def model():
        lstm = keras.layers.LSTM
        layers = [keras.layers.Embedding(1000, 64), lstm(256, return_sequences=True), lstm(256), keras.layers.Dense(2)]
        return keras.Sequential([keras.Input((64,), dtype="int32"), *layers])

    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    reference = model()
    reference.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9), loss=loss)
    reference.optimizer.build(reference.trainable_variables)  # one trace, not two: the same step
    reference.train_on_batch(x, y)
    keras_extra = effgrad.memory.measure(lambda: reference.train_on_batch(x, y)).extra_bytes
    step = effgrad.build_train_step(model(), loss, keras.optimizers.SGD(0.01, momentum=0.9))
    step(x, y)
    extra = effgrad.memory.measure(lambda: step(x, y)["loss"]).extra_bytes
    assert extra <= keras_extra, (extra / 2**20, keras_extra / 2**20)
