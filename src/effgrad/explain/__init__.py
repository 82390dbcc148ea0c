"""Streaming saliency: input-gradient maps for datasets of any size.

`effgrad.saliency` and `effgrad.saliency_summary` are the entry points; this
package holds the methods, reductions, sinks, engine and visualization.
"""

from effgrad.explain import visualize
from effgrad.explain.engine import SaliencyJob, saliency
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
