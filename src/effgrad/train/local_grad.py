"""Weight gradients from the gradients of the ops that use the weights, one variable at a time.

Backprop makes two kinds of gradients: those of the activations (the chain
``dz`` that runs from the loss back to the inputs) and those of the weights
(``dW = x^T dz`` for a Dense layer: half of backprop's work). Where each
weight meets the forward pass -- its *use*: the first op that computes with
it rather than viewing it (a ``MatMul``, not the ``Cast`` or ``Reshape`` on
the way) -- its gradient is the use's own gradient function applied to
``dz``, the gradient of the use's output::

    dW = sum over the uses u of W:  view_back(grad_u(dz_u)[the weight's input])

Two passes over one backward (the fused step, see ``fused_update``) can then
share the activation chain: the first computes every ``dz`` (activation-
sized, small where weights dominate) and the finiteness of every ``dW``
without making it where a bound suffices; the second makes each ``dW`` from
the kept ``dz`` only when its update is about to run.

The bound (``finite_bound``): a bilinear use (``MatMul``, ``BatchMatMul``,
``Einsum``, ``Conv2D``; a gather, whose ``dW`` sums rows of ``dz``) sums at most ``K`` products of one input element and
one ``dz`` element per weight element, so every element of ``dW`` is below
``K * max|x| * max|dz|`` and the float32 sum of ``dW`` below ``size(W)``
times that. When the inputs are finite and the bound is far below the
dtype's largest number, ``dW`` is finite and so is its sum: the same verdict
as ``is_finite(reduce_sum(dW))``, without the matmul. Otherwise (float16
under a large loss scale, huge activations) ``dW`` is made and checked.

Traps:
    TensorFlow 2.21's tape, asked in one call for the gradients of an op's
    input and of its output, keeps a reference to the output's gradient that
    it never drops, and that gradient holds its graph and every variable the
    graph captured (measured: a fused step's weights stayed allocated after the
    model and the step were deleted). A Dense's ``MatMul`` output is read by
    its ``BiasAdd``, both uses: :func:`unchained` asks the tape for the
    ``BiasAdd``'s and :func:`derive` makes the ``MatMul``'s from it, as the
    tape itself does. A use's output that another use and other ops read (a
    linear Dense's output feeding the next Dense and a residual sum) is still
    asked for with that use's: such a model's graph outlives the step.

    The *direct* gradient of each use is what counts. ``tape.gradient(z, W,
    output_gradients=dz)`` over several uses of one weight (a layer called
    twice in sequence) would follow the path from the second use back
    through the first and count it twice; each use's own gradient function
    does not.
"""

from __future__ import annotations

import dataclasses
import math

import tensorflow as tf

from effgrad import _compat
from effgrad.train import accumulate

__all__ = ["Use", "uses_of", "read_in_loops", "unchained", "derive", "weight_gradient", "finite_bound"]

# Ops that only view a weight (its values, reshaped, transposed or cast): its use is further on.
_VIEWS = frozenset({"Identity", "Cast", "Reshape", "Transpose", "ExpandDims", "Squeeze"})
# Ops that read a variable's handle without computing with its values.
_NOT_USES = frozenset({"VariableShape", "VarIsInitializedOp"})
_GATHERS = frozenset({"GatherV2", "ResourceGather"})
_LOOPS = frozenset({"While", "StatelessWhile"})
# Bilinear ops: terms summed per weight element, as a function of (size of the other input, size of dz).
_TERMS = {
    "MatMul": lambda other, dz: dz,  # dW[i, j] = sum over rows b of x[b, i] dz[b, j]
    "BatchMatMulV2": lambda other, dz: dz,
    "BatchMatMulV3": lambda other, dz: dz,
    "Conv2D": lambda other, dz: dz,  # sum over (batch, output row, output column)
    "Einsum": lambda other, dz: other + dz,  # any equation: distinct (x, dz) element pairs (logs: a product)
}


@dataclasses.dataclass(frozen=True)
class Use:
    """One op computing with a variable: ``op.inputs[index]`` is the variable seen through ``views``."""

    op: tf.Operation
    index: int
    views: tuple  # the view ops from the variable's read to ``op``, in forward order

    @property
    def output(self) -> tf.Tensor:
        return self.op.outputs[0]


def _handle(variable):
    if not isinstance(variable, tf.Variable):
        variable = getattr(variable, "value", None)  # a Keras variable wraps a tf.Variable
    return getattr(variable, "handle", None)


def uses_of(forward_ops: list, variables: list) -> list[list[Use] | None] | None:
    """Each variable's uses among ``forward_ops`` (ops of one graph); None where they cannot be told.

    A variable's entry is None when it is read by something else than a read
    or a gather (a loop, a recomputed block or a custom gradient that reads
    it inside its own function), when one of its uses has several outputs,
    or when it is large and a use outputs as much as the variable itself
    (its ``dz`` is no smaller than ``dW``). The whole answer is None when
    the variables are not resource variables of this graph.
    """
    inner = _captured(forward_ops, variables)
    if inner is None:
        return None
    inside = {id(op) for op in forward_ops}
    found = [[] for _ in variables]
    for op in forward_ops:
        for k, tensor in enumerate(op.inputs):
            i = inner.get(id(tensor))
            if i is None or op.type in _NOT_USES or found[i] is None:
                continue
            if op.type == "ResourceGather":  # an embedding lookup straight from the handle
                found[i].append(Use(op, k, ()))
            elif op.type == "ReadVariableOp":
                found[i].extend(_uses_after(op.outputs[0], (), inside))
            else:
                found[i] = None
    return [None if uses is None or not _small_uses(v, uses) else uses for v, uses in zip(variables, found)]


def read_in_loops(forward_ops: list, variables: list) -> list[int]:
    """The indices of ``variables`` that a loop among ``forward_ops`` reads (a recurrent layer's weights).

    Trap: under a persistent tape (the fused step's, for its second pass), backprop through
    such a loop keeps the weights' values once per iteration: memory grows with the sequence.
    """
    inner = _captured(forward_ops, variables) or {}
    return sorted({inner[id(t)] for op in forward_ops if op.type in _LOOPS for t in op.inputs if id(t) in inner})


def _captured(forward_ops: list, variables: list) -> dict | None:
    """``{id(the graph's captured handle): index}`` of ``variables``; None when one has no resource
    handle or there are no ops."""
    if not forward_ops:
        return None
    index = {}
    for i, variable in enumerate(variables):
        handle = _handle(variable)
        if handle is None:
            return None
        index[id(handle)] = i
    captures = forward_ops[0].graph.captures
    return {id(internal): index[id(external)] for external, internal in captures if id(external) in index}


def _small_uses(variable, uses: list[Use]) -> bool:
    size = math.prod(variable.shape)
    for use in uses:
        if len(use.op.outputs) != 1 or not use.output.dtype.is_floating:
            return False
        rows = math.prod(d or 1 for d in use.output.shape) if use.output.shape.rank is not None else 0
        if size >= 2**16 and rows >= size:
            return False
    return True


def _uses_after(tensor, views: tuple, inside: set) -> list[Use]:
    uses = []
    for consumer in tensor.consumers():
        if id(consumer) not in inside:
            continue
        if consumer.type in _VIEWS:
            uses += _uses_after(consumer.outputs[0], (*views, consumer), inside)
        else:
            uses += [Use(consumer, k, views) for k, t in enumerate(consumer.inputs) if t is tensor]
    return uses


def unchained(outputs: list) -> tuple[list, list]:
    """``(asked, derived)``: the uses' ``outputs`` to ask the tape for, and those :func:`derive` makes.

    An output read only by the op making another output (a ``MatMul``'s, read by its ``BiasAdd``) is
    derived from that one's gradient, so that the tape is not asked for an op's input and output (see
    the module's Traps). One that other ops read too is asked for all the same: its gradient sums
    their paths, and kept from the first pass instead, its variable's gradient would cost memory.
    """
    ids = {id(t) for t in outputs}
    asked, derived = [], []
    for t in outputs:
        consumers = t.consumers()
        one = len(consumers) == 1 and len(consumers[0].outputs) == 1 and id(consumers[0].outputs[0]) in ids
        (derived if one else asked).append(t)
    return asked, derived


def derive(derived: list, output_grads: dict) -> None:
    """Adds to ``output_grads`` (``{id(output): dz}``) the gradient of each :func:`unchained` ``derived``
    output: its one consumer's gradient function applied to the gradient of the consumer's output."""
    waiting = {id(t): t for t in derived}
    while waiting:
        # Downstream first: an output whose consumer makes another waiting output waits for that one.
        ready = [t for t in waiting.values() if id(t.consumers()[0].outputs[0]) not in waiting]
        if not ready:  # pragma: no cover - the ops of one graph make no cycle
            return
        for t in ready:
            del waiting[id(t)]
            op = t.consumers()[0]
            dz = output_grads.get(id(op.outputs[0]))
            if dz is None:
                continue
            grads = _compat.gradient_function(op)(op, tf.convert_to_tensor(dz))
            grads = grads if isinstance(grads, (list, tuple)) else [grads]
            parts = [g for x, g in zip(op.inputs, grads) if x is t and g is not None]
            if parts:
                output_grads[id(t)] = parts[0] if len(parts) == 1 else tf.add_n(parts)


def weight_gradient(uses: list[Use], output_grads: dict) -> tf.Tensor | None:
    """``dW`` from the gradients of the uses' outputs (``{id(output): dz}``; None where missing).

    One lookup's gradient stays ``IndexedSlices`` (as Keras hands it to the optimizer); else dense.
    """
    parts = []
    for use in uses:
        dz = output_grads.get(id(use.output))
        if dz is None:
            continue
        grad = _compat.gradient_function(use.op)(use.op, tf.convert_to_tensor(dz))
        grad = grad[use.index] if isinstance(grad, (list, tuple)) else grad
        for view in reversed(use.views):
            if grad is None:
                break
            grad = _compat.gradient_function(view)(view, tf.convert_to_tensor(grad))
            grad = grad[0] if isinstance(grad, (list, tuple)) else grad
        if grad is not None:
            parts.append(grad)
    if not parts:
        return None
    if len(parts) == 1:  # an embedding's one lookup stays IndexedSlices, as Keras hands it to the optimizer
        return parts[0]
    if all(isinstance(p, tf.IndexedSlices) for p in parts):  # several lookups: their rows together, as a tape
        # sums them (an optimizer with per-row state, Adam's, sees each lookup's rows, not their dense sum)
        return tf.IndexedSlices(
            tf.concat([p.values for p in parts], 0),
            tf.concat([tf.cast(p.indices, tf.int64) for p in parts], 0),
            parts[0].dense_shape,
        )
    parts = accumulate.dense(parts)
    return tf.add_n([tf.cast(p, parts[0].dtype) for p in parts])


def finite_bound(uses: list[Use], output_grads: dict, size: int) -> tf.Tensor | None:
    """True where ``dW`` is surely finite and sums finitely (see the module docstring); None if a use has no bound.

    A False is no verdict: the caller makes ``dW`` and checks it.
    """
    checks, logs = [], []
    for use in uses:
        dz = output_grads.get(id(use.output))
        if dz is None:
            continue
        if isinstance(dz, tf.IndexedSlices):
            return None
        if use.op.type in _GATHERS and use.index == 0:  # dW: rows of dz summed into the table's rows
            factors, count = [dz], _log_size(dz)
        else:
            terms = _TERMS.get(use.op.type)
            if terms is None or len(use.op.inputs) != 2:
                return None
            other = use.op.inputs[1 - use.index]
            if other is use.op.inputs[use.index]:
                return None
            factors, count = [other, dz], terms(_log_size(other), _log_size(dz))
        log_bound = count + tf.add_n([tf.math.log(tf.reduce_max(tf.abs(tf.cast(t, tf.float32)))) for t in factors])
        element_limit = math.log(use.output.dtype.max / 16)
        checks += [tf.math.is_finite(tf.reduce_sum(t)) for t in factors] + [log_bound < element_limit]
        logs.append(log_bound)
    if not logs:
        return None
    total = tf.reduce_logsumexp(tf.stack(logs)) + math.log(max(size, 1))
    return tf.reduce_all([*checks, total < math.log(tf.float32.max / 16)])


def _log_size(tensor) -> tf.Tensor:
    return tf.math.log(tf.cast(tf.size(tensor), tf.float32))
