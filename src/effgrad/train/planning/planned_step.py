"""``build_train_step(micro_batches="auto", memory_budget=...)``: a :class:`TrainStep` that plans first."""

from __future__ import annotations

from effgrad import memory
from effgrad.train.options import StepOptions
from effgrad.train.planning.plan import MemoryPlan, make_plan, plannable
from effgrad.train.step import TrainStep

__all__ = ["PlannedTrainStep"]


class PlannedTrainStep(TrainStep):
    """A :class:`TrainStep` that plans at its first call (when the batch shape is known), then trains as a
    step built with the chosen options: on the plan's ``checkpoint_model`` when it checkpoints, with the
    accumulators the plan's measurements ran with.

    Attributes:
        plan: The :class:`MemoryPlan`, ``None`` before the first call.
        micro_batches: ``"auto"`` until planned, then the chosen number.
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
        self.budget_bytes = memory.parse_budget(memory_budget)
        checked = plannable(StepOptions(**options))
        self._planning = (loss, optimizer, checked, margin, verbose)
        self.plan: MemoryPlan | None = None
        # Until it plans: the plain step (the noise scale's two micro-batches are the plan's to choose).
        self.configure(model, loss, optimizer, checked.replace(noise_scale=False), None)

    @property
    def micro_batches(self):
        return "auto" if self.plan is None else super().micro_batches

    @micro_batches.setter
    def micro_batches(self, value) -> None:
        TrainStep.micro_batches.fset(self, value)

    def choose(self, x, y, sample_weight=None) -> MemoryPlan:
        """Plans for this batch (once) and becomes the chosen step; returns :attr:`plan`."""
        if self.plan is None:
            loss, optimizer, options, margin, verbose = self._planning
            planning = options.replace(on_micro_batch=None)  # metrics are training's, not planning's
            chosen = make_plan(
                self.model, loss, optimizer, (x, y, sample_weight), self.budget_bytes, planning, margin, verbose,
                keep=True,
            )  # fmt: skip
            # The step it planned: the chosen model and options, the accumulators its peaks were measured with.
            chosen_options = options.replace(micro_batches=chosen.micro_batches)
            self.configure(chosen.model, loss, optimizer, chosen_options, chosen.accumulators)
            self.plan = chosen
        return self.plan

    def __call__(self, x, y, sample_weight=None) -> dict:
        if self.plan is None:
            self.choose(x, y, sample_weight)
        return super().__call__(x, y, sample_weight)
