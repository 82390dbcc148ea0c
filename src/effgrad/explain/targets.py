"""What a saliency map explains: the target output of each example.

A target is resolved once, before any work, into a :class:`Target`: its
:class:`TargetMode`, the checked value, and a JSON-able identity the resume
journal stores (so a resume with another target is refused).

=================  ==========================================================
``None``           each example's arg-max output (the output itself for a
                   model with one output unit)
``int``            that output unit for every example
``int array [N]``  one output unit per example
``callable``       ``callable(outputs) -> [B]`` scores, any differentiable
                   function of the model's outputs (several outputs too)
=================  ==========================================================
"""

from __future__ import annotations

import enum
import hashlib
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import tensorflow as tf

__all__ = ["TargetMode", "Target", "resolve", "outputs_function", "output_units", "score_function"]


class TargetMode(enum.Enum):
    ARGMAX = "argmax"
    FIXED = "fixed"
    PER_EXAMPLE = "per_example"
    CALLABLE = "callable"


@dataclass(frozen=True)
class Target:
    """A checked target.

    Attributes:
        mode: How the score of each example is chosen.
        value: The int (``FIXED``), the callable (``CALLABLE``), else ``None``.
        indices: ``int32 [N]`` per-example units (``PER_EXAMPLE``), else ``None``.
    """

    mode: TargetMode
    value: Any = None
    indices: np.ndarray | None = None

    def identity(self):
        """JSON-able identity: what a resumed run must match."""
        if self.mode is TargetMode.FIXED:
            return int(self.value)
        if self.mode is TargetMode.PER_EXAMPLE:
            return {"per_example": hashlib.sha1(self.indices).hexdigest()}
        if self.mode is TargetMode.CALLABLE:
            return {"callable": _callable_checksum(self.value)}
        return self.mode.value

    def job_key(self):
        """What distinguishes compiled jobs: per-example indices are an input of the job,
        a callable is part of it (by identity: a new lambda is a new function)."""
        if self.mode is TargetMode.CALLABLE:
            return ("callable", id(self.value))
        return (self.mode.value, int(self.value) if self.mode is TargetMode.FIXED else None)


def outputs_function(model, output=None):
    """``fn(inputs) -> outputs`` of ``model`` in inference mode, or of its output ``output``
    (a name or an index) when it has several; checked by :func:`resolve`."""
    if output is None:
        return lambda inputs: model(inputs, training=False)
    if isinstance(output, bool) or not isinstance(output, (int, np.integer, str)):
        raise TypeError(f"output must be an output's name or index, got {output!r}.")

    def select(inputs):
        outputs = model(inputs, training=False)
        return _pick(outputs, output, list(getattr(model, "output_names", None) or []))

    return select


def _pick(outputs, output, names: list):
    if isinstance(outputs, dict):
        keys = list(outputs)
        key = output if isinstance(output, str) else (keys[output] if -len(keys) <= output < len(keys) else None)
        if key in outputs:
            return outputs[key]
        valid = keys
    else:
        flat = list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]
        names = names if len(names) == len(flat) else []
        index = names.index(output) if output in names else output
        if isinstance(index, (int, np.integer)) and -len(flat) <= index < len(flat):
            return flat[index]
        valid = names or list(range(len(flat)))
    raise ValueError(f"The model has no output {output!r}; its outputs are {', '.join(map(repr, valid))}.")


def output_units(outputs_fn, sample) -> int:
    """Number of output units of the explained output (probed on one example)."""
    outputs = outputs_fn(tf.nest.map_structure(tf.convert_to_tensor, sample))
    if not tf.is_tensor(outputs):
        raise ValueError(
            "The model has several outputs; say which one to explain with output=NAME_OR_INDEX "
            "(--output on the command line), or pass target=callable(outputs) -> [batch] scores."
        )
    return int(np.prod(outputs.shape[1:])) if outputs.shape.rank > 1 else 1


def resolve(target, outputs_fn, sample, num_examples: int | None) -> Target:
    """Checks ``target`` against the explained outputs; raises before any work."""
    if callable(target):
        return Target(TargetMode.CALLABLE, target)
    units = output_units(outputs_fn, sample)
    if target is None:
        return Target(TargetMode.ARGMAX)
    if isinstance(target, (int, np.integer)) and not isinstance(target, bool):
        if not 0 <= target < units:
            raise ValueError(f"target={target} is out of range: the model has {units} output unit(s) (0..{units - 1}).")
        return Target(TargetMode.FIXED, int(target))
    indices = np.asarray(target)
    if indices.ndim != 1 or not np.issubdtype(indices.dtype, np.integer):
        raise TypeError("target must be None, an int, an int array [N] or a callable(outputs) -> [batch] scores.")
    if num_examples is not None and len(indices) != num_examples:
        raise ValueError(f"target has {len(indices)} entries but there are {num_examples} examples.")
    bad = (indices < 0) | (indices >= units)
    if bad.any():
        raise ValueError(
            f"target[{int(np.argmax(bad))}] = {indices[bad][0]} is out of range: the model has {units} output unit(s)."
        )
    return Target(TargetMode.PER_EXAMPLE, indices=np.ascontiguousarray(indices, dtype="int32"))


def score_function(forward, target: Target, indices, chosen: list | None = None):
    """``score_fn(points) -> [rows]``: each row's target output.

    ``forward(points)`` runs the model on the differentiated tensors
    ``points`` (see :mod:`effgrad.explain.wrt`), which may hold several copies
    of the batch stacked along rows (noise samples, path points); ``indices``
    (the batch's target units, ``[B]``) repeat with them. With
    ``indices=None`` the target is the arg-max of this same (differentiated)
    forward pass, appended to ``chosen``.
    """

    def score_fn(points):
        outputs = forward(points)
        if target.mode is TargetMode.CALLABLE:
            return target.value(outputs)
        rows = tf.shape(outputs)[0]
        flat = tf.reshape(tf.cast(outputs, tf.float32), [rows, -1])
        if indices is None:
            units = tf.stop_gradient(tf.cast(tf.argmax(flat, axis=-1), tf.int32))  # 0 for one output unit
            chosen.append(units)
        else:
            units = tf.tile(indices, [rows // tf.shape(indices)[0]])
        return tf.gather(flat, units, batch_dims=1)

    return score_fn


def _callable_checksum(fn) -> str:
    """Name, bytecode and the values it reads: captured cells, defaults and the globals it names
    (numbers, strings, NumPy scalars and arrays by value; anything else by its type)."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return type(fn).__qualname__
    names = getattr(fn, "__globals__", {})
    captured = [c.cell_contents for c in fn.__closure__ or ()] + list(fn.__defaults__ or ())
    captured += [names[name] for name in code.co_names if name in names]
    data = repr((_code_key(code), [_value_key(v) for v in captured])).encode()
    return f"{fn.__qualname__}:{zlib.crc32(data):08x}"


def _code_key(code):
    """Bytecode, names and constants, nested functions' code included (a code object's repr holds its
    address, which differs from process to process)."""
    consts = tuple(_code_key(c) if hasattr(c, "co_code") else repr(c) for c in code.co_consts)
    return (code.co_code, code.co_names, consts)


def _value_key(value):
    """What of ``value`` a target's identity records."""
    if isinstance(value, (int, float, str, bool, type(None))):
        return value
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return (value.dtype.str, value.shape, zlib.crc32(np.ascontiguousarray(value).tobytes()))
    return type(value).__name__
