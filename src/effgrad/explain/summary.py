"""Dataset-level saliency statistics without storing per-example maps.

``saliency_summary`` runs the streaming engine with a sink that folds each
batch's maps into TensorFlow Probability running statistics on the device
(Welford/Chan updates: ``tfp.experimental.stats.RunningVariance``), one per
target class. Memory is one batch plus ``2 x classes`` maps, whatever N is.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import tensorflow as tf

from effgrad.explain.engine import stream
from effgrad.explain.plan import prepare

__all__ = ["SaliencySummary", "saliency_summary"]


class _Counts(dict):
    """``{class: examples}``; a class that never occurred counts 0."""

    def __missing__(self, key):
        return 0


class _Maps(dict):
    """``{class: map}``; a class that never occurred has no map, and says which classes do."""

    def __missing__(self, key):
        raise KeyError(
            f"class {key!r} never occurred among the explained examples (summary.count[{key!r}] == 0), so it "
            f"has no map; classes present: {sorted(self, key=str)}."
        )


@dataclass
class SaliencySummary:
    """Per-class mean and variance maps.

    Attributes:
        mean: ``{class: mean map}`` (NumPy arrays). With several
            differentiated inputs each value is their nest, as
            :func:`effgrad.saliency` returns maps (e.g. ``mean[3]["image"]``).
            Only classes that occurred have a map: ``mean[c]`` for another
            class is a ``KeyError`` naming the classes present.
        variance: ``{class: variance map}`` (population variance), nested alike.
        count: ``{class: number of examples}``; 0 for a class that never occurred.

    With ``by_class=False`` the only key is ``"all"``.
    """

    mean: dict
    variance: dict
    count: dict

    def __post_init__(self):
        self.mean, self.variance, self.count = _Maps(self.mean), _Maps(self.variance), _Counts(self.count)


class _StatisticsSink:
    """A :class:`~effgrad.explain.sinks.Sink` that updates running statistics instead of storing rows."""

    complete = False

    def __init__(self, map_shapes, by_class: bool, pack):
        import tensorflow_probability as tfp  # lazy: a slow import effgrad itself does not need

        self._running = tfp.experimental.stats.RunningVariance
        self.map_shapes, self.by_class, self.pack = map_shapes, by_class, pack
        self.states: dict = {}  # {class: [running state of each differentiated tensor]}
        self.committed = 0
        self.input_crc = None  # never resumed

    def _update(self, key, maps):
        states = self.states.get(key) or [self._running.from_shape(s, dtype=tf.float32) for s in self.map_shapes]
        self.states[key] = [state.update(m, axis=0) for state, m in zip(states, maps)]

    def write(self, start, maps, targets) -> None:
        maps = [tf.cast(m, tf.float32) for m in maps]
        if not self.by_class:
            self._update("all", maps)
            return
        classes, _ = tf.unique(targets)
        for c in classes.numpy().tolist():
            rows = tf.equal(targets, c)
            self._update(int(c), [tf.boolean_mask(m, rows) for m in maps])

    def commit(self, rows: int, input_crc: int = 0) -> None:
        self.committed = rows

    finish = commit

    def close(self, failed: bool) -> None:
        """Nothing to release."""

    @property
    def result(self) -> SaliencySummary:
        keys = sorted(self.states, key=str)
        return SaliencySummary(
            mean={k: self.pack([np.asarray(s.mean) for s in self.states[k]]) for k in keys},
            variance={k: self.pack([np.asarray(s.variance()) for s in self.states[k]]) for k in keys},
            count={k: int(np.asarray(self.states[k][0].num_samples)) for k in keys},
        )


def saliency_summary(model, inputs, *, by_class: bool = True, **saliency_options) -> SaliencySummary:
    """Streams saliency maps into per-class running mean and variance.

    Example:
        >>> model = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Flatten(), keras.layers.Dense(3)])
        >>> images = np.random.default_rng(0).random((100, 8, 8, 1), dtype="float32")
        >>> summary = effgrad.saliency_summary(model, images, target=2, reduce="abs_sum", progress=False)
        >>> summary.count
        {2: 100}
        >>> summary.mean[2].shape  # the average map of the examples explained as class 2
        (8, 8)

        A model with several float inputs gets one map per input in each
        statistic, e.g. ``summary.mean[2]["tabular"]`` for dict inputs.

    Args:
        model: As for :func:`effgrad.saliency`.
        inputs: As for :func:`effgrad.saliency`.
        by_class: Group by each example's target class (the explained
            output); else one group ``"all"``.
        **saliency_options: Any option of :func:`effgrad.saliency` except
            ``out``, ``dtype`` and ``resume``.

    Returns:
        A :class:`SaliencySummary`.
    """
    for name in ("out", "resume", "dtype"):
        if name in saliency_options:
            raise TypeError(f"saliency_summary keeps no per-example maps; it takes no {name!r} option.")
    progress = saliency_options.pop("progress", True)
    plan = prepare(model, inputs, **saliency_options)
    sink = _StatisticsSink(plan.map_shapes, by_class, plan.pack)
    stream(plan, sink, progress)
    return sink.result
