"""The compiled step traces once per input signature, never per batch size."""

import keras
import numpy as np
import pytest

import effgrad
from helpers import mlp


@pytest.mark.parametrize("micro_batches", [1, 4])
def test_new_batch_size_does_not_retrace(rng, micro_batches):
    step = effgrad.build_train_step(mlp(), "mse", keras.optimizers.SGD(0.01), micro_batches=micro_batches)
    for batch in [16, 7, 1, 33, 16]:
        x = rng.normal(size=(batch, 5)).astype("float32")
        y = rng.normal(size=(batch, 3)).astype("float32")
        step(x, y)
    assert step.trace_count == 1


def test_sample_weight_or_dtype_change_is_a_new_signature(rng):
    step = effgrad.build_train_step(mlp(), "mse", keras.optimizers.SGD(0.01), micro_batches=2)
    x, y = rng.normal(size=(8, 5)).astype("float32"), rng.normal(size=(8, 3)).astype("float32")
    step(x, y)
    step(x[:3], y[:3], np.ones(3, "float32"))  # new signature: weights given
    step(x[:5], y[:5], np.ones(5, "float32"))  # same as the previous one
    step(x.astype("float64"), y)  # new signature: float64 inputs
    assert step.trace_count == 3


def test_attributes(rng):
    step = effgrad.build_train_step(mlp(), "mse", keras.optimizers.SGD(0.01), micro_batches=3)
    assert step.micro_batches == 3
    assert isinstance(step.loss_scale, effgrad.NoLossScale)
    logs = step(rng.normal(size=(4, 5)).astype("float32"), rng.normal(size=(4, 3)).astype("float32"))
    assert set(logs) >= {"loss", "loss_scale", "grads_finite"}
    assert float(logs["loss_scale"]) == 1.0 and bool(logs["grads_finite"])


class _TraceCounter(keras.layers.Layer):
    """Counts how often its call is traced (Python runs only while tracing a graph)."""

    traces = 0

    def call(self, x):
        type(self).traces += 1
        return x


@pytest.mark.parametrize("micro_batches", [1, 4])
def test_model_is_traced_once_per_step_trace(rng, micro_batches):
    """The micro-batch loop traces the model once, like the plain step (no peeled copy without XLA)."""
    _TraceCounter.traces = 0
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((5,)), _TraceCounter(), keras.layers.Dense(3)])
    model(np.zeros((1, 5), "float32"))  # build: one eager call
    built_calls = _TraceCounter.traces
    step = effgrad.build_train_step(model, "mse", keras.optimizers.SGD(0.01), micro_batches=micro_batches)
    step(rng.normal(size=(10, 5)).astype("float32"), rng.normal(size=(10, 3)).astype("float32"))
    assert _TraceCounter.traces - built_calls == 1
