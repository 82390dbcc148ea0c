"""The compiled batch function of a saliency run.

``SaliencyJob.maps(x, indices, row_offset) -> (maps, targets)``: reduced (and
cast) maps of one batch and the output unit each row explained, computed on
the device in one ``tf.function`` with a ``None`` batch dimension, so a short
last batch does not retrace it (``trace_count``).

It is traced without AutoGraph: effgrad's own code has no Python control flow
on tensors, and converting it was most of the fixed cost of a short job.
A callable target must therefore use ``tf.where``/``tf.cond`` rather than a Python ``if`` on tensors.
"""

from __future__ import annotations

import collections

import tensorflow as tf

from effgrad import _compat, distribute
from effgrad.explain import reductions
from effgrad.explain.targets import Target, TargetMode, score_function

__all__ = ["SaliencyJob", "cached_job"]

# Compiled jobs live ON the model (a plain attribute, not tracked by Keras):
# effgrad itself keeps no reference, so a model and its jobs are freed
# together. A few per model, most recent first: a new lambda target per call
# must not grow memory without bound.
_JOBS_PER_MODEL = 4


class SaliencyJob:
    """One compiled ``(what is differentiated, method, reduce, target, dtype, input spec)`` batch function.

    ``maps(x, indices, row_offset)`` takes a nest of input tensors (as the
    source's ``spec``) and returns a tuple of maps, one per differentiated
    tensor, and the explained unit of each row.
    """

    def __init__(self, model, wrt, method, reduce, target: Target, dtype, spec, strategy=None):
        self.model, self.wrt, self.method, self.reduce = model, wrt, method, reduce
        self.target, self.dtype, self.strategy = target, tf.as_dtype(dtype), strategy
        self.trace_count = 0
        self.maps = tf.function(
            self._maps,
            autograph=False,
            input_signature=[spec, tf.TensorSpec([None], tf.int32), tf.TensorSpec([], tf.int64)],
        )

    def _replica_maps(self, x, indices, row_offset):
        mode, xs = self.target.mode, self.wrt.start(x)

        def forward(points):
            return self.wrt.forward(x, points)

        if mode is TargetMode.ARGMAX and self.method.scores_at_input:
            chosen = []  # the arg-max of the differentiated pass itself: one forward pass, not two
            maps = self.method.attribute(score_function(forward, self.target, None, chosen), xs, row_offset)
            indices = chosen[0]
        else:
            rows = tf.shape(xs[0])[0]
            if mode is TargetMode.FIXED:
                indices = tf.fill([rows], tf.constant(self.target.value, tf.int32))
            elif mode is TargetMode.ARGMAX:  # noisy/interpolated inputs: the target is the clean input's
                outputs = forward(xs)
                indices = tf.cast(tf.argmax(tf.reshape(outputs, [rows, -1]), axis=-1), tf.int32)
            maps = self.method.attribute(score_function(forward, self.target, indices), xs, row_offset)
        maps = tuple(tf.cast(reductions.reduce_map(m, self.reduce), self.dtype) for m in maps)
        return maps, indices

    def _maps(self, x, indices, row_offset):
        self.trace_count += 1
        if self.strategy is None or self.strategy.num_replicas_in_sync == 1:
            return self._replica_maps(x, indices, row_offset)

        def shard(x, indices, row_offset):
            start, stop = distribute.replica_rows(tf.shape(indices)[0])
            rows = tf.nest.map_structure(lambda v: v[start:stop], x)
            return self._replica_maps(rows, indices[start:stop], row_offset + tf.cast(start, tf.int64))

        maps, targets = self.strategy.run(shard, args=(x, indices, row_offset))
        gather = self.strategy.gather  # replica order = row order
        return tuple(gather(m, axis=0) for m in maps), gather(targets, axis=0)


def cached_job(model, key, make) -> SaliencyJob:
    """The job cached on ``model`` under ``key``, made by ``make()`` if missing."""
    jobs = _compat.model_state(model).setdefault("saliency_jobs", collections.OrderedDict())
    if key in jobs:
        jobs.move_to_end(key)
    else:
        jobs[key] = make()
        while len(jobs) > _JOBS_PER_MODEL:
            jobs.popitem(last=False)
    return jobs[key]
