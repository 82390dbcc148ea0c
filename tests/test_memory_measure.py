"""effgrad.memory.measure sees what a call allocates."""

import tensorflow as tf

import effgrad


def _allocate(n_floats):
    t = tf.random.uniform([n_floats])  # one buffer of n_floats * 4 bytes
    return tf.reduce_sum(t)


def test_peak_grows_with_a_known_allocation():
    reports = [effgrad.memory.measure(_allocate, n) for n in (1_000_000, 3_000_000, 5_000_000)]
    extras = [r.extra_bytes for r in reports]
    assert extras[0] >= 4_000_000
    # Each step adds 2M floats = 8 MB to the buffer that must be alive at the peak.
    for smaller, larger in zip(extras, extras[1:]):
        assert 8_000_000 <= larger - smaller <= 3 * 8_000_000
    assert all(r.peak_bytes >= r.extra_bytes for r in reports)
    assert reports[0].device in ("CPU:0", "GPU:0")
    assert 0 < float(reports[0].result) < 1_000_000
