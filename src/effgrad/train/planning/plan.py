"""``effgrad.plan``: the fastest train-step configuration whose measured peak fits a memory budget.

What it guarantees, and how (docs/planning.md "How" says it at length):

    floor      weights + optimizer state + the batch + the smallest gradient buffer any configuration
               needs (one gradient where updates can run inside backward, else every gradient),
               counted from shapes: a budget it does not fit is refused at once, with the breakdown
    limits     measured peaks must leave max(margin / 2 of the budget, the largest gradient) free (the
               allocator's run-to-run spread and placement, what fit adds); predictions margin / 2 more
    search     :func:`effgrad.train.planning.search.search` over real steps (:mod:`.harness`)
    left       what planning left on the device (traced graphs TensorFlow keeps) is counted against every
               fit; where it rules them all out, the search runs once more within the budget less it
    nothing    changes: every variable, slot, iteration and loss-scale state is restored

Trap:
    The plan holds for the batch shape it was made with: a larger batch or longer sequences need a new
    plan. On CPU the budget is the allocator's bytes, not the process's RSS.
"""

from __future__ import annotations

import dataclasses
import gc
import sys
import time
import warnings

import keras
import tensorflow as tf

from effgrad import memory
from effgrad.memory import format_bytes
from effgrad.train import accumulate, fused_update
from effgrad.train.options import StepOptions
from effgrad.train.planning import harness as harness_lib
from effgrad.train.planning.search import Calibration, Candidate, Limits, Outcome, search

__all__ = ["MemoryPlan", "plan", "make_plan", "floor_parts"]


@dataclasses.dataclass
class MemoryPlan:
    """The chosen configuration and everything planning measured.

    Attributes:
        micro_batches: Micro-batches to split every batch into.
        segments: ``checkpoint_model`` segments, or ``None`` (no checkpointing).
        peak_bytes: Measured peak of the chosen configuration, what planning left included.
        seconds_per_step: Its measured time per step.
        budget_bytes: The budget.
        table: Every configuration tried: predicted, measured, and why it was not chosen.
        planning_seconds: What planning took.
        batch_size: Rows of the batch planned for.
        floor_bytes: What no configuration goes below (counted from shapes).
        left_bytes: What planning left on the device, which training runs next to.
        reserve_bytes: What measured peaks leave free of the budget.
        model: The model to train: the one given, or its ``checkpoint_model`` (sharing its variables).
        accumulators: The chosen family's accumulators as its measurements placed them (for the step that
            trains with the plan to take; None from :func:`plan`, which keeps nothing on the device).
    """

    micro_batches: int
    segments: int | None
    peak_bytes: int
    seconds_per_step: float
    budget_bytes: int
    table: list[Candidate]
    planning_seconds: float
    batch_size: int
    floor_bytes: int = 0
    left_bytes: int = 0
    reserve_bytes: int = 0
    plain: bool = True
    model: keras.Model | None = dataclasses.field(default=None, repr=False, compare=False)
    accumulators: accumulate.Accumulators | None = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def step_options(self) -> dict:
        """The :func:`effgrad.build_train_step` options of the chosen configuration (with :attr:`model`)."""
        return {"micro_batches": self.micro_batches}

    def __str__(self) -> str:
        lines = [
            f"effgrad memory plan: batch {self.batch_size}, budget {format_bytes(self.budget_bytes)} (measured "
            f"peaks leave {format_bytes(self.reserve_bytes)} free), floor {format_bytes(self.floor_bytes)}, "
            f"planned in {self.planning_seconds:.1f} s"
            + (f", {format_bytes(self.left_bytes)} left by planning counted in" if self.left_bytes else ""),
            f"{'micro_batches':>13} {'segments':>8} {'predicted':>12} {'measured':>12} {'s/step':>8}  verdict",
        ]
        for c in self.table:
            chosen = (c.config.micro_batches, c.config.segments) == (self.micro_batches, self.segments)
            verdict = "<- chosen" if chosen and c.fits else c.note or {True: "fits", None: "not measured"}.get(c.fits)
            lines.append(
                f"{c.config.micro_batches:>13} {str(c.config.segments or '-'):>8} "
                f"{'-' if c.predicted is None else format_bytes(c.predicted):>12} "
                f"{'-' if c.measured is None else format_bytes(c.measured):>12} "
                f"{'-' if c.seconds is None else f'{c.seconds:.3f}':>8}  {verdict or 'over the limit'}"
            )
        return "\n".join(lines)


def plan(
    model,
    loss,
    optimizer,
    x,
    y,
    *,
    memory_budget=None,
    sample_weight=None,
    margin: float = 0.1,
    verbose: bool = True,
    budget=None,
    **step_options,
) -> MemoryPlan:
    """Finds the fastest train-step configuration whose measured peak fits ``memory_budget``.

    Example:
        >>> model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(64, activation="relu"),
        ...                           keras.layers.Dense(1)])
        >>> x, y = np.ones((256, 16), "float32"), np.zeros((256, 1), "float32")
        >>> plan = effgrad.plan(model, "mse", keras.optimizers.SGD(0.01), x, y, memory_budget="256MiB",
        ...                     verbose=False)
        >>> plan.micro_batches, plan.segments  # it fits as it is: no slowdown
        (1, None)
        >>> print(plan)  # doctest: +SKIP

    Args:
        model: A built ``keras.Model`` (functional or Sequential to allow checkpointing).
        loss: As for :func:`effgrad.build_train_step`.
        optimizer: The optimizer training will use (built here if it is not; its state is restored).
        x: One batch of inputs, of the size training will use.
        y: Its targets.
        memory_budget: Bytes, a size string (``"300MiB"``, ``"6GiB"``) or a fraction in (0, 1] of the
            device's memory (:func:`effgrad.memory.parse_budget`).
        sample_weight: Optional sample weights of the batch.
        margin: A share of the budget: half kept free below measured peaks, half more below predictions.
        verbose: One line per measurement on stderr.
        budget: Deprecated name of ``memory_budget``.
        **step_options: Other :func:`effgrad.build_train_step` options (``loss_scale``, ``clip_norm``,
            ``strategy``, ...).

    Returns:
        A :class:`MemoryPlan`.

    Raises:
        ValueError: the budget is below what never shrinks (before any trace, with the breakdown), or
            nothing fits (naming the smallest peak measured).
    """
    if budget is not None:
        warnings.warn("plan(budget=...) is now plan(memory_budget=...).", DeprecationWarning, stacklevel=2)
        memory_budget = budget if memory_budget is None else memory_budget
    if memory_budget is None:
        raise TypeError("plan() needs memory_budget= (bytes, '6GiB', or a fraction of the device's memory).")
    for name in ("micro_batches",):
        if name in step_options:
            raise TypeError(f"plan() chooses {name}; do not pass it.")
    options = plannable(StepOptions(**step_options))
    return make_plan(
        model, loss, optimizer, (x, y, sample_weight), memory.parse_budget(memory_budget), options, margin, verbose
    )


def plannable(options: StepOptions) -> StepOptions:
    """``options``, or a ``ValueError`` for what the planner does not measure."""
    if options.shard_state:
        raise ValueError(
            "shard_state=True is not planned (the planner measures unsharded steps): give micro_batches=k."
        )
    return options


def make_plan(
    model, loss, optimizer, batch, budget: int, options: StepOptions, margin: float, verbose: bool, keep=False
) -> MemoryPlan:
    """:func:`plan` with parsed arguments; ``keep``: the plan hands its accumulators to training."""
    started = time.perf_counter()
    if not 0 <= margin < 1:
        raise ValueError(f"margin must be in [0, 1), got {margin}.")
    if not getattr(model, "built", False):
        raise ValueError("plan() needs a built model: call it once on a batch, or build it, first.")
    parts = floor_parts(model, optimizer, batch, options)
    state_bytes, floor = parts["optimizer state"], sum(parts.values())
    replicas = (options.strategy or tf.distribute.get_strategy()).num_replicas_in_sync
    reserve = max(int(margin / 2 * budget), max(4 * int(v.shape.num_elements()) for v in model.trainable_variables))
    limits = Limits(budget, budget - reserve, int(budget - reserve - margin / 2 * budget))
    if floor > limits.limit:
        breakdown = ", ".join(f"{name} {format_bytes(size)}" for name, size in parts.items())
        raise ValueError(
            f"Nothing fits in {format_bytes(budget)} (less the {format_bytes(reserve)} measured peaks keep free): "
            f"every configuration holds at least {format_bytes(floor)} ({breakdown}), whatever the micro-batches "
            f"or checkpointing. A smaller optimizer state (effgrad.compact_state(optimizer) keeps it in about "
            f"{format_bytes(0.26 * state_bytes)}; SGD), float16 weights or a smaller batch help."
        )
    say = _say if verbose else (lambda line: None)
    segments = () if options.private else harness_lib.segment_choices(model)
    plain = not (options.noise_scale and replicas == 1)
    freeze = not gc.get_freeze_count()  # what exists now is left out of release's collection
    gc.freeze() if freeze else gc.collect()
    resident = memory.current_bytes()
    harness = harness_lib.Harness(model, loss, optimizer, batch, options, state_bytes, say)
    say(f"batch {harness.batch}, budget {format_bytes(budget)}, floor {format_bytes(floor)}: measuring")
    outcome: Outcome | None = None
    try:
        outcome = search(harness, limits, segments=segments, plain=plain, calibration=Calibration())
    finally:
        harness.restore()
        best = None if outcome is None else outcome.chosen()
        kept = harness.release(best.config if keep and best is not None else None)
        if freeze:
            gc.unfreeze()
    left = max(0, memory.current_bytes() - resident - (kept.nbytes if kept is not None else 0))
    chosen = outcome.chosen(left)
    if chosen is None and best is not None and left:
        say(f"nothing fits next to the {format_bytes(left)} planning left on the device: planning within the rest")
        again = make_plan(model, loss, optimizer, batch, budget - left, options, margin, verbose, keep)
        return dataclasses.replace(
            again,
            budget_bytes=budget,
            peak_bytes=again.peak_bytes + left,
            left_bytes=again.left_bytes + left,
            table=outcome.table + again.table,
            planning_seconds=time.perf_counter() - started,
        )
    if chosen is None:
        smallest = outcome.smallest()
        raise ValueError(
            f"Nothing fits in {format_bytes(budget)} (measured peaks must stay within {format_bytes(limits.limit)}): "
            f"the smallest peak achievable is {format_bytes(smallest.peak_bytes + left)} ({smallest.config.describe()}"
            + (", measured" if smallest.peaks else ", predicted from its family's measured points")
            + (f", with the {format_bytes(left)} planning left" if left else "")
            + "). A smaller batch, a compact optimizer state (effgrad.compact_state) or float16 help."
        )
    if kept is not None and best is not chosen:
        kept = None  # training runs another family than the one whose accumulators were kept
    seconds = time.perf_counter() - started
    say(f"chose {chosen.config.describe()}: {format_bytes(chosen.measured + left)}, {chosen.seconds:.3f} s/step "
        f"(planned in {seconds:.1f} s)")  # fmt: skip
    return MemoryPlan(
        micro_batches=chosen.config.micro_batches,
        segments=chosen.config.segments,
        peak_bytes=chosen.measured + left,
        seconds_per_step=chosen.seconds,
        budget_bytes=budget,
        table=outcome.table,
        planning_seconds=seconds,
        batch_size=harness.batch,
        floor_bytes=floor,
        left_bytes=left,
        reserve_bytes=reserve,
        plain=chosen.config.plain,
        model=harness.model_for(chosen.config.segments),
        accumulators=kept,
    )


def floor_parts(model, optimizer, batch, options: StepOptions) -> dict[str, int]:
    """What no configuration goes below, by part, counted from shapes (the optimizer built first, its state
    counted as the allocator holds it): weights, optimizer state, the batch, and one gradient where updates
    can run inside backward, else every gradient."""
    state = max(
        harness_lib.build_optimizer(optimizer, model, options.strategy), harness_lib.nbytes(optimizer.variables)
    )
    gradients = [4 * int(v.shape.num_elements()) for v in model.trainable_variables]
    replicas = (options.strategy or tf.distribute.get_strategy()).num_replicas_in_sync
    inside = options.fused_update is not False and not options.private and not fused_update.why_not(replicas, optimizer)
    return {
        "weights": harness_lib.nbytes(model.variables),
        "optimizer state": state,
        "the batch": sum(getattr(a, "nbytes", 0) for a in tf.nest.flatten(batch) if a is not None),
        "one gradient" if inside else "every gradient": max(gradients) if inside else sum(gradients),
    }


def _say(line: str) -> None:
    print(f"effgrad plan: {line}", file=sys.stderr, flush=True)
