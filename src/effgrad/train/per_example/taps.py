"""Taps on every layer call with weights: one backward pass gives each example's gradient norm and the clipped sum.

Every call of a layer that owns trained weights is run by its rule
(:mod:`~effgrad.train.per_example.rules`) or, without one, as it is
(:mod:`~effgrad.train.per_example.fallback`), with a tap on the tensor whose
gradient ``g`` the rule needs: an identity whose custom gradient passes
``g`` through unchanged, files the layer's per-example gradient parts in a
:class:`~effgrad.train.per_example.forms.Book` and returns its ``[batch]``
share of ``|grad l_i|^2`` as the gradient of a ``[batch]`` zero tensor the
tape watches. So ONE backward pass, to those zeros, gives::

    norms_i = sqrt(sum of shares)                                 # every layer, every example
    clipped = sum_i c_i grad l_i, per weight, from what the Book kept   # Backward.gradients(c)

(book-keeping, Bu et al. 2023): no weight gradient is formed before the
clipping factors ``c`` exist, and no second backward pass.

Refused before any trace, in one line each: BatchNormalization (batch
statistics mix the examples), effgrad-checkpointed layers (the recompute
hides their calls), stateful recurrent layers and dropout inside a
recurrence in training. Found while tracing: a weight read outside the call
of the layer that owns it (the taps cannot see that use), a tapped layer
called inside another layer's loop.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import NamedTuple

import keras
import tensorflow as tf

from effgrad import _compat
from effgrad.train.per_example import convolution, fallback, forms, recurrent, rules  # noqa: F401 (registers)

__all__ = ["NormTaps", "Recorder", "Backward"]


class Owner(NamedTuple):
    layer: keras.layers.Layer
    variables: list  # the trained weights this layer's calls produce gradients for
    rule: rules.Rule | None  # None: the fallback


class NormTaps:
    """Which layers carry trained weights and how each one's per-example gradients are read.

    Example:
        >>> taps = NormTaps(model)                           # doctest: +SKIP
        >>> with tf.GradientTape(watch_accessed_variables=False) as tape:  # doctest: +SKIP
        ...     with taps.recording(tape) as recorder:
        ...         y_pred = recorder.hook(lambda: model(x, training=True))
        ...     per_example_losses = ...                     # [batch]
        >>> backward = recorder.backward(per_example_losses)  # doctest: +SKIP
        >>> backward.norms, backward.gradients(model.trainable_variables, weights)  # doctest: +SKIP

    Attributes:
        paths: ``{layer name: "closed form" | "per-example fallback: <why>"}``.
    """

    def __init__(self, model, *, training: bool = True):
        from effgrad.remat.checkpointing import Checkpoint, CheckpointedModel

        self.trained = {id(v) for v in model.trainable_variables}
        # What a tape reports reading: the backend variable inside each Keras variable.
        self.read_as = {id(getattr(v, "value", v)): v for v in model.trainable_variables}
        layers = _compat.flatten_layers(model)
        inside_recurrent = {id(sub) for layer in layers if isinstance(layer, keras.layers.RNN)
                            for sub in _compat.flatten_layers(layer)[1:]}  # fmt: skip
        self.owners: list[Owner] = []
        self.paths: dict[str, str] = {}
        self._warned: set[str] = set()
        for layer in layers:
            if isinstance(layer, (Checkpoint, CheckpointedModel)):
                raise ValueError(
                    f"{layer.name} recomputes its activations in backprop (effgrad checkpointing), where the taps "
                    "that read each example's gradient norm cannot see them. Train the model without "
                    "checkpointing for per-example clipping (micro_batches bound its memory instead)."
                )
            if id(layer) in inside_recurrent:
                continue
            recurrent_layer = isinstance(layer, keras.layers.RNN)  # its cells' weights are its own
            owned = layer.trainable_variables if recurrent_layer else _compat.own_variables(layer)
            own = [v for v in owned if id(v) in self.trained]
            if not own:
                continue
            if isinstance(layer, keras.layers.BatchNormalization):
                raise ValueError(
                    f"{layer.name} is a BatchNormalization layer: in training its output mixes the examples of a "
                    "batch, so an example's gradient (and DP-SGD's clipping of it) is not defined. Use "
                    "LayerNormalization or GroupNormalization, or freeze it (layer.trainable = False)."
                )
            if recurrent_layer:
                _refuse_recurrent(layer, training)
            rule, reason = rules.find(layer)
            if rule is not None and not recurrent_layer and len(own) != len(layer.trainable_weights):
                rule, reason = None, "some of its weights belong to its sublayers"
            if rule is None:
                self.warn(layer, reason)
            self.paths[layer.name] = "closed form" if rule is not None else f"per-example fallback: {reason}"
            self.owners.append(Owner(layer, own, rule))

    @contextlib.contextmanager
    def recording(self, tape: tf.GradientTape):
        """A :class:`Recorder` for one forward pass under ``tape``."""
        yield Recorder(self, tape)

    def warn(self, layer, reason: str) -> None:
        """One warning per layer class: it falls back, and why."""
        self.paths[layer.name] = f"per-example fallback: {reason}"
        name = type(layer).__name__
        if name not in self._warned:
            self._warned.add(name)
            warnings.warn(
                f"effgrad: per-example gradient norms of {name} layers (e.g. {layer.name!r}) have no closed form "
                f"here ({reason}); they are computed from per-example gradients of that layer's weights "
                "(vectorized), which costs batch x its weights in memory during backprop.",
                UserWarning,
                stacklevel=4,
            )


def _refuse_recurrent(layer, training: bool) -> None:
    if getattr(layer, "stateful", False):
        raise ValueError(
            f"{layer.name} is a stateful {type(layer).__name__}: each row continues a row of the previous batch, "
            "which per-example clipping does not follow; use stateful=False (pass the states as inputs instead)."
        )
    cells = _compat.flatten_layers(layer)[1:]
    if training and any(getattr(c, "dropout", 0) or getattr(c, "recurrent_dropout", 0) for c in cells):
        raise ValueError(
            f"{layer.name} ({type(layer).__name__}) applies dropout inside its recurrence, which per-example "
            "gradients cannot repeat: set dropout=0 and recurrent_dropout=0 (a Dropout layer before or after it works)."
        )


def _graph_now():
    return None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()


class Recorder:
    """The taps of one forward pass; :meth:`backward` is the one backward pass after it."""

    def __init__(self, taps: NormTaps, tape: tf.GradientTape):
        self.taps, self.tape = taps, tape
        self.zeros: list[tf.Tensor] = []  # one watched [batch] zero per tap
        self.uses: dict[int, int] = {}  # id(variable) -> calls that used it
        self.book: forms.Book | None = None  # only while backward() runs
        self._watchers: list[tf.GradientTape] = []  # what records weight reads outside tapped calls
        self._graph = None

    def hook(self, call_model):
        """Runs ``call_model()`` with every weighted layer's call tapped."""
        self._graph = _graph_now()
        with contextlib.ExitStack() as stack:
            for owner in self.taps.owners:
                stack.enter_context(_compat.intercepted_call(owner.layer, self._tapped(owner)))
            with tf.GradientTape() as outside:
                self._watchers = [outside]
                try:
                    out = call_model()
                finally:
                    self._watchers = []
        self._refuse_unseen(outside.watched_variables(), (), "outside the calls of the layers that own them")
        return out

    def _refuse_unseen(self, read, allowed, where: str) -> None:
        allowed = {id(v) for v in allowed}
        read = [self.taps.read_as.get(id(v), v) for v in read]
        unseen = [v for v in read if id(v) in self.taps.trained and id(v) not in allowed]
        if unseen:
            names = ", ".join(sorted({getattr(v, "path", v.name) for v in unseen}))
            raise ValueError(
                f"effgrad: per-example gradients cannot see the use of {names}: read {where}. Read a weight only "
                "in the call of the layer that owns it (call that layer), or train without per_example_clip."
            )

    def _tapped(self, owner: Owner):
        def call(original, *args, **kwargs):
            with contextlib.ExitStack() as paused:
                for watcher in self._watchers:  # this call's reads are this call's: seen by its rule
                    paused.enter_context(watcher.stop_recording())
                outer, self._watchers = self._watchers, []
                try:
                    out = self._run(owner, original, args, kwargs)
                finally:
                    self._watchers = outer
            for v in owner.variables:
                self.uses[id(v)] = self.uses.get(id(v), 0) + 1
            return out

        return call

    def _run(self, owner: Owner, original, args, kwargs):
        if owner.rule is not None:
            try:
                return owner.rule.apply(
                    owner.layer, original, args, kwargs, lambda z, parts: self._tap(owner, [z], parts)[0]
                )
            except rules.NotApplicable as why:
                self.taps.warn(owner.layer, str(why))
        with tf.GradientTape() as inside:
            self._watchers = [inside]
            out = fallback.call(owner.layer, original, args, kwargs)
        self._watchers = []
        self._refuse_unseen(inside.watched_variables(), owner.variables, f"inside {owner.layer.name}'s call")
        flat = tf.nest.flatten(out)
        floats = [i for i, t in enumerate(flat) if tf.is_tensor(t) and t.dtype.is_floating]
        if not floats:
            raise ValueError(f"effgrad: the per-example norms of {owner.layer.name} need a float output, got {out!r}.")

        def parts(*gradients):
            return fallback.per_example(owner.layer, owner.variables, args, kwargs, floats, list(gradients))

        tapped = self._tap(owner, [flat[i] for i in floats], parts)
        for i, t in zip(floats, tapped):
            flat[i] = t
        return tf.nest.pack_sequence_as(out, flat)

    def _tap(self, owner: Owner, outputs: list, parts):
        """``outputs`` unchanged (a list); their gradients file ``parts(*gradients)`` in the book."""
        if _graph_now() is not self._graph:
            raise ValueError(
                f"effgrad: {owner.layer.name} is called inside a loop of another layer (a tf.while_loop or a "
                "vectorized map), where its per-example gradients cannot be read out; call it outside the loop."
            )
        zero = tf.zeros(tf.shape(outputs[0])[:1], tf.float32)
        self.tape.watch(zero)
        self.zeros.append(zero)

        @_compat.custom_gradient
        def tap(*inputs):
            *values, zero = inputs

            def grad(*upstream):
                upstream = [tf.zeros_like(v) if g is None else g for v, g in zip(values, upstream)]
                if self.book is None:  # a backward pass that is not ours: only the gradient matters
                    return (*upstream, tf.zeros_like(zero))
                return (*upstream, self.book.add(parts(*upstream), tf.shape(zero)[0]))

            return [tf.identity(v) for v in values], grad

        tapped = tap(*outputs, zero)
        for before, after in zip(outputs, tapped):
            mask = _compat.get_keras_mask(before)
            if mask is not None:
                _compat.set_keras_mask(after, mask)
        return tapped

    def backward(self, per_example: tf.Tensor, scale=1.0) -> Backward:
        """The one backward pass from ``per_example`` (``[batch]``, computed under the tape).

        Backprop starts from ``scale`` (a float16 model's loss scale, so small gradients do not
        underflow); the norms are divided by it again, the gradients are not (see :class:`Backward`).
        """
        if not self.zeros:
            raise ValueError("No layer with trainable weights was called: there is no gradient to take the norm of.")
        self.book = forms.Book(dict(self.uses))
        try:
            seed = tf.fill(tf.shape(per_example), tf.cast(scale, per_example.dtype))
            with _compat.loops_one_iteration_at_a_time():  # as in every training backward pass (effgrad.train.flows)
                shares = self.tape.gradient(per_example, self.zeros, output_gradients=seed)
            book = self.book
        finally:
            self.book = None
        squares = [s for s in shares if s is not None]
        shared = book.shared_sq()
        squares += [shared] if shared is not None else []
        zeros = tf.zeros_like(tf.cast(per_example, tf.float32))
        return Backward(tf.sqrt(tf.add_n([zeros, *squares])) / tf.cast(scale, tf.float32), book)


class Backward(NamedTuple):
    """What the backward pass left: every example's norm, and what the clipped sum is formed from."""

    norms: tf.Tensor  # [batch] float32, unscaled
    book: forms.Book

    def gradients(self, variables, weights: tf.Tensor) -> list:
        """``sum_i weights_i * (scale * grad l_i)`` per variable (None where no call reached it)."""
        return self.book.clipped(variables, weights)
