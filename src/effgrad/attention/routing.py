"""Routing a model's attention layers to :func:`effgrad.attention` while a step is traced.

Inside ``with effgrad.efficient_attention(model):`` every TRAINING call of an
attention layer of ``model`` that effgrad knows (:mod:`effgrad.attention.layers`)
computes its attention with the kernel; inference calls, ``generate`` and the
saved model are untouched (nothing is changed outside the block). The hook is
an instance attribute over the layer's ``_compute_attention``, seen by calls
in any thread while a block over that layer is open (MirroredStrategy traces
its replicas in threads), and removed when the last block closes.

Modes: ``True`` routes every known layer and refuses (one-line ``ValueError``)
where it cannot; ``"auto"`` routes a call when its scores outweigh its
queries, keys, values and output (the memory the plain computation adds
beyond what any keeps) and says why once per layer on the ``effgrad`` logger;
``False`` routes nothing.
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
from effgrad.attention import layers as known

__all__ = ["AttentionRouting", "efficient_attention", "check_mode", "check_model"]

_log = logging.getLogger("effgrad")
_LOCK = threading.RLock()
_MIB = 2**20


def check_mode(mode) -> bool | str:
    if mode not in (True, False, "auto") or not isinstance(mode, (bool, str)):
        raise ValueError(f'attention must be True, False or "auto", got {mode!r}.')
    return mode


class AttentionRouting(LayerDecisions):
    """What one routing block decided, per attention layer (``decisions``: name -> (routed, why)).

    ``applied``: whether any layer computed its attention with the kernel;
    ``reason``: one line saying which did and why, which did not and why.
    """

    OFF = "attention=False"
    NONE = "no attention layer effgrad knows was called in training"
    WORDS = ("effgrad.attention", "own path")

    def __init__(self, mode):
        super().__init__(mode)
        self.refused: list[tuple[object, str]] = []  # attention=True: (layer, why), raised as the block closes

    def record(self, layer, routed: bool, why: str) -> None:
        with _LOCK:
            self.decisions[getattr(layer, "path", None) or layer.name] = (routed, why)
        logged = _compat.model_state(layer).setdefault("attention_logged", set())
        if (routed, why) not in logged:  # once per layer and decision
            logged.add((routed, why))
            _log.info(
                "effgrad: %s %s: %s", layer.name, "uses effgrad.attention" if routed else "keeps its own attention", why
            )

    def refuse(self, layer, why: str):
        raise ValueError(
            f"attention=True: layer {layer.name!r} ({type(layer).__name__}) cannot use effgrad.attention: {why} "
            '(attention="auto" keeps its own path)'
        )


class _Hook:
    """Installed as ``layer._compute_attention`` while any block over the layer is open."""

    def __init__(self, layer, family: str, cls: type):
        self.layer, self.family, self.cls = layer, family, cls
        self.blocks: list[tuple[int, AttentionRouting]] = []  # (thread id, routing), newest last
        self.previous = None

    def routing(self) -> AttentionRouting | None:
        mine = threading.get_ident()
        with _LOCK:
            own = [r for t, r in self.blocks if t == mine]
            return own[-1] if own else (self.blocks[-1][1] if self.blocks else None)

    @tf.autograph.experimental.do_not_convert
    def __call__(self, *args, **kwargs):
        layer = self.layer
        # Someone else's instance hook below ours, else the class's method.
        original = self.previous if callable(self.previous) else _compat.class_attention(layer)
        routing = self.routing()
        arguments = known.bind(layer, self.cls, args, kwargs)
        if routing is None or not known.in_training(self.family, arguments):
            return original(*args, **kwargs)
        job = known.job(layer, self.family, arguments)
        if not isinstance(job, str) and None in [*job.q.shape[1:], *job.k.shape[1:], *job.v.shape[1:]]:
            job = f"its lengths, heads or depths are unknown while tracing (query {job.q.shape}, key {job.k.shape})"
        elif not isinstance(job, str) and 0 in (job.q.shape[1], job.k.shape[1]):
            job = f"its query or key sequence is empty (query {job.q.shape}, key {job.k.shape})"
        if isinstance(job, str):
            if routing.mode is True:  # raised as the block closes: Keras would wrap it in lines of its own here
                routing.refused.append((layer, job))
            routing.record(layer, False, job)
            return original(*args, **kwargs)
        routed, why = worth_it(job, routing.mode)
        routing.record(layer, routed, why)
        if not routed:
            return original(*args, **kwargs)
        return known.output(self.family, job.run())


def worth_it(job: known.Job, mode) -> tuple[bool, str]:
    """``"auto"``: route when the scores outweigh the layer's q, k, v and output (per example)."""
    scores, others = job.bytes_per_example()
    h, t, s = job.q.shape[2], job.q.shape[1], job.k.shape[1]
    what = f"its scores ({h}x{t}x{s} per example, {scores / _MIB:.2f} MiB)"
    versus = f"its q, k, v and output ({others / _MIB:.2f} MiB)"
    if mode is True:
        return True, f"attention=True; {what} are never made"
    if scores >= others:
        return True, f"{what} outweigh {versus}"
    return False, f"{what} weigh less than {versus}: the plain computation is as small"


def attention_layers(model) -> list[tuple[keras.layers.Layer, str | None, type | None, str | None]]:
    """``(layer, family, known class, reason it cannot be routed)`` for every attention layer in ``model``.

    An attention layer effgrad does not know (it has a ``_compute_attention``
    of its own) is listed with family None and the reason.
    """
    found = []
    for layer in _compat.flatten_layers(model):
        match = known.family_of(layer)
        if match is not None:
            family, cls = match
            found.append((layer, family, cls, known.class_reason(layer, family, cls)))
        elif _compat.class_attention(layer) is not None:
            why = f"effgrad does not know its attention ({type(layer).__name__}._compute_attention)"
            found.append((layer, None, None, why))
    return found


def check_model(model, mode) -> None:
    """``attention=True``: refuses now a model with no attention layer, or one that cannot be routed."""
    if check_mode(mode) is not True:
        return
    found = attention_layers(model)
    if not found:
        raise ValueError(
            f"attention=True, but {getattr(model, 'name', model)!r} has no attention layer effgrad knows "
            "(keras.layers.MultiHeadAttention and subclasses, keras_hub's Llama/Mistral/Qwen/Gemma attention)."
        )
    for layer, _, _, why in found:
        if why:
            AttentionRouting(True).refuse(layer, why)


@contextlib.contextmanager
def efficient_attention(model, mode: bool | str = True) -> Iterator[AttentionRouting]:
    """Routes ``model``'s attention layers to :func:`effgrad.attention` in training calls inside the block.

    For custom training loops (``build_train_step`` and ``attach`` take
    ``attention=`` instead). A ``tf.function`` must be TRACED inside the
    block: its graph keeps the path it was traced with.

    Example:
        >>> layer = keras.layers.MultiHeadAttention(num_heads=2, key_dim=8)
        >>> x = tf.random.normal([2, 64, 16])
        >>> with effgrad.efficient_attention(layer) as routing:
        ...     y = layer(x, x, use_causal_mask=True, training=True)
        >>> routing.applied, bool(tf.reduce_max(tf.abs(y - layer(x, x, use_causal_mask=True))) < 1e-5)
        (True, True)

    Args:
        model: A Keras model or layer; every attention layer in it is routed.
        mode: ``True`` (default): route every known attention layer, and
            raise a one-line ``ValueError`` for one that cannot be: on
            entering for its class (it overrides ``_compute_attention``), as
            the block closes for a call (it returned its scores).
            ``"auto"``: route a call when its scores outweigh its queries,
            keys, values and output; otherwise, or where it cannot, keep the
            layer's own path and log why once. ``False``: nothing.

    Yields:
        An :class:`AttentionRouting`: ``applied``, ``reason``, ``decisions``
        (filled in as layers are called).

    Trap:
        Only training calls are routed (``training=True``, as ``fit`` and
        effgrad's steps call): inference and ``generate`` keep Keras's path.
        Dropout on the probabilities uses the layer's own ``SeedGenerator``
        (advanced as Keras would) but draws its own mask, per block.
    """
    mode = check_mode(mode)
    routing = AttentionRouting(mode)
    if mode is False:
        yield routing
        return
    check_model(model, mode)
    found = attention_layers(model)
    for layer, _, _, why in found:
        if why:
            routing.record(layer, False, why)
    hooks = [_enter(layer, family, cls, routing) for layer, family, cls, why in found if not why]
    try:
        yield routing
    finally:
        for hook in hooks:
            _leave(hook, routing)
    if routing.refused:
        routing.refuse(*routing.refused[0])


def _enter(layer, family: str, cls: type, routing: AttentionRouting) -> _Hook:
    with _LOCK:
        state = _compat.model_state(layer)
        hook = state.get("attention_hook")
        if hook is None:
            hook = state["attention_hook"] = _Hook(layer, family, cls)
            hook.previous = _compat.override_method(layer, "_compute_attention", hook)
        hook.blocks.append((threading.get_ident(), routing))
        return hook


def _leave(hook: _Hook, routing: AttentionRouting) -> None:
    with _LOCK:
        hook.blocks = [(t, r) for t, r in hook.blocks if r is not routing]
        if not hook.blocks:
            _compat.restore_method(hook.layer, "_compute_attention", hook.previous)
            _compat.model_state(hook.layer).pop("attention_hook", None)
