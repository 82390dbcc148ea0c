"""effgrad: gradient computation in TensorFlow/Keras that fits in memory.

Exact gradient accumulation, activation checkpointing, dynamic loss scaling
and streaming saliency behind one compiled train-step builder.
"""

import contextlib as _contextlib
import os as _os
import sys as _sys

from effgrad import _quiet


def _allocator_statistics_on() -> None:
    # effgrad.memory reads the allocator's peak; on CPU TensorFlow only keeps that
    # statistic with its BFC allocator, which it chooses when its context starts (the
    # first op), not at import: `import keras; import effgrad` still gets it.
    if "tensorflow" in _sys.modules:
        from effgrad import _compat

        if _compat.context_started():
            return  # too late: memory.measure says what to do
    _os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")


_allocator_statistics_on()

# Importing everything here registers effgrad's Keras layers, so a .keras file
# that contains them loads after a plain `import effgrad`. `effgrad --help`
# needs none of it: it answers at once instead of loading TensorFlow (7-9 s).
if not _quiet.answering_help():
    with _quiet.stderr_silenced() if _quiet.running_as_command() else _contextlib.nullcontext():
        from effgrad import diagnostics, memory, privacy
        from effgrad.attention import AttentionRouting, attention, efficient_attention
        from effgrad.diagnostics import MemoryMonitor
        from effgrad.explain import saliency, saliency_summary
        from effgrad.remat.activations import ActivationRecompute, recompute_activations
        from effgrad.remat.checkpointing import (
            Checkpoint,
            CheckpointedModel,
            checkpoint,
            checkpoint_model,
            checkpoint_sequential,
        )
        from effgrad.train.builder import build_train_step
        from effgrad.train.compact import compact_state
        from effgrad.train.fit import attach
        from effgrad.train.fused_loss import fused_sparse_cross_entropy
        from effgrad.train.loss_scale import DynamicLossScale, LossScale, NoLossScale, StaticLossScale
        from effgrad.train.options import StepOptions
        from effgrad.train.per_example import per_example_norms
        from effgrad.train.planning.plan import MemoryPlan, plan
        from effgrad.train.step import TrainStep

__version__ = "0.1.0"

__all__ = [
    "ActivationRecompute",
    "AttentionRouting",
    "Checkpoint",
    "CheckpointedModel",
    "DynamicLossScale",
    "LossScale",
    "MemoryMonitor",
    "MemoryPlan",
    "NoLossScale",
    "StaticLossScale",
    "StepOptions",
    "TrainStep",
    "attach",
    "attention",
    "build_train_step",
    "checkpoint",
    "checkpoint_model",
    "checkpoint_sequential",
    "compact_state",
    "diagnostics",
    "efficient_attention",
    "fused_sparse_cross_entropy",
    "memory",
    "per_example_norms",
    "plan",
    "privacy",
    "recompute_activations",
    "saliency",
    "saliency_summary",
]
