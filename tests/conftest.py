"""Test set-up: quiet TensorFlow, CPU allocator stats, two logical CPUs."""

import gc
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
# XLA's CPU code generated at LLVM's lowest level and without LLVM's expensive passes (the flags pick
# LLVM's CodeGenOptLevel and pass pipeline in XLA's CPU compiler): the same HLO and buffers, faster
# compiles (measured on 2 cores: the 41 XLA tests 132 s -> 105 s with the first; the 32 tests named xla
# 77 s -> 69 s with the second too), and the memory tests hold with them. Fresh processes the tests
# start inherit them.
for _flag in ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true"):
    if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_flag}".strip()

import numpy as np  # noqa: E402
import pytest  # noqa: E402


def pytest_configure(config):
    # The controller of pytest-xdist's workers runs no test: TensorFlow starts in the workers only
    # (importing it first in the controller kept both cores idle for its ~12 s).
    if not hasattr(config, "workerinput") and config.getoption("dist", "no") != "no":
        return
    import tensorflow as tf

    # Two logical CPU devices let MirroredStrategy tests run on one machine; this
    # must happen before TensorFlow initializes its devices.
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    # One pytest-xdist worker per core already keeps every core busy: each worker's ops then run on
    # one thread, not on a pool per core that the workers fight over (measured: the parity and
    # accumulation tests took 67 s instead of 81 on 2 cores). Fresh processes the tests start keep
    # TensorFlow's defaults.
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        tf.config.threading.set_intra_op_parallelism_threads(max(1, (os.cpu_count() or 1) // workers))


@pytest.fixture(autouse=True)
def _fresh_keras_state():
    import keras

    # The cycles the last test left are collected, then everything still alive (modules, TensorFlow's
    # registries, session and module fixtures) is frozen out of the collector's sight: a worker holds
    # hundreds of thousands of objects after a few hundred traces, and each full collection walked them
    # all (measured: 12-27 s of a worker's 210 s on three test files, 11% of their wall time). A full
    # gc.collect() without freezing took 0.5-1 s per test. Objects frozen here that die later (a module
    # fixture's model) are freed by reference counting, or stay until the worker exits if cyclic.
    keras.backend.clear_session(free_memory=False)
    gc.collect()
    gc.freeze()
    keras.config.set_dtype_policy("float32")
    yield
    keras.config.set_dtype_policy("float32")


@pytest.fixture(scope="session")
def strategy():
    """ONE MirroredStrategy over the two logical CPUs for the whole session: a second one in the
    same process reuses collective instance keys and TensorFlow aborts (measured on TF 2.21)."""
    import tensorflow as tf

    return tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"])


@pytest.fixture
def rng():
    return np.random.default_rng(0)


def assert_variables_close(a, b, atol=1e-6, rtol=1e-5):
    assert len(a) == len(b)
    for va, vb in zip(a, b):
        np.testing.assert_allclose(
            np.asarray(va), np.asarray(vb), atol=atol, rtol=rtol, err_msg=getattr(va, "path", "")
        )
