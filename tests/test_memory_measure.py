"""effgrad.memory.measure sees what a call allocates."""

import textwrap

from helpers import in_fresh_processes, run_forked

_KNOWN_ALLOCATIONS = textwrap.dedent(
    """
    import json
    import effgrad, tensorflow as tf

    def allocate(n_floats):
        t = tf.random.uniform([n_floats])  # one buffer of n_floats * 4 bytes
        return tf.reduce_sum(t)

    reports = [effgrad.memory.measure(allocate, n) for n in (1_000_000, 3_000_000, 5_000_000)]
    print("@@" + json.dumps([[r.extra_bytes, r.peak_bytes, r.device, float(r.result)] for r in reports]))
    """
)


def test_peak_grows_with_a_known_allocation():
    # In a fresh process: in a test worker, threads left by earlier tests (tf.data prefetching)
    # allocate during the call too (seen: a 22 MiB peak whatever the allocation).
    reports = in_fresh_processes(_KNOWN_ALLOCATIONS, {"known": []}, timeout=120)["known"]
    extras = [extra for extra, _, _, _ in reports]
    for n, extra in zip((1_000_000, 3_000_000, 5_000_000), extras):
        # The allocator may round a large buffer up (seen: 12 MB -> 16 MiB, 20 MB -> 32 MiB).
        assert 4 * n <= extra <= 2 * 4 * n + 2**20, extras
    assert extras[0] < extras[1] < extras[2], extras
    assert all(peak >= extra for extra, peak, _, _ in reports)
    assert reports[0][2] in ("CPU:0", "GPU:0")
    assert 0 < reports[0][3] < 1_000_000


def test_no_allocator_statistics_is_an_error_not_zero():
    """TensorFlow's context started without TF_CPU_ALLOCATOR_USE_BFC (TensorFlow used before effgrad was
    imported): say so. A forked child's context has not started yet: it starts here, without the variable."""
    code = textwrap.dedent(
        """
        import os
        os.environ.pop("TF_CPU_ALLOCATOR_USE_BFC", None)
        import effgrad, keras, tensorflow as tf
        tf.constant(1.0)                   # the context starts: the allocator is chosen, without BFC
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64)])
        try:
            report = effgrad.memory.measure(lambda: model(tf.ones([256, 64])))
        except RuntimeError as err:
            print("ERROR", err)
        else:
            print("PEAK", report.peak_bytes)
        """
    )
    status, out, err = run_forked(code, {"no statistics": []}, timeout=120)["no statistics"]
    assert status == 0, err[-3000:]
    assert out.startswith("ERROR") and "TF_CPU_ALLOCATOR_USE_BFC" in out, out
