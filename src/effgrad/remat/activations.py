"""Recomputing a layer's activation function in backprop: its input is all that is kept.

``Dense(4 * d, activation="gelu")`` keeps, for backprop, not one tensor of its
output's size but several: TensorFlow's gradient of the tanh GELU reads its
input, ``x ** 3``, the ``tanh`` and two products (measured: 80 MiB after a
``Dense(1024, gelu_approximate)`` on 4,096 rows, against 32 MiB with the
activation recomputed: its input and output). In a transformer's feed-forward
block that is most of a layer's activations. Inside
``with effgrad.recompute_activations(model):`` every training call of a layer
whose last step is ``self.activation(outputs)`` (Keras's ``Dense``,
``EinsumDense``, convolutions and ``Activation``, or a subclass that inherits
their ``call``) runs its activation through :func:`effgrad.checkpoint`: the
same function, on the same input, run a second time in backprop. Nothing
stands in for user code, so the values and gradients are the layer's own
(checkpointing's guards keep Grappler's and XLA's common-subexpression
elimination from merging the recompute back, which would keep everything
again).

Which activations: ``"auto"`` recomputes one when its backprop keeps at least
two tensors of its input's size besides its output (the recompute keeps one:
the input). This is read from the gradient graph of the function itself,
traced once on a small input: GELU (both forms) and swish/SiLU qualify; ReLU,
tanh and sigmoid, whose gradients read only their output, do not. ``True``
recomputes every non-linear activation of those layers.

Example:
    >>> model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(64, activation="gelu"), keras.layers.Dense(1)])
    >>> with effgrad.recompute_activations(model) as recompute, tf.GradientTape() as tape:
    ...     loss = tf.reduce_sum(model(tf.ones([4, 16]), training=True))
    >>> recompute.applied, len(tape.gradient(loss, model.trainable_variables))
    (True, 4)

Trap:
    A recompute is one more elementwise pass per layer (a few percent of a
    step); what it saves grows with the layer's width. A ``tf.function`` must
    be traced inside the block (its graph keeps what it was traced with).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections.abc import Iterator

import keras
import tensorflow as tf

from effgrad import _compat
from effgrad.remat.checkpointing import checkpoint

__all__ = ["ActivationRecompute", "recompute_activations", "check_mode", "kept_by_backprop"]

_log = logging.getLogger("effgrad")
_LOCK = threading.RLock()

# Keras layers whose call ends with ``self.activation(outputs)``: a subclass qualifies when it
# inherits that call.
_LAYERS = (
    keras.layers.Dense,
    keras.layers.EinsumDense,
    keras.layers.Conv1D,
    keras.layers.Conv2D,
    keras.layers.Conv3D,
    keras.layers.Conv1DTranspose,
    keras.layers.Conv2DTranspose,
    keras.layers.Conv3DTranspose,
    keras.layers.DepthwiseConv1D,
    keras.layers.DepthwiseConv2D,
    keras.layers.SeparableConv1D,
    keras.layers.SeparableConv2D,
    keras.layers.Activation,
)


def check_mode(mode) -> bool | str:
    if mode not in (True, False, "auto") or not isinstance(mode, (bool, str)):
        raise ValueError(f'recompute_activations must be True, False or "auto", got {mode!r}.')
    return mode


@functools.lru_cache(maxsize=256)
def kept_by_backprop(fn) -> int:
    """How many tensors of its input's size, other than its output, ``fn``'s gradient reads.

    Traced once per function on a ``[2, 3]`` float32 input in a graph of its own.
    """
    with tf.Graph().as_default() as graph:
        x = tf.compat.v1.placeholder(tf.float32, [2, 3])
        upstream = tf.compat.v1.placeholder(tf.float32, [2, 3])
        y = fn(x)
        forward = set(graph.get_operations())
        # Symbolic gradients, not a tape: a tape records nothing where recording is paused (inside a
        # checkpointed segment's forward pass, where the first call may come from).
        tf.compat.v1.gradients(y, x, grad_ys=upstream)
        read = {  # the upstream gradient is no forward tensor
            t.ref()
            for op in graph.get_operations()
            if op not in forward
            for t in op.inputs
            if t.op in forward and t.shape == x.shape and t.dtype.is_floating and t is not upstream
        }
        y = tf.convert_to_tensor(y)
        while True:  # the output and what it merely renames hold one buffer
            read.discard(y.ref())
            if y.op.type not in ("Identity", "Cast", "Reshape") or not y.op.inputs:
                break
            y = y.op.inputs[0]
    return len(read)


def _eligible(layer) -> bool:
    """Whether ``layer``'s call ends with ``self.activation(outputs)`` and it has a non-linear function there."""
    cls = next((c for c in _LAYERS if isinstance(layer, c)), None)
    fn = layer.__dict__.get("activation")
    return (
        cls is not None
        and type(layer).call is cls.call  # a subclass with a call of its own is left alone
        and callable(fn)
        and not isinstance(fn, keras.layers.Layer)
        and fn is not keras.activations.linear
    )


class ActivationRecompute:
    """What one block decided, per layer (``decisions``: name -> (recomputed, why)).

    ``applied``: whether any activation was recomputed; ``reason``: one line.
    """

    def __init__(self, mode):
        self.mode = mode
        self.decisions: dict[str, tuple[bool, str]] = {}

    @property
    def applied(self) -> bool:
        return any(done for done, _ in self.decisions.values())

    @property
    def reason(self) -> str:
        if self.mode is False:
            return "recompute_activations=False"
        if not self.decisions:
            return "no layer ending with an activation effgrad can recompute was called in training"
        groups: dict[tuple[bool, str], list[str]] = {}
        for name, decision in self.decisions.items():
            groups.setdefault(decision, []).append(name)
        parts = []
        for (done, why), names in groups.items():
            shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
            parts.append(f"{'recomputed' if done else 'kept'} in {shown}: {why}")
        return "; ".join(parts)

    def decide(self, layer, fn) -> bool:
        name = getattr(fn, "__name__", type(fn).__name__)
        if self.mode is True:
            done, why = True, f"recompute_activations=True ({name})"
        else:
            kept = kept_by_backprop(fn)
            done = kept >= 2
            why = f"its backprop keeps {kept} tensor{'s' * (kept != 1)} of its input's size besides its output ({name})"
        with _LOCK:
            self.decisions[getattr(layer, "path", None) or layer.name] = (done, why)
            logged = _compat.model_state(layer).setdefault("activation_logged", set())
            if (done, why) in logged:
                return done
            logged.add((done, why))
        _log.info("effgrad: %s %s its activation: %s", layer.name, "recomputes" if done else "keeps", why)
        return done


class _Hook:
    """Installed as ``layer.activation`` while any block over the layer is open."""

    def __init__(self, layer, original):
        self.layer, self.original = layer, original
        self.recomputed = checkpoint(original)
        self.blocks: list[tuple[int, ActivationRecompute]] = []  # (thread id, block), newest last
        self.previous = None

    def block(self) -> ActivationRecompute | None:
        """This thread's newest block (MirroredStrategy traces each replica in a thread), else the newest."""
        mine = threading.get_ident()
        with _LOCK:
            own = [b for t, b in self.blocks if t == mine]
            return own[-1] if own else (self.blocks[-1][1] if self.blocks else None)

    @tf.autograph.experimental.do_not_convert
    def __call__(self, x, *args, **kwargs):
        block = self.block()
        if block is None or args or kwargs or not _compat.call_context_training():
            return self.original(x, *args, **kwargs)
        if not block.decide(self.layer, self.original):
            return self.original(x)
        return self.recomputed(x)

    def __getattr__(self, name):  # get_config and friends see the function itself
        return getattr(self.original, name)


@contextlib.contextmanager
def recompute_activations(model, mode: bool | str = True) -> Iterator[ActivationRecompute]:
    """Recomputes, in backprop, the activation functions of ``model``'s layers in training calls.

    For custom training loops (``build_train_step`` and ``attach`` take
    ``recompute_activations=`` instead). See :mod:`effgrad.remat.activations`.

    Args:
        model: A Keras model or layer.
        mode: ``True`` (default): every non-linear activation of those
            layers; ``"auto"``: those whose backprop keeps two or more tensors
            of the input's size besides the output; ``False``: none.

    Yields:
        An :class:`ActivationRecompute`: ``applied``, ``reason``,
        ``decisions`` (filled in as layers are called in training).
    """
    mode = check_mode(mode)
    block = ActivationRecompute(mode)
    if mode is False:
        yield block
        return
    hooks = []
    with _LOCK:
        for layer in _compat.flatten_layers(model):
            if not _eligible(layer):
                continue
            state = _compat.model_state(layer)
            hook = state.get("activation_hook")
            if hook is None:
                hook = state["activation_hook"] = _Hook(layer, layer.__dict__["activation"])
                hook.previous = _compat.override_method(layer, "activation", hook)
            hook.blocks.append((threading.get_ident(), block))
            hooks.append(hook)
    try:
        yield block
    finally:
        with _LOCK:
            for hook in hooks:
                hook.blocks = [(t, b) for t, b in hook.blocks if b is not block]
                if not hook.blocks:
                    _compat.restore_method(hook.layer, "activation", hook.previous)
                    _compat.model_state(hook.layer).pop("activation_hook", None)
