"""The planner's search: the fastest configuration whose measured peak fits, in few measurements.

Pure Python: it sees the model only through a :class:`Measurer`, so it runs (and is tested) without
TensorFlow against synthetic memory and time curves.

The model of a step it searches over::

    configuration   (k micro-batches, checkpoint segments s or none)
    family          configurations sharing one trace: the plain step (k = 1, as build_train_step
                    makes it), the micro-batched step (every k, one trace: k is a runtime value),
                    and the micro-batched step of the checkpointed model (every k, k = 1 included)
    peak            within a family, affine in the rows per micro-batch m = ceil(B / k):
                    peak = F + A m  (what scales with the rows is activations; the rest does not)
    time            within a family, growing with k (each micro-batch runs the model once more);
                    recomputing the forward pass costs about a third of a step (backward ~ 2 forward)

The search::

    measure the plain step; it fits: done (nothing else is faster)
    for each other family, fastest first (micro-batched, then checkpointed):
        skip it when it cannot be faster than the best fit measured, or (once a fit is known) when
        looking at it (its trace and a few calls) fits neither in what is left of the planning budget
        (a few default first calls) nor in what it could save over the best fit in a hundred steps
        measure its fastest member on the whole batch (its trace) and a near point (1/16 of the batch
        per micro-batch, on a slice of the batch: the same trace)
        repeat: fit F and A to the family's points (through the two around the limit where one lies
                within it); measure the fewest micro-batches predicted to fit (the prediction kept a
                margin below the limit); a fit ends the family, a peak over the limit is one more point
                of its line; where the line says nothing fits (and nothing has fit yet), one row per
                micro-batch is measured on a slice (and on the whole batch where the slice is within
                the limit's reach) before the family is given up: peaks need not be affine in the rows
    nothing fits: refuse, naming the smallest peak (every family's one row per micro-batch measured)
    choose the fastest measured fit; within timing noise, the simpler one

A measured peak fits when it and the spread of its steady calls stay within the limit (the call that
traced a family is in the peak, not in the spread: what tracing holds once does not recur); a peak at
the edge (within the prediction margin of the limit) is called up to twice more, since training's calls
can go higher than two did.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from typing import Protocol

__all__ = ["Calibration", "Config", "Calls", "Limits", "Measurer", "Candidate", "Outcome", "search"]


@dataclasses.dataclass(frozen=True)
class Calibration:
    """Every number the search assumes, with what it means.

    Attributes:
        recompute_share: What recomputing the forward pass adds to a step, as a share of the step (a
            backward pass costs about two forward passes): a checkpointed family is at best this much
            slower than the plain step.
        same_speed: Measured times within this share of each other are equally fast (timing noise of a
            loaded host), or within ``jitter_seconds`` (a small step's dispatch noise).
        jitter_seconds: See ``same_speed``.
        planning_budget: Once a fit is known, planning goes on while it stays within this many first calls
            (trace and call) of the plain step, or while looking at a family (its trace and calls) would
            be repaid within ``repay_steps`` steps by the time it could save over the best fit.
        repay_steps: See ``planning_budget``.
        near_fraction: The near point of a family's line: ``1 / near_fraction`` of the batch per
            micro-batch (far from the first point, so the allocator's noise does not set the slope).
        edge_calls: Calls more for a peak at the edge of the limit.
        family_calls: The calls looking at a family takes beyond its first, each counted as its fastest
            step could be: a near point and two calls of the configuration predicted to fit (the search's
            own count, where the family's first configuration does not fit).
    """

    recompute_share: float = 1 / 3
    same_speed: float = 0.05
    jitter_seconds: float = 0.005
    planning_budget: float = 4.0
    repay_steps: int = 100
    near_fraction: int = 16
    edge_calls: int = 2
    family_calls: int = 3


@dataclasses.dataclass(frozen=True)
class Config:
    """One configuration: ``micro_batches`` and ``segments``; ``plain`` is the step without accumulators."""

    micro_batches: int
    segments: int | None = None
    plain: bool = False

    @property
    def family(self) -> tuple[bool, int | None]:
        return self.plain, self.segments

    def describe(self) -> str:
        return f"micro_batches={self.micro_batches}, segments={self.segments or '-'}" + (
            " (the plain step)" if self.plain else ""
        )


@dataclasses.dataclass(frozen=True)
class Calls:
    """What calls of one configuration measured."""

    peaks: list[int]  # each call's peak, as on the whole batch (resident state counted from shapes)
    seconds: float | None  # the fastest timed call; None when no call was timed
    trace_seconds: float | None = None  # the first call less a call's time, when it traced


@dataclasses.dataclass(frozen=True)
class Limits:
    """What peaks must stay within, in bytes: ``limit`` for measured peaks (with their calls' spread),
    ``sure`` (below it) for predictions, whose error the difference absorbs."""

    budget: int
    limit: int
    sure: int


class Measurer(Protocol):
    """What the search measures through (:class:`effgrad.train.planning.harness.Harness` with TensorFlow)."""

    batch: int  # rows of the batch planned for
    can_slice: bool  # a family's peak on its first rows stands for the whole batch's (one trace)

    def measure(self, config: Config, calls: int, rows: int | None = None, stop_above: float | None = None) -> Calls:
        """``calls`` calls of ``config`` on the batch's first ``rows`` rows (all: None); the calls stop
        after a peak above ``stop_above``. A family's first call traces it."""
        ...


@dataclasses.dataclass
class Candidate:
    """One row of the plan's table."""

    config: Config
    predicted: int | None = None
    peaks: list[int] = dataclasses.field(default_factory=list)
    seconds: float | None = None
    fits: bool | None = None
    note: str = ""
    traced: bool = False  # its first call traced the family

    @property
    def measured(self) -> int | None:
        return max(self.peaks) if self.peaks else None

    @property
    def spread(self) -> int:
        """How far apart its steady calls' peaks lie: a tracing call's excess is in the peak and does not recur."""
        steady = self.peaks[1:] if self.traced else self.peaks
        return max(steady) - min(steady) if len(steady) > 1 else 0

    @property
    def peak_bytes(self) -> int | None:
        return self.measured if self.peaks else self.predicted


@dataclasses.dataclass
class Outcome:
    """The search's table, and what it chose within what planning left on the device."""

    table: list[Candidate]
    limits: Limits
    calibration: Calibration

    def fits(self, left: int = 0) -> list[Candidate]:
        """Measured, timed fits that still fit next to ``left`` bytes planning left on the device."""
        return [
            c for c in self.table
            if c.fits and c.seconds is not None and c.measured + c.spread + left <= self.limits.limit
        ]  # fmt: skip

    def chosen(self, left: int = 0) -> Candidate | None:
        """The fastest fit; within timing noise of it, the simplest (fewest segments, fewest micro-batches)."""
        fits = self.fits(left)
        if not fits:
            return None
        fastest = min(c.seconds for c in fits)
        close = [c for c in fits if same_speed(c.seconds, fastest, self.calibration)]
        return min(close, key=lambda c: (c.config.segments or 0, c.config.micro_batches, not c.config.plain))

    def smallest(self) -> Candidate | None:
        """The configuration with the smallest peak, measured or (never measured) predicted: a refusal names it."""
        known = [c for c in self.table if c.peak_bytes is not None]
        return min(known, key=lambda c: c.peak_bytes, default=None)


def same_speed(seconds: float, fastest: float, calibration: Calibration) -> bool:
    return seconds <= max(fastest * (1 + calibration.same_speed), fastest + calibration.jitter_seconds)


def search(
    measurer: Measurer,
    limits: Limits,
    *,
    segments: tuple[int, ...] = (),
    plain: bool = True,
    calibration: Calibration = Calibration(),
    clock: Callable[[], float] = time.perf_counter,
) -> Outcome:
    """Searches as the module docstring says; ``segments``: the checkpointed families (none: no
    checkpointing); ``plain=False``: the plain step is not an option (the noise scale needs two
    micro-batches)."""
    return _Search(measurer, limits, calibration, clock).run(plain, segments)


class _Search:
    def __init__(self, measurer: Measurer, limits: Limits, calibration: Calibration, clock):
        self.measurer, self.limits, self.calibration, self.clock = measurer, limits, calibration, clock
        self.batch = measurer.batch
        self.candidates: dict[Config, Candidate] = {}
        self.points: dict[int | None, list[tuple[int, int]]] = {}  # segments -> [(rows per micro-batch, peak)]
        self.started = clock()
        self.first_call: float | None = None  # the plain step's (or the first family's) trace and call

    def run(self, plain: bool, segments: tuple[int, ...]) -> Outcome:
        if plain and self.verify(Config(1, plain=True)).fits:
            return self.outcome()
        for s in (None, *segments):
            if self.worth(s):
                self.explore(s, first=2 if s is None or not plain else 1)
        return self.outcome()

    def outcome(self) -> Outcome:
        table = sorted(self.candidates.values(), key=lambda c: (c.config.segments or 0, c.config.micro_batches))
        return Outcome(table, self.limits, self.calibration)

    # ---------------------------------------------------------------- measuring
    def verify(self, config: Config) -> Candidate:
        """``config`` measured on the whole batch: two calls, up to ``edge_calls`` more at the edge."""
        c = self.candidates.setdefault(config, Candidate(config))
        if c.peaks:
            return c
        limit, sure = self.limits.limit, self.limits.sure
        # The plain step is timed even when over the limit: its time is what every family is weighed against.
        calls = self.measurer.measure(config, 2, stop_above=None if config.plain else limit)
        c.peaks, c.seconds, c.traced = list(calls.peaks), calls.seconds, calls.trace_seconds is not None
        if calls.trace_seconds is not None and self.first_call is None and calls.seconds is not None:
            self.first_call = calls.trace_seconds + calls.seconds
        for _ in range(self.calibration.edge_calls):
            if not sure < c.measured <= limit or c.measured + c.spread > limit:
                break
            more = self.measurer.measure(config, 1)
            c.peaks += more.peaks
            if more.seconds is not None:
                c.seconds = more.seconds if c.seconds is None else min(c.seconds, more.seconds)
        c.fits = c.measured + c.spread <= limit and c.seconds is not None
        if not c.fits:
            c.note = "over the limit" if c.measured > limit else "over the limit with its calls' spread"
        if not config.plain:
            self.points.setdefault(config.segments, []).append((self.rows(config.micro_batches), c.measured))
        return c

    def rows(self, micro_batches: int) -> int:
        return math.ceil(self.batch / micro_batches)

    # ------------------------------------------------------------------ families
    def worth(self, segments: int | None) -> bool:
        """Whether a family could be faster than the best fit, looking at it within the planning budget."""
        best = self.outcome().chosen()
        if best is None:
            return True  # nothing fits yet: every family is looked at
        timed = [c.seconds for c in self.candidates.values() if c.seconds is not None and not c.config.segments]
        slower = 1 + (self.calibration.recompute_share if segments else 0)
        optimistic = min(timed) * slower
        if same_speed(best.seconds, optimistic, self.calibration):
            return False
        # Its trace and call (the first call's, recomputing included), then the calls finding its fit.
        cost = (self.first_call or 0) * slower + self.calibration.family_calls * optimistic
        within = self.clock() - self.started + cost <= self.calibration.planning_budget * (self.first_call or math.inf)
        return within or (best.seconds - optimistic) * self.calibration.repay_steps > cost

    def explore(self, segments: int | None, first: int) -> None:
        """The fewest micro-batches of one family that fit, from the line of its measured points."""
        if self.verify(Config(first, segments)).fits:
            return
        far = self.rows(first)
        near = max(1, math.ceil(self.batch / self.calibration.near_fraction))
        near = near if near < far else max(1, far // 4)
        if near < far:
            self.near_point(segments, near)
        over = first
        while True:
            k = self.fewest_predicted(segments, over)
            if (
                k is None
                and self.outcome().chosen() is None
                and over < self.batch
                and 1 not in dict(self.points[segments])
            ):
                # Refused on a measurement, not on the line alone: a peak need not be affine in the rows
                # (one row per micro-batch can hold much less than the line through larger ones says).
                # Within the limit's reach on a slice, the whole batch at one row per micro-batch decides.
                self.near_point(segments, 1)
                limit, sure = self.limits.limit, self.limits.sure
                if dict(self.points[segments])[1] <= limit + (limit - sure):
                    if self.verify(Config(self.batch, segments)).fits:
                        return
                k = self.fewest_predicted(segments, over)
            if k is None:
                return
            c = self.verify(Config(k, segments))
            if c.fits or k >= self.batch:
                return
            over = k

    def near_point(self, segments: int | None, rows: int) -> None:
        """A point of the family's line at ``rows`` rows per micro-batch: two micro-batches of a slice of the
        batch (a peak depends on the rows per micro-batch, not on their number), or, where a slice cannot
        stand for the batch (XLA, several replicas), a configuration on the whole batch."""
        k = math.ceil(self.batch / rows)
        if not self.measurer.can_slice or 2 * rows >= self.batch:
            self.verify(Config(k, segments))
            return
        calls = self.measurer.measure(Config(2, segments), 1, rows=2 * rows)
        self.points.setdefault(segments, []).append((rows, max(calls.peaks)))
        # What the configuration with these rows per micro-batch would hold (a refusal may name it).
        self.candidates.setdefault(Config(k, segments), Candidate(Config(k, segments))).predicted = max(calls.peaks)

    def line(self, segments: int | None) -> tuple[float, float]:
        """``(F, A)`` of ``peak = F + A m``, ``A >= 0``: through the two measured points around the limit
        where one lies within it (the most rows within it, the fewest over it); else least squares over
        the family's points."""
        points = self.points[segments]
        within = [(r, v) for r, v in points if v <= self.limits.sure]
        if within:
            m0, p0 = max(within)
            over = [(r, v) for r, v in points if r > m0 and v > self.limits.sure]
            if over:
                m1, p1 = min(over)
                slope = max(0.0, (p1 - p0) / (m1 - m0))
                return p0 - slope * m0, slope
        m = [float(r) for r, _ in points]
        p = [float(v) for _, v in points]
        mean_m, mean_p = sum(m) / len(m), sum(p) / len(p)
        var = sum((x - mean_m) ** 2 for x in m)
        slope = max(0.0, sum((x - mean_m) * (y - mean_p) for x, y in zip(m, p)) / var) if var else 0.0
        return mean_p - slope * mean_m, slope

    def fewest_predicted(self, segments: int | None, over: int) -> int | None:
        """The fewest micro-batches, with fewer rows each than ``over`` (measured over the limit), predicted
        to fit; else one row per micro-batch when even that is predicted within the prediction margin's
        reach of the limit (the prediction may err that much); else None: the family cannot fit."""
        fixed, per_row = self.line(segments)
        sure, limit = self.limits.sure, self.limits.limit
        if per_row > 0:
            most_rows = math.floor((sure - fixed) / per_row)
        else:
            most_rows = self.batch if fixed <= sure else 0
        k = max(over + 1, math.ceil(self.batch / most_rows)) if most_rows >= 1 else self.batch + 1
        while k <= self.batch and self.rows(k) >= self.rows(over):
            k += 1  # the same rows per micro-batch as one measured over the limit
        if k > self.batch:
            if over >= self.batch or fixed + per_row > limit + (limit - sure):
                return None
            k = self.batch  # one row per micro-batch, predicted within the prediction's error of the limit
        candidate = self.candidates.setdefault(Config(k, segments), Candidate(Config(k, segments)))
        candidate.predicted = int(fixed + per_row * self.rows(k))
        return k
