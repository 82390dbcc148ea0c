"""The pieces of ``shard_state`` that hold numbers: shard layouts, collectives, sharded variables.

A variable of ``n`` numbers cut for ``N`` replicas (a :class:`Layout`) is flattened and padded to
``N * s`` numbers; replica ``r`` owns ``[r*s, (r+1)*s)``. Its :class:`ShardRef` holds those numbers
(the variable the optimizer is built on and updates); each optimizer slot made for it is a
:class:`ShardSlot`: ``s`` numbers per replica (or the rows of a ``compact_state`` code table that
cover them), never the whole slot.

A checkpoint never sees a shard: a ``ShardSlot`` is saved whole (its shards all-gathered, the padding
dropped), exactly as the unsharded optimizer's slot, and restored by each replica taking its rows,
whatever the number of replicas the file was written with::

    saved  = concat(shard of replica 0, ..., shard of replica N-1)[:rows]   reshaped to the whole slot
    restore: rows = flatten(saved) padded to N * rows_per_shard;  replica r takes its rows

``numpy()`` and ``assign`` of a ``ShardSlot`` (outside a step) work on that whole value too, so
``optimizer.variables`` keeps its length, order and meaning (``model.save``/``load_weights`` use them);
its ``shape`` is its shard's. Under MultiWorkerMirroredStrategy every worker must save and read
together (a collective), as with TensorFlow's own ``SyncOnRead`` variables.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import keras
import tensorflow as tf

from effgrad import _compat

__all__ = ["Layout", "Group", "ShardRef", "ShardSlot", "shard_slots"]


@dataclasses.dataclass(frozen=True)
class Layout:
    """How one variable is cut: its ``shape``, ``shard`` numbers per replica, ``replicas`` shards."""

    shape: tuple
    shard: int
    replicas: int

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def padded(self, value) -> tf.Tensor:
        """``value`` flat, with zeros up to ``replicas * shard`` numbers."""
        flat = tf.reshape(value, [-1])
        padding = self.replicas * self.shard - self.size
        return tf.ensure_shape(tf.pad(flat, [[0, padding]]) if padding else flat, [self.replicas * self.shard])

    def piece(self, value, rank) -> tf.Tensor:
        """Replica ``rank``'s ``shard`` numbers of ``value`` (zeros past its end), with no padded copy of it."""
        flat = tf.reshape(value, [-1])
        start = tf.minimum(rank * self.shard, self.size)
        stop = tf.minimum(start + self.shard, self.size)
        part = tf.pad(flat[start:stop], [[0, self.shard - (stop - start)]])
        return tf.ensure_shape(part, [self.shard])

    def real(self, rank) -> tf.Tensor:
        """Which numbers of replica ``rank``'s shard are the variable's (the rest is padding)."""
        return tf.range(self.shard) + rank * self.shard < self.size

    def whole(self, gathered) -> tf.Tensor:
        """The variable's value from every replica's shard in order (``replicas * shard`` numbers)."""
        return tf.reshape(gathered[: self.size], self.shape)


class Group:
    """The replicas of ``strategy`` and the collectives effgrad issues on them (tf.distribute's own)."""

    def __init__(self, strategy):
        self.strategy = strategy
        self.replicas = strategy.num_replicas_in_sync
        self.launchers = _compat.collective_launchers(strategy)

    def _arguments(self) -> dict:
        device = _compat.current_device()
        if device not in self.launchers:  # pragma: no cover - a strategy placing replicas elsewhere
            raise RuntimeError(f"effgrad: no collective of the strategy runs on {device} ({sorted(self.launchers)}).")
        return _compat.collective_arguments(self.launchers[device])

    def reduce_scatter(self, flat, scale=None) -> tf.Tensor:
        """This replica's part (``1/replicas`` of ``flat``) of the sum of ``flat * scale`` over replicas.

        An all-to-all and a local sum, in pieces one after the other, each summed into one part-sized
        buffer in place: a piece's sent and received rows together hold at most one part's numbers
        (received whole, they would be as large as ``flat``, next to ``flat`` itself). ``scale``
        multiplies each piece before it is sent (no scaled copy of ``flat``).
        """
        parts = tf.reshape(flat, [self.replicas, -1])
        width = parts.shape[1]
        cut = -(-width // (2 * self.replicas))
        pieces = -(-width // cut)
        total = None
        for i in range(pieces):
            with tf.control_dependencies([] if total is None else [total]):  # cut once the last one is summed
                piece = tf.cast(parts[:, i * cut : (i + 1) * cut] if pieces > 1 else parts, tf.float32)
            if scale is not None:
                piece = piece * scale
            received = tf.raw_ops.CollectiveAllToAllV2(input=piece, **self._arguments())  # row j: replica j's
            summed = tf.reduce_sum(received, axis=0)
            if summed.shape[0] < cut:  # the last piece is shorter
                summed = tf.pad(summed, [[0, cut - summed.shape[0]]])
            if total is None:  # the first piece padded with zeros is the buffer (tf.zeros would be folded
                # into a constant that the graph keeps for good); the others are written into it in place
                total = tf.pad(summed[None], [[0, pieces - 1], [0, 0]])
            else:
                total = tf.raw_ops.InplaceUpdate(x=total, i=[i], v=summed[None])
        return tf.reshape(total, [-1])[:width]

    def all_gather(self, shard) -> tf.Tensor:
        """Every replica's ``shard`` in replica order, along the first axis."""
        return tf.raw_ops.CollectiveGatherV2(input=shard, **self._arguments())

    # Outside a step, eagerly: whole values from shards and back (checkpoints, numpy, assign).
    @property
    def _all_local(self) -> bool:
        """Every replica is in this process (MirroredStrategy): no collective needed to see them all."""
        return len(self.strategy.extended.worker_devices) == self.replicas

    def gathered(self, variable) -> tf.Tensor:
        """Every replica's rows of ``variable`` in replica order (eagerly; every worker calls it)."""
        if self._all_local:
            return tf.concat([tf.identity(c) for c in self.strategy.experimental_local_results(variable.value)], 0)
        # Collectives carry 32/64-bit numbers and float16: int8 codes and bfloat16 moments travel widened.
        dtype = tf.as_dtype(variable.dtype)
        wide = dtype if dtype in (tf.float16, tf.float32, tf.float64, tf.int32, tf.int64) else None
        wide = wide or (tf.float32 if dtype.is_floating else tf.int32)
        parts = self.strategy.run(lambda: tf.cast(variable.value.read_value(), wide))
        return tf.cast(self.strategy.gather(parts, axis=0), dtype)

    def scatter(self, variable, rows) -> None:
        """Each replica's copy of ``variable`` := its rows of ``rows`` (padded to ``replicas`` times its own)."""
        per = variable.shape[0]
        if self._all_local:
            for i, copy in enumerate(self.strategy.experimental_local_results(variable.value)):
                copy.assign(rows[i * per : (i + 1) * per], read_value=False)
            return

        def assign(rows):
            rank = tf.distribute.get_replica_context().replica_id_in_sync_group
            variable.value.assign(rows[rank * per : (rank + 1) * per], read_value=False)

        self.strategy.run(tf.function(assign, autograph=False), args=(rows,))


class ShardRef(keras.Variable):
    """This replica's ``layout.shard`` numbers of a model variable: what the optimizer is built on.

    Holds them only during the update: written from the weights before it (they may have been set or
    restored since), emptied once gathered into them (``_compat.empty_variable``); not saved.
    ``unsharded_size`` tells ``compact_state`` to store its slots as the whole variable's would be.
    """

    def __init__(self, layout: Layout, *, name: str, dtype):
        super().__init__(
            keras.initializers.Zeros(),
            shape=(layout.shard,),
            dtype=dtype,
            trainable=True,
            synchronization="on_read",
            aggregation="none",
            name=name,
        )
        self.layout = layout
        self.unsharded_size = layout.size


class ShardSlot(_compat.SavedAsVariable):
    """An optimizer slot of a cut variable: this replica's rows; saved, read and assigned whole.

    The slot's rows lie along the flat variable (``shard / rows`` numbers per row: 1 for a moment,
    ``block_size`` for an int8 code table); the whole slot has ``ceil(size * rows / shard)`` rows, or
    the variable's shape when the shard is stored as it is.
    """

    def __init__(self, group: Group, layout: Layout, *, shape, **kwargs):
        shape = tuple(shape)
        if not shape or layout.shard % shape[0]:
            raise ValueError(
                f"shard_state cannot cut the optimizer's slot {kwargs.get('name')} of shape {shape} for a shard of "
                f"{layout.shard} numbers: the optimizer keeps state that is not one number per weight."
            )
        super().__init__(shape=shape, trainable=False, synchronization="on_read", aggregation="none", **kwargs)
        self.group, self.layout = group, layout
        # Rows of the whole slot: one per number when the shard is stored as it is, else what covers them.
        self._whole_rows = layout.size if shape == (layout.shard,) else -(-layout.size // (layout.shard // shape[0]))
        self.unsharded_shape = layout.shape if shape == (layout.shard,) else (self._whole_rows, *shape[1:])

    def saved_value(self) -> tf.Tensor:
        return tf.reshape(self.group.gathered(self)[: self._whole_rows], self.unsharded_shape)

    def restore_saved_value(self, value) -> None:
        value = tf.cast(tf.convert_to_tensor(value), self.dtype)
        rows = tf.reshape(value, [self._whole_rows, *self.shape[1:]])
        missing = self.group.replicas * self.shape[0] - self._whole_rows
        self.group.scatter(self, tf.pad(rows, [[0, missing]] + [[0, 0]] * (len(self.shape) - 1)))

    def numpy(self):
        """The whole slot (every replica's shard), outside a step."""
        if _whole_view():
            return self.saved_value().numpy()
        return super().numpy()

    def assign(self, value):
        """Outside a step, a value of the whole slot's shape is cut into the replicas' shards."""
        shape = getattr(value, "shape", None)
        if shape is not None and tuple(shape) == tuple(self.unsharded_shape) and _whole_view():
            self.restore_saved_value(value)
            return value
        return super().assign(value)


def _whole_view() -> bool:
    """Eager and outside any replica (the user's code, checkpointing): a ShardSlot reads as a whole."""
    if not tf.executing_eagerly():
        return False
    ctx = tf.distribute.get_replica_context()
    return ctx is None or ctx.num_replicas_in_sync == 1


@contextlib.contextmanager
def shard_slots(optimizer, group: Group, layouts: dict):
    """While ``optimizer.build`` runs: each slot made for a :class:`ShardRef` (``layouts``: id -> Layout) is a
    :class:`ShardSlot` of the shape the optimizer asks for (so ``compact_state``'s code tables too)."""
    plain_from_reference, plain_add = optimizer.add_variable_from_reference, optimizer.add_variable
    current = []

    def add_variable_from_reference(reference_variable, name=None, initializer="zeros"):
        current.append(layouts.get(id(reference_variable)))
        try:
            return plain_from_reference(reference_variable, name=name, initializer=initializer)
        finally:
            current.pop()

    def add_variable(shape, initializer="zeros", dtype=None, aggregation="none", layout=None, name=None):
        if not current or current[-1] is None:
            return plain_add(
                shape, initializer=initializer, dtype=dtype, aggregation=aggregation, layout=layout, name=name
            )
        with keras.name_scope(optimizer.name):
            slot = ShardSlot(
                group, current[-1], initializer=keras.initializers.get(initializer), shape=shape, dtype=dtype, name=name
            )
        _compat.track_variable(optimizer, slot)
        return slot

    object.__setattr__(optimizer, "add_variable_from_reference", add_variable_from_reference)
    object.__setattr__(optimizer, "add_variable", add_variable)
    try:
        with group.strategy.scope():
            yield
    finally:
        object.__delattr__(optimizer, "add_variable_from_reference")
        object.__delattr__(optimizer, "add_variable")
