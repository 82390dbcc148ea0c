"""The planner's TensorFlow side: real steps measured on the device allocator, and nothing changed after.

A :class:`Harness` is the search's :class:`~effgrad.train.planning.search.Measurer`. Each family gets
one real :class:`~effgrad.train.step.TrainStep` with the caller's optimizer; a configuration's peak is
what is resident, counted from shapes (weights, optimizer state, the batch, the family's
accumulators as the allocator placed them), plus what a call added at its worst on the allocator
(:func:`effgrad.memory.measure`): independent of whatever else the process allocated before.

Planning changes nothing: every model variable, the optimizer's slots and iterations and a loss
scale passed in are copied to the host first and assigned back at the end (:meth:`Harness.restore`).

Trap:
    On CPU a read of a variable shares its buffer, and an assign whose value is its last reference may
    adopt that value's buffer: the snapshot holds host copies (zeros not copied) and each value is held
    while it is assigned back.
"""

from __future__ import annotations

import gc
import math
import time
import warnings

import keras
import numpy as np
import tensorflow as tf

from effgrad import memory, model_graph
from effgrad.remat.checkpointing import checkpoint_model
from effgrad.train.options import StepOptions
from effgrad.train.planning.search import Calls, Config
from effgrad.train.step import TrainStep

__all__ = ["Harness", "nbytes", "build_optimizer", "segment_choices"]


def nbytes(variables) -> int:
    """Bytes of ``variables`` (a variable shared by several models counted once)."""
    unique = {id(v): v for v in variables}.values()
    return sum(int(np.prod(v.shape)) * tf.as_dtype(v.dtype).size for v in unique if v.shape.is_fully_defined())


def build_optimizer(optimizer, model, strategy=None) -> int:
    """Builds ``optimizer`` for ``model`` if it is not built; what its state took on the allocator.

    Planning steps the optimizer training uses next (no second copy of its state on the device), and
    counts its state as allocated (a buffer placed in a free chunk less than twice its size takes the
    whole chunk): 0 when it was built before.
    """
    before = memory.current_bytes()
    if not getattr(optimizer, "inner_optimizer", optimizer).built:
        with (strategy or tf.distribute.get_strategy()).scope():
            optimizer.build(model.trainable_variables)
    return memory.current_bytes() - before


def _on_device(arrays):
    """Allocator-owned copies of ``arrays``, as training's input pipeline hands a batch over (on CPU
    ``convert_to_tensor`` aliases an aligned NumPy array and copies the others; ``DeepCopy`` always copies)."""
    copy = lambda a: None if a is None else tf.raw_ops.DeepCopy(x=tf.convert_to_tensor(a))  # noqa: E731
    return tf.nest.map_structure(copy, arrays)


def _components(variables: list) -> list[tf.Variable]:
    """The ``tf.Variable`` objects holding ``variables``' values: each replica's of a distributed one."""
    held = [v.value if isinstance(v, keras.Variable) else v for v in variables]
    return [c for v in held for c in getattr(v, "values", (v,))]


def _host_copies(variables: list) -> list[np.ndarray | None]:
    """Host copies of ``variables``' components; ``None`` for zeros (an optimizer state planning built)."""
    return [a.copy() if a.any() else None for a in (c.numpy() for c in _components(variables))]


class Harness:
    """Measures configurations of one model and batch; one trace per family; restores every state.

    Args:
        model: The model (built).
        loss: As for :func:`effgrad.build_train_step`.
        optimizer: The optimizer training uses, built (:func:`build_optimizer`).
        batch: ``(x, y, sample_weight)`` as host arrays.
        options: The step's validated options (``micro_batches`` is the harness's).
        state_bytes: The optimizer's state as the allocator holds it (at least its shapes).
        say: Called with one line per measurement (``verbose``).
    """

    def __init__(self, model, loss, optimizer, batch, options: StepOptions, state_bytes: int, say=None):
        self.model, self.loss, self.optimizer, self.options = model, loss, optimizer, options
        self.say = say or (lambda line: None)
        self.data = tf.nest.map_structure(lambda t: None if t is None else np.asarray(t), batch)
        self.batch = int(tf.nest.flatten(self.data[0])[0].shape[0])
        self.strategy = options.strategy or tf.distribute.get_strategy()
        # A slice's peak stands for the batch's on one trace (not under XLA: a compilation per shape, nor
        # split over replicas).
        self.can_slice = self.strategy.num_replicas_in_sync == 1 and not options.jit_compile
        self.resident = (
            nbytes(model.variables) + state_bytes + sum(a.nbytes for a in tf.nest.flatten(self.data) if a is not None)
        )
        self.steps: dict[tuple, TrainStep] = {}
        self.held: dict[tuple, int] = {}  # a family's accumulators as the allocator placed them
        self.models: dict[int, keras.Model] = {}
        scale = options.loss_scale
        self.state = [
            *model.variables,
            *(scale.variables if isinstance(scale, tf.Module) else ()),
            *optimizer.variables,
        ]
        self.snapshot = _host_copies(self.state)

    def model_for(self, segments: int | None) -> keras.Model:
        """The model, or its ``checkpoint_model`` in ``segments`` segments (sharing its variables)."""
        if segments is None:
            return self.model
        if segments not in self.models:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # fewer cuts than segments: the plan's table says what was built
                self.models[segments] = checkpoint_model(self.model, segments=segments)
        return self.models[segments]

    def _step(self, config: Config) -> TrainStep:
        """``config``'s family's step; only its accumulators are filled (another's would sit on the device)."""
        family = config.family
        for other, step in self.steps.items():
            if other != family and step.accumulators is not None:
                step.accumulators.free()
        if family not in self.steps:
            before = memory.current_bytes()
            options = self.options.replace(micro_batches=1 if config.plain else 2, strategy=self.strategy)
            step = TrainStep.with_options(self.model_for(config.segments), self.loss, self.optimizer, options)
            self.held[family] = memory.current_bytes() - before
            own = [v for part in (step.loss_scale, step.noise_scale) if isinstance(part, tf.Module)
                   for v in part.variables if all(v is not known for known in self.state)]  # fmt: skip
            self.state += own  # what the step made for itself (a loss scale) is restored too
            self.snapshot += _host_copies(own)
            self.steps[family] = step
        step = self.steps[family]
        step.micro_batches = config.micro_batches
        if step.accumulators is not None:
            step.accumulators.refill()  # before the step, not by it: counted as resident, not as the call's
        return step

    def measure(self, config: Config, calls: int, rows: int | None = None, stop_above: float | None = None) -> Calls:
        step = self._step(config)
        part = (
            self.data if rows is None else tf.nest.map_structure(lambda a: None if a is None else a[:rows], self.data)
        )
        x, y, sample_weight = _on_device(part)  # resident, as the whole batch is counted

        def run():
            return step(x, y, sample_weight)["loss"]

        accumulators = 0 if step.accumulators is None else max(step.accumulators.nbytes, self.held[config.family])
        resident = self.resident + accumulators
        peaks, times, traced = [], [], None
        if not step.trace_count:
            start = time.perf_counter()
            peaks.append(resident + memory.measure(run).extra_bytes)
            traced = time.perf_counter() - start
        while len(peaks) < calls or not times:
            if stop_above is not None and peaks and peaks[-1] > stop_above:
                break
            start = time.perf_counter()
            peaks.append(resident + memory.measure(run).extra_bytes)
            times.append(time.perf_counter() - start)
        seconds = min(times, default=None)
        where = "" if rows is None else f" on {rows} of {self.batch} rows (as on the whole batch)"
        timed = "" if seconds is None else f", {seconds:.3f} s"
        self.say(f"{config.describe()}{where}: {memory.format_bytes(max(peaks))}{timed}")
        return Calls(peaks, seconds, None if traced is None else traced - (seconds or 0.0))

    def restore(self) -> None:
        """Assigns the snapshot back, each value held while it is assigned (see the module's trap)."""
        for variable, value in zip(_components(self.state), self.snapshot, strict=True):
            variable.assign(tf.zeros(variable.shape, variable.dtype) if value is None else tf.constant(value))

    def release(self, keep: Config | None = None):
        """Drops every step planning made; ``keep``'s family's accumulators, as allocated, are returned for
        training to take (its peaks were measured with them). A traced step and its functions refer to each
        other: only a collection frees them, and training should not start next to them."""
        kept = None
        for family, step in self.steps.items():
            if step.accumulators is None:
                continue
            if keep is not None and family == keep.family:
                kept = step.accumulators
            else:
                step.accumulators.free()
        self.steps.clear()
        self.snapshot = []
        gc.collect()
        return kept


def segment_choices(model) -> tuple[int, ...]:
    """The checkpointed family's segment count: ``ceil(sqrt(cuts + 1))`` (the recompute costs one
    forward pass whatever the count; sqrt segments hold the fewest activations: their boundaries plus
    one segment's), or none if the model cannot be cut."""
    try:
        cuts = len(model_graph.layer_graph(model).cuts)
    except (TypeError, ValueError):
        return ()
    return (math.ceil(math.sqrt(cuts + 1)),) if cuts else ()
