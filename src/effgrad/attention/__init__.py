"""Memory-efficient exact attention: the kernel (:func:`effgrad.attention`) and the routing of
Keras/keras_hub attention layers to it (:func:`effgrad.efficient_attention`, ``attention=`` on a step)."""

from effgrad.attention.kernel import attention, dropout_keep_mask
from effgrad.attention.routing import AttentionRouting, efficient_attention

__all__ = ["AttentionRouting", "attention", "dropout_keep_mask", "efficient_attention"]
