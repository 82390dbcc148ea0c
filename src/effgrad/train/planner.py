"""Fit a train step to a memory budget: ``effgrad.plan``.

Algorithm::

    shapes first (no trace): weights + optimizer state + the batch + the smallest gradient
        buffer any configuration needs (one gradient for a fused k=1 step, else the
        accumulator); a budget below that is refused at once, with the breakdown
    weights outweigh activations (fine-tuning): the plain step fused; fitting, it is the plan
        (micro-batches and recompute could only add; the gathered step, no faster, is not traced)
    weights + state + batch + every gradient over the limit (shapes): only the fused plain step
        can fit; it is measured, then checkpointed where predicted to fit from it, nothing else
    per family (one trace each: the number of micro-batches is a runtime value of the step):
        micro-batched (k >= 2): measure 1/4 of the batch per micro-batch (the whole batch; half
                                of a batch under 16 rows) and 1/16 (a slice of it, in 2 and in 4), fit
                                peak = fixed + per_row * rows  and
                                time = fixed + per_micro * k + per_row * batch rows;
                                predict every k; measure those predicted to fit and to be as
                                fast as the fastest measured fit
        plain (k = 1):          predicted from the same line (no accumulator); measured if
                                predicted to fit (first: slower micro-batch counts are then
                                not measured; predicted at the edge, after k = 2 on the whole
                                batch, a point further out on the same trace); and
                                fused_update=True (each update inside backprop) where weights
                                outweigh activations
        checkpointed (checkpoint_model segments 2, then sqrt): only when no family without
                                recompute fits with fewer than 8 micro-batches; the plain step
                                first where the share of its activations recomputed could bring
                                it within the limit (no further trace if it fits with half
                                the margin to spare); else 8 or more without recompute first
                                (calls, no trace), and where one fits, one checkpointed family
                                (the segments bringing the fewest micro-batches within reach)
                                only if predicted (its forward once more) to repay its trace
                                within 100 steps
        unfused loss (where "auto" fuses it): the fewest micro-batches predicted to fit as the fused
                                step plus 1.4 copies of a micro-batch's logits; faster where it fits
                                (the plain step unfused is tried before the fused one: a clear fit
                                saves that trace)
    nothing measured fits: those ruled out by a prediction within half the margin over their
                                limit are measured, the fastest first (the prediction's error,
                                the other way)
    keep the fastest MEASURED configuration that fits (the simplest one within 5% or 5 ms
    of it: step times vary between calls), counting what planning left on the device
    (TensorFlow keeps traced graphs and some of their buffers; training runs next to them);
    where that rules out every fit, a second round plans again within the budget less what was
    left
    hand the chosen family's step to training (build_train_step(micro_batches="auto") runs
    it: no second trace; attach takes its accumulators, as allocated, which the peaks counted)

A configuration fits when its measured peak leaves a reserve of the budget
free: half the ``margin`` (10% by default), or one float32 gradient of the
largest variable when that is more (the allocator's placement can add up to
that in another process history, below), and is tried only when its
prediction leaves half the margin more. Half the margin absorbs prediction
error, half the allocator's run-to-run noise and what ``fit`` adds (the next
batch its input pipeline prepares). A configuration measured within half
the margin of its limit is called up to twice more (no more once its peak
plus the spread between its calls is over the limit), and that sum must stay
within the limit: training's calls go higher
than two (ResNet50 in a used process: plans measured 4 micro-batches at
440-450 MiB of 450.9 allowed, and ``fit`` peaked at up to 475.3 MiB of a
474.6 MiB budget).

The reserve for placement: a best-fit allocator (TensorFlow's BFC, on GPU and
on CPU) does not split a free chunk less than twice the request, and counts
the whole chunk in use; which chunk a tensor lands in depends on the process's
history. The same step of the GPT-2 LM (a 49 MiB tied embedding), called 8
times in each of 3 fresh processes, peaked at 372-394 MiB, except 2 calls of
the 24, at 423 and 425 MiB (also with one inter-op thread): a largest tensor's
worth. A plan measures a few calls; training makes thousands. A fused loss's
kernel is not counted as that variable: its gradient is made after the
backward pass (the same LM since: 96 calls within 17 MiB of each other).

Each family builds one real :class:`effgrad.TrainStep` with the caller's
optimizer (built for the model first if it is not: training uses it next,
and a clone's slots would stay on the device as long as TensorFlow keeps
the traced steps that used them, 110 MiB on the GPT-2 LM); a configuration's
peak is the resident state counted from shapes (model variables, optimizer
variables, accumulators, the batch; an optimizer state planning built and
each family's accumulators, as the allocator holds them; emptied while another
family ran, they are refilled before the calls, or the first micro-batch's
refill would count them twice) plus what a call
added at its worst on the device allocator
(:func:`effgrad.memory.measure`'s ``extra_bytes``:
activations, gradients), the largest of two calls after the family's first
(the call that traces): independent of whatever else the process allocated
before. Planning changes nothing: every model
variable (weights, BatchNorm statistics, dropout seed states), a
``LossScale`` passed in and the optimizer's slots and iterations are copied
to the host first and restored when planning ends (a few steps' drift does not
change what a step holds; restoring after each measurement cost ResNet50 0.6 s).

Trap:
    The plan holds for the batch shape it was made with: a larger batch or
    longer sequences need a new plan (``build_train_step(micro_batches="auto")``
    plans once, at the first call). On CPU the budget is the allocator's
    bytes, not the process's RSS (which adds TensorFlow's own code and caches).
    Under ``jit_compile=True`` every number of micro-batches is its own trace.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import os
import re
import sys
import time
import warnings

import keras
import numpy as np
import tensorflow as tf

from effgrad import memory
from effgrad.train import accumulate, fused_loss, fused_update
from effgrad.train.objective import Objective
from effgrad.train.options import StepOptions
from effgrad.train.step import TrainStep, batch_shape

__all__ = ["MemoryPlan", "Candidate", "PlannedTrainStep", "plan", "parse_budget", "device_memory_bytes"]

# Checkpointing is tried only when micro-batching alone needs this many
# micro-batches: it recomputes the forward pass (1.2-1.4x step time measured
# in benchmarks/checkpoint_model), and every family costs a trace.
_CHECKPOINT_FROM = 8
# A checkpointed step's time, predicted before its family is traced: the unchecked step's with the
# forward pass once more (a third of a step; measured 1.12-1.47x). Where micro-batches alone fit,
# a checkpointed family is traced only if that prediction repays its trace within this many steps.
_RECOMPUTE = 4 / 3
_REPAY_STEPS = 100
# Measured step times within this factor of the fastest, or this many seconds of it, count as
# equally fast: a compiled call's dispatch on a busy host varies by milliseconds, which is 20%
# and more of a small model's step (a 1 ms plain step measured 1.2x a 2-micro-batch one in CI).
_SAME_SPEED = 1.05
_JITTER_SECONDS = 0.005
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}
_MIB = 2**20


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
    """One configuration of the table: predicted, measured when it was tried, and the verdict."""

    micro_batches: int
    segments: int | None = None
    fused_update: bool = False
    fused_loss: bool | None = None  # False: the loss the step would fuse ("auto") is not, the logits are made
    predicted_bytes: int | None = None
    measured_bytes: int | None = None
    seconds: float | None = None
    fits: bool | None = None
    # How far its calls' peaks lay apart, where it measured within half the margin of its limit: that far
    # again is what further calls may add (see _Planner.measure).
    spread_bytes: int = 0
    note: str = ""  # why it was not chosen

    @property
    def peak_bytes(self) -> int | None:
        return self.measured_bytes if self.measured_bytes is not None else self.predicted_bytes

    @property
    def key(self) -> tuple:
        return self.micro_batches, self.segments, self.fused_update, self.fused_loss

    @property
    def family(self) -> tuple:
        """What one trace serves: micro-batched steps share it whatever their number."""
        return self.micro_batches > 1, self.segments, self.fused_update, self.fused_loss

    def describe(self) -> str:
        fused = ", fused_update" if self.fused_update else ""
        logits = ", fused_loss=False" if self.fused_loss is False else ""
        return f"micro_batches={self.micro_batches}, segments={self.segments or '-'}{fused}{logits}"


@dataclasses.dataclass
class _Point:
    """One measurement of a micro-batched family: ``rows`` rows of the batch in ``micro_batches``."""

    micro_batches: int
    rows: int
    peak_bytes: int  # as on the whole batch: the whole batch is counted resident
    seconds: float

    @property
    def per_micro(self) -> int:
        return _rows(self.rows, self.micro_batches)


@dataclasses.dataclass
class MemoryPlan:
    """The chosen configuration and everything planning saw.

    Attributes:
        micro_batches: Micro-batches to split every batch into.
        segments: ``checkpoint_model`` segments, or ``None`` (no checkpointing).
        fused_update: Whether each update runs inside backprop (one micro-batch).
        fused_loss: ``False`` when the loss the step would fuse with the model's
            projection (``fused_loss="auto"``) is faster unfused and its logits
            fit; else ``None`` (as the step options say).
        peak_bytes: Measured peak of the chosen configuration, with ``left_bytes``.
        seconds_per_step: Measured time of one step with it.
        budget_bytes: The budget, in bytes.
        margin: Safety margin on predictions (a fraction of the budget).
        table: Every candidate: predicted, measured when tried, and why it was not chosen.
        planning_seconds: Time planning took.
        batch_size: Rows of the batch planned for.
        floor_bytes: What no configuration goes below (weights, optimizer
            state, the batch, one gradient buffer), counted from shapes (an
            optimizer state planning built, as the allocator holds it).
        left_bytes: What planning left on the device (TensorFlow keeps traced
            graphs and some of their buffers): training runs next to it, so
            every measured peak plus it must fit.
        reserve_bytes: What measured peaks leave free: half the margin, or
            one float32 gradient of the largest variable when that is more
            (what the allocator's placement can add in another process; a
            fused loss's kernel, whose gradient comes last, not counted).
        model: The model to train: the one given, or its ``checkpoint_model``
            (sharing its variables) when the plan checkpoints.
        step: The chosen configuration's traced step, which training takes
            (``build_train_step(micro_batches="auto")``; ``attach`` takes its
            accumulators). ``None`` from :func:`plan`, which keeps nothing on
            the device.
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
    fused_update: bool = False
    fused_loss: bool | None = None
    floor_bytes: int = 0
    left_bytes: int = 0
    reserve_bytes: int = 0
    model: keras.Model | None = dataclasses.field(default=None, repr=False, compare=False)
    step: TrainStep | None = dataclasses.field(default=None, repr=False, compare=False)

    def take_step(self) -> TrainStep | None:
        """:attr:`step`, handed over once: the plan keeps no reference to what training now owns."""
        step, self.step = self.step, None
        return step

    @property
    def step_options(self) -> dict:
        """The :func:`effgrad.build_train_step` options of the chosen configuration."""
        options = {"micro_batches": self.micro_batches, "fused_update": self.fused_update}
        return options if self.fused_loss is None else {**options, "fused_loss": self.fused_loss}

    def __str__(self) -> str:
        mib = lambda b: "-" if b is None else f"{b / _MIB:,.1f}"  # noqa: E731
        lines = [
            f"effgrad memory plan: batch {self.batch_size}, budget {mib(self.budget_bytes)} MiB (measured peaks "
            f"must leave {mib(self.reserve_bytes)} MiB of it free, predictions {self.margin / 2:.0%} more), floor "
            f"{mib(self.floor_bytes)} MiB, planned in {self.planning_seconds:.1f} s"
            + (f", {mib(self.left_bytes)} MiB left by planning counted in" if self.left_bytes else ""),
            f"{'micro_batches':>13} {'segments':>8} {'fused':>5} {'logits':>6} {'predicted MiB':>13} "
            f"{'measured MiB':>12} {'s/step':>8}  verdict",
        ]
        for c in self.table:
            chosen = c.key == (self.micro_batches, self.segments, self.fused_update, self.fused_loss)
            seconds = "-" if c.seconds is None else f"{c.seconds:.3f}"
            verdict = "<- chosen" if chosen else c.note or {True: "fits", False: "over budget", None: "?"}[c.fits]
            lines.append(
                f"{c.micro_batches:>13} {str(c.segments or '-'):>8} {'yes' if c.fused_update else '-':>5} "
                f"{'made' if c.fused_loss is False else '-':>6} {mib(c.predicted_bytes):>13} "
                f"{mib(c.measured_bytes):>12} {seconds:>8}  {verdict}"
            )
        return "\n".join(lines)


def _bytes(variables) -> int:
    unique = {id(v): v for v in variables}.values()  # a checkpointed model shares the variables
    # An accumulator's static shape is open (accumulate.make_accumulators): its size is its value's.
    sizes = (int(np.prod(v.shape)) if v.shape.is_fully_defined() else int(tf.size(v)) for v in unique)
    return sum(n * tf.as_dtype(v.dtype).size for n, v in zip(sizes, unique))


def _on_device(arrays):
    """Allocator-owned copies of ``arrays``: a batch as training's input pipeline hands it over.

    ``tf.convert_to_tensor`` copies a NumPy array on an accelerator, but on CPU it aliases one whose
    buffer happens to be 64-byte aligned (where malloc put it: process history) and copies the
    others, so a batch converted inside a measured call was in some peaks and not in others (a
    4 MiB batch: its line point and the whole-batch step 4 MiB apart, either way). ``DeepCopy``
    always copies; the copies are resident, counted by their bytes, and outside the measured calls.
    """
    copy = lambda a: None if a is None else tf.raw_ops.DeepCopy(x=tf.convert_to_tensor(a))  # noqa: E731
    return tf.nest.map_structure(copy, arrays)


def _micro_batch_choices(batch: int) -> list[int]:
    """1, 2, 4, ... and the batch size itself (one row per micro-batch)."""
    return sorted({1 << i for i in range(int(math.log2(batch)) + 1)} | {batch})


def _components(variables: list) -> list[tf.Variable]:
    """The ``tf.Variable`` objects holding ``variables``' values: one per replica for a ``tf.distribute``
    variable, whose replicas can differ (Keras updates mirrored BatchNormalization statistics per replica)."""
    held = [v.value if isinstance(v, keras.Variable) else v for v in variables]
    return [c for v in held for c in getattr(v, "values", (v,))]


def _host_copies(variables: list) -> list[np.ndarray | None]:
    """Copies of the values of ``variables``' components (:func:`_components`) in host memory, outside
    the allocator planning measures, for :meth:`_Planner.restore`; ``None`` for a value of zeros.

    A copy, not a read: on CPU a read shares the variable's buffer, and the step's first update then
    copies every variable on the device (copy on write): ResNet50's planning held 685 MiB of a 535 MiB
    budget that way, 270 MiB of weights and Adam's state twice. Zeros are not copied (the slots of an
    optimizer planning built: 180 of those 270 MiB; the snapshot took 0.3 s, most of it writing new
    host pages), the read that found them dropped at once."""
    return [a.copy() if a.any() else None for a in (c.numpy() for c in _components(variables))]


def _gradient_bytes(variable) -> int:
    """The size of ``variable``'s gradient: float32, as the step accumulates and applies them."""
    return 4 * int(np.prod(variable.shape))


def _rows(batch: int, micro_batches: int) -> int:
    return math.ceil(batch / micro_batches)


class _Planner:
    """Measures candidates of one model and batch: one trace per family, the state restored at the end."""

    def __init__(
        self, model, loss, optimizer, x, y, sample_weight, strategy, budget, margin, options, verbose, built_bytes=0
    ):
        self.model, self.loss, self.options, self.verbose = model, loss, options, verbose
        # Host arrays, copied to the device (_on_device) for each measurement and freed after it.
        self.x, self.y, self.sample_weight = tf.nest.map_structure(
            lambda t: None if t is None else np.asarray(t), (x, y, sample_weight)
        )
        self.batch = int(tf.nest.flatten(self.x)[0].shape[0])
        self.strategy = strategy or tf.distribute.get_strategy()
        self.budget, self.margin = budget, margin
        # The noise scale compares micro-batch gradients: on one replica it needs 2 of them.
        replicas = self.strategy.num_replicas_in_sync
        self.fewest = 2 if options.get("noise_scale") and replicas == 1 else 1
        # Whether a one-micro-batch step could apply its updates inside backprop (see fused_update.decide).
        self.can_fuse = (
            replicas == 1
            and options.get("fused_update", "auto") is not False
            and not options.get("per_example_clip")
            and not getattr(optimizer, "global_clipnorm", None)
            and not getattr(optimizer, "compact_dtype", None)
        )
        # Weights dominate (fine-tuning): see one_micro_batch_first.
        self.gradients_dominate = fused_update.gradients_dominate(model, batch_shape(self.x))
        self.optimizer = optimizer  # built by plan(); its state is restored when planning ends
        trained = model.trainable_variables
        self.weights_bytes = _bytes(model.variables)
        # What the allocator holds for the optimizer's state when planning built it, not only its shapes:
        # a buffer placed in a free chunk less than twice its size takes the whole chunk (measured: Adam's
        # 110.7 MiB of GPT-2 LM slots held 133.6 MiB), and training keeps the state as it was allocated.
        self.state_bytes = max(_bytes(self.optimizer.variables), built_bytes)
        self.accumulator_bytes = sum(map(_gradient_bytes, trained))
        # The same for each micro-batched family's accumulators, made when its step is (training takes the
        # chosen family's as they are): the GPT-2 LM's 55.4 MiB held 75.2 in a fresh process, and the
        # plans that counted shapes went over at fit level, by up to 15 MiB (k=2, checkpointed).
        self.held: dict[tuple, int] = {}
        self.largest_bytes = max(map(_gradient_bytes, trained))
        # Measured peaks must leave this free (see the module's docstring), predictions half the margin more.
        # A fused loss makes its kernel's gradient after the backward pass, where it measured no placement
        # outliers: that variable is not the one whose gradient may land in a chunk twice its size.
        head = _fused_head(model, loss, options, self.x, self.y)
        self.later = None if head is None else head.kernel()
        self.placed_bytes = max([_gradient_bytes(v) for v in trained if v is not self.later] or [0])
        self.reserve = max(margin / 2 * budget, self.placed_bytes)
        self.limit = budget - self.reserve
        # Where "auto" fuses the loss, the unfused step (a third fewer of the head's matmuls) is faster
        # where its logits fit: float32 logits of one row, for its prediction (0: not a knob here).
        self.logits_per_row = 0
        if head is not None and options.get("fused_loss", "auto") == "auto":
            self.logits_per_row = 4 * head.sizes[1] * head.positions(batch_shape(self.x)) // self.batch
        self.batch_bytes = sum(a.nbytes for a in tf.nest.flatten((self.x, self.y, self.sample_weight)) if a is not None)
        # Everything a candidate step may write, restored at the end: the model's variables and
        # those of a LossScale object the caller passed (its scale and growth counter).
        scale = options.get("loss_scale")
        self.state = [*model.variables, *(scale.variables if isinstance(scale, tf.Module) else ())]
        self.state += list(optimizer.variables)  # its slots and iterations, on the host meanwhile
        self.snapshot = _host_copies(self.state)
        # The line's points are measured on the first rows of the batch: a peak depends on the rows per
        # micro-batch, not on how many there are, and the family's one trace takes any batch size
        # (not under XLA, where every shape is its own compilation, nor split over replicas).
        self.sub_batches = replicas == 1 and not options.get("jit_compile")
        self.points: dict[int | None, list[_Point]] = {}
        self.candidates: dict[tuple, Candidate] = {}
        self.steps: dict[tuple, TrainStep] = {}
        self._checkpointed: dict[int, keras.Model] = {}
        self._segments: dict[int, list[tuple[list, list]]] = {}
        self._waiting: dict[int, int] = {}
        self._boundaries: dict[int, int] = {}
        self.trace_seconds: dict[tuple, float] = {}  # per family: its first call less a call
        self.reached = 0  # the highest peak a call measured (see _run)

    def limit_of(self, c: Candidate) -> float:
        """What ``c``'s measured peak must stay within: unfused, the kernel's gradient is made during the
        backward pass, so it is the largest variable the allocator's placement can add (see above)."""
        if c.fused_loss is False:
            return self.budget - max(self.reserve, self.largest_bytes)
        return self.limit

    def clear_of(self, c: Candidate) -> float:
        """What ``c``'s measured peak must stay within to fit clear of its limit: half the margin below it,
        the whole margin below the budget (with the reserve). Clear of it by that much, two calls are enough
        (one, see :meth:`_run`; ResNet50's ``fit`` peaks went up to 35 MiB above the plan's two calls, of 47.5
        of margin), and what planning leaves on the device (0-13 MiB on ResNet50) does not rule it out."""
        return self.limit_of(c) - self.margin / 2 * self.budget

    @property
    def sure(self) -> float:
        """What predictions must stay within: the limit less half the margin (their error, the other way)."""
        return self.limit - self.margin / 2 * self.budget

    def fits_clear(self, c: Candidate) -> bool:
        """Whether ``c`` measured a fit clear of its limit (:meth:`clear_of`): one that needs no fallback (what
        planning leaves on the device, counted once it is done, cannot rule it out)."""
        return bool(c.fits) and c.measured_bytes <= self.clear_of(c)

    def clear_fits(self) -> list[Candidate]:
        """The measured, timed configurations that fit clear of their limit (:meth:`fits_clear`)."""
        return [c for c in self.candidates.values() if self.fits_clear(c) and c.seconds is not None]

    def accumulators_held(self, family: tuple) -> int:
        """What a micro-batched family's accumulators hold on the allocator: as allocated, at least their shapes."""
        return max(self.accumulator_bytes, self.held.get(family, 0))

    def kept_free(self) -> str:
        """``"X MiB kept free"``, and why when the reserve is more than half the margin."""
        said = f"{self.reserve / _MIB:,.1f} MiB kept free"
        if self.reserve <= self.margin / 2 * self.budget:
            return said
        return (
            f"{said}: a gradient of the largest variable, which the allocator's placement can add to a peak in "
            "another process history"
        )

    # ------------------------------------------------------------- shapes
    def floor(self) -> int:
        """What no configuration goes below, before any trace: weights, state, batch, one gradient buffer."""
        gradient = self.largest_bytes if self.can_fuse and self.fewest == 1 else self.accumulator_bytes
        return self.weights_bytes + self.state_bytes + self.batch_bytes + gradient

    def breakdown(self) -> str:
        parts = [
            ("weights", self.weights_bytes),
            ("optimizer state", self.state_bytes),
            ("the batch", self.batch_bytes),
            (
                "one gradient" if self.can_fuse and self.fewest == 1 else "the gradient accumulator",
                self.floor() - self.weights_bytes - self.state_bytes - self.batch_bytes,
            ),
        ]
        return ", ".join(f"{name} {size / _MIB:,.1f} MiB" for name, size in parts)

    # --------------------------------------------------------- measuring
    def model_for(self, segments: int | None) -> keras.Model:
        if segments is None:
            return self.model
        if segments not in self._checkpointed:
            from effgrad.remat.checkpointing import checkpoint_model

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # segments that cannot all be placed: the table says what was built
                self._checkpointed[segments] = checkpoint_model(self.model, segments=segments)
        return self._checkpointed[segments]

    def segments_of(self, segments: int) -> list[tuple[list, list]]:
        """``(layers, outputs)`` of each segment of the model cut in ``segments`` segments, in order, as
        ``checkpoint_model`` cuts it, without building it (the planner weighs counts it never traces)."""
        if segments not in self._segments:
            from effgrad.remat.checkpointing import segment_bounds

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # segments that cannot all be placed: the table says what was built
                g, bounds = segment_bounds(self.model, segments)
            self._segments[segments] = [
                ([node.operation for node in g.nodes[start:stop]], g.segment_io(start, stop)[1])
                for start, stop in zip(bounds, bounds[1:])
            ]
        return self._segments[segments]

    def waiting_bytes(self, segments: int | None, activations: float) -> float:
        """Float32 gradients a plain step holds at its peak over the line's, waiting for the update (see
        :meth:`predict`); ``activations``: what the line counts of the batch's at once.

        Unchecked: were activations freed and gradients made at an even pace through backprop, the
        peak would be its start where activations are the larger part (nothing waits) and its end
        otherwise (the gradients less the activations by then freed); a quarter of them at least, as
        measured where activations dominate (the GPT-2 LM: 0.3 of its 55 MiB; ResNet50's plain step,
        counted an eighth of its 90 MiB, was predicted 2.8-3.5% under its 552 MiB in fresh processes).
        Checkpointed, the peak is where the first segment is recomputed (segments hold about equal
        activations, and the first is recomputed last): those of every variable outside that segment. Not
        a fused loss's kernel, made after."""
        if segments is None:
            return max(self.accumulator_bytes / 4, self.accumulator_bytes - activations)
        if segments not in self._waiting:
            first = next(iter(self.segments_of(segments)), ([], []))[0]
            inside = {id(v) for layer in first for v in layer.trainable_variables} | {id(self.later)}
            self._waiting[segments] = sum(
                _gradient_bytes(v) for v in self.model.trainable_variables if id(v) not in inside
            )
        return self._waiting[segments]

    def boundary_bytes(self, segments: int) -> int:
        """Bytes a row of the segments' outputs holds: a checkpointed step keeps them for the backward pass
        besides a segment's activations recomputed (from their static shapes: a dimension other than the
        batch's unknown counts nothing). ResNet50 at 64x64 in 7 segments: 0.88 MiB a row."""
        if segments not in self._boundaries:
            outputs = [o for _, segment_outputs in self.segments_of(segments) for o in segment_outputs]
            self._boundaries[segments] = sum(
                math.prod(o.shape[1:]) * tf.as_dtype(o.dtype).size for o in outputs if None not in o.shape[1:]
            )
        return self._boundaries[segments]

    def _step(self, c: Candidate) -> TrainStep:
        """``c``'s family's one step: micro-batched ones share a trace whatever their number.

        Only the current family's accumulators are filled: another's would sit on the device meanwhile
        (its step is kept, emptied: training may take the chosen one, trace and all).
        """
        family = c.family
        for other, step in self.steps.items():
            if other != family:
                accumulate.free_accumulators(step._accumulators or [])
        if family not in self.steps:
            options = {**self.options, "micro_batches": max(c.micro_batches, 1), "strategy": self.strategy}
            if c.micro_batches == 1:
                options["fused_update"] = c.fused_update
            if c.fused_loss is not None:
                options["fused_loss"] = c.fused_loss
            model = self.model_for(c.segments)
            before = memory.current_bytes()
            step = TrainStep(model, self.loss, self.optimizer, **options)  # makes its accumulators
            self.held[family] = memory.current_bytes() - before
            # What the step made for itself (a loss scale, the noise-scale statistics) is restored too.
            own = [v for part in (step.loss_scale, step.noise_scale) if isinstance(part, tf.Module)
                   for v in part.variables if all(v is not known for known in self.state)]  # fmt: skip
            self.state += own
            self.snapshot += _host_copies(own)
            self.steps[family] = step
        step = self.steps[family]
        step.micro_batches = c.micro_batches
        # Refilled before the step, not by it: a peak measured around the step would count them
        # twice (also as resident, see _run).
        accumulate.refill_accumulators(step._accumulators or [], step.model.trainable_variables)
        return step

    def _run(
        self, c: Candidate, calls: int, rows: int, over: float | None = None, clear: float | None = None
    ) -> tuple[list[int], float | None]:
        """``(peaks, seconds)`` of ``calls`` calls of a step on the batch's first ``rows`` rows, each
        peak as on the whole batch, and the fastest of their times; the calls stop at a peak above
        ``over`` (more could only confirm it: the GPT-2 LM's 2 micro-batches, 0.7 s a call), and after
        one timed call whose peak is within ``clear`` and within the highest an earlier call reached.

        The peak varies from call to call with how the executor's threads interleave frees and
        allocations. Two calls of a candidate (a third cost the GPT-2 LM's plan 0.6-0.9 s per
        configuration), two more at the edge of the limit (:meth:`measure`); one where a call is clear of
        its limit (the margin left is for the calls' spread: 5-11 MiB of ResNet50's 4 micro-batches) and
        within what an earlier call reached. It touches no new memory, and its time is 0-17% above the
        next calls' (ResNet50's 8 micro-batches after 4: 0.598 s, then 0.579-0.630, as 16 and 32; in 7
        segments, 4 after 2: 0.73, then 0.61-0.63): 0.5 s of ResNet50's plan at 50% of the way from its
        floor to its plain peak. Such a time errs high, never low (:meth:`repays_trace` allows for it).
        Above what was reached, slower: its 2 micro-batches after 4, 57 MiB higher, 0.506 s, then
        0.344-0.358. A line point on a slice: one call in each of two configurations (:meth:`line`).

        A family's first call (on the whole batch, see :meth:`line`) traces: its peak counts as a call's,
        its time does not, and one more call is timed, unless the peak is above ``over`` (the time is then
        ``None``). Its peak lay among the next four calls' (ResNet50's 4 micro-batches: 80.8 MiB, then
        76.6-84.7; its plain step 271.2, then 271.9-274.6; the GPT-2 LM's plain step 199.4, then
        192.6-194.5, unfused 742.0, then 735.4-748.7): a call less per family traced, 0.4 s of ResNet50's
        plan at 90% of the way from its floor to its plain peak, 0.7 s of the LM's at 70%.
        """
        step = self._step(c)
        whole = (self.x, self.y, self.sample_weight)
        part = whole if rows == self.batch else tf.nest.map_structure(lambda a: None if a is None else a[:rows], whole)
        x, y, sample_weight = _on_device(part)  # resident, as the whole batch is counted below
        run = lambda: step(x, y, sample_weight)["loss"]  # noqa: E731
        accumulators = self.accumulators_held(c.family) if c.micro_batches > 1 else 0
        resident = self.weights_bytes + self.state_bytes + accumulators + self.batch_bytes
        peaks, times, traced = [], [], None
        if not step.trace_count:
            start = time.perf_counter()
            peaks.append(resident + memory.measure(run).extra_bytes)
            traced = time.perf_counter() - start
        while len(peaks) < calls or not times:
            if over is not None and peaks and peaks[-1] > over:
                break
            if clear is not None and times and max(peaks) <= min(clear, self.reached):
                break
            start = time.perf_counter()
            peaks.append(resident + memory.measure(run).extra_bytes)
            times.append(time.perf_counter() - start)
        if traced is not None:  # what the trace cost: a call's time less, where one was timed
            self.trace_seconds[c.family] = traced - min(times, default=0.0)
        self.reached = max(self.reached, *peaks)
        return peaks, min(times, default=None)

    def measure(
        self,
        micro_batches: int,
        segments: int | None = None,
        fused: bool = False,
        calls: int = 2,
        fused_loss: bool | None = None,
    ) -> Candidate:
        candidate = self.candidate(micro_batches, segments, fused, fused_loss)
        if candidate.measured_bytes is not None or candidate.note == "out of memory":
            return candidate
        try:
            limit = self.limit_of(candidate)
            peaks, candidate.seconds = self._run(
                candidate, calls, self.batch, over=limit, clear=self.clear_of(candidate)
            )
            if self.clear_of(candidate) < max(peaks) <= limit:
                # A fit within half the margin of its limit: training's calls can go higher than two did
                # (ResNet50's 4 micro-batches: 67-85 MiB above the resident state over 4 calls; plans
                # that measured them at 440-450 MiB of 450.9 allowed peaked at fit level at up to
                # 475.3 MiB of a 474.6 MiB budget). Up to two calls more, and the spread between the
                # calls counts against the limit too: one by one, since more calls only widen the spread
                # and raise the peak, a sum over the limit already is the verdict (ResNet50 at 50%:
                # 445.2 and 449.6 MiB of 450.9, two calls of 0.55 s saved).
                for _ in range(calls):
                    if max(peaks) + max(peaks) - min(peaks) > limit:
                        break
                    more, seconds = self._run(candidate, 1, self.batch)
                    peaks, candidate.seconds = peaks + more, min(candidate.seconds, seconds)
                candidate.spread_bytes = max(peaks) - min(peaks)
            candidate.measured_bytes = max(peaks)
            candidate.fits = candidate.measured_bytes + candidate.spread_bytes <= limit
            if not candidate.fits:
                candidate.note = (
                    "over budget (measured)"
                    if candidate.measured_bytes > limit
                    else f"over budget with the {candidate.spread_bytes / _MIB:,.1f} MiB its calls' peaks spread"
                )
        except tf.errors.ResourceExhaustedError:  # out of memory on a real accelerator: does not fit
            candidate.fits, candidate.note = False, "out of memory"
        if self.verbose:
            peak = (
                "out of memory" if candidate.measured_bytes is None else f"{candidate.measured_bytes / _MIB:,.1f} MiB"
            )
            verdict = "fits" if candidate.fits else "over budget"
            _say(
                f"{candidate.describe()}: {peak} ({verdict} {self.budget / _MIB:,.1f} MiB)"
                + ("" if candidate.seconds is None else f", {candidate.seconds:.3f} s/step")
            )
        return candidate

    def probe(self, micro_batches: int, rows: int, segments: int | None) -> bool:
        """Measures a line point on the batch's first ``rows`` rows (one call: :meth:`line` measures each
        point twice, in two configurations); ``False`` if out of memory."""
        if any((p.micro_batches, p.rows) == (micro_batches, rows) for p in self.points.get(segments, [])):
            return True
        try:
            (peak,), seconds = self._run(Candidate(micro_batches, segments), 1, rows)
        except tf.errors.ResourceExhaustedError:
            return False
        point = _Point(micro_batches, rows, peak, seconds)
        self.points.setdefault(segments, []).append(point)
        if self.verbose:
            _say(
                f"line point: {point.per_micro} rows per micro-batch ({micro_batches} of {rows} rows), "
                f"{peak / _MIB:,.1f} MiB as on the whole batch, {seconds:.3f} s"
            )
        return True

    def candidate(
        self, micro_batches: int, segments: int | None = None, fused: bool = False, fused_loss: bool | None = None
    ) -> Candidate:
        key = (micro_batches, segments, fused, fused_loss)
        if key not in self.candidates:
            self.candidates[key] = Candidate(micro_batches, segments, fused, fused_loss)
        return self.candidates[key]

    def restore(self) -> None:
        """Assigns the snapshot back, each value held while it is assigned: an assign whose value is its
        last reference may adopt that value's buffer, and on CPU a tensor made from an aligned NumPy array
        is that array's memory (a 4 MiB variable assigned such an array as it was: 4 MiB less in the
        allocator's use, the host copy kept alive by the variable). Held, it is copied."""
        for variable, value in zip(_components(self.state), self.snapshot, strict=True):
            source = tf.zeros(variable.shape, variable.dtype) if value is None else tf.constant(value)
            variable.assign(source)

    def release(self, keep: Candidate | None = None) -> TrainStep | None:
        """Drops what planning made on the device (steps, their accumulators), but for ``keep``'s step,
        which it returns: set to ``keep``'s micro-batches, its accumulators as they were allocated if its
        family ran last.

        A traced step and its functions refer to each other: only a collection frees them, and
        training (the budget holds at fit level) should not start next to them.
        """
        kept = None
        if keep is not None:
            kept = self.steps.pop(keep.family, None)
        if kept is not None:
            kept.micro_batches = keep.micro_batches
            kept.forget_calls()  # planning's calls are not training's
        # Emptied now, not at the next collection, and whatever graph TF keeps holds no gradient.
        for step in self.steps.values():
            accumulate.free_accumulators(step._accumulators or [])
        self.steps.clear()
        accumulate.free_released()
        self.optimizer, self.snapshot = None, []
        gc.collect()
        return kept

    # ------------------------------------------------------------ planning
    def line(self, segments: int | None) -> tuple[float, float] | None:
        """``(fixed, per_row)`` of the micro-batched family: points at 1/4 and 1/16 of the batch per
        micro-batch (far apart: the allocator's noise, about 1 MiB between identical runs here, does
        not swamp the slope), then :meth:`fitted`. All on the family's one trace.

        The 1/4 point is a candidate, measured on the whole batch; the family's first call, on the
        whole batch too, lays the allocator's regions out as training will (after a first call on
        2 rows, the GPT-2 LM's peaks at 1 row per micro-batch were 60-150 MiB higher). The 1/16
        point is measured on a slice of the batch, in 2 micro-batches and in 4: a peak depends on
        the rows per micro-batch, not on how many there are, and the two times give what a
        micro-batch costs (:meth:`seconds`). ResNet50 at batch 32: k=4 on 32 rows, then k=2 on 4
        rows and k=4 on 8, where two k=16 calls on 32 rows took 3 s. Under XLA (a compilation per
        shape) or split over replicas, the 1/16 point is a candidate too.

        Under 16 rows, 1/16 of the batch rounds up to a row and 1/4 lies a row or two from it, where
        the allocator's placement sets the slope (the GPT-2 LM at batch 8: from points at 1 and 2 rows,
        2 micro-batches were predicted 9-16% over and the plain step 11-19%): the far point is then
        half the batch (from 1 and 4 rows, 4 micro-batches 1% over and the plain step 5%, in one process).
        """
        near = max(1, math.ceil(self.batch / 16))
        far = max(1, math.ceil(self.batch / (4 if self.batch >= 16 else 2)))
        whole = [far] if self.sub_batches and 4 * near < self.batch else [far, near]
        for r in dict.fromkeys(whole):
            if self.measure(max(2, math.ceil(self.batch / r)), segments).measured_bytes is None:
                return None
        if len(whole) == 1:
            # Next to a fit clear of its limit, the times must say which counts are no faster than it (and
            # are not measured): 2 micro-batches and 4 give what one costs, unless the whole batch's points
            # do. Without one, more micro-batches are measured on the whole batch next, their time the third
            # point: 4 only (ResNet50 at 50%: k=4 at the edge, 0.2 s of calls less), the larger peak of the
            # two in the runs measured (401.4 and 405.2 MiB; 398.6 and 405.5).
            for k in (2, 4) if self.clear_fits() and self.seconds(segments, 1) is None else (4,):
                if not self.probe(k, k * near, segments):
                    return None
            # One call each, at the same rows per micro-batch: the point's peak is the larger, as two calls
            # of one configuration gave it. A first call on a new shape is no slower (ResNet50: 0.20 and
            # 0.20 s, the GPT-2 LM 0.26 and 0.26 s), and the second calls took 0.55-0.8 s of their plans.
            same = [p for p in self.points[segments] if p.per_micro == near]
            top = max(p.peak_bytes for p in same)
            for p in same:
                p.peak_bytes = top
        return self.fitted(segments)

    def _points(self, segments: int | None) -> list[_Point]:
        """The family's line points and measured micro-batched candidates (on the whole batch)."""
        whole = [_Point(c.micro_batches, self.batch, c.measured_bytes, c.seconds) for c in self.candidates.values()
                 if c.family == (True, segments, False, None) and c.measured_bytes is not None]  # fmt: skip
        return self.points.get(segments, []) + whole

    def fitted(self, segments: int | None) -> tuple[float, float]:
        """``peak = fixed + per_row * rows``, least squares over every measured micro-batched point.

        Each measurement refines the line: a small batch's two points can be a row apart (the GPT-2
        LM at batch 8: 1 and 2 rows), where the allocator's noise sets the slope; a third point
        further out corrects it before a larger step (the plain one: a trace more) is tried.
        """
        points = self._points(segments)
        rows = np.array([p.per_micro for p in points], float)
        peaks = np.array([p.peak_bytes for p in points], float)
        per_row = max(0.0, float(np.polyfit(rows, peaks, 1)[0])) if np.ptp(rows) else 0.0
        return float(peaks.mean() - per_row * rows.mean()), per_row

    def seconds(self, segments: int | None, micro_batches: int) -> float | None:
        """A micro-batched step's time on the whole batch, ``fixed + per_micro * k + per_row * rows``,
        least squares over its measured points.

        Each call pays a fixed cost (the optimizer's update, dispatch), each micro-batch its own (a loop
        iteration, kernel launches, the accumulation) and every row its share. ResNet50 at batch 32:
        2 micro-batches of 4 rows in 0.22 s, 4 of 8 rows in 0.43 s and 4 of 32 rows in 0.72 s predict
        1.05 and 1.72 s for 8 and 16 micro-batches of 32 rows (measured 0.97-1.06 and 1.48-1.82 s
        over runs). A negative ``per_micro`` (small micro-batches that run faster per row, seen on
        CPU caches) predicts more micro-batches faster, and they are measured.
        """
        points = [p for p in self._points(segments) if p.seconds is not None]
        if len({(p.micro_batches, p.rows) for p in points}) < 2:
            return None
        design = np.array([[1.0, p.micro_batches, p.rows] for p in points])
        wanted = np.array([1.0, micro_batches, self.batch])
        # Not determined by the points (two slices, the whole-batch point over the limit and not timed).
        if np.linalg.matrix_rank(np.vstack([design, wanted])) > np.linalg.matrix_rank(design):
            return None
        coefficients = np.linalg.lstsq(design, np.array([p.seconds for p in points]), rcond=None)[0]
        return float(coefficients @ wanted)

    def predict(self, line, micro_batches: int, fused: bool = False, segments: int | None = None) -> int:
        """A configuration's peak from the micro-batched family's line.

        One micro-batch has no accumulator: they come off as the line counted
        them, as the allocator held them (their shapes alone over-predicted the
        GPT-2 LM's checkpointed plain step by 12%: 55.4 MiB held 75.2). Its
        gradients wait for the update, where a micro-batch's are added up as
        they are made (:meth:`waiting_bytes`). Where activations are the larger
        part, the peak comes early in backprop and few wait: in fresh
        processes, the GPT-2 LM's plain step measured 386-388 MiB (3
        processes) where 3 plans' lines less the accumulators came to 366-386,
        0.02-0.37 of its 55 MiB of gradients more; ResNet50's 548-550 MiB,
        0.01-0.23 of its 90 MiB (half of them, as counted before,
        over-predicted both by 2-8%); on MobileNetV2 and small MLPs measured
        in the planning process, the line itself over-predicts by 5-8%, and
        more waiting counted only adds to it. Checkpointed, the peak is in the
        first segment's recompute, with the gradients of every variable outside
        that segment waiting: ResNet50's deep stages hold 89 of its 90 MiB of
        them, and its plain step with 2 segments measured 509 MiB where the
        line alone predicted 417 (an 18% miss, two traces in vain at its 50%
        budget); the GPT-2 LM's first segment holds its embedding, whose
        gradient the fused loss makes last: 3 MiB wait, and it measured 6-10%
        below the line as it is.

        Fused, each update is made as its gradient is: the largest gradient in
        flight instead of those waiting, with half as much again (the update's
        temporaries; a tied embedding's two partial gradients). Measured in
        fresh processes: the GPT-2 LM's 440-450 MiB, 1.2-1.6 of its 49 MiB tied
        embedding over the line less the accumulators (where one was counted,
        it was predicted 3.4-8% under at every budget of a benchmark run);
        ResNet50's 8-17 MiB under it, its largest gradient being 9 MiB (two of
        them over-predicted both by 5-9%). Checkpointed, a couple instead of
        those waiting (ResNet50 with 2 segments measured 442 MiB, predicted 390
        when half the gradients came off that had not been counted).
        """
        fixed, per_row = line
        activations = per_row * _rows(self.batch, micro_batches)
        peak = fixed + activations
        if micro_batches == 1:
            peak -= self.accumulators_held((True, segments, False, None))
            if fused:  # each update inside backprop: unchecked, one gradient in flight instead of those waiting
                peak += (1.5 if segments is None else 2) * self.largest_bytes
            else:
                peak += self.waiting_bytes(segments, activations)
        return int(peak)

    def one_micro_batch_first(self) -> bool:
        """Where the gradients outweigh the activations (fine-tuning), measures the one-micro-batch steps
        before any micro-batched family; whether one fits (then it is the plan, and nothing else is traced).

        Micro-batches add an accumulator the size of every gradient and save at most the activations,
        checkpointing at most the activations: neither can be smaller where the gradients outweigh them,
        nor faster (nor a fallback, should what planning leaves rule a fit at the edge out). Their line
        cannot predict the fused step there either: it counts the accumulators and the gradients a
        micro-batch makes before adding them up, where the fused step holds about one gradient. VGG16
        at 32x32, batch 16, Adam (128 MiB of weights): micro-batched peaks 592-611 MiB, the plain step
        537, the fused 482, predicted 599 from the line; at a 600 MiB budget three families were traced
        (unchecked and checkpointed twice), none fitted, and "Nothing fits" was said.

        The fused step first (what ``build_train_step``'s defaults make there, the smallest). Where it
        fits, the gathered one is predicted (the fused step's peak with every gradient but the largest:
        VGG16 546 MiB, measured 537) but not traced: nothing predicts it faster (with Adam it measured
        0.94x the fused step's time on a GPT-2 backbone, 1.02x on VGG16, 1.16x on 8 Dense 2048:
        benchmarks/step_floor, planning), and its trace delayed VGG16's first trained step by 15 steps.
        """
        if self.fewest > 1 or not self.gradients_dominate:
            return False
        if not self.can_fuse:
            return bool(self.measure(1, None).fits)
        fused = self.measure(1, None, True)
        if not fused.fits:
            return False
        gathered = self.candidate(1, None)
        gathered.predicted_bytes = fused.measured_bytes + self.accumulator_bytes - self.largest_bytes
        gathered.fits = False
        gathered.note = (
            "predicted over budget"
            if gathered.predicted_bytes > self.clear_of(gathered)
            else "not measured: a trace more, no faster than the fused step that fits"
        )
        return True

    def fused_only(self, checkpointing: list[int]) -> bool:
        """Where shapes leave only the fused one-micro-batch steps, measures them (without recompute, then
        with each of ``checkpointing``'s segment counts where predicted to fit); whether shapes did.

        Every other step holds every gradient at once (micro-batched ones in their accumulators, the
        plain step at its update) besides the weights, the optimizer state and the batch; where that is
        over the limit, none of them can fit, and tracing them is in vain. VGG16 fine-tuned at 540 MiB
        (476 allowed; weights, Adam's state, batch and gradients 516): its fused step measured 481 MiB,
        then three micro-batched families were traced, 591-604 MiB, before "Nothing fits" (20 s).

        Checkpointed, the fused step is predicted as unchecked less the share of what it made over the
        floor (activations at most) not alive at once, with a second gradient in flight (:meth:`predict`).
        """
        every = self.weights_bytes + self.state_bytes + self.batch_bytes + self.accumulator_bytes
        if not self.can_fuse or self.fewest > 1 or every <= self.limit:
            return False
        unchecked = self.measure(1, None, True)
        if unchecked.fits or unchecked.measured_bytes is None:
            return True
        spare = max(0, unchecked.measured_bytes - self.floor())
        for segments in checkpointing:
            c = self.candidate(1, segments, True)
            c.predicted_bytes = int(unchecked.measured_bytes - spare * (1 - 1 / segments) + self.largest_bytes)
            if c.predicted_bytes > self.clear_of(c):
                c.fits, c.note = False, "predicted over budget"
            elif self.measure(1, segments, True).fits:
                return True
        return True

    def plain_first(self, segments: int, within: float) -> bool:
        """Measures the checkpointed plain step before its family's line, where checkpointing could bring
        the plain step ``within`` (the limit; what predictions must stay within where a fit clear of its
        limit is at hand); whether it fits with half the margin to spare (then the checkpointed
        micro-batched family, slower, is not traced; if what planning leaves on the device rules the
        plain step out, a second round plans within the budget less it).

        It could fit only if :meth:`recompute_guess` is within the limit (the gradients waiting counted
        checkpointed, ResNet50: all of them, 89 of 90 MiB; the GPT-2 LM: 3 MiB). Where it is, the plain step
        is the likely answer: the GPT-2 LM at 50-70% of the way from its floor to its plain peak,
        predicted unchecked at 382 MiB with 144 MiB of activations, measured 298-303 MiB with 2
        segments, for a 331-344 MiB limit; its family's line and a point further out came first, 10 s
        of 23 of planning.
        """
        return self.could_fit(1, segments, within) and self.fits_clear(self.measure(1, segments))

    def recompute_guess(self, micro_batches: int, segments: int) -> float | None:
        """``micro_batches`` with ``segments`` segments at best, before their family is traced: the unchecked
        peak (measured, or predicted from the line) less the share of its activations not alive at once
        (``segments`` segments keep a ``1 / segments`` share at least, and the segments' outputs:
        :meth:`boundary_bytes`), with the gradients of one micro-batch waiting as :meth:`predict` counts
        them checkpointed. ``None``: nothing to guess from.

        ResNet50 at batch 32, its plain step in 7 segments: 446 MiB measured, 451 guessed (417-423 without
        the segments' 28 MiB of outputs: traced in vain at its 50% budget, where predictions must stay
        within 427); in 2 segments, 526 measured, 519 guessed.
        """
        unchecked = self.candidates.get((micro_batches, None, False, None))
        if unchecked is None or unchecked.peak_bytes is None or len(self._points(None)) < 2:
            return None
        rows = _rows(self.batch, micro_batches)
        activations = self.fitted(None)[1] * rows
        waiting = 0.0
        if micro_batches == 1:
            waiting = self.waiting_bytes(segments, activations) - self.waiting_bytes(None, activations)
        kept = activations / segments + self.boundary_bytes(segments) * rows
        return unchecked.peak_bytes + waiting - activations + kept

    def could_fit(self, micro_batches: int, segments: int, within: float) -> bool:
        """Whether :meth:`recompute_guess` puts ``micro_batches`` with ``segments`` segments within ``within``."""
        guess = None if micro_batches < self.fewest else self.recompute_guess(micro_batches, segments)
        return guess is not None and guess <= within

    def recompute_best(self, segments: int, fewer_than: int, least: int = 1) -> tuple[int, float, float | None] | None:
        """The fewest micro-batches (``least`` or more, fewer than ``fewer_than``) that checkpointing with
        ``segments`` segments could bring within what predictions must stay within (:meth:`recompute_guess`):
        ``(k, guess, seconds)``, ``seconds`` the unchecked step's time with the forward pass once more
        (``None``: nothing to predict it from); ``None`` if no count could."""
        for k in _micro_batch_choices(self.batch):
            if max(self.fewest, least) <= k < fewer_than:
                guess = self.recompute_guess(k, segments)
                if guess is not None and guess <= self.sure:
                    unchecked = self.candidates[(k, None, False, None)].seconds or self.seconds(None, k)
                    return k, guess, None if unchecked is None else _RECOMPUTE * unchecked
        return None

    def repays_trace(self, segments: int, best: Candidate, least: int = 1) -> bool:
        """Whether checkpointing with ``segments`` segments is worth its family's trace next to ``best``, the
        fastest measured fit clear of its limit, of 8 or more micro-batches without recompute: the fewest
        micro-batches it could bring within what predictions must stay within (:meth:`recompute_best`)
        must save the trace's time (the unchecked family's) within 100 steps. Else the table says so, on
        that configuration.

        ResNet50 at batch 32, 50% of the way from its floor to its plain peak: 4 micro-batches measured
        at the edge, 8 fit (1.0-1.09 s a step); 4 checkpointed, as fast (1.03-1.11 s) where they were
        traced, cost 18-20 s of trace: planning took 55-61 s, 26-30 s without them.
        """
        found = self.recompute_best(segments, best.micro_batches, least)
        if found is None:
            return False
        k, guess, seconds = found
        if seconds is None:
            return True  # nothing to predict its time from: traced
        # Beyond timing noise on both sides: a time measured in one call runs up to 17% high (_run), a
        # prediction from the line's slices is off by as much, and a wrong trace costs 16-19 s (ResNet50
        # at 50%: 8 micro-batches at 0.66 s/step in one call, 7 segments predicted 0.50, traced in 2 plans
        # of 3: 41-42 s of planning instead of 19; they measured 0.58-0.64 there).
        saving = best.seconds / _SAME_SPEED - seconds * _SAME_SPEED
        trace = self.trace_seconds.get((True, None, False, None), 0.0)
        if saving * _REPAY_STEPS > trace:
            return True
        c = self.candidate(k, segments)
        c.predicted_bytes, c.fits = int(guess), False
        c.note = f"not traced: predicted {seconds:.3f} s/step at best, " + (
            "no faster than a measured fit"
            if saving <= 0
            else f"{saving:.3f} s faster than a measured fit beyond timing noise: {_REPAY_STEPS} steps do not repay "
            f"its {trace:.1f} s trace"
        )
        if self.verbose:
            _say(f"{c.describe()}: {c.note}")
        return False

    def most_promising(self, checkpointing: list[int], best: Candidate) -> int:
        """Of ``checkpointing``'s segment counts, the one that brings the fewest micro-batches within reach
        (:meth:`recompute_best`), the fewest segments of those (as :meth:`best` prefers). Next
        to a fit, one checkpointed family is traced: each is a trace, and the others, needing as many
        micro-batches or more, are predicted no faster (the forward pass is recomputed once, whatever the
        segments).

        ResNet50 at 50% of the way from its floor to its plain peak, 8 micro-batches fitting: 2 segments
        traced first (4 micro-batches, 0.73 s a step, as fast as the 8), then 7 (2 micro-batches within
        reach): three traces, 74 s of planning.
        """

        def fewest(segments: int) -> float:
            found = self.recompute_best(segments, best.micro_batches)
            return math.inf if found is None else found[0]

        return min(checkpointing, key=lambda segments: (fewest(segments), segments))

    def explore(self, segments: int | None, most: int = 3, fewer_than: int | None = None) -> None:
        """Predicts every configuration of one checkpointing choice; measures up to ``most`` predicted to fit.

        The micro-batched family first (its line is measured on the same trace), then one micro-batch.
        With ``fewer_than``, micro-batch counts from it on are left for a later call (neither measured nor
        ruled out), where checkpointing is tried first (:func:`_plan`).
        """
        if self.line(segments) is None:
            return
        choices = [k for k in _micro_batch_choices(self.batch) if k >= self.fewest]
        # What predictions must stay within: the plain step's too (it was allowed up to the measured limit
        # while its prediction counted its gradients twice; ResNet50 at a budget 3% below its plain peak
        # then measured it and its fused variant in vain, two traces: 62 s of planning instead of 19).
        sure = self.sure

        def fitting(micro: bool, within: float = sure) -> list[Candidate]:
            """Re-predicted from the line as it stands; those predicted within, not measured or ruled out."""
            line = self.fitted(segments)
            for k in choices:
                for fused in [False, True] if k == 1 and self.can_fuse else [False]:
                    c = self.candidate(k, segments, fused)
                    if c.measured_bytes is None:
                        c.predicted_bytes = self.predict(line, k, fused, segments)
            return [c for c in self.candidates.values() if c.segments == segments and c.measured_bytes is None
                    and (c.micro_batches > 1) == micro and c.fused_loss is None and not c.note
                    and c.predicted_bytes <= within]  # fmt: skip

        def no_faster(k: int) -> float | None:
            """``k``'s predicted time where a measured fit clear of its limit is as fast (``None``: else)."""
            fastest = [m.seconds for m in self.clear_fits()]
            predicted = self.seconds(segments, k)
            if not fastest or predicted is None:
                return None
            if k > 1:
                return None if predicted < min(fastest) else predicted
            # A checkpointed one-micro-batch step is a trace more: not for one predicted as fast within timing
            # noise (ResNet50 at 50%, 7 segments: its fused plain step, predicted 0.435 s/step next to 2
            # micro-batches' 0.450, traced: 0.619). Unchecked, it is the plain step users know, the simplest.
            return predicted if segments is not None and same_speed(min(fastest), predicted) else None

        def measure_plain(plain: list[Candidate]) -> None:
            unfused = self.candidates.get((1, None, False, False))
            for c in sorted(plain, key=lambda c: c.fused_update):
                if c.fused_update and self.candidate(1, segments).fits:
                    c.note = "not measured: the gathered step fits and is faster"
                elif segments is None and unfused is not None and self.fits_clear(unfused):
                    c.note = "not measured: the unfused loss fits and is faster"
                elif (predicted := no_faster(1)) is not None:
                    c.note = f"not measured: predicted {predicted:.3f} s/step, no faster than a measured fit"
                else:
                    self.measure(1, segments, c.fused_update)

        # The fastest step first (more micro-batches predicted slower than a clear fit are then not measured:
        # the GPT-2 LM checkpointed, one measurement of 1 s steps less); and again after the micro-batched
        # ones, whose measurements refine the line it is predicted from. Where the loss is fused, the
        # fastest is the plain step unfused (the logits made once): tried before the fused one, which it
        # saves a trace when it fits clear (the GPT-2 LM at a roomy budget).
        plain = fitting(micro=False)
        if self.fewest == 1 and self.further(segments, sure):
            # Predicted from half the batch, the plain step is tried up to the limit: checkpointed, the
            # GPT-2 LM's measured 309 MiB, predicted 327, where predictions had to stay within 336.
            # Not the fused one, whose saving is a guess (ResNet50: 534 MiB measured, 506 predicted).
            plain = [c for c in fitting(micro=False, within=self.limit) if c.predicted_bytes <= sure
                     or not c.fused_update]  # fmt: skip
        if segments is None and self.logits_per_row and self.fewest == 1:
            self.try_unfused(1)
        measure_plain(plain)
        tries = max(most - len(fitting(micro=False)), 1)

        def micro_batched() -> list[Candidate]:
            return [c for c in fitting(micro=True) if fewer_than is None or c.micro_batches < fewer_than]

        while tries and (micro := micro_batched()):
            # The fastest predicted first; one predicted no faster than a measured fitting step is not measured
            # (as fast, it could not replace that step, simpler or measured first: best(); the GPT-2 LM at a
            # roomy budget measured 2 micro-batches, predicted 3% slower than the plain step, in vain),
            # unless that step is within half the margin of the limit: what planning leaves on the device,
            # counted once it is done (ResNet50: 0-13 MiB in the last runs, up to 37 in earlier ones), may rule it
            # out, and then the next one is needed (ResNet50 at batch 32: k=4 measured 445.3 MiB of 448.8, then
            # 13.2 MiB left over; at a 506 MiB budget, more than half the margin was left, before the second
            # round, and "Nothing fits" was said). Without a fit clear of its limit, the fewest first: the
            # time per micro-batch comes from the line's two one-call slices until then, whose noise can make
            # it negative and put the most first (ResNet50 at 50%: slices of 0.23 and 0.26 s, k=4 over; 32
            # micro-batches predicted fastest, 3.4 s of calls, 1.7 s a step); the fewest's whole-batch time
            # refits it.
            clear = bool(self.clear_fits())
            c = min(micro, key=lambda c: ((self.seconds(segments, c.micro_batches) or 0) * clear, c.micro_batches))
            if (predicted := no_faster(c.micro_batches)) is not None:
                c.note = f"not measured: predicted {predicted:.3f} s/step, no faster than a measured fit"
                continue
            self.measure(c.micro_batches, segments)
            tries -= 1
        measure_plain(fitting(micro=False))
        for c in self.candidates.values():
            if c.segments == segments and c.measured_bytes is None and not c.note:
                over = c.predicted_bytes is not None and c.predicted_bytes > sure
                if not over and fewer_than is not None and c.micro_batches >= fewer_than:
                    continue  # left for the later call
                c.fits = False if over else c.fits
                c.note = "predicted over budget" if over else "not measured: fewer micro-batches fit"

    def explore_families(self, checkpointing: list[int]) -> None:
        """:meth:`explore` without checkpointing, then, where that needs 8 or more micro-batches or
        nothing fits, with checkpointing (the plain step first where recompute could bring it within the
        limit): next to a fit clear of its limit, the most promising segment count only
        (:meth:`most_promising`), if it repays its trace; else each of ``checkpointing``'s until one fits
        with fewer micro-batches. Then the micro-batch counts left for after checkpointing."""
        self.explore(None, fewer_than=_CHECKPOINT_FROM if checkpointing else None)
        best = self.best()
        if best is None and checkpointing and not self.could_fit(1, checkpointing[0], self.limit):
            # Checkpointed, only micro-batches could fit: the many without recompute first (calls of the
            # trace at hand), then a checkpointed family only where it repays its trace.
            self.explore(None)
            best = self.best()
        if best is None or best.micro_batches >= _CHECKPOINT_FROM:
            # Against the fastest fit clear of its limit: one at the edge, what planning leaves may rule out
            # (ResNet50 at 50%: 8 micro-batches at 428 MiB of 450 allowed, ruled out; 16 chosen, 2x slower).
            fallback = min(self.clear_fits(), key=lambda c: c.seconds, default=None)
            tried = checkpointing
            if fallback is not None and checkpointing:
                tried = [self.most_promising(checkpointing, fallback)]
            for segments in tried:
                if fallback is not None and not self.repays_trace(segments, fallback):
                    continue
                # Next to a fit clear of its limit, the plain step is measured only if guessed clear too: at the
                # edge, what planning leaves may rule it out (ResNet50 at 50%: 7 segments' plain step, guessed
                # 445 MiB, measured 442.5 of 450.5 allowed, then ruled out by the 9 MiB planning left).
                # Measured at the edge (or over), the checkpointed micro-batched family is a trace more, as a
                # fallback or the answer, weighed again from two micro-batches on (ResNet50 at 50%: 4
                # checkpointed, predicted no faster than 8 unchecked and clear, traced: 16 s of a 44 s plan).
                within = self.limit if fallback is None else self.sure
                if not self.plain_first(segments, within) and (
                    fallback is None or self.repays_trace(segments, fallback, 2)
                ):
                    self.explore(segments, most=2)
                found = self.best()
                if found is not None and found.segments is not None and found.micro_batches < _CHECKPOINT_FROM:
                    break
        if checkpointing:
            self.explore(None)

    def further(self, segments: int | None, sure: float) -> bool:
        """Whether the plain step, not measured, is predicted from half the batch per micro-batch: a line
        point already (a batch under 16 rows, :meth:`line`), or two micro-batches on the whole batch,
        measured here as a point further out where its prediction is within the margin of what
        predictions must stay within (measuring it is a trace, the decision a gamble).

        Where a peak barely grows over the line's points (the end of backprop's: the GPT-2 LM's embedding
        gradient, from points at 1 and 2 rows), the plain step measured 11% above the line, a trace in vain;
        two micro-batches are a few calls of the family's trace.
        """
        plain = self.candidate(1, segments)
        if plain.measured_bytes is not None:
            return False
        if 2 * max(p.per_micro for p in self._points(segments)) >= self.batch:
            return True
        if abs(plain.predicted_bytes - sure) > self.margin * self.budget:
            return False
        return self.measure(2, segments).measured_bytes is not None

    def unfused(self) -> None:
        """Measures the loss unfused (the logits made), with the fewest micro-batches predicted to fit.

        The fused loss makes the logits twice (a third more of the head's matmuls: the GPT-2 LM's step
        1.02-1.06x slower, a 100,000-class classifier's 1.39x), so where the budget leaves room for them
        the unfused step is faster. Its peak is predicted as the fused step's with as many micro-batches
        plus 1.4 float32 copies of a micro-batch's logits (measured at one micro-batch in fresh processes:
        1.37 on the GPT-2 LM at T=256, 925-929 MiB against 387 fused; up to 1.6 in a planning process;
        1.2 on a Dense head to 20,000 classes; counted 1.5, it was predicted 3.5-6.5% over in a benchmark
        run), within half the margin. Only micro-batch counts
        up to the best fused one's are tried (more would be slower), without checkpointing, and at most
        two, since each new family is a trace.
        """
        best = self.best()
        if not self.logits_per_row or best is None:
            return
        for k in [k for k in _micro_batch_choices(self.batch) if self.fewest <= k <= best.micro_batches]:
            if sum(c.fused_loss is False and c.measured_bytes is not None for c in self.candidates.values()) >= 2:
                return
            c = self.try_unfused(k)
            if c is not None and c.fits:
                return

    def try_unfused(self, micro_batches: int) -> Candidate | None:
        """The unfused step with ``micro_batches``, predicted from the fused one's peak (measured, or predicted
        from the line), and again once that is measured; measured if the prediction leaves half the margin,
        or, from a measured peak, if it is within the limit: the logits' copies are then all the guess (1.2-1.6
        of them measured). At the GPT-2 LM's roomy budget the line put its fused plain step 9-12% high, and
        its unfused step (0.63 s a step against 0.70) was ruled out in one run of two. ``None`` if nothing
        to predict from."""
        fused = self.candidates.get((micro_batches, None, False, None))
        base = None if fused is None else fused.peak_bytes
        if base is None:
            return None
        c = self.candidate(micro_batches, None, False, fused_loss=False)
        if c.measured_bytes is not None or c.note == "out of memory":
            return c
        c.predicted_bytes = int(base + 1.4 * self.logits_per_row * _rows(self.batch, micro_batches))
        if c.predicted_bytes > (self.clear_of(c) if fused.measured_bytes is None else self.limit_of(c)):
            c.fits, c.note = False, "predicted over budget"
            return c
        c.fits, c.note = None, ""
        return self.measure(micro_batches, fused_loss=False)

    def near_misses(self, most: int = 2) -> None:
        """Where nothing measured fits: measures the configurations ruled out by a prediction less than half
        the margin over their limit, the fastest first (fewest micro-batches, no recompute), until one fits
        (at most ``most``: each may be a trace). A prediction is the line's guess, and half the margin is
        its error allowed the other way: the GPT-2 LM's checkpointed plain step, predicted 0.1 MiB over
        the limit in a used process, was not measured and "Nothing fits" was said; it measured 296-313 MiB
        of the 331 allowed in other processes. (Next to a fit at the edge, measuring them too cost the LM's
        plan 4.5 s in vain, and what planning leaves, if it rules that fit out, sends a second round.)"""
        near = [c for c in self.candidates.values() if c.measured_bytes is None and c.note == "predicted over budget"
                and c.predicted_bytes <= self.limit_of(c) + self.margin / 2 * self.budget]  # fmt: skip
        for c in sorted(near, key=lambda c: (c.micro_batches, c.segments or 0, c.predicted_bytes))[:most]:
            c.fits, c.note = None, ""
            if self.measure(c.micro_batches, c.segments, c.fused_update, fused_loss=c.fused_loss).fits:
                return

    def what_dominates(self, smallest: Candidate) -> str:
        """For "Nothing fits": what of ``smallest``'s peak does not shrink, what does, and what would help.

        One micro-batch holds no accumulators, which the micro-batched line's fixed part counts: it is
        counted from shapes (VGG16 fine-tuned: the fused step's 484.7 MiB had "about 590.9 MiB" that
        "does not shrink")."""
        if smallest.micro_batches == 1:
            fixed, parts = self.floor(), self.breakdown()
            activations = max(0, smallest.peak_bytes - fixed)
            rest = f"the rest (activations, gradients made in backprop) is {activations / _MIB:,.1f} MiB"
        else:
            line = self.line(smallest.segments)
            if line is None:
                return ""
            fixed, per_row = line
            parts = f"{self.breakdown()}, the backend's per-step workspace"
            activations = per_row * _rows(self.batch, smallest.micro_batches)
            rest = f"activations are {activations / _MIB:,.1f} MiB"
        return (
            f" Of it, about {fixed / _MIB:,.1f} MiB does not shrink with micro-batches or segments ({parts}) "
            f"and {rest}: "
            + (
                "the fixed part dominates; a smaller optimizer state (effgrad.compact_state, SGD, Adafactor), "
                "float16 weights or a smaller batch help."
                if fixed >= activations
                else "activations dominate; checkpointing inside the model's layers helps."
            )
        )

    def best(self) -> Candidate | None:
        """The simplest fitting configuration (fewest micro-batches, no recompute) as fast as the fastest.

        Step times of one configuration vary between calls (by tens of percent on a busy machine): a
        configuration that measured a little faster is not faster, and the simpler one is the plain
        step users know, which keeps the most memory free.
        """
        fitting = [c for c in self.candidates.values() if c.fits and c.seconds is not None]
        if not fitting:
            return None
        fastest = min(c.seconds for c in fitting)
        close = [c for c in fitting if same_speed(c.seconds, fastest)]
        # As fast: the fused loss (its logits never made) before the unfused one.
        return min(close, key=lambda c: (c.segments or 0, c.micro_batches, c.fused_update, c.fused_loss is False,
                                         c.seconds))  # fmt: skip


def build_optimizer(optimizer, model, strategy=None) -> int:
    """Builds ``optimizer`` for ``model`` if it is not built; returns what its state took on the allocator.

    Planning steps the optimizer training uses next (no second copy of its state on the device), and
    counts its state as allocated: 0 when it was built before.
    """
    before = memory.current_bytes()
    if not getattr(optimizer, "inner_optimizer", optimizer).built:
        with (strategy or tf.distribute.get_strategy()).scope():
            optimizer.build(model.trainable_variables)
    return memory.current_bytes() - before


def _fused_head(model, loss, options, x, y) -> fused_loss.Head | None:
    """The projection the step fuses its loss with (making its kernel's gradient after the backward pass).

    Decided as the step decides at its first trace (:func:`effgrad.train.fused_loss.decide`), without one.
    """
    settings = StepOptions(**options)
    objective = loss if isinstance(loss, Objective) else Objective.of_loss(loss, settings.reduction)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the step says it again, at its trace, where users see it
        head, _ = fused_loss.decide(settings, objective, model, batch_shape(x), private=settings.private, y=y)
    return head


def _say(line: str) -> None:
    """One progress line of planning, on stderr (``verbose``)."""
    print(f"effgrad plan: {line}", file=sys.stderr, flush=True)


def count_left(candidates, left: int, limit_of) -> None:
    """Marks the measured candidates that no longer fit ``limit_of(c)`` next to ``left`` bytes planning left."""
    for c in candidates:
        if c.fits and c.measured_bytes + c.spread_bytes + left > limit_of(c):
            c.fits, c.note = False, f"over budget with the {left / _MIB:,.1f} MiB planning left"


def same_speed(seconds: float, fastest: float) -> bool:
    """Whether a measured step time is the fastest's, within timing noise (5% or 5 ms)."""
    return seconds <= max(_SAME_SPEED * fastest, fastest + _JITTER_SECONDS)


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


def _second_round(first_table, left: int, started: float, *args, budget: int, verbose: bool, **kwargs) -> MemoryPlan:
    """Plans again within ``budget`` less the ``left`` bytes the first round left on the device (the
    reserve is then half the margin of that); the plan as of the whole budget, the first round's table
    included."""
    if verbose:
        _say(f"nothing fits next to the {left / _MIB:,.1f} MiB planning left on the device: planning within the rest")
    try:
        second = _plan(*args, budget=budget - left, verbose=verbose, again=True, **kwargs)
    except ValueError as err:
        raise ValueError(
            f"{err} (a second round, within the {budget / _MIB:,.1f} MiB budget less the "
            f"{left / _MIB:,.1f} MiB the first round left on the device)"
        ) from None
    return dataclasses.replace(
        second,
        budget_bytes=budget,
        peak_bytes=second.peak_bytes + left,
        left_bytes=second.left_bytes + left,
        table=first_table + second.table,
        planning_seconds=time.perf_counter() - started,
    )


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
    verbose: bool = True,
    **step_options,
) -> MemoryPlan:
    """Finds the fastest train-step configuration whose measured peak fits ``budget``.

    Example:
        >>> model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(64, activation="relu"),
        ...                           keras.layers.Dense(1)])
        >>> x, y = np.ones((256, 16), "float32"), np.zeros((256, 1), "float32")
        >>> plan = effgrad.plan(model, "mse", keras.optimizers.SGD(0.01), x, y, budget="256MiB", verbose=False)
        >>> plan.micro_batches, plan.segments  # it fits as it is: no slowdown
        (1, None)
        >>> print(plan)  # doctest: +SKIP
        >>> step = effgrad.build_train_step(model, "mse", keras.optimizers.SGD(0.01),
        ...                                 micro_batches="auto", memory_budget="256MiB")  # plans at step(x, y)

    Args:
        model: A built ``keras.Model`` (functional or Sequential to allow
            checkpointing; any model for micro-batching).
        loss: As for :func:`effgrad.build_train_step`.
        optimizer: The optimizer training will use. Planning builds it for
            the model if it is not built (training uses it next; a clone's
            slots would stay on the device for as long as TensorFlow keeps
            the traced steps that used them) and restores its state when
            planning ends.
        x: One batch of inputs, of the size training will use.
        y: Its targets.
        budget: Bytes (int), a size string (``"300MiB"``, ``"6GiB"``) or a
            fraction in (0, 1] of the device's memory (the GPU's; on CPU the
            machine's RAM), as a number or a string (``"0.5"``).
        sample_weight: Optional sample weights of the batch.
        strategy: A ``tf.distribute.Strategy``; default the current one.
        margin: Measured peaks must leave ``margin / 2`` of the budget free
            (or a gradient of the largest variable, if more), predictions
            ``margin / 2`` more to be tried.
        verbose: One line per measured configuration on stderr.
        **step_options: Other :func:`effgrad.build_train_step` options
            (``loss_scale``, ``clip_norm``, ``reduction``, ...).

    Returns:
        A :class:`MemoryPlan`.

    Raises:
        ValueError: the budget is below what never shrinks (said before any
            trace, with the breakdown), or nothing measured fits (the message
            names the smallest peak achievable and what dominates it).
    """
    return _plan(
        model, loss, optimizer, x, y, budget=budget, sample_weight=sample_weight, strategy=strategy, margin=margin,
        verbose=verbose, keep_step=False, **step_options,
    )  # fmt: skip


def _plan(
    model,
    loss,
    optimizer,
    x,
    y,
    *,
    budget,
    sample_weight,
    strategy,
    margin,
    verbose,
    keep_step,
    again: bool = False,
    **step_options,
) -> MemoryPlan:
    """:func:`plan`; with ``keep_step`` the plan's ``step`` is the chosen configuration's traced step, for
    training to take (:class:`PlannedTrainStep`, ``attach``) right away: one trace less, and the
    accumulators its peaks were measured with, as they were allocated. ``again``: the second round
    (below), which makes no third."""
    started = time.perf_counter()
    budget_bytes = parse_budget(budget)
    if not 0 <= margin < 1:
        raise ValueError(f"margin must be in [0, 1), got {margin}.")
    for name in ("micro_batches", "memory_budget"):
        if name in step_options:
            raise TypeError(f"plan() chooses {name}; do not pass it.")
    StepOptions(**step_options)  # every bad option is refused before any work
    if not getattr(model, "built", False):
        raise ValueError("plan() needs a built model: call it once on a batch, or build it, first.")
    built = build_optimizer(optimizer, model, strategy)
    planner = _Planner(
        model, loss, optimizer, x, y, sample_weight, strategy, budget_bytes, margin, dict(step_options), verbose,
        built_bytes=built,
    )  # fmt: skip
    floor = planner.floor()
    if floor > planner.limit:
        raise ValueError(
            f"Nothing fits in {budget_bytes / _MIB:,.1f} MiB (less the {planner.kept_free()}): every "
            f"configuration holds at least {floor / _MIB:,.1f} MiB ({planner.breakdown()}), whatever the "
            "micro-batches or checkpointing. A smaller optimizer state (effgrad.compact_state(optimizer) keeps it "
            f"in about {0.26 * planner.state_bytes / _MIB:,.1f} MiB; SGD, Adafactor), float16 weights or a smaller "
            "batch help."
        )
    if verbose:  # the first family's trace can take a while: say what is happening before it
        _say(
            f"batch {planner.batch}, budget {budget_bytes / _MIB:,.1f} MiB, floor {floor / _MIB:,.1f} MiB; "
            "measuring configurations (a trace per family)"
        )
    # What planning may leave behind is counted from here. Garbage of earlier work freed during planning
    # (release collects) would hide it (a used process): frozen, what exists now is left out of release's
    # collection, which then looks at what planning made only (ResNet50: 0.23 s less, and 0.18 s of
    # collecting first). A process that froze objects of its own (a pre-forking server) is collected first.
    freeze = not gc.get_freeze_count()
    if freeze:
        gc.freeze()
    else:
        gc.collect()
    resident = memory.current_bytes()
    best = None  # what release keeps if planning fails
    try:
        # Recomputing the forward pass costs 1.2-1.4x; only where micro-batching alone needs many. Those
        # many are measured after checkpointing, only if predicted faster than what it found: the GPT-2
        # LM's 8 micro-batches took 1.7 s of calls where its checkpointed plain step fit, 30% faster.
        checkpointing = [] if step_options.get("per_example_clip") else _segment_choices(model)
        if not planner.one_micro_batch_first() and not planner.fused_only(checkpointing):
            planner.explore_families(checkpointing)
        planner.unfused()
        if planner.best() is None:
            planner.near_misses()
        best = planner.best()
    finally:
        planner.restore()
        kept = planner.release(keep=best if keep_step else None)
        if freeze:
            gc.unfreeze()
    # What planning left on the device (TensorFlow keeps every traced graph and some of its buffers
    # for the life of the process: measured 7-37 MiB after planning ResNet50, varying run to run)
    # stays there while training runs: each measured peak carries it. Accumulators handed to
    # training are in every micro-batched peak already, as they were allocated.
    left = memory.current_bytes() - resident
    if kept is not None and any(int(tf.size(a)) for a in kept._accumulators or []):
        left -= planner.accumulators_held(best.family)
    left, chosen = max(0, left), best
    if left:
        count_left(planner.candidates.values(), left, planner.limit_of)
        best = planner.best()
        if kept is not None and best is not chosen:
            if best is not None and best.family == chosen.family:
                kept.micro_batches = best.micro_batches  # the same trace and accumulators: k is a runtime value
            else:  # not the step training will run
                accumulate.free_accumulators(kept._accumulators or [])
                kept = None
    table = sorted(
        planner.candidates.values(),
        key=lambda c: (c.fused_loss is False, c.segments or 0, c.micro_batches, c.fused_update),
    )
    # What planning left on the device ruled out every fit: a second round plans within the budget less
    # it, where what was not measured, or not traced, may fit (the GPT-2 LM in a used process: 4
    # micro-batches measured 354 MiB of 355 allowed, then 18 MiB were left, and checkpointing had never
    # been tried; a checkpointed plain step measured first fits, its micro-batched family never traced;
    # a slower micro-batch count, not measured).
    if best is None and chosen is not None and not again:
        return _second_round(
            table, left, started, model, loss, optimizer, x, y, budget=budget_bytes, sample_weight=sample_weight,
            strategy=strategy, margin=margin, verbose=verbose, keep_step=keep_step, **step_options,
        )  # fmt: skip
    if best is None:
        known = [c for c in table if c.peak_bytes is not None]
        if not known:
            raise ValueError(f"Nothing fits in {budget_bytes / _MIB:,.1f} MiB: every configuration ran out of memory.")
        smallest = min(known, key=lambda c: c.peak_bytes)
        what = planner.what_dominates(smallest)
        raise ValueError(
            f"Nothing fits in {budget_bytes / _MIB:,.1f} MiB (measured peaks must stay within "
            f"{planner.limit / _MIB:,.1f} MiB, the budget less {planner.kept_free()}): the "
            f"smallest peak achievable is {(smallest.peak_bytes + left) / _MIB:,.1f} MiB ({smallest.describe()}"
            + (
                ""
                if smallest.measured_bytes is not None
                else ", predicted from the line's points, "
                f"where predictions must leave {planner.margin / 2:.0%} of the budget more"
            )
            + (f", with the {left / _MIB:,.1f} MiB planning left on the device" if left >= 0.05 * _MIB else "")
            + f").{what}"
        )
    for c in table:
        if c.fits and c is not best and not c.note:
            noise = same_speed(c.seconds, best.seconds)  # as fast: best() keeps the simpler one
            c.note = "fits, as fast within timing noise" if noise else "fits, slower"
    peak, seconds = best.measured_bytes + left, time.perf_counter() - started
    if verbose:
        _say(f"chose {best.describe()}: {peak / _MIB:,.1f} MiB, {best.seconds:.3f} s/step (planned in {seconds:.1f} s)")
    return MemoryPlan(
        micro_batches=best.micro_batches,
        segments=best.segments,
        fused_update=best.fused_update,
        fused_loss=best.fused_loss,
        peak_bytes=peak,
        seconds_per_step=best.seconds,
        budget_bytes=budget_bytes,
        margin=margin,
        table=table,
        planning_seconds=seconds,
        batch_size=planner.batch,
        floor_bytes=floor,
        left_bytes=left,
        reserve_bytes=int(planner.budget - planner.limit_of(best)),
        model=planner.model_for(best.segments),
        step=kept,
    )


class PlannedTrainStep:
    """``build_train_step(..., micro_batches="auto", memory_budget=...)``.

    Plans at the first call (when the batch shape is known), then trains
    exactly as a :class:`effgrad.TrainStep` built with the chosen options
    (on the plan's ``checkpoint_model`` when it checkpoints). Attributes:
    ``plan`` (the :class:`MemoryPlan`, ``None`` before the first call) and,
    after it, those of the inner step.
    """

    def __init__(
        self, model, loss, optimizer, *, micro_batches="auto", memory_budget=None, margin=0.1, verbose=True, **options
    ):
        if micro_batches != "auto":
            raise ValueError(f"memory_budget goes with micro_batches='auto' (got micro_batches={micro_batches!r}).")
        if memory_budget is None:
            raise ValueError(
                "micro_batches='auto' needs memory_budget=... (bytes, '6GiB', or a fraction of the device)."
            )
        self.budget_bytes = parse_budget(memory_budget)
        StepOptions(**options)  # every other bad option is refused now, not at the first batch
        if options.get("shard_state"):
            raise ValueError(
                "shard_state=True is not planned (the planner measures unsharded steps): give micro_batches=k."
            )
        self.model, self.loss, self.optimizer, self.margin, self.options = model, loss, optimizer, margin, options
        self.verbose = verbose
        self.plan: MemoryPlan | None = None
        self.step = None

    def choose(self, x, y, sample_weight=None) -> MemoryPlan:
        """Plans for this batch (once): :attr:`plan`."""
        if self.plan is None:
            options = {"strategy": None, **{k: v for k, v in self.options.items() if k != "on_micro_batch"}}
            self.plan = _plan(
                self.model, self.loss, self.optimizer, x, y, budget=self.budget_bytes, sample_weight=sample_weight,
                margin=self.margin, verbose=self.verbose, keep_step=True, **options,
            )  # fmt: skip
        return self.plan

    def __call__(self, x, y, sample_weight=None) -> dict:
        if self.step is None:
            chosen = self.choose(x, y, sample_weight)
            planned = chosen.take_step()
            if planned is not None and "on_micro_batch" not in self.options:
                self.step = planned  # built with these options: its trace and accumulators are training's
            else:
                options = {**self.options, **chosen.step_options}
                self.step = TrainStep(chosen.model, self.loss, self.optimizer, _accumulators_of=planned, **options)
        return self.step(x, y, sample_weight)

    @property
    def micro_batches(self):
        return "auto" if self.step is None else self.step.micro_batches

    def __getattr__(self, name):
        step = self.__dict__.get("step")
        if step is None:
            raise AttributeError(f"{name!r}: the step is built at its first call (after planning).")
        return getattr(step, name)
