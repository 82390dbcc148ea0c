"""What plan() is given: budgets parsed as documented, the caller's loss scale untouched, options that need
micro-batches, and allocator statistics whatever was imported first."""

import os
import subprocess
import sys

import keras
import numpy as np
import pytest

import effgrad
from effgrad.memory import device_memory_bytes, format_bytes, parse_budget


def test_budgets_as_sizes_bytes_and_fractions_strings_included():
    assert parse_budget("300MiB") == 300 * 2**20 and parse_budget("2.5GB") == 2_500_000_000
    assert parse_budget("1000000") == 1_000_000 == parse_budget(1_000_000)
    assert parse_budget("0.5") == parse_budget(0.5) == int(0.5 * device_memory_bytes())  # not 0 bytes
    for bad in ("1.5", 1.5, "0.5b", "0", 0, -3, "lots", True, "10 parsecs"):
        with pytest.raises(ValueError, match="budget"):
            parse_budget(bad)
    with pytest.warns(UserWarning, match="more than the device has"):
        assert parse_budget("1TiB") == 2**40 == parse_budget("1 tib")
    assert format_bytes(1) == "1 bytes" and format_bytes(3 * 2**20) == "3.0 MiB"  # a tiny budget is not "0.0 MiB"


def _mlp():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((16,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(2)])


def test_planning_leaves_the_callers_loss_scale_alone(rng):
    x, y = rng.normal(size=(32, 16)).astype("float32"), rng.integers(0, 2, 32)
    x[0, 0] = np.inf  # every candidate step overflows: each would back the scale off
    scale = effgrad.DynamicLossScale(initial_scale=2.0**10)
    effgrad.plan(
        _mlp(),
        "sparse_categorical_crossentropy",
        keras.optimizers.SGD(),
        x,
        y,
        memory_budget=2**30,
        loss_scale=scale,
        verbose=False,
    )
    assert float(scale.value) == 2.0**10 and int(scale.counter) == 0


def test_noise_scale_with_planned_micro_batches_plans_from_two(rng):
    x, y = rng.normal(size=(32, 16)).astype("float32"), rng.integers(0, 2, 32)
    model = _mlp()
    step = effgrad.build_train_step(
        model, "sparse_categorical_crossentropy", keras.optimizers.SGD(), micro_batches="auto",
        memory_budget=2**30, noise_scale=True, verbose=False,
    )  # fmt: skip
    logs = step(x, y)
    assert step.plan.micro_batches >= 2 and "noise_scale" in logs
    assert all(c.config.micro_batches >= 2 for c in step.plan.table)


def test_importing_keras_before_effgrad_keeps_allocator_statistics():
    code = (
        "import keras, tensorflow as tf\n"
        "import effgrad\n"
        "report = effgrad.memory.measure(lambda: tf.ones((512, 512)))\n"
        "assert report.extra_bytes >= 512 * 512 * 4, report\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TF_CPU_ALLOCATOR_USE_BFC"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
