"""MemoryMonitor logs memory per epoch and warns on growth and retracing, not on a clean fit."""

import functools
import warnings

import keras
import numpy as np
import pytest

import effgrad
from helpers import mlp


def _data(n=256):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 5)).astype("float32"), rng.normal(size=(n, 3)).astype("float32")


class _KeepsOutputs(keras.callbacks.Callback):
    """The classic leak: device tensors appended to a Python list every batch."""

    def __init__(self):
        super().__init__()
        self.kept = []

    def on_train_batch_end(self, batch, logs=None):
        self.kept.append(keras.ops.ones((256, 1024)))  # 1 MiB on the device, never released


def _fit(model, callbacks, epochs=5, x=None, y=None, batch_size=32):
    x, y = (x, y) if x is not None else _data()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = model.fit(x, y, epochs=epochs, batch_size=batch_size, verbose=0, callbacks=callbacks)
    return history, [str(w.message) for w in caught if "MemoryMonitor" in str(w.message)]


def _compiled(attached: bool = False):
    """Stock Keras's optimizer built first: its fit then traces once, not twice (the unbuilt optimizer's
    second trace, within the first epoch, is test_retracing_after_the_first_epoch_warns's)."""
    model = mlp()
    model.compile(optimizer="adam", loss="mse")
    if attached:
        return effgrad.attach(model, micro_batches=2)
    model.optimizer.build(model.trainable_variables)
    return model


@functools.cache
def _clean_fit(attached: bool):
    """A 5-epoch fit under a default MemoryMonitor: (history, its warnings). The stock one is also the
    history test_plot_history draws (one fit and trace fewer)."""
    return _fit(_compiled(attached), [effgrad.MemoryMonitor()])


@pytest.mark.parametrize("attached", [False, True])
def test_clean_fit_logs_memory_and_does_not_warn(attached):
    history, messages = _clean_fit(attached)
    assert messages == []
    for key in ("memory_current_mib", "memory_peak_mib", "host_rss_mib", "train_traces"):
        assert len(history.history[key]) == 5, key
    assert all(v > 0 for v in history.history["memory_peak_mib"])


@pytest.mark.parametrize("attached", [False, True])
def test_tensors_kept_in_a_list_trigger_one_growth_warning(attached):
    model = _compiled(attached)
    leak = _KeepsOutputs()
    history, messages = _fit(model, [leak, effgrad.MemoryMonitor(growth_mib=4)])
    growth = [m for m in messages if "keeps growing" in m]
    assert len(growth) == 1 and "Python list" in growth[0]
    current = history.history["memory_current_mib"]
    assert current[-1] - current[0] > 16  # 8 batches x 1 MiB per epoch


def test_retracing_after_the_first_epoch_warns():
    model = mlp()
    model.compile(optimizer="sgd", loss="mse")
    monitor = effgrad.MemoryMonitor()
    x, y = _data(64)
    _, first = _fit(model, [monitor], epochs=1, x=x, y=y, batch_size=32)
    _, messages = _fit(model, [monitor], epochs=1, x=x, y=y, batch_size=16)  # a new batch shape: a new trace
    assert first == []
    assert any("traced again" in m for m in messages)


def test_every_n_batches_logs_into_batch_logs():
    seen = []

    class Spy(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append("memory_current_mib" in (logs or {}))

    model = _compiled()
    _fit(model, [effgrad.MemoryMonitor(every_n_batches=2), Spy()], epochs=1)
    assert seen == [False, True] * 4


def test_plot_history(tmp_path):
    history, _ = _clean_fit(False)
    effgrad.diagnostics.plot_history(history, path=tmp_path / "memory.png")
    assert (tmp_path / "memory.png").stat().st_size > 1000


@pytest.mark.parametrize("monitor_first", [True, False])
def test_attach_monitor_and_checkpoint_model_compose_in_either_order(rng, monitor_first):
    """effgrad's hooks on a model chain (attach innermost, the monitor around it) whatever the order,
    and a recompile (a re-attach) keeps the monitor."""
    x, y = rng.normal(size=(64, 8)).astype("float32"), rng.normal(size=(64, 1)).astype("float32")
    keras.utils.set_random_seed(0)
    base = keras.Sequential([keras.Input((8,))] + [keras.layers.Dense(8, activation="relu") for _ in range(4)]
                            + [keras.layers.Dense(1)])  # fmt: skip
    model = effgrad.checkpoint_model(base, segments=2)
    model.compile(optimizer="sgd", loss="mse")
    monitor = effgrad.MemoryMonitor()
    if monitor_first:
        monitor.set_model(model)
    effgrad.attach(model, micro_batches=2)
    history = model.fit(x, y, batch_size=32, epochs=2, verbose=0, callbacks=[monitor])
    assert history.history["train_traces"][-1] >= 1  # the monitor counted the attached step's traces
    assert model.effgrad_step.micro_batches == 2
    model.compile(optimizer="adam", loss="mae")  # attach follows the recompile...
    history = model.fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=[monitor])
    assert history.history["train_traces"][-1] >= 2  # ...and the monitor still counts
    assert isinstance(model.effgrad_step.optimizer, keras.optimizers.Adam)
