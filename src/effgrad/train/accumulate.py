"""Gradient accumulation over micro-batches inside one compiled step.

Algorithm (``k`` = ``micro_batches``, ``B`` = rows of this batch)::

    m = max(ceil(B / k), 1)            # rows per micro-batch
    n = ceil(B / m)                    # micro-batches (<= k); the last may be short
    acc = float32 variables, one per trainable variable (never zeroed)
    for i in range(n):                 # one tf.while_loop, one iteration at a time
        grads, carry = differentiate(batch[i*m : min(i*m + m, B)], carry)
        for each variable j, as soon as its gradient arrives:
            acc[j] = g if i == 0 else acc[j] + g       # g = grads[j]; in place (_add_or_overwrite)

The accumulator is ONE gradient-sized buffer updated in place. A
loop-carried tensor (``acc = acc + g``) would allocate a new buffer per add
and keep about three gradient-sized buffers alive. The next micro-batch's slice waits for the
current one's updates, so at most one micro-batch's activations are alive.

Without XLA the model is traced once: the last slice is simply shorter.
Under XLA shapes must be static, so the loop runs the ``n - 1`` full slices
(static size ``m``) and the last, short micro-batch is peeled off after it;
no padding rows exist in either case (metrics and BatchNorm only ever see
real examples).

``micro_batches=1`` uses no accumulator and no loop: exactly the plain step.
Any other ``k`` may be a tensor: one trace serves every number of
micro-batches (the planner measures them all on one trace).

Trap: normalizing inside ``differentiate`` by the micro-batch's own weight (a
mean of micro-batch means) is wrong whenever micro-batches carry different
total weight; carry the unnormalized sums and divide once by the global
total, as ``effgrad.build_train_step`` does.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence

import tensorflow as tf

__all__ = ["batch_size", "rows", "dense", "accumulate_gradients", "Accumulators", "read", "free_released"]


def batch_size(batch) -> tf.Tensor:
    """The leading dimension of the first tensor in ``batch`` (an int32 scalar)."""
    leaves = [t for t in tf.nest.flatten(batch) if t is not None]
    return tf.shape(leaves[0])[0]


def rows(batch, start, stop=None, size=None):
    """``batch[start:stop]`` for every tensor; with ``size``, a slice of that (static) size."""
    if size is not None:

        def cut(t):
            # tf.slice with a size derived from shapes stays static under XLA,
            # where t[start:start+size] with a dynamic start would be padded.
            part = tf.slice(t, [start] + [0] * (t.shape.rank - 1), [size] + [-1] * (t.shape.rank - 1))
            part.set_shape([None] + t.shape[1:].as_list())  # tf.slice forgets the other axes' sizes
            return part

        return tf.nest.map_structure(lambda t: None if t is None else cut(t), batch)
    return tf.nest.map_structure(lambda t: None if t is None else t[start:stop], batch)


def dense(grads: Sequence) -> list:
    """Gradients with every ``IndexedSlices`` made dense (None kept).

    An embedding's gradient arrives as IndexedSlices, one row per token. Made
    dense (duplicate rows summed: the gradient itself), every micro_batches
    gives the optimizer the same gradient; Keras's Adam would square each
    duplicate row separately at k=1 only.
    """
    return [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]


def _make_buffers(variables: Sequence[tf.Variable]) -> list[tf.Variable]:
    """One float32 zero buffer per variable, local to each replica (``ON_READ``: each replica sums its
    own micro-batches; the step reduces once across replicas). Eager, under the strategy's scope.

    Their static shape is left open so :meth:`Accumulators.free` can shrink them to nothing: TensorFlow
    keeps a traced graph that holds a custom gradient (checkpointing, the fused loss) alive for the
    life of the process, and with it every variable it captured, long after its step is gone.
    ``accumulate_gradients`` restores the shape where it reads them.
    """
    free_released()  # a safe point: eager, outside any trace
    return [
        tf.Variable(
            tf.zeros(v.shape, tf.float32),
            shape=tf.TensorShape(None),
            trainable=False,
            name="effgrad_accumulator",
            synchronization=tf.VariableSynchronization.ON_READ,
            aggregation=tf.VariableAggregation.SUM,
        )
        for v in variables
    ]


def read(accumulator: tf.Variable, shape) -> tf.Tensor:
    """An accumulator's value with its variable's static ``shape`` (its own is open)."""
    return tf.ensure_shape(accumulator.read_value(), shape)


def _add_or_overwrite(add, pairs: Sequence[tuple[tf.Variable, tf.Tensor]], one_branch: bool) -> list:
    """``acc += g`` for every ``(acc, g)`` where ``add``, else ``acc = g`` (in place); the ops to wait for.

    The first micro-batch overwrites, so no zeroing pass (a zero buffer per variable) runs between
    steps and nothing the last step left (an overflow's inf, a freed buffer's empty shape) survives.
    In a graph ONE cond holds every pair: TensorFlow lowers it to a switch per input, so each
    buffer is still updated as soon as its own gradient arrives (tests/test_step_memory.py), and
    tracing does not pay for a cond per variable. Under XLA, where
    conds are not lowered, ``one_branch=False`` keeps one cond per variable.
    """

    def branch(pairs, adding: bool) -> tf.Tensor:
        method = "assign_add" if adding else "assign"
        with tf.control_dependencies([getattr(acc, method)(g, read_value=False) for acc, g in pairs]):
            return tf.constant(adding)

    def branches(pairs):
        return tf.cond(add, lambda: branch(pairs, True), lambda: branch(pairs, False))

    if one_branch:
        return [branches(pairs)] if pairs else []
    return [branches([pair]) for pair in pairs]


def _free(buffers: Sequence[tf.Variable]) -> None:
    empty = tf.zeros([0], tf.float32)
    for buffer in buffers:
        for part in getattr(buffer, "values", (buffer,)):
            part.assign(empty, read_value=False)


class Accumulators:
    """The float32 buffers micro-batch gradients are summed into: one per trainable variable, per replica.

    Made once for a model's variables, given to a step (``TrainStep(accumulators=...)``) and reused by
    another step of the same variables (the planner hands the ones its measurements ran with to
    training, as the allocator placed them). Emptied when this object is collected: whatever still holds
    the buffers' handles (a graph TensorFlow never frees) then holds a few bytes, not a gradient.

    Example:
        >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        >>> accumulators = Accumulators(model.trainable_variables)
        >>> accumulators.nbytes, accumulators.matches(model.trainable_variables)
        (40, True)
    """

    def __init__(self, variables: Sequence[tf.Variable], strategy: tf.distribute.Strategy | None = None):
        self._variables = [id(v) for v in variables]
        self._shapes = [v.shape for v in variables]
        with (strategy or tf.distribute.get_strategy()).scope():
            self.buffers = _make_buffers(variables)
        finalizer = weakref.finalize(self, _release, list(self.buffers))
        finalizer.atexit = False

    def matches(self, variables: Sequence[tf.Variable]) -> bool:
        """Whether these buffers were made for exactly ``variables`` (in this order)."""
        return [id(v) for v in variables] == self._variables

    @property
    def nbytes(self) -> int:
        """The buffers' bytes when full (float32, one copy per replica counted once)."""
        return sum(4 * int(shape.num_elements() or 0) for shape in self._shapes)

    def free(self) -> None:
        """Shrinks every buffer (each replica's copy) to nothing. Eager. A step that runs again refills
        them with its first micro-batch, so it stays correct."""
        _free(self.buffers)

    def refill(self) -> None:
        """Gives freed buffers their shapes again, as zeros (eager): a peak measured around the next step
        then does not count them as the step's own."""
        for buffer, shape in zip(self.buffers, self._shapes):
            for part in getattr(buffer, "values", (buffer,)):
                if int(tf.size(part)) == 0 and shape.num_elements():
                    with tf.device(part.device):
                        part.assign(tf.zeros(shape, tf.float32), read_value=False)


# Buffers of collected Accumulators that could not be emptied at once (see _release).
_released: list[list[tf.Variable]] = []


def _release(buffers: list) -> None:
    """Empties ``buffers`` when their owner is collected. A collection can run in the middle of tracing,
    with the graph's lock held; creating ops then deadlocks (seen while planning). So they are emptied
    at once only when the collection happens eagerly, else at the next safe point (the next
    :class:`Accumulators`, or :func:`free_released`)."""
    if tf.executing_eagerly() and not tf.inside_function():
        _free(buffers)
    else:
        _released.append(buffers)


def free_released() -> None:
    """Empties the buffers of collected :class:`Accumulators` that had to wait (call it eagerly)."""
    while _released:
        _free(_released.pop())


def accumulate_gradients(
    differentiate: Callable,
    variables: Sequence[tf.Variable],
    batch,
    micro_batches,
    carry,
    accumulators: Sequence[tf.Variable] | None = None,
    static_shapes: bool = False,
):
    """Sums ``differentiate``'s gradients over micro-batches, each added as backprop makes it.

    Args:
        differentiate: ``(batch_i, carry) -> (grads, carry)``: one micro-batch's
            gradients (one per variable, None where it does not reach the
            objective) and the carry (a nest of tensors with fixed shapes,
            e.g. running sums) threaded to the next micro-batch.
        variables: What ``differentiate`` differentiates with respect to.
        batch: A nest of tensors sharing the leading (batch) dimension.
        micro_batches: ``k >= 1``: the Python int 1 is the plain step (no loop,
            no accumulator); otherwise an int or an int32 scalar TENSOR, so one
            trace serves every ``k`` (not under ``static_shapes``, where the
            micro-batch size must be known when compiling: an int).
        carry: The initial carry.
        accumulators: one float32 buffer per variable (:attr:`Accumulators.buffers`);
            required unless ``k`` is the int 1. What they hold on entry is overwritten by the first
            micro-batch.
        static_shapes: Keep every slice's shape static (XLA).

    Returns:
        ``(grads, carry)``: ``grads[j]`` is the summed gradient of variable
        ``j`` (the accumulator's value when there is one), or None when the
        objective does not depend on it; ``carry`` after the last micro-batch.
    """
    variables = list(variables)
    if isinstance(micro_batches, int) and micro_batches == 1:  # no loop, no slicing: exactly the plain step
        return differentiate(batch, carry)
    if accumulators is None or len(accumulators) != len(variables):
        raise ValueError("accumulate_gradients needs one accumulator per variable when micro_batches > 1.")
    if static_shapes and not isinstance(micro_batches, int):
        raise TypeError("Under XLA (static_shapes) micro_batches must be a Python int: it sets a static shape.")

    connected = []  # which variables get a gradient, seen while tracing

    def add(i, batch_i, carry):
        grads, carry = differentiate(batch_i, carry)
        connected[:] = [g is not None for g in grads]
        pairs = [(acc, tf.cast(g, tf.float32)) for acc, g in zip(accumulators, grads) if g is not None]
        return _add_or_overwrite(i > 0, pairs, one_branch=not static_shapes), carry

    total = batch_size(batch)
    k = tf.cast(micro_batches, tf.int32)
    per_micro = tf.maximum((total + k - 1) // k, 1)
    num_micro = (total + per_micro - 1) // per_micro
    full = num_micro - 1 if static_shapes else num_micro

    def body(i, carry):
        start = i * per_micro
        if static_shapes:
            batch_i = rows(batch, start, size=per_micro)
        else:
            batch_i = rows(batch, start, tf.minimum(start + per_micro, total))
        updates, carry = add(i, batch_i, carry)
        # The next micro-batch's slice waits for this one's updates, so at
        # most one micro-batch's activations are alive. (parallel_iterations=1
        # would also do that, but it throttles TF's op parallelism: 1.8x slower.)
        with tf.control_dependencies(updates):
            return i + 1, tf.nest.map_structure(tf.identity, carry)

    _, carry = tf.while_loop(lambda i, _: i < full, body, (tf.constant(0), carry))
    if static_shapes:  # the last, maybe short, micro-batch with its own static shape
        start = (num_micro - 1) * per_micro
        updates, carry = add(num_micro - 1, rows(batch, start, total), carry)
        with tf.control_dependencies(updates):
            carry = tf.nest.map_structure(tf.identity, carry)
    with tf.control_dependencies(tf.nest.flatten(carry)):
        grads = [read(acc, v.shape) if c else None for acc, v, c in zip(accumulators, variables, connected)]
    return grads, carry
