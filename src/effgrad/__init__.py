"""effgrad: gradient computation in TensorFlow/Keras that fits in memory.

Exact gradient accumulation, activation checkpointing, dynamic loss scaling
and streaming saliency behind one compiled train-step builder.
"""

import os as _os
import sys as _sys

if "tensorflow" not in _sys.modules:
    # effgrad.memory reads the allocator's peak; on CPU TensorFlow only keeps
    # that statistic with its BFC allocator, chosen at TensorFlow start-up.
    _os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")

from effgrad import memory  # noqa: E402
from effgrad.checkpointing import Checkpoint, checkpoint, checkpoint_sequential  # noqa: E402
from effgrad.explain import saliency, saliency_summary  # noqa: E402
from effgrad.loss_scale import DynamicLossScale, LossScale, NoLossScale, StaticLossScale  # noqa: E402
from effgrad.step import TrainStep, attach, build_train_step  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "Checkpoint",
    "DynamicLossScale",
    "LossScale",
    "NoLossScale",
    "StaticLossScale",
    "TrainStep",
    "attach",
    "build_train_step",
    "checkpoint",
    "checkpoint_sequential",
    "memory",
    "saliency",
    "saliency_summary",
]
