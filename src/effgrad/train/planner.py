"""Fit a train step to a memory budget: ``effgrad.plan``.

Algorithm::

    fixed + per_row * rows      # the memory model of one step, per checkpointing choice:
                                # fixed   = parameters + optimizer state + accumulator + batch
                                # per_row = activations (and their gradients) of one row
    1. measure two small, safe configurations (many micro-batches of few rows)
       and fit fixed/per_row; predict every micro_batches (1, 2, 4, ... B)
    2. the plain step (micro_batches=1, no checkpointing) predicted to fit
       -> measure it; it is the fastest
    3. else the fewest micro-batches predicted to fit, measured; and, if the model
       can be cut, the same with checkpoint_model segments (2, then sqrt)
       (only when micro-batching alone needs 4 or more micro-batches)
    4. keep the fastest MEASURED configuration that fits

A configuration is tried only when its prediction is at most ``(1 - margin)``
of the budget, and it fits when its measured peak is at most
``(1 - margin / 2)`` of it (``margin`` = 10% by default): half the margin
absorbs prediction error, half the allocator's run-to-run noise (about 1 MiB
between identical configurations here). The chosen one is always measured,
never only predicted; the plain step (k=1) has no accumulator, which the
prediction subtracts.

Each measurement builds a real :class:`effgrad.TrainStep` with a CLONE of the
optimizer and runs it twice on the batch (the first call traces). The peak
reported is the resident state counted from shapes (model variables,
optimizer variables, accumulators) plus what the second call added at its
worst on the device allocator (:func:`effgrad.memory.measure`'s
``extra_bytes``: the batch, activations, gradients): what training with
that configuration holds at its worst, independent of whatever else the
process allocated or freed before (in-process before/after differences
were not repeatable: up to 4 MiB apart for one configuration). Planning changes nothing: every
model variable (weights, BatchNorm statistics, dropout seed states) is copied
to the host first and restored after each measurement, and the caller's
optimizer is never used.

Trap:
    The plan holds for the batch shape it was made with: a larger batch or
    longer sequences need a new plan (``build_train_step(micro_batches="auto")``
    plans once, at the first call). On CPU the budget is the allocator's
    bytes, not the process's RSS (which adds TensorFlow's own code and caches).
"""

from __future__ import annotations

import dataclasses
import gc
import math
import os
import re
import time
import warnings

import keras
import numpy as np
import tensorflow as tf

from effgrad import memory

__all__ = ["MemoryPlan", "Candidate", "PlannedTrainStep", "plan", "parse_budget"]

# Checkpointing is tried only when micro-batching alone needs this many
# micro-batches: it recomputes the forward pass (1.2-1.4x step time measured
# in benchmarks/checkpoint_model), and every candidate costs a trace.
_CHECKPOINT_FROM = 4
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def device_memory_bytes() -> int:
    """Total memory of the device effgrad measures: the GPU's, else the machine's RAM."""
    if memory.default_device().startswith("GPU"):
        try:
            import subprocess

            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits", "-i", "0"],
                capture_output=True,
                text=True,
                timeout=10,
            )
            return int(out.stdout.split()[0]) * 2**20
        except (OSError, ValueError, IndexError, subprocess.SubprocessError):
            raise ValueError(
                "A budget as a fraction needs the GPU's total memory, which nvidia-smi did not tell; "
                "pass bytes instead, e.g. budget='6GiB'."
            ) from None
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def parse_budget(budget) -> int:
    """Bytes from an int, a size string (``"300MiB"``, ``"6GiB"``, ``"2.5GB"``, ``"1000000"``) or a
    fraction in (0, 1] of the device's memory (``0.8`` or ``"0.8"``).

    A number without a unit is bytes when it is whole (``"1000000"``) and a
    fraction when it has a decimal point (``"0.5"``); ``"1.5"`` is neither and
    is refused, as is anything below one byte.
    """
    if isinstance(budget, bool):
        raise ValueError(f"budget must be bytes, a size string or a fraction, got {budget!r}.")
    if isinstance(budget, (int, np.integer)):
        if budget <= 0:
            raise ValueError(f"budget must be > 0 bytes, got {budget}.")
        return int(budget)
    if isinstance(budget, float):
        if not 0 < budget <= 1:
            raise ValueError(
                f"A budget without a unit and with a decimal point is a fraction of the device's memory, in (0, 1]; "
                f"got {budget}. For a size give bytes (a whole number) or a unit, e.g. '300MiB'."
            )
        return int(budget * device_memory_bytes())
    if isinstance(budget, str):
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", budget)
        if match and not match.group(2) and "." in match.group(1):
            return parse_budget(float(match.group(1)))  # "0.5": a fraction, checked as one
        if match and match.group(2).lower() in _UNITS:
            value = float(match.group(1)) * _UNITS[match.group(2).lower()]
            if value >= 1:
                return int(value)
    raise ValueError(
        f"budget must be bytes (int), a size like '300MiB' or '6GiB', or a fraction in (0, 1]; got {budget!r}."
    )


@dataclasses.dataclass
class Candidate:
    """One configuration of the table: predicted, and measured when it was tried."""

    micro_batches: int
    segments: int | None
    predicted_bytes: int | None = None
    measured_bytes: int | None = None
    seconds: float | None = None
    fits: bool | None = None

    @property
    def peak_bytes(self) -> int | None:
        return self.measured_bytes if self.measured_bytes is not None else self.predicted_bytes


@dataclasses.dataclass
class MemoryPlan:
    """The chosen configuration and everything planning saw.

    Attributes:
        micro_batches: Micro-batches to split every batch into.
        segments: ``checkpoint_model`` segments, or ``None`` (no checkpointing).
        peak_bytes: Measured peak of the chosen configuration.
        seconds_per_step: Measured time of one step with it.
        budget_bytes: The budget, in bytes.
        margin: Safety margin on predictions (a fraction of the budget).
        table: Every candidate, predicted and (when tried) measured.
        planning_seconds: Time planning took.
        batch_size: Rows of the batch planned for.
    """

    micro_batches: int
    segments: int | None
    peak_bytes: int
    seconds_per_step: float
    budget_bytes: int
    margin: float
    table: list[Candidate]
    planning_seconds: float
    batch_size: int

    def __str__(self) -> str:
        mib = lambda b: "-" if b is None else f"{b / 2**20:,.1f}"  # noqa: E731
        lines = [
            f"effgrad memory plan: batch {self.batch_size}, budget {mib(self.budget_bytes)} MiB "
            f"(predictions must fit in {1 - self.margin:.0%} of it), planned in {self.planning_seconds:.1f} s",
            f"{'micro_batches':>13} {'segments':>8} {'predicted MiB':>13} {'measured MiB':>12} {'s/step':>8}  fits",
        ]
        for c in self.table:
            chosen = c.micro_batches == self.micro_batches and c.segments == self.segments
            seconds = "-" if c.seconds is None else f"{c.seconds:.3f}"
            fits = {True: "yes", False: "no", None: "?"}[c.fits]
            lines.append(
                f"{c.micro_batches:>13} {str(c.segments or '-'):>8} {mib(c.predicted_bytes):>13} "
                f"{mib(c.measured_bytes):>12} {seconds:>8}  {fits}{'  <- chosen' if chosen else ''}"
            )
        return "\n".join(lines)


def _bytes(variables) -> int:
    unique = {id(v): v for v in variables}.values()  # a checkpointed model shares the variables
    return sum(int(np.prod(v.shape)) * tf.as_dtype(v.dtype).size for v in unique)


def _micro_batch_choices(batch: int) -> list[int]:
    """1, 2, 4, ... and the batch size itself (one row per micro-batch)."""
    choices = [1 << i for i in range(int(math.log2(batch)) + 1)]
    return sorted(set(choices + [batch]))


def _rows(batch: int, micro_batches: int) -> int:
    return math.ceil(batch / micro_batches)


class _Planner:
    def __init__(self, model, loss, optimizer, x, y, sample_weight, strategy, budget, margin, step_options):
        self.model, self.loss, self.optimizer_config = model, loss, keras.optimizers.serialize(optimizer)
        # Host copies: converting inside the measured call counts the batch in every peak.
        self.x, self.y, self.sample_weight = tf.nest.map_structure(
            lambda t: None if t is None else np.asarray(t), (x, y, sample_weight)
        )
        self.batch = int(tf.nest.flatten(self.x)[0].shape[0])
        self.strategy, self.budget, self.margin, self.step_options = strategy, budget, margin, step_options
        # The noise scale compares micro-batch gradients: on one replica it needs 2 of them.
        replicas = (strategy or tf.distribute.get_strategy()).num_replicas_in_sync
        self.fewest = 2 if step_options.get("noise_scale") and replicas == 1 else 1
        self.accumulator_bytes = sum(int(np.prod(v.shape)) * 4 for v in model.trainable_variables)  # float32
        self.parameter_bytes = _bytes(model.variables)
        # Everything a candidate step may write, restored after each: the model's variables and
        # those of a LossScale object the caller passed (its scale and growth counter).
        scale = step_options.get("loss_scale")
        self.state = [*model.variables, *(scale.variables if isinstance(scale, tf.Module) else ())]
        self.snapshot = [v.numpy() for v in self.state]
        self.measured: dict[tuple, Candidate] = {}
        self._checkpointed: dict[int, keras.Model] = {}

    def checkpointed(self, segments: int) -> keras.Model:
        if segments not in self._checkpointed:
            from effgrad.remat.checkpointing import checkpoint_model

            self._checkpointed[segments] = checkpoint_model(self.model, segments=segments)
        return self._checkpointed[segments]

    def measure(self, micro_batches: int, segments: int | None) -> Candidate:
        key = (micro_batches, segments)
        if key in self.measured:
            return self.measured[key]
        from effgrad.train.step import TrainStep

        model = self.model if segments is None else self.checkpointed(segments)
        candidate = Candidate(micro_batches, segments)
        step = optimizer = None
        gc.collect()
        try:
            optimizer = keras.optimizers.deserialize(self.optimizer_config)
            step = TrainStep(
                model, self.loss, optimizer, micro_batches=micro_batches, strategy=self.strategy, **self.step_options
            )
            step(self.x, self.y, self.sample_weight)  # traces, creates the optimizer state
            # The peak varies from call to call with how the executor's threads interleave
            # frees and allocations (more under CPU contention, e.g. parallel test workers):
            # the larger of two calls, and the faster of their times.
            reports, times = [], []
            for _ in range(2):
                start = time.perf_counter()
                reports.append(memory.measure(lambda: step(self.x, self.y, self.sample_weight)["loss"]))
                times.append(time.perf_counter() - start)
            report, candidate.seconds = max(reports, key=lambda r: r.extra_bytes), min(times)
            # Resident state counted from shapes, the step's own transient peak measured: both
            # are the same whatever else this process allocated or freed before.
            state = [*model.variables, *optimizer.variables, *(step._accumulators or [])]
            candidate.measured_bytes = _bytes(state) + report.extra_bytes
        except tf.errors.ResourceExhaustedError:  # out of memory on a real accelerator: does not fit
            candidate.fits = False
        finally:
            self.restore()
            step = optimizer = None
            gc.collect()
        if candidate.fits is None:
            # Half the margin stays free for the allocator's run-to-run noise.
            candidate.fits = candidate.measured_bytes <= (1 - self.margin / 2) * self.budget
        self.measured[key] = candidate
        return candidate

    def restore(self) -> None:
        for variable, value in zip(self.state, self.snapshot):
            variable.assign(value)

    def fit_line(self, segments: int | None) -> tuple[float, float] | None:
        """``(fixed, per_row)`` of the micro-batched step from two safe measurements.

        The points are far apart (1/16 and 1/4 of the batch per micro-batch)
        so the allocator's noise (about 1 MiB between identical runs here)
        does not swamp the slope.
        """
        rows = sorted({max(1, math.ceil(self.batch / 16)), max(1, math.ceil(self.batch / 4))})
        points = []
        for r in rows:
            c = self.measure(math.ceil(self.batch / r), segments)
            if c.measured_bytes is None:
                return None
            points.append((_rows(self.batch, c.micro_batches), c.measured_bytes))
        if len(points) == 1 or points[0][0] == points[-1][0]:
            return float(points[0][1]), 0.0
        (r1, p1), (r2, p2) = points[0], points[-1]
        per_row = max(0.0, (p2 - p1) / (r2 - r1))
        return p1 - per_row * r1, per_row

    def predict(self, line: tuple[float, float], micro_batches: int) -> int:
        fixed, per_row = line
        # One micro-batch needs no accumulator: the plain step holds one gradient-sized buffer less.
        accumulators = self.accumulator_bytes if micro_batches == 1 else 0
        return int(fixed + per_row * _rows(self.batch, micro_batches) - accumulators)

    def best(self, segments: int | None, table: list[Candidate]) -> Candidate | None:
        """The fewest micro-batches predicted to fit, confirmed by measuring, for one checkpointing choice."""
        line = self.fit_line(segments)
        if line is None:
            return None
        chosen = None
        for k in [k for k in _micro_batch_choices(self.batch) if k >= self.fewest]:
            predicted = self.predict(line, k)
            if chosen is None and predicted <= (1 - self.margin) * self.budget:
                measured = self.measure(k, segments)
                chosen = measured if measured.fits else None
            c = self.measured.get((k, segments)) or Candidate(k, segments)
            c.predicted_bytes = predicted
            if c.fits is None:
                c.fits = predicted <= (1 - self.margin) * self.budget
            table.append(c)
        return chosen


def _segment_choices(model) -> list[int]:
    """Segments worth trying: 2 and sqrt(cuts + 1), if the model can be cut at all."""
    from effgrad.remat import graph

    try:
        cuts = len(graph.layer_graph(model).cuts)
    except (TypeError, ValueError):
        return []
    if cuts == 0:
        return []
    return sorted({min(2, cuts + 1), math.ceil(math.sqrt(cuts + 1))} - {1})


def plan(
    model,
    loss,
    optimizer,
    x,
    y,
    *,
    budget,
    sample_weight=None,
    strategy: tf.distribute.Strategy | None = None,
    margin: float = 0.1,
    **step_options,
) -> MemoryPlan:
    """Finds the fastest train-step configuration whose measured peak fits ``budget``.

    Example:
        >>> model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(64, activation="relu"),
        ...                           keras.layers.Dense(1)])
        >>> x, y = np.ones((256, 16), "float32"), np.zeros((256, 1), "float32")
        >>> plan = effgrad.plan(model, "mse", keras.optimizers.SGD(0.01), x, y, budget="256MiB")
        >>> plan.micro_batches, plan.segments  # it fits as it is: no slowdown
        (1, None)
        >>> print(plan)  # doctest: +SKIP
        >>> step = effgrad.build_train_step(model, "mse", keras.optimizers.SGD(0.01),
        ...                                 micro_batches="auto", memory_budget="256MiB")  # plans at step(x, y)

    Args:
        model: A built ``keras.Model`` (functional or Sequential to allow
            checkpointing; any model for micro-batching).
        loss: As for :func:`effgrad.build_train_step`.
        optimizer: The optimizer training will use (only its config is used:
            planning builds and steps a clone).
        x: One batch of inputs, of the size training will use.
        y: Its targets.
        budget: Bytes (int), a size string (``"300MiB"``, ``"6GiB"``) or a
            fraction in (0, 1] of the device's memory (the GPU's; on CPU the
            machine's RAM).
        sample_weight: Optional sample weights of the batch.
        strategy: A ``tf.distribute.Strategy``; default the current one.
        margin: Predictions must fit in ``(1 - margin) * budget`` to be tried.
        **step_options: Other :func:`effgrad.build_train_step` options
            (``loss_scale``, ``clip_norm``, ``reduction``, ...).

    Returns:
        A :class:`MemoryPlan`.

    Raises:
        ValueError: nothing fits; the message names the smallest peak
            achievable and whether parameters + optimizer state or
            activations dominate it.
    """
    started = time.perf_counter()
    budget_bytes = parse_budget(budget)
    if not 0 <= margin < 1:
        raise ValueError(f"margin must be in [0, 1), got {margin}.")
    for name in ("micro_batches", "memory_budget"):
        if name in step_options:
            raise TypeError(f"plan() chooses {name}; do not pass it.")
    if not getattr(model, "built", False):
        raise ValueError("plan() needs a built model: call it once on a batch, or build it, first.")
    planner = _Planner(model, loss, optimizer, x, y, sample_weight, strategy, budget_bytes, margin, dict(step_options))
    table: list[Candidate] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # segments that cannot all be placed: the table says what was built
        families = [None] + _segment_choices(model)
        found = []
        for segments in families:
            best = planner.best(segments, table)
            if best is not None:
                found.append(best)
            if best is not None and best.micro_batches < _CHECKPOINT_FROM:
                break  # the plain step, or 2 micro-batches: checkpointing (1.2-1.4x time) is not faster
    planner.restore()
    if not found:
        smallest = min((c for c in planner.measured.values() if c.measured_bytes), key=lambda c: c.measured_bytes)
        fixed = planner.fit_line(smallest.segments)
        what = ""
        if fixed is not None:
            base, per_row = fixed
            activations = per_row * _rows(planner.batch, smallest.micro_batches)
            what = (
                f" Of it, about {base / 2**20:,.1f} MiB does not shrink with micro-batches or segments "
                f"(parameters {planner.parameter_bytes / 2**20:,.1f} MiB, optimizer state, accumulators, the "
                f"batch, the backend's per-step workspace) and activations are {activations / 2**20:,.1f} MiB: "
                + (
                    "the fixed part dominates; a smaller optimizer state (SGD, Adafactor), float16 weights or "
                    "a smaller batch help."
                    if base >= activations
                    else "activations dominate; checkpointing inside the model's layers helps."
                )
            )
        raise ValueError(
            f"Nothing fits in {budget_bytes / 2**20:,.1f} MiB: the smallest peak achievable is "
            f"{smallest.measured_bytes / 2**20:,.1f} MiB (micro_batches={smallest.micro_batches}, "
            f"segments={smallest.segments}).{what}"
        )
    chosen = min(found, key=lambda c: c.seconds)
    table.sort(key=lambda c: (c.segments or 0, c.micro_batches))
    return MemoryPlan(
        micro_batches=chosen.micro_batches,
        segments=chosen.segments,
        peak_bytes=chosen.measured_bytes,
        seconds_per_step=chosen.seconds,
        budget_bytes=budget_bytes,
        margin=margin,
        table=table,
        planning_seconds=time.perf_counter() - started,
        batch_size=planner.batch,
    )


class PlannedTrainStep:
    """``build_train_step(..., micro_batches="auto", memory_budget=...)``.

    Plans at the first call (when the batch shape is known), then trains
    exactly as a :class:`effgrad.TrainStep` built with the chosen
    ``micro_batches`` (on ``checkpoint_model(model, segments)`` when the plan
    checkpoints). Attributes: ``plan`` (the :class:`MemoryPlan`, ``None``
    before the first call) and, after it, those of the inner step.
    """

    def __init__(self, model, loss, optimizer, *, micro_batches="auto", memory_budget=None, margin=0.1, **options):
        from effgrad.train.options import StepOptions

        if micro_batches != "auto":
            raise ValueError(f"memory_budget goes with micro_batches='auto' (got micro_batches={micro_batches!r}).")
        if memory_budget is None:
            raise ValueError(
                "micro_batches='auto' needs memory_budget=... (bytes, '6GiB', or a fraction of the device)."
            )
        self.budget_bytes = parse_budget(memory_budget)
        StepOptions(**options)  # every other bad option is refused now, not at the first batch
        self.model, self.loss, self.optimizer, self.margin, self.options = model, loss, optimizer, margin, options
        self.plan: MemoryPlan | None = None
        self.step = None

    def __call__(self, x, y, sample_weight=None) -> dict:
        if self.step is None:
            self.step = self.build(x, y, sample_weight)
        return self.step(x, y, sample_weight)

    def build(self, x, y, sample_weight=None):
        """Plans for this batch and builds the step it chose."""
        from effgrad.remat.checkpointing import checkpoint_model
        from effgrad.train.step import TrainStep

        options = {k: v for k, v in self.options.items() if k != "on_micro_batch"}
        self.plan = plan(
            self.model,
            self.loss,
            self.optimizer,
            x,
            y,
            budget=self.budget_bytes,
            sample_weight=sample_weight,
            margin=self.margin,
            **options,
        )
        model = self.model if self.plan.segments is None else checkpoint_model(self.model, self.plan.segments)
        return TrainStep(model, self.loss, self.optimizer, micro_batches=self.plan.micro_batches, **self.options)

    @property
    def micro_batches(self):
        return "auto" if self.step is None else self.step.micro_batches

    def __getattr__(self, name):
        step = self.__dict__.get("step")
        if step is None:
            raise AttributeError(f"{name!r}: the step is built at its first call (after planning).")
        return getattr(step, name)
