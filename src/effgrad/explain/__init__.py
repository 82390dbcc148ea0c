"""Streaming saliency: input-gradient maps for datasets of any size.

`effgrad.saliency` (api.py) and `effgrad.saliency_summary` (summary.py) are
the entry points. Inside: inputs.py (every kind of input as batches),
targets.py (what is explained), wrt.py (what is differentiated: the float
inputs, or a layer's output), methods.py (one class per method),
reductions.py, job.py (the compiled batch function), plan.py (a run checked
before any work), sinks.py (where maps go), engine.py (the streaming loop),
visualize.py (pictures).
"""

from effgrad.explain import visualize
from effgrad.explain.api import saliency
from effgrad.explain.job import SaliencyJob
from effgrad.explain.methods import Gradient, GradientXInput, IntegratedGradients, SaliencyMethod, SmoothGrad
from effgrad.explain.summary import SaliencySummary, saliency_summary

__all__ = [
    "Gradient",
    "GradientXInput",
    "IntegratedGradients",
    "SaliencyJob",
    "SaliencyMethod",
    "SaliencySummary",
    "SmoothGrad",
    "saliency",
    "saliency_summary",
    "visualize",
]
