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


@dataclass
class SaliencySummary:
    """Per-class mean and variance maps.

    Attributes:
        mean: ``{class: mean map}`` (NumPy arrays).
        variance: ``{class: variance map}`` (population variance).
        count: ``{class: number of examples}``.

    With ``by_class=False`` the only key is ``"all"``.
    """

    mean: dict
    variance: dict
    count: dict


class _StatisticsSink:
    """A :class:`~effgrad.explain.sinks.Sink` that updates running statistics instead of storing rows."""

    complete = False

    def __init__(self, map_shape, by_class: bool):
        import tensorflow_probability as tfp  # lazy: a slow import effgrad itself does not need

        self._running = tfp.experimental.stats.RunningVariance
        self.map_shape, self.by_class = map_shape, by_class
        self.states: dict = {}
        self.committed = 0
        self.input_crc = None  # never resumed

    def _update(self, key, maps):
        state = self.states.get(key) or self._running.from_shape(self.map_shape, dtype=tf.float32)
        self.states[key] = state.update(maps, axis=0)

    def write(self, start, maps, targets) -> None:
        (maps,) = maps  # one differentiated tensor (checked by saliency_summary)
        maps = tf.cast(maps, tf.float32)
        if not self.by_class:
            self._update("all", maps)
            return
        classes, _ = tf.unique(targets)
        for c in classes.numpy().tolist():
            self._update(int(c), tf.boolean_mask(maps, tf.equal(targets, c)))

    def commit(self, rows: int, input_crc: int = 0) -> None:
        self.committed = rows

    finish = commit

    def close(self, failed: bool) -> None:
        """Nothing to release."""

    @property
    def result(self) -> SaliencySummary:
        keys = sorted(self.states, key=str)
        return SaliencySummary(
            mean={k: np.asarray(self.states[k].mean) for k in keys},
            variance={k: np.asarray(self.states[k].variance()) for k in keys},
            count={k: int(np.asarray(self.states[k].num_samples)) for k in keys},
        )


def saliency_summary(model, inputs, *, by_class: bool = True, **saliency_options) -> SaliencySummary:
    """Streams saliency maps into per-class running mean and variance.

    Example:
        >>> summary = effgrad.saliency_summary(model, images, method="gradient", reduce="abs_sum")
        >>> summary.mean[3]      # the average map of the examples explained as class 3

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
    if len(plan.names) > 1:
        raise ValueError(
            f"saliency_summary summarizes the maps of one tensor, but {len(plan.names)} inputs are differentiated "
            f"({', '.join(plan.names)}); pass layer= to summarize one layer's maps, or call effgrad.saliency."
        )
    sink = _StatisticsSink(plan.map_shapes[0], by_class)
    stream(plan, sink, progress)
    return sink.result
