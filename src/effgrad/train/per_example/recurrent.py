"""Closed forms of LSTM, GRU and SimpleRNN: weights shared over time, summed inside each example.

A recurrent layer applies one cell at every step ``t``; its gate
pre-activation is ``z_t = x_t W + h_{t-1} R + b``. So each example's
gradient sums over its steps before any norm::

    grad_i(W) = sum_t x_it (x) g_it        grad_i(R) = sum_t h_i,t-1 (x) g_it        grad_i(b) = sum_t g_it

with ``g_t = dL/dz_t``: a :class:`forms.Outer` over the ``T`` steps, like a
Dense over positions. ``g_t`` for every step at once is the gradient of
``Z = X W`` computed BEFORE the recurrence, for all steps (``z_t = Z_t + h_{t-1} R + b``
inside it): the tap sits on ``Z``. The recurrence is the cell's own
arithmetic, step by step in the order its ``call`` computes it
(implementation 2), run by Keras's own loop (masks, ``go_backwards``,
``unroll`` as the layer has them); each step also returns ``h_{t-1}``
(and GRU's reset gate ``r_t``, which scales the recurrent gradient of the
candidate: ``reset_after=True`` gives ``g_rec = g * [1, 1, r]``;
``reset_after=False`` multiplies ``r_t * h_{t-1}`` into the candidate's
recurrent input instead: three groups).

Applies to ``LSTM``, ``GRU``, ``SimpleRNN`` and ``RNN`` over one
``LSTMCell``/``GRUCell``/``SimpleRNNCell``, exact classes or subclasses
that inherit ``call``/``inner_loop`` (cells: ``call``) unchanged, without
dropout in training and not stateful (those are refused earlier, by
:class:`~effgrad.train.per_example.taps.NormTaps`). ``Bidirectional``
calls two of them: each is tapped.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from effgrad import _compat
from effgrad._proof import stands_in_for
from effgrad.train.per_example.forms import Direct, Outer, View, by_rows
from effgrad.train.per_example.rules import NotApplicable, bind, register

__all__ = ["CELLS"]

ops = keras.ops

CELLS = (keras.layers.LSTMCell, keras.layers.GRUCell, keras.layers.SimpleRNNCell)


def _cell_config(layer) -> str | None:
    cell = layer.cell
    kind = next((c for c in CELLS if isinstance(cell, c)), None)
    if kind is None:
        return f"its cell is a {type(cell).__name__}"
    if why := stands_in_for(cell, kind):
        return f"its cell: {why}"
    if getattr(layer, "stateful", False):
        return "it is stateful"
    return None


def _lstm_step(cell, recurrent, bias):
    def step(z_x, states):  # LSTMCell.call, implementation 2, after its input projection
        h, c = states[0], states[1]
        z = ops.add(z_x, ops.matmul(h, recurrent))
        if bias is not None:
            z = ops.add(z, bias)
        z0, z1, z2, z3 = ops.split(z, 4, axis=1)
        i = cell.recurrent_activation(z0)
        f = cell.recurrent_activation(z1)
        c = f * c + i * cell.activation(z2)
        o = cell.recurrent_activation(z3)
        h_new = o * cell.activation(c)
        return ops.concatenate([h_new, h], axis=-1), [h_new, c]

    return step


def _gru_step(cell, recurrent, recurrent_bias):
    units = cell.units

    def step(z_x, states):  # GRUCell.call, implementation 2, after its input projection (+ input bias)
        h = states[0]
        x_z, x_r, x_h = ops.split(z_x, 3, axis=-1)
        if cell.reset_after:
            inner = ops.matmul(h, recurrent)
            if recurrent_bias is not None:
                inner += recurrent_bias
        else:
            inner = ops.matmul(h, recurrent[:, : 2 * units])
        z = cell.recurrent_activation(x_z + inner[:, :units])
        r = cell.recurrent_activation(x_r + inner[:, units : units * 2])
        if cell.reset_after:
            recurrent_h = r * inner[:, units * 2 :]
        else:
            recurrent_h = ops.matmul(r * h, recurrent[:, 2 * units :])
        hh = cell.activation(x_h + recurrent_h)
        h_new = z * h + (1 - z) * hh
        return ops.concatenate([h_new, h, r], axis=-1), [h_new]

    return step


def _simple_step(cell, recurrent):
    def step(z_x, states):  # SimpleRNNCell.call after its input projection (+ bias)
        h = states[0]
        out = z_x + ops.matmul(h, recurrent)
        if cell.activation is not None:
            out = cell.activation(out)
        return ops.concatenate([out, h], axis=-1), [out]

    return step


def _recurrent(layer, call, args, kwargs, tap):
    arguments = bind(call, args, kwargs)
    sequences, initial_state, mask = arguments["sequences"], arguments["initial_state"], arguments["mask"]
    if len(sequences.shape) != 3:
        raise NotApplicable(f"its input has rank {len(sequences.shape)}, not 3")
    cell, units = layer.cell, layer.cell.units
    if initial_state is None:
        initial_state = layer.get_initial_state(batch_size=ops.shape(sequences)[0])
    states = list(initial_state) if isinstance(initial_state, (list, tuple)) else [initial_state]
    states = [ops.convert_to_tensor(s, dtype=cell.compute_dtype) for s in states]
    recurrent = ops.convert_to_tensor(cell.recurrent_kernel)
    z_x = ops.matmul(sequences, cell.kernel)
    input_bias = recurrent_bias = loop_bias = None
    if isinstance(cell, keras.layers.GRUCell):
        if cell.use_bias:
            input_bias, recurrent_bias = cell.bias, None
            if cell.reset_after:  # as GRUCell.call splits it
                input_bias, recurrent_bias = (ops.squeeze(e, axis=0) for e in ops.split(cell.bias, 2, axis=0))
            z_x = ops.add(z_x, input_bias)
        step = _gru_step(cell, recurrent, recurrent_bias)
    elif isinstance(cell, keras.layers.LSTMCell):
        loop_bias = cell.bias if cell.use_bias else None
        step = _lstm_step(cell, recurrent, loop_bias)
    else:
        if cell.bias is not None:
            z_x = ops.add(z_x, cell.bias)
        step = _simple_step(cell, recurrent)
    kept = {}  # what the recurrence saw: h_{t-1} (and GRU's r_t), step for step

    def parts(g):
        g = tf.cast(g, tf.float32)
        rows = tf.shape(g)[0]
        previous, out = kept["previous"], []
        out.append(Outer(cell.kernel, sequences[:, :, None], g[:, :, None], View(tuple(cell.kernel.shape))))
        g_recurrent = g
        shape = tuple(cell.recurrent_kernel.shape)
        if isinstance(cell, keras.layers.GRUCell) and not cell.reset_after:  # (r * h) feeds the candidate's third
            r = tf.cast(kept["reset"], previous.dtype)
            left = tf.stack([previous, previous, r * previous], axis=2)
            right = by_rows(g, -1, 3, units)
            out.append(Outer(cell.recurrent_kernel, left, right, View((3, units, units), (1, 0, 2), shape)))
        else:
            if isinstance(cell, keras.layers.GRUCell):  # the candidate's recurrent term is scaled by r
                r = tf.cast(kept["reset"], tf.float32)
                g_recurrent = tf.concat([g[..., : 2 * units], g[..., 2 * units :] * r], axis=-1)
            out.append(Outer(cell.recurrent_kernel, previous[:, :, None], g_recurrent[:, :, None], View(shape)))
        if getattr(cell, "use_bias", False) and cell.bias is not None:
            summed = tf.reduce_sum(g, axis=1)
            if isinstance(cell, keras.layers.GRUCell) and cell.reset_after:
                summed = tf.stack([summed, tf.reduce_sum(g_recurrent, axis=1)], axis=1)
            out.append(Direct(cell.bias, tf.reshape(summed, [rows, *cell.bias.shape])))
        return out

    z_x = tap(z_x, parts)
    last, outputs, new_states = _compat.rnn_loop(
        step, z_x, states, go_backwards=layer.go_backwards, mask=mask, unroll=layer.unroll,
        input_length=sequences.shape[1], zero_output_for_mask=layer.zero_output_for_mask, return_all_outputs=True,
    )  # fmt: skip
    in_order = (lambda t: tf.reverse(t, [1])) if layer.go_backwards else (lambda t: t)  # back to the input's order
    kept["previous"] = in_order(outputs[..., units : 2 * units])
    if isinstance(cell, keras.layers.GRUCell):
        kept["reset"] = in_order(outputs[..., 2 * units : 3 * units])
    # RNN.call from here on
    last_output = ops.cast(last[..., :units], layer.compute_dtype)
    sequence = ops.cast(outputs[..., :units], layer.compute_dtype)
    new_states = [ops.cast(s, layer.compute_dtype) for s in new_states]
    output = sequence if layer.return_sequences else last_output
    return (output, *new_states) if layer.return_state else output


for _cls in (keras.layers.RNN, keras.layers.LSTM, keras.layers.GRU, keras.layers.SimpleRNN):
    register(_cls, methods=("call", "inner_loop"), config=_cell_config)(_recurrent)
