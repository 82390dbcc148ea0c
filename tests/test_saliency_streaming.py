"""Streaming saliency: every input kind and sink agree; resume; bounded memory; bad input; CLI."""

import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

import effgrad
from effgrad.explain import engine
from helpers import Forked, in_fresh_processes, run_forked


def _model(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((8, 8, 1)),
            keras.layers.Conv2D(4, 3, activation="relu"),
            keras.layers.Flatten(),
            keras.layers.Dense(3),
        ]
    )


# Saliency reads the model and never changes it: the tests share one, so each compiled job (cached on
# the model) is traced once for the file, not again in every test that explains the same way.
@pytest.fixture(scope="module")
def model():
    return _model()


@pytest.fixture
def x(rng):
    return rng.uniform(0, 1, size=(50, 8, 8, 1)).astype("float32")


def test_every_input_kind_and_sink_gives_the_same_maps(model, tmp_path, x):
    expected = effgrad.saliency(model, x, batch_size=16, reduce="abs_sum", progress=False)
    np.save(tmp_path / "inputs.npy", x)
    inputs = {
        "memmap": np.load(tmp_path / "inputs.npy", mmap_mode="r"),
        "tensor": tf.constant(x),
        "dataset": tf.data.Dataset.from_tensor_slices((x, np.zeros(50))).batch(16),
        "list": [x[i : i + 16] for i in range(0, 50, 16)],
        "generator": (x[i : i + 7] for i in range(0, 50, 7)),
    }
    for name, source in inputs.items():
        n = 50 if name in ("dataset", "generator") else None
        got = effgrad.saliency(model, source, batch_size=16, reduce="abs_sum", num_examples=n, progress=False)
        np.testing.assert_allclose(got, expected, rtol=1e-6, err_msg=name)
    buffer = np.full((50, 8, 8), np.nan, "float32")
    assert effgrad.saliency(model, x, batch_size=16, reduce="abs_sum", out=buffer, progress=False) is buffer
    np.testing.assert_array_equal(buffer, expected)
    on_disk = effgrad.saliency(model, x, batch_size=16, reduce="abs_sum", out=tmp_path / "maps.npy", progress=False)
    assert isinstance(on_disk, np.memmap)
    np.testing.assert_array_equal(np.load(tmp_path / "maps.npy"), expected)


def test_copy_on_write_memmaps_keep_the_callers_edits_and_the_maps(model, tmp_path, rng):
    """mode="c" pages are private memory: releasing them would revert edits to the file's zeros."""
    n = 4000  # 1 MiB of inputs: many pages to release
    np.save(tmp_path / "zeros.npy", np.zeros((n, 8, 8, 1), "float32"))
    edited = np.load(tmp_path / "zeros.npy", mmap_mode="c")
    values = rng.uniform(0.5, 1, size=edited.shape).astype("float32")
    edited[:] = values  # the caller's in-memory edits, never written to the file
    expected = effgrad.saliency(model, values, batch_size=256, reduce="abs_sum", progress=False)
    np.save(tmp_path / "out.npy", np.zeros((n, 8, 8), "float32"))
    out = np.load(tmp_path / "out.npy", mmap_mode="c")
    got = effgrad.saliency(model, edited, batch_size=256, reduce="abs_sum", out=out, progress=False)
    np.testing.assert_array_equal(np.asarray(edited), values)  # the inputs kept their edits
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-6)  # the maps were not dropped
    assert np.abs(np.asarray(out)).sum() > 0


def test_resume_after_an_exception_skips_committed_rows(model, tmp_path, x, monkeypatch):
    expected = effgrad.saliency(model, x, batch_size=8, progress=False)
    path = tmp_path / "maps.npy"

    def failing():
        for i in range(0, 50, 8):
            if i == 24:
                raise RuntimeError("the data loader died")
            yield x[i : i + 8]

    with pytest.raises(RuntimeError, match="data loader died"):
        effgrad.saliency(model, failing(), batch_size=8, num_examples=50, out=path, progress=False)
    journal = json.loads((tmp_path / "maps.npy.journal.json").read_text())
    assert journal["committed"] == 24 and not journal["complete"]
    with pytest.raises(FileExistsError, match="resume=True"):
        effgrad.saliency(model, x, batch_size=8, out=path, progress=False)
    poisoned = x.copy()
    poisoned[:24] = np.nan  # not the rows the interrupted run explained: refused, nothing written
    before = path.read_bytes()
    with pytest.raises(ValueError, match="first 24 input rows are not the ones"):
        effgrad.saliency(model, poisoned, batch_size=8, out=path, resume=True, progress=False)
    assert path.read_bytes() == before
    from effgrad.explain import engine

    computed, submit = [], engine._Writer.submit
    monkeypatch.setattr(engine._Writer, "submit", lambda self, row, *a: (computed.append(row), submit(self, row, *a)))
    effgrad.saliency(model, x, batch_size=8, out=path, resume=True, progress=False)
    assert computed == [24, 32, 40, 48]  # committed rows were checked, not computed again
    np.testing.assert_array_equal(np.load(path), expected)
    assert json.loads((tmp_path / "maps.npy.journal.json").read_text())["complete"]


def test_an_interrupt_after_a_batch_was_handed_over_commits_what_was_written(model, tmp_path, x, monkeypatch):
    """Ctrl-C can land inside queue.put after the batch is enqueued: the writer still writes it, and the
    final commit must claim the writer's rows, not the rows the main thread believed it had submitted."""
    from effgrad.explain import engine

    expected = effgrad.saliency(model, x, batch_size=8, progress=False)
    path = tmp_path / "maps.npy"
    submit = engine._Writer.submit

    def interrupted_after_enqueue(self, row, *args):
        submit(self, row, *args)
        if row == 16:
            raise KeyboardInterrupt

    monkeypatch.setattr(engine._Writer, "submit", interrupted_after_enqueue)
    with pytest.raises(KeyboardInterrupt):
        effgrad.saliency(model, x, batch_size=8, out=path, progress=False)
    assert json.loads((tmp_path / "maps.npy.journal.json").read_text())["committed"] == 24
    monkeypatch.undo()
    effgrad.saliency(model, x, batch_size=8, out=path, resume=True, progress=False)
    np.testing.assert_array_equal(np.load(path), expected)


def test_ctrl_c_is_never_lost_even_inside_a_finalizer(model, tmp_path, x, monkeypatch, request):
    """A KeyboardInterrupt raised inside a __del__ (TensorFlow runs many) is only printed by Python: the run
    must still stop, at the next batch boundary, with its rows committed."""
    from effgrad.explain import engine

    class Finalizer:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C arrives while this __del__ runs

    submit = engine._Writer.submit

    def submit_then_finalize(self, row, *args):
        submit(self, row, *args)
        if row == 16:
            Finalizer()  # dropped at once, in the main thread

    monkeypatch.setattr(engine._Writer, "submit", submit_then_finalize)
    # Python's handler, as in an interactive run (a background job of a non-interactive shell ignores SIGINT).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    request.addfinalizer(lambda: signal.signal(signal.SIGINT, previous))
    path = tmp_path / "maps.npy"
    with pytest.raises(KeyboardInterrupt):
        effgrad.saliency(model, x, batch_size=8, out=path, progress=False)
    assert json.loads((tmp_path / "maps.npy.journal.json").read_text())["committed"] == 24
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # Python's handler is back


def test_resume_refuses_a_different_configuration(model, tmp_path, x):
    path = tmp_path / "maps.npy"
    effgrad.saliency(model, x, batch_size=8, out=path, progress=False)
    before = path.read_bytes()
    for change in ({"method": "smoothgrad"}, {"batch_size": 16}, {"target": 1}):
        with pytest.raises(ValueError, match="different configuration"):
            effgrad.saliency(model, x, out=path, resume=True, progress=False, **{"batch_size": 8, **change})
    assert path.read_bytes() == before
    (tmp_path / "foreign.npy").write_bytes(before)
    with pytest.raises(ValueError, match="no effgrad journal"):
        effgrad.saliency(model, x, batch_size=8, out=tmp_path / "foreign.npy", resume=True, progress=False)


_CHILD = textwrap.dedent(
    """
    import sys, time
    import numpy as np, keras, effgrad
    model = keras.models.load_model(sys.argv[1])
    x = np.load(sys.argv[2], mmap_mode="r")
    def slow():
        for i in range(0, len(x), 8):
            time.sleep(0.05)
            yield x[i : i + 8]
    effgrad.saliency(model, slow(), batch_size=8, num_examples=len(x), out=sys.argv[3], progress=False)
    """
)


def test_sigkilled_run_resumes_to_the_same_file(model, tmp_path, rng):
    x = rng.uniform(0, 1, size=(400, 8, 8, 1)).astype("float32")
    model.save(tmp_path / "m.keras")
    np.save(tmp_path / "x.npy", x)
    expected = effgrad.saliency(model, x, batch_size=8, progress=False)
    path, journal = tmp_path / "maps.npy", tmp_path / "maps.npy.journal.json"
    child = Forked(_CHILD, {"run": [tmp_path / "m.keras", tmp_path / "x.npy", path]})  # forked: no new imports
    deadline = time.time() + 120
    committed = 0
    while time.time() < deadline and child.running():
        if journal.exists():
            committed = json.loads(journal.read_text())["committed"]
            if committed >= 40:
                break
        time.sleep(0.05)
    child.send_signal(signal.SIGKILL)
    child.wait()
    state = json.loads(journal.read_text())
    assert 0 < state["committed"] < 400 and not state["complete"], state
    done = state["committed"]
    np.testing.assert_array_equal(np.load(path)[:done], expected[:done])  # what the journal names is whole
    effgrad.saliency(model, x, batch_size=8, out=path, resume=True, progress=False)
    np.testing.assert_array_equal(np.load(path), expected)


_MEMORY_CHILD = textwrap.dedent(
    """
    import os, sys, json
    import numpy as np, keras, effgrad
    n = int(sys.argv[1])
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((32, 32, 3)), keras.layers.Conv2D(16, 3, activation="relu"),
                              keras.layers.Flatten(), keras.layers.Dense(10)])
    x = np.lib.format.open_memmap(sys.argv[2], mode="w+", dtype="float32", shape=(n, 32, 32, 3))
    x[:] = 0.5
    effgrad.saliency(model, x[:64], batch_size=64, progress=False)  # trace outside the measurement
    report = effgrad.memory.measure(effgrad.saliency, model, x, batch_size=64, out=sys.argv[3], progress=False)
    print("@@" + json.dumps({"peak": report.peak_bytes}))
    """
)


def test_device_memory_is_flat_in_the_number_of_examples(tmp_path):
    runs = {n: [n, tmp_path / f"x{n}.npy", tmp_path / f"m{n}.npy"] for n in (512, 2048)}
    peaks = [run["peak"] for run in in_fresh_processes(_MEMORY_CHILD, runs).values()]
    # 4x the examples: the same device memory up to the batches the pipeline holds in flight
    # (_AHEAD staged and pending on each side of the device, one being made and one being
    # written: the short run may never fill it; measured up to 3.1 batches more, 6 MiB), far
    # below the 19 MB a leak of the extra 1,536 inputs would add.
    batch_bytes = 64 * 32 * 32 * 3 * 4 * 2  # one batch of inputs and its maps
    assert peaks[1] <= peaks[0] + (engine._AHEAD + 2) * batch_bytes, peaks


# ---------------------------------------------------------------- bad input
def test_bad_inputs_fail_before_any_work(model, tmp_path, x):
    buffer = np.full((50, 8, 8, 1), 7.0, "float32")
    with pytest.raises(TypeError, match="float inputs"):
        effgrad.saliency(model, (x * 10).astype("int32"), out=buffer, progress=False)
    with pytest.raises(ValueError, match="out of range"):
        effgrad.saliency(model, x, target=3, out=buffer, progress=False)
    with pytest.raises(ValueError, match="out of range"):
        effgrad.saliency(model, x, target=np.full(50, -1), out=buffer, progress=False)
    with pytest.raises(ValueError, match="50 examples"):
        effgrad.saliency(model, x, target=np.zeros(49, int), out=buffer, progress=False)
    with pytest.raises(ValueError, match="Unknown saliency method"):
        effgrad.saliency(model, x, method="deeplift", out=buffer, progress=False)
    with pytest.raises(ValueError, match="Unknown reduce"):
        effgrad.saliency(model, x, reduce="mean", out=buffer, progress=False)
    with pytest.raises(TypeError, match="unknown option"):
        effgrad.saliency(model, x, method="gradient", samples=3, out=buffer, progress=False)
    with pytest.raises(ValueError, match="shape"):
        effgrad.saliency(model, x, reduce="abs_sum", out=buffer, progress=False)  # needs (50, 8, 8)
    with pytest.raises(ValueError, match="dtype"):
        effgrad.saliency(model, x, dtype="float16", out=buffer, progress=False)
    with pytest.raises(ValueError, match="num_examples=7 but the inputs hold"):
        effgrad.saliency(model, x, num_examples=7, out=buffer, progress=False)
    with pytest.raises(ValueError, match="resume=True continues a file"):
        effgrad.saliency(model, x, out=buffer, resume=True, progress=False)
    assert (buffer == 7.0).all()  # untouched
    existing = tmp_path / "maps.npy"
    existing.write_bytes(b"precious")
    with pytest.raises(FileExistsError, match="never overwrites"):
        effgrad.saliency(model, x, out=existing, progress=False)
    assert existing.read_bytes() == b"precious"
    with pytest.raises(ValueError, match="nothing to explain") as err:
        effgrad.saliency(model, x[:0], progress=False)
    assert "\n" not in str(err.value)
    lock = tmp_path / "fresh.npy.lock"  # the user's own file that happens to bear the lock's name
    lock.write_bytes(b"mine")
    with pytest.raises(FileExistsError, match="not effgrad's lock"):
        effgrad.saliency(model, x, out=tmp_path / "fresh.npy", progress=False)
    assert lock.read_bytes() == b"mine"


def test_progress_is_a_keras_progbar(model, capsys, x, monkeypatch):
    monkeypatch.setattr("sys.stdout.isatty", lambda: True, raising=False)  # a terminal: the live bar
    effgrad.saliency(model, x, batch_size=10, progress=True)
    shown = capsys.readouterr().out
    assert "50/50" in shown and "/example" in shown  # Keras's bar: rows done and time per example
    effgrad.saliency(model, (x[i : i + 10] for i in range(0, 50, 10)), progress=True)
    assert "50/Unknown" in capsys.readouterr().out  # a generator of unknown length
    effgrad.saliency(model, x, batch_size=10, progress=False)
    assert capsys.readouterr() == ("", "")


def test_cli_end_to_end(model, tmp_path, x, capfd):
    from effgrad import cli

    model.save(tmp_path / "m.keras")
    np.save(tmp_path / "x.npy", x)
    arguments = [
        "saliency",
        str(tmp_path / "m.keras"),
        str(tmp_path / "x.npy"),
        "--out",
        str(tmp_path / "maps.npy"),
        "--reduce",
        "abs_max",
        "--batch-size",
        "16",
        "--no-progress",
    ]
    # Once as `python -m effgrad.cli` runs it (the module as __main__, in a process of its own, forked
    # from one that imported the libraries); then in this process.
    main = "import runpy; runpy.run_module('effgrad.cli', run_name='__main__')"
    status, out, err = run_forked(main, {"cli": arguments})["cli"]
    assert status == 0, err[-2000:]
    assert "wrote" in out
    expected = effgrad.saliency(model, x, reduce="abs_max", batch_size=16, progress=False)
    np.testing.assert_allclose(np.load(tmp_path / "maps.npy"), expected, rtol=1e-6)
    capfd.readouterr()
    assert cli.main(arguments) == 2 and "never overwrites" in capfd.readouterr().err
    assert cli.main([*arguments, "--resume"]) == 0, capfd.readouterr().err[-2000:]


# ---------------------------------------------------------------- resume identity and damaged files
def _interrupted(tmp_path, model, x, rows=24, **options):
    """A run into maps.npy whose input dies after ``rows`` rows."""
    path = tmp_path / "maps.npy"

    def dying():
        for i in range(0, len(x), 8):
            if i == rows:
                raise RuntimeError("killed")
            yield x[i : i + 8]

    with pytest.raises(RuntimeError, match="killed"):
        effgrad.saliency(model, dying(), batch_size=8, num_examples=len(x), out=path, progress=False, **options)
    return path


def test_resume_refuses_other_weights_other_target_and_other_rows(model, tmp_path, x):
    path = _interrupted(tmp_path, model, x)
    before = path.read_bytes()
    other = _model()
    other.set_weights([w + 0.01 for w in model.get_weights()])
    with pytest.raises(ValueError, match="model"):
        effgrad.saliency(other, x, batch_size=8, out=path, resume=True, progress=False)
    shuffled = x[np.random.default_rng(1).permutation(len(x))]
    with pytest.raises(ValueError, match="not the ones.*shuffle=False"):
        effgrad.saliency(model, shuffled, batch_size=8, out=path, resume=True, progress=False)
    assert path.read_bytes() == before
    # another callable target (same code, another captured class) is another run
    path2 = _interrupted(tmp_path / "c", model, x, target=(lambda c: lambda y: y[:, c])(0))
    with pytest.raises(ValueError, match="target"):
        effgrad.saliency(model, x, batch_size=8, out=path2, resume=True, progress=False, target=lambda y: y[:, 1])


def test_resume_accepts_the_same_model_built_again(tmp_path, x):
    # Built again in the same process its layers get other names, wrapped layers included.
    def make():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((8, 8, 1))
        h = keras.layers.Flatten()(keras.layers.TimeDistributed(keras.layers.Dense(2))(inputs))
        return keras.Model(inputs, effgrad.Checkpoint(keras.layers.Dense(3))(h))

    first = make()
    path = _interrupted(tmp_path, first, x)
    again = make()
    again.set_weights(first.get_weights())
    effgrad.saliency(again, x, batch_size=8, out=path, resume=True, progress=False)
    np.testing.assert_allclose(np.load(path), effgrad.saliency(again, x, batch_size=8, progress=False), atol=1e-6)


_CLASS = 0  # a global a callable target reads


def test_resume_refuses_the_same_weights_in_another_model_and_targets_reading_other_values(model, tmp_path, x):
    global _CLASS
    path = _interrupted(tmp_path, model, x)
    other = _model()
    other.layers[0].activation = keras.activations.tanh  # the same weights, another function
    other.set_weights(model.get_weights())
    with pytest.raises(ValueError, match="model"):
        effgrad.saliency(other, x, batch_size=8, out=path, resume=True, progress=False)
    # NumPy scalars captured, and globals read, are part of a callable target
    path = _interrupted(tmp_path / "n", model, x, target=(lambda c: lambda y: y[:, c])(np.int64(0)))
    with pytest.raises(ValueError, match="target"):
        target = (lambda c: lambda y: y[:, c])(np.int64(1))
        effgrad.saliency(model, x, batch_size=8, out=path, resume=True, progress=False, target=target)
    path = _interrupted(tmp_path / "g", model, x, target=lambda y: y[:, _CLASS])
    _CLASS = 1
    try:
        with pytest.raises(ValueError, match="target"):
            target = lambda y: y[:, _CLASS]  # noqa: E731
            effgrad.saliency(model, x, batch_size=8, out=path, resume=True, progress=False, target=target)
    finally:
        _CLASS = 0


def test_shuffling_dataset_cannot_corrupt_a_resumed_file(model, tmp_path, x):
    ds = tf.data.Dataset.from_tensor_slices(x).shuffle(len(x), seed=None, reshuffle_each_iteration=True).batch(8)
    first_pass = np.concatenate(list(ds.as_numpy_iterator()))  # the order the interrupted run saw
    path = _interrupted(tmp_path, model, first_pass)
    with pytest.raises(ValueError, match="shuffle=False"):
        effgrad.saliency(model, ds, batch_size=8, num_examples=len(x), out=path, resume=True, progress=False)


def test_damaged_files_are_never_resumed_as_whole(model, tmp_path, x):
    path = _interrupted(tmp_path, model, x)
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 100)  # a truncated file: committed rows would read as zeros
    with pytest.raises(ValueError, match="missing or damaged"):
        effgrad.saliency(model, x, batch_size=8, out=path, resume=True, progress=False)
    # killed between creating the file and writing its header, before any commit: starts again
    path.write_bytes(b"")
    journal = json.loads((tmp_path / "maps.npy.journal.json").read_text())
    (tmp_path / "maps.npy.journal.json").write_text(json.dumps({**journal, "committed": 0}))
    maps = effgrad.saliency(model, x, batch_size=8, out=path, resume=True, progress=False)
    np.testing.assert_array_equal(maps, effgrad.saliency(model, x, batch_size=8, progress=False))


def test_a_run_that_computed_nothing_leaves_no_file(model, tmp_path, x):
    path = tmp_path / "maps.npy"
    with pytest.raises(Exception, match="no_such_thing"):  # fails while tracing the target
        effgrad.saliency(model, x, out=path, progress=False, target=lambda y: y.no_such_thing)
    assert list(tmp_path.iterdir()) == []
    effgrad.saliency(model, x, out=path, progress=False)  # a plain rerun works


# ---------------------------------------------------------------- unknown length, disk space, locking
def test_datasets_and_generators_need_no_num_examples(model, tmp_path, x):
    expected = effgrad.saliency(model, x, batch_size=16, reduce="l2", progress=False)
    sources = {
        "dataset": lambda: tf.data.Dataset.from_tensor_slices(x).batch(16),
        "dataset of (x, y)": lambda: tf.data.Dataset.from_tensor_slices((x, np.arange(50))).batch(16),
        "generator": lambda: (x[i : i + 7] for i in range(0, 50, 7)),
    }
    for name, make in sources.items():
        got = effgrad.saliency(model, make(), reduce="l2", progress=False)
        np.testing.assert_allclose(got, expected, rtol=1e-6, err_msg=name)
        path = tmp_path / f"{name}.npy"
        on_disk = effgrad.saliency(model, make(), reduce="l2", out=path, progress=False)
        assert on_disk.shape == (50, 8, 8)
        np.testing.assert_allclose(np.load(path), expected, rtol=1e-6, err_msg=name)  # a standard .npy
    buffer = np.zeros((50, 8, 8), "float32")
    effgrad.saliency(model, sources["generator"](), reduce="l2", out=buffer, progress=False)
    np.testing.assert_allclose(buffer, expected, rtol=1e-6)
    with pytest.raises(ValueError, match="held 50 examples but the output buffer has 60"):
        effgrad.saliency(
            model, sources["generator"](), reduce="l2", out=np.zeros((60, 8, 8), "float32"), progress=False
        )


def test_unknown_length_file_resumes_after_an_interruption(model, tmp_path, x):
    expected = effgrad.saliency(model, x, batch_size=8, progress=False)
    path = tmp_path / "maps.npy"

    def batches(die_at=None):
        for i in range(0, 50, 8):
            if i == die_at:
                raise RuntimeError("killed")
            yield x[i : i + 8]

    with pytest.raises(RuntimeError, match="killed"):
        effgrad.saliency(model, batches(die_at=24), batch_size=8, out=path, progress=False)
    assert json.loads((tmp_path / "maps.npy.journal.json").read_text())["committed"] == 24
    assert np.load(path).shape == (0, 8, 8, 1)  # the header names no rows until the length is known
    maps = effgrad.saliency(model, batches(), batch_size=8, out=path, resume=True, progress=False)
    np.testing.assert_array_equal(maps, expected)
    np.testing.assert_array_equal(np.load(path), expected)
    with open(path, "r+b") as f:  # a damaged finished file is not taken as whole
        f.truncate(path.stat().st_size - 4)
    with pytest.raises(ValueError, match="missing or damaged"):
        effgrad.saliency(model, batches(), batch_size=8, out=path, resume=True, progress=False)


def test_not_enough_disk_space_is_an_error_before_any_work(model, tmp_path, x, monkeypatch):
    import shutil as shutil_module

    from effgrad.explain import sinks

    path = tmp_path / "maps.npy"
    usage = shutil_module.disk_usage(tmp_path)
    monkeypatch.setattr(sinks.shutil, "disk_usage", lambda p: usage._replace(free=1000))
    with pytest.raises(OSError, match=r"needs 0\.0 MiB, 0\.0 MiB are free") as err:
        effgrad.saliency(model, x, out=path, progress=False)
    assert err.value.errno == errno.ENOSPC
    assert list(tmp_path.iterdir()) == []  # nothing created


def test_space_is_reserved_up_front(model, tmp_path, x, monkeypatch):
    """A full disk fails the reservation (a clear error, no file), not a write (SIGBUS through a memmap)."""
    from effgrad.explain import sinks

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(sinks.os, "posix_fallocate", full)
    with pytest.raises(OSError, match="Not enough disk space"):
        effgrad.saliency(model, x, out=tmp_path / "maps.npy", progress=False)
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    effgrad.saliency(model, x, out=tmp_path / "maps.npy", progress=False)
    assert os.stat(tmp_path / "maps.npy").st_blocks * 512 >= 50 * 8 * 8 * 4  # blocks allocated, not sparse


def test_one_writer_per_output_file(model, tmp_path, x):
    from effgrad.explain.sinks import _OutputLock

    path = tmp_path / "maps.npy"
    held = _OutputLock(path)  # another writer (flock conflicts between open files, even in one process)
    with pytest.raises(BlockingIOError, match="being written by another process"):
        effgrad.saliency(model, x, out=path, progress=False)
    assert not path.exists() and not (tmp_path / "maps.npy.journal.json").exists()
    held.release()
    effgrad.saliency(model, x, out=path, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["maps.npy", "maps.npy.journal.json"]  # lock removed


def test_effgrad_help_does_not_load_tensorflow():
    probe = "import sys; sys.argv = ['effgrad', '--help']; import effgrad; print('tensorflow' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "False", done.stderr[-2000:]


def test_a_completed_run_resumed_with_other_inputs_is_refused(model, tmp_path, x):
    path = tmp_path / "maps.npy"
    maps = np.array(effgrad.saliency(model, x, batch_size=8, out=path, progress=False))
    with pytest.raises(ValueError, match="not the ones"):
        effgrad.saliency(model, x + 1, batch_size=8, out=path, resume=True, progress=False)
    longer = (b for b in (x[:25], x[25:], x[:3]))  # unknown length: only reading them can tell
    with pytest.raises(ValueError, match="inputs hold more"):
        effgrad.saliency(model, longer, batch_size=8, out=path, resume=True, progress=False, num_examples=50)
    with pytest.raises(ValueError, match="before the 50 committed"):
        effgrad.saliency(
            model, (b for b in (x[:40],)), batch_size=8, out=path, resume=True, progress=False, num_examples=50
        )
    # the same inputs: the finished maps, nothing recomputed
    np.testing.assert_array_equal(effgrad.saliency(model, x, batch_size=8, out=path, resume=True, progress=False), maps)


@pytest.mark.parametrize("complete", [False, True])
def test_committed_rows_damaged_on_disk_are_refused_with_their_range(model, tmp_path, x, complete):
    path = tmp_path / "maps.npy"
    if complete:
        effgrad.saliency(model, x, batch_size=8, out=path, progress=False)
    else:
        path = _interrupted(tmp_path, model, x)
    committed = json.loads((tmp_path / "maps.npy.journal.json").read_text())["committed"]
    assert committed >= 20
    stored = np.load(path, mmap_mode="r+")  # header and size stay intact
    stored[10:20] = 0
    stored.flush()
    del stored
    with pytest.raises(ValueError, match=r"rows \d+-\d+ changed after they were committed") as err:
        effgrad.saliency(model, x, batch_size=8, out=path, resume=True, progress=False)
    first, last = map(int, err.value.args[0].split("rows ")[1].split(" changed")[0].split("-"))
    assert first <= 10 and last >= 19  # the range names the damaged rows
