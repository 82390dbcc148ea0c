"""Optimizer state in fewer bits: int8 block-wise or bfloat16 moments for Keras optimizers.

Adam keeps two float32 numbers per weight, twice the model's own size: in a
fine-tuning step whose gradients are consumed in backward
(``fused_update``) they are the largest thing left. :func:`compact_state`
returns the same optimizer with each slot stored in 8 or 16 bits; each
variable's slots are expanded to float32, updated and compressed again
inside that variable's own update (one XLA-compiled loop over parts of
2^18 numbers that writes the variable in place), so no float32 copy of all
slots exists.

int8 is block-wise (Dettmers et al., "8-bit Optimizers via Block-wise
Quantization", ICLR 2022): the slot is cut into blocks of ``block_size``
numbers, each with its float32 scale (the block's largest magnitude), and
each number ``x`` is stored as one byte ``q`` on a companded (fourth-root)
scale::

    u = |x| / scale                       in [0, 1]
    q = round(L * u ** (1/4))             L = 255 if the block has no negative number, else 127 (and a sign)
    x ~ sign * (q / L) ** 4 * scale       the scale's sign records which of the two L was used

Why companded and not linear: Adam's second moment spans many decades
within a block, and linear codes round its small entries to 0, where
``m / (sqrt(v) + eps)`` explodes. Measured on a trained MLP's slots
(``benchmarks/compact_state.py``): linear codes zeroed 17% of ``v`` and
moved the 99th percentile of the update by 138 (median update 0.2);
bitsandbytes' dynamic-tree map zeroed 1.6% (largest error 5.1); the
fourth-root scale zeroed 0.07% with a largest error of 0.5. It is also
a few multiplies per number and compiles with XLA (no table search).

bfloat16 keeps each slot as a bfloat16 variable (rounded to nearest): half
the bytes, 3 significant digits.

Example:
    >>> import keras, effgrad
    >>> opt = effgrad.compact_state(keras.optimizers.Adam(1e-3), dtype="int8")
    >>> isinstance(opt, keras.optimizers.Adam)
    True
    >>> model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(128)])
    >>> opt.build(model.trainable_variables)
    >>> sorted({str(v.dtype) for v in opt.variables})  # codes, scales, small slots, step
    ['float32', 'int64', 'int8']

Trap:
    Slots of variables smaller than ``min_size`` (biases, norms) stay
    float32: compressing them saves nothing and their scale would cost more.
    Keras's EMA weights (``use_ema``) and its own gradient accumulators stay
    float32 too: they are weights and gradients, not moment estimates.
"""

from effgrad.train.compact.codec import dequantize, quantize
from effgrad.train.compact.optimizer import DTYPES, compact_state, elementwise
from effgrad.train.compact.slot import CompactSlot

__all__ = ["compact_state", "CompactSlot", "quantize", "dequantize", "DTYPES", "elementwise"]
