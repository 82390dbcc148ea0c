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

Which activations: only one proven to give the same values when run again:
its graph, traced on its own (in a function graph of its own, on the layer
input's shape, never run), has no stateful op (random numbers, a variable
read or write), and it traces at all; anything else is kept and the reason
logged. ``"auto"`` recomputes one when its backprop keeps at least two
tensors of its input's size besides its output (the recompute keeps one: the
input), read from that same graph: GELU (both forms), SiLU/swish, mish and
hard SiLU qualify; ReLU, tanh and sigmoid, whose gradients read only their
output, and softplus, leaky ReLU and softsign (one) do not. ``True``
recomputes every non-linear activation of those layers that is proven
recomputable.

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
import logging
import threading
from collections.abc import Iterator

import keras
import tensorflow as tf

from effgrad import _compat
from effgrad._decisions import LayerDecisions
from effgrad.remat.checkpointing import checkpoint

__all__ = ["ActivationRecompute", "recompute_activations", "check_mode", "analyse"]

_log = logging.getLogger("effgrad")
_LOCK = threading.RLock()

# Keras layers whose call ends with ``self.activation(outputs)``: a subclass qualifies when it
# inherits that call. Not SeparableConv2D: on TF 2.21 Grappler's remapper fails on its bias add when the
# recompute's barrier reads it ("fanout 'XlaOptimizationBarrier' exist for missing node") and then
# leaves the whole graph unfused.
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
    keras.layers.Activation,
)


def check_mode(mode) -> bool | str:
    if mode not in (True, False, "auto") or not isinstance(mode, (bool, str)):
        raise ValueError(f'recompute_activations must be True, False or "auto", got {mode!r}.')
    return mode


def analyse(fn, x) -> tuple[int, str | None]:
    """``(kept, unsafe)`` for ``fn`` on inputs shaped as ``x``.

    ``kept``: how many tensors of ``x``'s size, other than its output, ``fn``'s gradient reads.
    ``unsafe``: why ``fn`` cannot be run again to the same values (it draws random numbers, reads or
    changes state, or could not be traced on its own), else None. Traced in a function graph of its
    own (which captures the constants and variables ``fn`` closes over) on ``x``'s shape, and never run.
    """
    shape = [2 if n is None else n for n in x.shape]
    spec = tf.TensorSpec(shape, x.dtype if x.dtype.is_floating else tf.float32)
    found: dict = {}

    def probe(x, upstream):
        graph = x.graph
        before = set(graph.get_operations())
        y = tf.convert_to_tensor(fn(x))
        forward = set(graph.get_operations()) - before
        stateful = sorted({op.type for op in forward if op.op_def.is_stateful})
        # Symbolic gradients, not a tape: a tape records nothing where recording is paused (inside a
        # checkpointed segment's forward pass, where the first call may come from).
        tf.compat.v1.gradients(y, x, grad_ys=upstream)
        forward |= {x.op}
        read = {  # the upstream gradient is no forward tensor
            t.ref()
            for op in graph.get_operations()
            if op not in forward and op not in before
            for t in op.inputs
            if t.op in forward and t.shape == x.shape and t.dtype.is_floating
        }
        while True:  # the output and what it merely renames hold one buffer
            read.discard(y.ref())
            if y.op.type not in ("Identity", "Cast", "Reshape") or not y.op.inputs:
                break
            y = y.op.inputs[0]
        found.update(kept=len(read), stateful=stateful)
        return x

    try:
        tf.function(probe, autograph=False).get_concrete_function(spec, spec)
    except Exception as error:  # any failure: not proven, so it is kept
        line = (str(error).strip().splitlines() or [type(error).__name__])[0][:160]
        return 0, f"it could not be traced on its own ({type(error).__name__}: {line})"
    if found["stateful"]:
        return found["kept"], f"it runs stateful ops ({', '.join(found['stateful'][:3])}): a second run may differ"
    return found["kept"], None


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


class ActivationRecompute(LayerDecisions):
    """What one block decided, per layer (``decisions``: name -> (recomputed, why)).

    ``applied``: whether any activation was recomputed; ``reason``: one line.
    """

    OFF = "recompute_activations=False"
    NONE = "no layer ending with an activation effgrad can recompute was called in training"
    WORDS = ("recomputed", "kept")

    def decide(self, layer, fn, analysis: tuple[int, str | None]) -> bool:
        name = getattr(fn, "__name__", type(fn).__name__)
        kept, unsafe = analysis
        if unsafe:
            done, why = False, f"{unsafe} ({name})"
        elif self.mode is True:
            done, why = True, f"recompute_activations=True ({name})"
        else:
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
        self.analyses: dict = {}  # (shape, dtype) -> analyse(original, ...): once per shape while installed

    def block(self) -> ActivationRecompute | None:
        """This thread's newest block (MirroredStrategy traces each replica in a thread), else the newest."""
        mine = threading.get_ident()
        with _LOCK:
            own = [b for t, b in self.blocks if t == mine]
            return own[-1] if own else (self.blocks[-1][1] if self.blocks else None)

    @tf.autograph.experimental.do_not_convert
    def __call__(self, x, *args, **kwargs):
        block = self.block()
        if block is None or args or kwargs or not tf.is_tensor(x) or not _compat.call_context_training():
            return self.original(x, *args, **kwargs)
        key = (tuple(x.shape), x.dtype)
        if key not in self.analyses:  # not under the lock: tracing waits for no other replica's thread
            self.analyses.setdefault(key, analyse(self.original, x))
        if not block.decide(self.layer, self.original, self.analyses[key]):
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
