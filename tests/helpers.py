"""Reference computations the tests compare effgrad against."""

import atexit
import gc
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
from pathlib import Path

import keras
import numpy as np
import tensorflow as tf


def mlp(seed=0, inputs=5, hidden=7, outputs=3, regularizer=None, dtype=None):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((inputs,)),
            keras.layers.Dense(hidden, activation="tanh", kernel_regularizer=regularizer, dtype=dtype),
            keras.layers.Dense(outputs, dtype=dtype),
        ]
    )


def tiny_gpt2_lm(seed=0, vocabulary=50, length=8, dropout=0.1, layers=2):
    """A keras_hub GPT2CausalLM built from constructor arguments (nothing downloaded).

    Each transformer layer lengthens every trace and XLA compile: tests whose subject is not the
    depth take ``layers=1``.
    """
    import keras_hub

    keras.utils.set_random_seed(seed)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=vocabulary,
        num_layers=layers,
        num_heads=2,
        hidden_dim=16,
        intermediate_dim=32,
        max_sequence_length=length,
        dropout=dropout,
    )
    return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)


def sequence_model(seed=0, features=4, vocab=6):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [keras.Input((None, features)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(vocab)]
    )


def plain_step(model, per_example_loss, optimizer, x, y, sample_weight=None, clip_norm=None):
    """One full-batch GradientTape update of L = sum(w*l)/sum(w) + regularization."""
    with tf.GradientTape() as tape:
        losses = per_example_loss(y, tf.cast(model(x, training=True), tf.float32))
        w = tf.ones_like(losses) if sample_weight is None else tf.cast(sample_weight, tf.float32)
        while w.shape.rank < losses.shape.rank:
            w = w[..., None]
        w = tf.broadcast_to(w, tf.shape(losses))
        loss = tf.reduce_sum(w * losses) / tf.reduce_sum(w)
        if model.losses:
            loss += tf.add_n(model.losses)
    grads = tape.gradient(loss, model.trainable_variables)
    if clip_norm is not None:
        grads, _ = tf.clip_by_global_norm(grads, clip_norm)
    optimizer.apply(grads, model.trainable_variables)
    return float(loss)


def per_example_losses(loss, y, y_pred, sample_weight=None):
    """``[batch]``: each example's unreduced loss, weighted, summed over its elements (DP-SGD's ``l_i``)."""
    fn = keras.losses.get(loss) if isinstance(loss, str) else loss
    values = tf.cast(fn.call(y, y_pred) if isinstance(fn, keras.losses.Loss) else fn(y, y_pred), tf.float32)
    mask = getattr(y_pred, "_keras_mask", None)
    if mask is not None:
        values = values * tf.cast(tf.reshape(mask, tf.shape(values)), tf.float32)
    if sample_weight is not None:
        w = tf.cast(sample_weight, tf.float32)
        values = values * tf.reshape(w, [-1] + [1] * (values.shape.rank - 1))
    return tf.reduce_sum(tf.reshape(values, [tf.shape(values)[0], -1]), axis=1)


def naive_per_example_gradients(model, loss, x, y, sample_weight=None, training=False):
    """``[example][variable]`` NumPy gradients: one forward pass, then one backward pass per example."""
    with tf.GradientTape(persistent=True) as tape:
        y_pred = model(x, training=training)
        losses = per_example_losses(loss, y, y_pred, sample_weight)
        singles = [losses[i] for i in range(int(losses.shape[0]))]
    grads = []
    for single in singles:
        g = tape.gradient(single, model.trainable_variables)
        grads.append([np.zeros(v.shape, "float32") if t is None else tf.convert_to_tensor(t).numpy()
                      for v, t in zip(model.trainable_variables, g)])  # fmt: skip
    return grads


def per_example_norms_naive(model, loss, x, y, sample_weight=None, training=False) -> np.ndarray:
    """``[batch]``: the norm of each example's gradient, one backward pass per example."""
    grads = naive_per_example_gradients(model, loss, x, y, sample_weight, training)
    return np.array([np.sqrt(sum(float(np.sum(np.square(g))) for g in example)) for example in grads])


_CHANNELS_FIRST: list = []


def channels_first_unsupported() -> str | None:
    """None when TensorFlow on this machine trains a channels_first Conv2D model; else its error's key line.

    TensorFlow's CPU builds differ: some have no NCHW convolution kernels (forward or input
    gradient, e.g. "Conv2DCustomBackpropInputOp only supports NHWC"), and stock Keras fails on
    them the same way. Asked once per process, with a tiny two-layer model's gradient in a graph.
    """
    if not _CHANNELS_FIRST:
        layers = [keras.layers.Conv2D(2, 2, data_format="channels_first") for _ in range(2)]
        model = keras.Sequential([keras.Input((2, 4, 4)), *layers])

        @tf.function
        def gradient(x):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(model(x))
            return tape.gradient(loss, model.trainable_variables)

        try:
            gradient(tf.ones((1, 2, 4, 4)))
            _CHANNELS_FIRST.append(None)
        except (tf.errors.UnimplementedError, tf.errors.InvalidArgumentError) as err:
            lines = [line.strip() for line in str(err.message).splitlines() if line.strip()]
            key = [line for line in lines if "NHWC" in line or "NCHW" in line or "not implemented" in line.lower()]
            _CHANNELS_FIRST.append((key or lines or [type(err).__name__])[0])
    return _CHANNELS_FIRST[0]


def png_pixels(path) -> np.ndarray:
    """The picture at ``path`` as an ``[H, W, channels]`` float array; a clear failure if it is no PNG or blank."""
    import matplotlib.image

    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", path
    pixels = matplotlib.image.imread(path)
    assert pixels.ndim == 3 and min(pixels.shape[:2]) >= 100 and pixels.std() > 0.01, (path, pixels.shape)
    return pixels


def numpy_vars(variables):
    return [np.array(v.numpy()) for v in variables]


def assert_summary_equals_numpy(summary, maps, classes):
    """saliency_summary's per-class count, mean and variance equal NumPy's over the stored maps.

    ``maps`` is what effgrad.saliency returned: one array, or a dict of arrays per input.
    """
    assert sorted(summary.count) == sorted(set(classes.tolist()))
    for c, count in summary.count.items():
        assert count == (classes == c).sum()
        mean, variance = summary.mean[c], summary.variance[c]
        if isinstance(maps, dict):
            assert set(mean) == set(maps)  # the inputs' nest, as saliency() returns maps
            triples = [(mean[k], variance[k], maps[k]) for k in maps]
        else:
            triples = [(mean, variance, maps)]
        for m, v, stored in triples:
            rows = stored[classes == c]
            np.testing.assert_allclose(m, rows.mean(0), rtol=1e-4, atol=1e-6)
            np.testing.assert_allclose(v, rows.var(0), rtol=1e-3, atol=1e-7)


# A process that imported TensorFlow, Keras, keras_hub and effgrad, and started nothing: it forks one
# child per run, without the ~8 s of imports each. TensorFlow's context, devices and allocator start
# in the child. For runs that need a process of their own but measure no peak (the quick benchmarks,
# a docs block with a MirroredStrategy, a run to interrupt or kill: Forked): see in_fresh_processes
# for why measurements are not forked.
_ZYGOTE = textwrap.dedent(
    """
    import json, os, signal, sys, traceback
    import effgrad, keras, keras_hub, numpy, tensorflow  # noqa: F401  imported once, for every child
    for line in sys.stdin:
        request, pids = json.loads(line), []
        for argv, out, err in request["runs"]:
            pid = os.fork()
            if pid:
                pids.append(pid)
                continue
            status = 1
            try:
                signal.signal(signal.SIGINT, signal.default_int_handler)  # as a new interpreter has it
                os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
                for fd, path in ((1, out), (2, err)):
                    os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
                sys.argv = ["-c", *argv]
                exec(compile(request["code"], "<child>", "exec"), {"__name__": "__main__"})
                status = 0
            except SystemExit as stop:
                status = stop.code if isinstance(stop.code, int) else 1
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(status)
        print(json.dumps(pids), flush=True)
        print(json.dumps([os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]), flush=True)
    """
)
_zygote: subprocess.Popen | None = None


def _forking_process() -> subprocess.Popen:
    global _zygote
    if _zygote is None or _zygote.poll() is not None:
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", TF_CPU_ALLOCATOR_USE_BFC="true")
        _zygote = subprocess.Popen(
            [sys.executable, "-c", _ZYGOTE],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            start_new_session=True,  # its own process group, children included: killed together
        )
        atexit.register(_kill, _zygote)
    return _zygote


def _kill(zygote: subprocess.Popen) -> None:
    try:
        os.killpg(zygote.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


class Forked:
    """Children of the forking process, started side by side: their pids, files and exit statuses."""

    def __init__(self, code: str, runs: dict):
        self.zygote = _forking_process()
        self._folder = tempfile.TemporaryDirectory()
        self.files = {key: (Path(self._folder.name, f"{i}.out"), Path(self._folder.name, f"{i}.err"))
                      for i, key in enumerate(runs)}  # fmt: skip
        request = [
            [list(map(str, argv)), str(self.files[key][0]), str(self.files[key][1])] for key, argv in runs.items()
        ]
        self.zygote.stdin.write(json.dumps({"code": code, "runs": request}) + "\n")
        self.zygote.stdin.flush()
        self.pids = dict(zip(runs, json.loads(self.zygote.stdout.readline())))
        self._reply: list = []
        self._reader = threading.Thread(target=lambda: self._reply.append(self.zygote.stdout.readline()), daemon=True)
        self._reader.start()

    def running(self) -> bool:
        return self._reader.is_alive()

    def send_signal(self, sig: int) -> None:
        for pid in self.pids.values():
            os.kill(pid, sig)

    def wait(self, timeout: float = 300) -> dict:
        """``{key: (exit status, stdout, stderr)}`` once every child has ended."""
        self._reader.join(timeout)
        if not self._reply or not self._reply[0]:
            _kill(self.zygote)  # its children are stuck or it died: the next call starts another
            raise AssertionError(f"fresh processes did not finish in {timeout} s")
        with self._folder:
            return {
                key: (status, out.read_text(), err.read_text())
                for (key, (out, err)), status in zip(self.files.items(), json.loads(self._reply[0]))
            }


def run_forked(code: str, runs: dict, timeout: float = 300) -> dict:
    """``{key: (exit status, stdout, stderr)}``: ``code`` run with ``sys.argv[1:] = runs[key]``, side by
    side, each in a fresh process forked from one that imported the libraries already."""
    return Forked(code, runs).wait(timeout)


def in_fresh_processes(code: str, runs: dict, timeout: float = 300, new_interpreters: bool = False) -> dict:
    """``{key: value}``: ``python -c code *argv`` per ``runs[key] = argv``, side by side, each printing
    ``@@`` + JSON, in a process of its own: allocator peaks then belong to it alone (the processes share
    only the wall time).

    Forked (:func:`run_forked`) unless ``new_interpreters``: a new interpreter spends 6.5 s of CPU on
    imports (TensorFlow 5.3), and forking 23 of them took the suite from 1,160 to 928 s of CPU on 2
    cores (4 of those are new interpreters again, below). Forked children's peaks had a heavier upper
    tail, though (a planned step's 3 training steps: 19.9-20.9 MiB in 3 of 18 forked runs, at most 19.7
    in 18 new interpreters), enough to fail a budget test, and a checkpointed model's eager peaks once
    moved by more than test_checkpoint_model allows: those tests ask for new interpreters."""
    if not new_interpreters:
        results = {}
        for key, (status, out, err) in run_forked(code, runs, timeout).items():
            found = [json.loads(line[2:]) for line in out.splitlines() if line.startswith("@@")]
            assert status == 0 and found, err[-3000:]
            results[key] = found[0]
        return results
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", TF_CPU_ALLOCATOR_USE_BFC="true")
    procs = {
        key: subprocess.Popen(
            [sys.executable, "-c", code, *map(str, argv)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for key, argv in runs.items()
    }
    results = {}
    for key, proc in procs.items():
        out, err = proc.communicate(timeout=timeout)
        found = [json.loads(line[2:]) for line in out.splitlines() if line.startswith("@@")]
        assert found, err[-3000:]
        results[key] = found[0]
    return results


def run_cluster(code: str, argv: list, workers: int = 2, timeout: float = 240) -> None:
    """``code`` run by each worker of a ``MultiWorkerMirroredStrategy`` cluster on loopback, side by side,
    forked (:func:`run_forked`) with its own ``TF_CONFIG``; ``"{index}"`` in ``argv`` is the worker's index."""
    sockets = [socket.socket() for _ in range(workers)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    cluster = [f"127.0.0.1:{s.getsockname()[1]}" for s in sockets]
    for s in sockets:
        s.close()
    runs = {
        index: [
            json.dumps({"cluster": {"worker": cluster}, "task": {"type": "worker", "index": index}}),
            *(str(a).format(index=index) for a in argv),
        ]
        for index in range(workers)
    }
    # TF_CONFIG is read when the strategy is made: set in the child, before the code runs. A worker that
    # has run the code waits for the others before it exits: its gRPC server closes with it, while a
    # sibling may still be reading its part of the last collective ("Socket closed").
    prelude = "import os, sys\nos.environ['TF_CONFIG'] = sys.argv.pop(1)\n_done = sys.argv.pop(1)\n"
    epilogue = (
        "\nimport time\nopen(os.path.join(_done, str(os.getpid())), 'w').close()\n"
        f"_until = time.time() + 60\nwhile len(os.listdir(_done)) < {workers} and time.time() < _until:\n"
        "    time.sleep(0.05)\n"
    )
    with tempfile.TemporaryDirectory() as done:
        for argv in runs.values():
            argv.insert(1, done)
        results = run_forked(prelude + code + epilogue, runs, timeout)
    for index, (status, _, err) in results.items():
        assert status == 0, f"worker {index}: {err[-3000:]}"


def counting(cls, calls: list):
    """A subclass of ``cls`` that appends each instance's constructor arguments to ``calls``."""

    class Counted(cls):
        def __init__(self, *args):
            calls.append(args)
            super().__init__(*args)

    return Counted


def bag_of_embeddings(vocabulary: int, width: int, length: int, classes: int = 3):
    """Token ids -> an Embedding table, averaged, -> Dense: a model whose table gets a sparse gradient."""
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((length,), dtype="int32"), keras.layers.Embedding(vocabulary, width),
                             keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(classes)])  # fmt: skip


def bytes_left_after(make) -> int:
    """Allocator bytes still held once what ``make()`` built (and returned) is deleted and collected:
    what a process that builds one model after another keeps of each."""
    gc.collect()
    before = tf.config.experimental.get_memory_info("CPU:0")["current"]
    built = make()
    del built
    gc.collect()
    return tf.config.experimental.get_memory_info("CPU:0")["current"] - before
