"""The planner's search against synthetic memory and time curves: no model, no TensorFlow in the search.

A fake measurer gives each family an affine peak in the rows per micro-batch and a time growing with the
number of micro-batches, with a clock that advances by what each call and trace would cost. Every outcome
is checked against brute force over the whole search space.
"""

import dataclasses
import math

import numpy as np
import pytest

from effgrad.train.planning.search import Calibration, Calls, Config, Limits, search

MIB = 2**20


@dataclasses.dataclass
class Family:
    fixed: float  # bytes
    per_row: float  # bytes per row of a micro-batch
    seconds: float  # a step's time with one micro-batch
    per_micro: float  # seconds more per micro-batch
    trace: float  # seconds of its trace
    trace_bytes: float = 0.0  # what the call that traces holds more, once
    knee: float = 0.0  # what micro-batches of more than one row hold more (peaks not affine in the rows)


class FakeMeasurer:
    """Families keyed by segments (None: not checkpointed); the plain step is ``plain`` (k = 1 only)."""

    def __init__(self, batch, families, plain=None, can_slice=True, noise=0.0, seed=0):
        self.batch, self.families, self.plain, self.can_slice = batch, families, plain, can_slice
        self.noise, self.rng = noise, np.random.default_rng(seed)
        self.now, self.traced, self.calls = 0.0, set(), []

    def family(self, config):
        return self.plain if config.plain else self.families[config.segments]

    def peak(self, config, rows=None):
        f = self.family(config)
        per_micro = math.ceil((rows or self.batch) / config.micro_batches)
        return f.fixed + f.per_row * per_micro + (f.knee if per_micro > 1 else 0.0)

    def seconds(self, config):
        f = self.family(config)
        return f.seconds + f.per_micro * (config.micro_batches - 1)

    def clock(self):
        return self.now

    def measure(self, config, calls, rows=None, stop_above=None):
        peaks, seconds, trace = [], None, None
        if config.family not in self.traced:
            self.traced.add(config.family)
            trace = self.family(config).trace
            self.now += trace
        for _ in range(calls):
            if stop_above is not None and peaks and peaks[-1] > stop_above:
                break
            extra = self.family(config).trace_bytes if trace is not None and not peaks else 0.0
            peaks.append(int((self.peak(config, rows) + extra) * (1 + self.noise * self.rng.uniform(-1, 1))))
            self.now += self.seconds(config)
            seconds = self.seconds(config) if seconds is None else seconds
        if trace is not None and len(peaks) == 1 and stop_above is not None and peaks[0] > stop_above:
            seconds = None  # the tracing call was over: no timed call
        self.calls.append((config, rows))
        return Calls(peaks, seconds, trace)

    def every_fit(self, limit, segments, plain=True):
        """Brute force: (seconds, config) of every configuration whose true peak fits."""
        configs = [Config(1, plain=True)] if plain and self.plain else []
        for s in (None, *segments):
            configs += [Config(k, s) for k in range(1 if s else 2, self.batch + 1)]
        return sorted((self.seconds(c), c.micro_batches, c) for c in configs if self.peak(c) <= limit)


def _limits(budget, margin=0.1):
    limit = int(budget * (1 - margin / 2))
    return Limits(int(budget), limit, int(limit - margin / 2 * budget))


# A CNN-like model at batch 64: the plain step 120 MiB, activations 1.4 MiB a row; checkpointing keeps a third.
def _cnn(batch=64, **changes):
    families = {
        None: Family(fixed=20 * MIB, per_row=1.4 * MIB, seconds=1.0, per_micro=0.02, trace=3.0),
        3: Family(fixed=24 * MIB, per_row=0.45 * MIB, seconds=1.35, per_micro=0.02, trace=4.0),
    }
    plain = Family(fixed=18 * MIB + 1.4 * MIB * batch, per_row=0, seconds=1.0, per_micro=0, trace=3.0)
    return FakeMeasurer(batch, families, plain, **changes)


def _run(fake, budget, segments=(3,), plain=True):
    return search(fake, _limits(budget), segments=segments, plain=plain, clock=fake.clock)


def test_a_roomy_budget_measures_the_plain_step_only():
    fake = _cnn()
    outcome = _run(fake, 200 * MIB)
    assert outcome.chosen().config == Config(1, plain=True)
    assert [c for c, _ in fake.calls] == [Config(1, plain=True)]


@pytest.mark.parametrize("budget_mib", [110, 80, 50, 38])
def test_the_choice_fits_and_is_the_fastest_fitting_configuration(budget_mib):
    fake = _cnn()
    outcome = _run(fake, budget_mib * MIB)
    chosen = outcome.chosen()
    limits = _limits(budget_mib * MIB)
    fits = fake.every_fit(limits.sure, (3,))
    assert chosen is not None and fake.peak(chosen.config) <= limits.limit
    fastest = fits[0][0]
    assert fake.seconds(chosen.config) <= fastest * 1.05 + 0.005, (chosen.config, fits[:3])


def test_micro_batches_found_with_a_trace_and_a_few_calls():
    fake = _cnn()
    _run(fake, 80 * MIB)
    assert len(fake.traced) == 2  # the plain step and the micro-batched family: no checkpointing needed
    assert len(fake.calls) <= 5, fake.calls


def test_checkpointing_is_traced_only_where_it_could_be_faster():
    # 80 MiB: 2 micro-batches fit at 1.02 s, and checkpointing costs 1.35 s at best: not traced.
    fake = _cnn()
    _run(fake, 80 * MIB)
    assert (False, 3) not in fake.traced
    # 30 MiB: micro-batches alone need 8 or more (1.14 s+); checkpointing's best is slower: still not traced.
    fake = _cnn()
    outcome = _run(fake, 33 * MIB)
    assert outcome.chosen().config.segments is None and (False, 3) not in fake.traced
    # Expensive micro-batches (0.2 s each): 8 of them cost 2.4 s, checkpointing (1.35 s at one) is worth it.
    fake = _cnn()
    fake.families[None].per_micro = fake.families[3].per_micro = 0.2
    outcome = _run(fake, 33 * MIB)
    assert outcome.chosen().config.segments == 3


def test_a_family_whose_trace_would_not_be_repaid_is_skipped_once_a_fit_is_known():
    # Micro-batches fit at 1.42 s; checkpointing could at best take 1.33 s: 0.09 s a step, which 10 steps do
    # not repay a trace with, and planning has used its budget of one first call.
    fake = _cnn()
    fake.families[None].per_micro = fake.families[3].per_micro = 0.047
    calibration = Calibration(planning_budget=1.0, repay_steps=10)
    outcome = search(fake, _limits(33 * MIB), segments=(3,), calibration=calibration, clock=fake.clock)
    assert outcome.chosen().config.segments is None and (False, 3) not in fake.traced
    # With 100 steps to repay it (the default), the same trace is worth it.
    fake = _cnn()
    fake.families[None].per_micro = fake.families[3].per_micro = 0.047
    search(fake, _limits(33 * MIB), segments=(3,), calibration=Calibration(planning_budget=1.0), clock=fake.clock)
    assert (False, 3) in fake.traced


def test_the_planning_budget_counts_the_calls_that_look_at_a_family_not_only_its_trace():
    # A recurrent-like model: a call (2.8 s) costs more than a trace (2.2 s). Micro-batches fit at 4 (4.9 s a
    # step) after 26.8 s; checkpointing costs its trace and then calls of at least 3.7 s each, which the
    # budget of eight first calls (40 s) has no room for. Counting its trace only, the search looked and
    # ended at 46.6 s.
    families = {
        None: Family(fixed=20 * MIB, per_row=1.0 * MIB, seconds=2.8, per_micro=0.7, trace=2.2),
        3: Family(fixed=24 * MIB, per_row=0.3 * MIB, seconds=3.7, per_micro=0.7, trace=2.9),
    }
    fake = FakeMeasurer(64, families, Family(84 * MIB, 0, 2.8, 0, 2.2))
    calibration = Calibration(planning_budget=8, repay_steps=0)  # the budget alone decides
    outcome = search(fake, _limits(40 * MIB), segments=(3,), calibration=calibration, clock=fake.clock)
    assert outcome.chosen().config == Config(4)
    assert (False, 3) not in fake.traced and fake.now <= 8 * (2.2 + 2.8)


def test_where_only_checkpointing_fits_it_is_found():
    # A densely connected CNN at a third of its peak: micro-batches never get below 40 MiB (a constant the
    # rows do not shrink), checkpointing with 8 micro-batches does.
    families = {
        None: Family(fixed=40 * MIB, per_row=1.0 * MIB, seconds=1.0, per_micro=0.03, trace=5.0),
        6: Family(fixed=30 * MIB, per_row=0.5 * MIB, seconds=1.4, per_micro=0.03, trace=7.0),
    }
    fake = FakeMeasurer(32, families, Family(72 * MIB, 0, 1.0, 0, 5.0))
    limits = _limits(38 * MIB)
    outcome = search(fake, limits, segments=(6,), clock=fake.clock)
    chosen = outcome.chosen()
    assert chosen.config.segments == 6 and fake.peak(chosen.config) <= limits.limit
    assert chosen.config.micro_batches == fake.every_fit(limits.sure, (6,))[0][2].micro_batches


@pytest.mark.parametrize("can_slice", [True, False])
@pytest.mark.parametrize("fixed_mib", [40, 45.97])  # one row: well within the limit; between sure and limit
def test_a_family_is_given_up_on_a_measurement_not_on_a_line_its_peaks_do_not_follow(can_slice, fixed_mib):
    # A small CNN at batch 256: micro-batches of 2+ rows hold 22 MiB more than one of one row (measured on
    # such a model: 64.4 MiB at 16 rows a micro-batch, 42.1 at one). The line through 128 and 16 rows
    # says even one row cannot fit 50 MiB; one row a micro-batch does.
    families = {None: Family(fixed=fixed_mib * MIB, per_row=0.03 * MIB, seconds=0.05, per_micro=0.001, trace=1.0,
                             knee=22 * MIB)}  # fmt: skip
    fake = FakeMeasurer(256, families, Family(70 * MIB, 0, 0.05, 0, 1.0), can_slice=can_slice)
    limits = _limits(50 * MIB)
    assert fake.every_fit(limits.limit, ())  # something fits: one row per micro-batch
    chosen = search(fake, limits, segments=(), clock=fake.clock).chosen()
    assert chosen is not None and fake.peak(chosen.config) <= limits.limit
    assert chosen.config.micro_batches == 256


def test_it_refuses_only_when_nothing_fits_and_names_the_smallest_peak():
    fake = _cnn()
    outcome = _run(fake, 21 * MIB)  # below every family's fixed part
    limits = _limits(21 * MIB)
    assert outcome.chosen() is None and not fake.every_fit(limits.limit, (3,))
    smallest = outcome.smallest()
    assert smallest is not None and smallest.peak_bytes > limits.limit
    assert len(fake.calls) <= 8  # it stops: the lines rule the rest out


def test_a_recurrent_model_with_a_large_fixed_part_is_planned_in_few_calls():
    # An LSTM classifier: the state and gates of every step hold most of the peak; rows matter little.
    families = {None: Family(fixed=90 * MIB, per_row=0.3 * MIB, seconds=2.0, per_micro=0.05, trace=6.0)}
    fake = FakeMeasurer(128, families, Family(90 * MIB + 0.3 * MIB * 128, 0, 2.0, 0, 6.0))
    outcome = search(fake, _limits(115 * MIB), segments=(), clock=fake.clock)
    assert outcome.chosen() is not None and len(fake.calls) <= 5
    assert fake.now <= 4 * (6.0 + 2.0) + 2.0  # within the planning budget's four first calls (and a step)


def test_peaks_at_the_edge_are_called_again_and_their_spread_counts():
    fake = _cnn(noise=0.03, seed=1)
    limits = _limits(80 * MIB)
    outcome = search(fake, limits, segments=(3,), clock=fake.clock)
    for c in outcome.table:
        if c.peaks and limits.sure < c.measured <= limits.limit:
            assert len(c.peaks) > 2 or c.measured + c.spread > limits.limit
        if c.fits:
            assert c.measured + c.spread <= limits.limit


def test_what_the_tracing_call_holds_once_counts_in_the_peak_but_not_as_spread():
    fake = _cnn()
    fake.plain = dataclasses.replace(fake.plain, trace_bytes=6 * MIB)
    plain_peak = fake.peak(Config(1, plain=True))
    limits = _limits((plain_peak + 9 * MIB) / 0.95)  # the tracing call's peak fits; counted twice, it would not
    outcome = search(fake, limits, segments=(3,), clock=fake.clock)
    assert outcome.chosen().config == Config(1, plain=True)
    assert outcome.chosen().measured == int(plain_peak + 6 * MIB)
    tight = _limits((plain_peak + 3 * MIB) / 0.95)  # only the steady calls would fit: the tracing call counts
    assert search(_cnn(), tight, segments=(3,), clock=fake.clock).chosen().config == Config(1, plain=True)
    fake = _cnn()
    fake.plain = dataclasses.replace(fake.plain, trace_bytes=6 * MIB)
    assert search(fake, tight, segments=(3,), clock=fake.clock).chosen().config != Config(1, plain=True)


def test_without_slices_the_near_point_is_a_configuration_on_the_whole_batch():
    fake = _cnn(can_slice=False)
    _run(fake, 50 * MIB)
    assert all(rows is None for _, rows in fake.calls)


def test_the_noise_scale_plans_from_two_micro_batches():
    fake = _cnn()
    outcome = _run(fake, 200 * MIB, plain=False)
    assert outcome.chosen().config.micro_batches >= 2
    assert all(not c.plain and (c.segments is not None or c.micro_batches >= 2) for c, _ in fake.calls)


@pytest.mark.parametrize("seed", range(40))
def test_random_problems_fit_and_are_near_the_fastest_or_refused_only_when_nothing_fits(seed):
    r = np.random.default_rng(seed)
    batch = int(r.choice([8, 16, 32, 64, 128]))
    per_row = float(r.uniform(0.05, 4)) * MIB
    fixed = float(r.uniform(5, 200)) * MIB
    seconds = float(r.uniform(0.01, 3))
    families = {None: Family(fixed, per_row, seconds, seconds * float(r.uniform(0.005, 0.2)), seconds * 3)}
    segments = ()
    if r.random() < 0.7:
        segments = (int(r.integers(2, 8)),)
        share, fewer = float(r.uniform(0.2, 0.5)), float(r.uniform(0.2, 0.6))
        families[segments[0]] = Family(
            fixed * float(r.uniform(0.8, 1.2)), per_row * fewer, seconds * (1 + share), families[None].per_micro,
            seconds * 4,
        )  # fmt: skip
    plain = Family(fixed * float(r.uniform(0.9, 1.0)) + per_row * batch, 0, seconds, 0, seconds * 3)
    fake = FakeMeasurer(batch, families, plain)
    plain_peak = fake.peak(Config(1, plain=True))
    budget = float(r.uniform(0.3, 1.3)) * plain_peak
    limits = _limits(budget)
    outcome = search(fake, limits, segments=segments, clock=fake.clock)
    chosen = outcome.chosen()
    if chosen is None:
        assert not fake.every_fit(limits.sure, segments), "refused though a configuration fits with the margin"
        return
    assert fake.peak(chosen.config) <= limits.limit
    fits = fake.every_fit(limits.sure, segments)
    if fits:  # the fastest among those predicted to fit with the margin
        assert fake.seconds(chosen.config) <= fits[0][0] * 1.05 + 0.005 + fake.families[None].per_micro, (
            chosen.config, fits[:3],
        )  # fmt: skip
