"""effgrad.memory.measure sees what a call allocates."""

import os
import subprocess
import sys
import textwrap

import tensorflow as tf

import effgrad


def _allocate(n_floats):
    t = tf.random.uniform([n_floats])  # one buffer of n_floats * 4 bytes
    return tf.reduce_sum(t)


def test_peak_grows_with_a_known_allocation():
    # Whatever else the process runs (a test's leftover tf.data threads) can only add to a
    # peak: the smallest of three calls is the call's own.
    reports = [
        min((effgrad.memory.measure(_allocate, n) for _ in range(3)), key=lambda r: r.extra_bytes)
        for n in (1_000_000, 3_000_000, 5_000_000)
    ]
    extras = [r.extra_bytes for r in reports]
    assert extras[0] >= 4_000_000
    # Each step adds 2M floats = 8 MB to the buffer that must be alive at the peak; after other
    # tests the allocator's pool can already hold part of it (measured 5.9 MB in the full suite).
    for smaller, larger in zip(extras, extras[1:]):
        assert 4_000_000 <= larger - smaller <= 3 * 8_000_000
    assert all(r.peak_bytes >= r.extra_bytes for r in reports)
    assert reports[0].device in ("CPU:0", "GPU:0")
    assert 0 < float(reports[0].result) < 1_000_000


def test_no_allocator_statistics_is_an_error_not_zero():
    """TensorFlow imported and used before effgrad, without TF_CPU_ALLOCATOR_USE_BFC: say so."""
    code = textwrap.dedent(
        """
        import tensorflow as tf            # before effgrad: no TF_CPU_ALLOCATOR_USE_BFC
        import effgrad, keras
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64)])
        try:
            report = effgrad.memory.measure(lambda: model(tf.ones([256, 64])))
        except RuntimeError as err:
            print("ERROR", err)
        else:
            print("PEAK", report.peak_bytes)
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "TF_CPU_ALLOCATOR_USE_BFC"}
    env["TF_CPP_MIN_LOG_LEVEL"] = "3"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120).stdout
    assert out.startswith("ERROR") and "TF_CPU_ALLOCATOR_USE_BFC" in out, out
