"""Training diagnostics: why memory grows, and the gradient noise scale.

:class:`MemoryMonitor` is a Keras callback that answers "why does my memory
grow?". Per epoch (and optionally every ``every_n_batches`` batches) it puts
into fit's logs and ``history``::

    memory_current_mib   device allocator bytes in use at the end of the epoch
    memory_peak_mib      allocator peak during the epoch (reset each epoch)
    host_rss_mib         resident memory of this process
    train_traces         how often the train function has been traced so far

and warns, once each, when the device memory in use at the end of an epoch
keeps growing (tensors kept alive across steps: outputs appended to a Python
list, a growing cache) or when the train function is traced again after the
first epoch (new input shapes or Python values in ``tf.function`` arguments:
every trace keeps a graph alive).

The gradient noise scale (``build_train_step(..., noise_scale=True)``) lives
in :mod:`effgrad.train.noise_scale`; :func:`plot_history` draws either.
"""

from __future__ import annotations

import os
import warnings

import keras
import tensorflow as tf

from effgrad import _compat, memory

__all__ = ["MemoryMonitor", "host_rss_mib", "plot_history"]

_MIB = 2**20


def host_rss_mib() -> float:
    """Resident set size of this process in MiB (Linux ``/proc``; 0 where unavailable)."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / _MIB
    except (OSError, ValueError, IndexError):
        return 0.0


class MemoryMonitor(keras.callbacks.Callback):
    """Logs device and host memory per epoch and warns when memory grows or the step retraces.

    Example:
        >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        >>> model.compile(optimizer="sgd", loss="mse")
        >>> history = model.fit(np.ones((64, 4)), np.zeros((64, 1)), epochs=2, verbose=0,
        ...                     callbacks=[effgrad.MemoryMonitor()])
        >>> sorted(k for k in history.history if "mib" in k)
        ['host_rss_mib', 'memory_current_mib', 'memory_peak_mib']

    Args:
        growth_mib: Warn when the device memory in use at the end of an epoch
            exceeds the end of the first epoch by more than this (MiB) and
            grew over each of the last ``patience`` epochs.
        patience: Consecutive epochs of growth before warning.
        every_n_batches: Also log ``memory_current_mib`` every N batches
            (into the batch logs); 0 turns it off.
        device: Allocator to read; default :func:`effgrad.memory.default_device`.

    Trap:
        The first epoch allocates optimizer slots and traces the step, so
        growth is measured from the end of the first epoch on. On CPU the
        allocator statistics need ``TF_CPU_ALLOCATOR_USE_BFC=true`` before
        TensorFlow allocates (``import effgrad`` first); without them the
        device columns are absent and a warning says why.
    """

    def __init__(self, growth_mib: float = 16.0, patience: int = 2, every_n_batches: int = 0, device=None):
        super().__init__()
        if growth_mib < 0 or patience < 1 or every_n_batches < 0:
            raise ValueError("growth_mib must be >= 0, patience >= 1 and every_n_batches >= 0.")
        self.growth_mib = float(growth_mib)
        self.patience = int(patience)
        self.every_n_batches = int(every_n_batches)
        self.device = device or memory.default_device()
        self.history: list[dict] = []
        self._warned: set[str] = set()
        self._has_stats = True
        self._graphs: set[int] = set()  # graphs the train step was traced into

    def set_model(self, model):
        """Wraps ``model.train_step`` to count traces (fit calls this before it builds the train function).

        An effgrad hook (``_compat.hook_method``) outside any ``attach``: the two compose in
        either order, and a re-``attach`` keeps the count.
        """
        super().set_model(model)
        graphs = self._graphs

        def counting(inner):
            def train_step(data):
                if not tf.executing_eagerly():  # Python runs here only while a graph is traced
                    graphs.add(id(tf.compat.v1.get_default_graph()))  # replicas of one trace share a graph
                return inner(data)

            return train_step

        _compat.hook_method(model, "train_step", "monitor", counting, order=10)
        model.train_function = None  # rebuilt around the counting step

    def _info(self) -> dict | None:
        if not self._has_stats:
            return None
        try:
            info = tf.config.experimental.get_memory_info(self.device)
        except ValueError:
            info = {"current": 0, "peak": 0}
        if info["peak"] == 0:
            self._has_stats = False
            self._warn_once(
                "stats",
                f"MemoryMonitor: TensorFlow keeps no allocator statistics for {self.device}, so only host "
                "memory is logged. On CPU set TF_CPU_ALLOCATOR_USE_BFC=true before TensorFlow allocates "
                "(import effgrad before tensorflow).",
            )
            return None
        return info

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, RuntimeWarning, stacklevel=3)

    def on_epoch_begin(self, epoch, logs=None):
        if self._info() is not None:
            tf.config.experimental.reset_memory_stats(self.device)

    def on_train_batch_end(self, batch, logs=None):
        if self.every_n_batches and logs is not None and (batch + 1) % self.every_n_batches == 0:
            info = self._info()
            if info is not None:
                logs["memory_current_mib"] = info["current"] / _MIB

    def on_epoch_end(self, epoch, logs=None):
        logs = logs if logs is not None else {}
        row = {"epoch": epoch, "host_rss_mib": host_rss_mib()}
        info = self._info()
        if info is not None:
            row["memory_current_mib"] = info["current"] / _MIB
            row["memory_peak_mib"] = info["peak"] / _MIB
        row["train_traces"] = len(self._graphs)
        self.history.append(row)
        logs.update({k: v for k, v in row.items() if k != "epoch"})
        self._check_growth()
        self._check_retracing()

    def _check_growth(self) -> None:
        currents = [r["memory_current_mib"] for r in self.history if "memory_current_mib" in r]
        if len(currents) < self.patience + 1:
            return
        recent = currents[-(self.patience + 1) :]
        growing = all(b > a for a, b in zip(recent, recent[1:]))
        if growing and currents[-1] - currents[0] > self.growth_mib:
            self._warn_once(
                "growth",
                f"MemoryMonitor: device memory in use at the end of each epoch keeps growing "
                f"({currents[0]:.0f} -> {currents[-1]:.0f} MiB over {len(currents) - 1} epochs). Something "
                "keeps tensors alive across steps. Likely causes: model outputs, losses or gradients "
                "appended to a Python list (in a callback or a custom train step): call .numpy() or "
                "float() on them, or keep only what you need; a cache or queue of tensors that is never "
                "emptied; a tf.function retraced for new shapes or Python arguments (each trace keeps "
                "a graph and its constants). Track it with memory_current_mib in history.",
            )

    def _check_retracing(self) -> None:
        traces = [r["train_traces"] for r in self.history if "train_traces" in r]
        if len(traces) >= 2 and traces[-1] > traces[0]:
            self._warn_once(
                "retrace",
                f"MemoryMonitor: the train function was traced again after the first epoch "
                f"({traces[0]} -> {traces[-1]} traces). Every trace builds and keeps a new graph. Likely "
                "causes: batches of changing shapes (pad or bucket them; drop_remainder=True), Python "
                "numbers or objects passed as tf.function arguments (pass tensors), or recompiling the "
                "model inside the training loop.",
            )


def plot_history(history, keys=("memory_current_mib", "memory_peak_mib", "host_rss_mib"), path=None):
    """Plots per-epoch values from a ``keras.callbacks.History`` (or its ``.history`` dict).

    Returns the matplotlib figure; with ``path``, also saves it as an image.
    """
    import matplotlib

    if path is not None:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    values = history.history if hasattr(history, "history") else history
    present = [k for k in keys if k in values]
    if not present:
        raise ValueError(f"history has none of {list(keys)}; it has {sorted(values)}.")
    fig, axes = plt.subplots(1, len(present), figsize=(4 * len(present), 3.2), squeeze=False)
    for ax, key in zip(axes[0], present):
        ax.plot(range(1, len(values[key]) + 1), values[key], "o-")
        ax.set(xlabel="epoch", title=key)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=110)
    return fig
