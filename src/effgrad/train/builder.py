"""``effgrad.build_train_step``: the one place that turns options into a step.

``micro_batches="auto"`` (with ``memory_budget=``) asks for a plan at the
first batch (:class:`effgrad.train.planning.planned_step.PlannedTrainStep`); anything else
is a :class:`effgrad.train.step.TrainStep`. :func:`effgrad.attach` routes
its options through :func:`planned` the same way.
"""

from __future__ import annotations

from effgrad.train.planning.planned_step import PlannedTrainStep
from effgrad.train.step import TrainStep

__all__ = ["build_train_step", "planned"]


def planned(options: dict) -> bool:
    """Whether ``options`` ask for a plan rather than name the configuration."""
    return options.get("micro_batches") == "auto" or "memory_budget" in options


def build_train_step(model, loss, optimizer, **options) -> TrainStep:
    """Builds a compiled step that applies one exact update per batch.

    The update equals the plain full-batch update of
    ``L = sum(w * l) / sum(w) + regularization`` for any batch size and any
    ``micro_batches``; only one micro-batch's activations and one
    gradient-sized float32 accumulator are in memory at a time (with one
    micro-batch, where weights dominate, not even that: ``fused_update``).

    Example:
        >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        >>> step = effgrad.build_train_step(model, keras.losses.MeanSquaredError(),
        ...                                 keras.optimizers.SGD(0.1), micro_batches=4)
        >>> logs = step(np.ones((10, 4), "float32"), np.zeros((10, 2), "float32"))
        >>> sorted(logs)
        ['grads_finite', 'loss', 'loss_scale']

    Args:
        model: A built or buildable ``keras.Model``/``keras.Layer``.
        loss: A ``keras.losses.Loss``, a Keras loss name, or a callable
            ``(y_true, y_pred) -> losses`` with a leading batch dimension
            (NOT reduced: effgrad normalizes once over the whole batch).
        optimizer: A ``keras.optimizers.Optimizer``. A Keras
            ``LossScaleOptimizer`` (what ``compile`` makes under
            ``mixed_float16``) is unwrapped: effgrad's loss scale replaces
            it and keeps its state in the wrapper's variables.
        **options: Keyword options (:class:`StepOptions`):

            * ``micro_batches``: split every batch into this many micro-batches;
              ``"auto"`` with ``memory_budget=`` (bytes, ``"6GiB"`` or a
              fraction of the device): plan at the first call
              (:func:`effgrad.plan`) and train with the fastest configuration
              whose measured peak fits (a :class:`effgrad.train.planning.planned_step.PlannedTrainStep`).
              A built step's ``micro_batches`` may also be assigned between
              calls: every ``k >= 2`` runs on one trace.
            * ``loss_scale``: ``"auto"`` (dynamic iff the model computes in
              float16), ``None``, ``"dynamic"``, a number (static) or a ``LossScale``.
            * ``clip_norm``: clip the global norm of the final (unscaled,
              reduced) gradient.
            * ``jit_compile``: compile the gradient computation with XLA.
            * ``strategy``: a ``tf.distribute.Strategy``; default: the current one.
            * ``reduction``: Keras's reduction name, computed over the whole
              batch and all replicas: ``"mean_with_sample_weight"`` (default,
              ``sum(w*l)/sum(w)``), ``"sum_over_batch_size"`` (``sum(w*l)`` / loss
              elements, Keras's default for its losses) or ``"sum"``.
            * ``noise_scale``: log the gradient noise scale ``B_simple``
              (``logs["noise_scale"]``, plus ``"noise_scale_trace"`` and
              ``"noise_scale_grad_sq"``) from the micro-batch gradients the
              step computes anyway; needs ``micro_batches >= 2`` or several
              replicas. See ``docs/diagnostics.md``.
            * ``on_micro_batch``: ``fn(x, y, y_pred, sample_weight)`` called
              inside the compiled step once per micro-batch (e.g. metrics).
              It reads the logits, so the loss is then not fused, unless it
              also has ``readers_of_logits(y, logits) -> []`` and
              ``update_from_ranks(y, ranks, sample_weight, mask)`` (as
              ``attach``'s compiled accuracy and top-k metrics do: see
              :func:`effgrad.train.fused_loss.readers_of_logits`).
            * ``fused_update``: with one micro-batch on one replica, apply each
              variable's update as backprop makes its gradient instead of
              gathering every gradient first (two passes over one backward:
              the first decides finiteness and the clip norm, so a skipped
              step still changes nothing; the second makes each weight
              gradient from the output gradients the first kept, see
              :mod:`effgrad.train.fused_update`). ``"auto"`` (default) fuses
              when the gradients outweigh the activations (fine-tuning: the
              peak drops below Keras's); ``True`` always, ``False`` never.
              ``step.fused_update`` says what was chosen.
            * ``fused_loss``: when the model ends in a projection (a linear
              ``Dense``, keras_hub's reversed ``ReversibleEmbedding``) and the
              loss is ``SparseCategoricalCrossentropy(from_logits=True)``,
              compute it in chunks without ever making the logits
              (:func:`effgrad.fused_sparse_cross_entropy`). ``"auto"``
              (default): where it applies, with one line on the ``effgrad``
              logger saying whether it does and why not; ``True`` refuses
              with the reason where it cannot; ``False`` never.
              ``step.fused_loss`` / ``step.fused_loss_reason`` tell.
            * ``attention``: in the step's (training) calls, compute the
              attention of ``keras.layers.MultiHeadAttention`` (and its
              keras_hub subclasses) and of keras_hub's
              Llama, Mistral, Qwen and Gemma attention with
              :func:`effgrad.attention`: exact, and the ``[B, H, T, S]``
              scores never exist. ``"auto"`` (default): per layer, when its
              scores outweigh its queries, keys, values and output, with one
              line on the ``effgrad`` logger saying why (not); ``True``:
              every such layer, refusing with the reason one that cannot be
              routed (it returns its scores, overrides ``_compute_attention``);
              ``False`` never. ``step.attention`` / ``step.attention_reason``
              tell. Inference, ``generate`` and saved files are unchanged.
            * ``recompute_activations``: in the step's (training) calls, the
              activation function of a ``Dense``, ``EinsumDense``,
              convolution or ``Activation`` layer runs again in backprop
              from its input, which is all it keeps
              (:func:`effgrad.recompute_activations`; the same function, so
              the same values and gradients). ``"auto"`` (default): the
              activations whose backprop keeps two or more tensors of their
              input's size besides the output (GELU, SiLU; not ReLU,
              tanh); ``True``: every non-linear one; ``False`` never.
              Only activations proven free of state (no random numbers,
              no variable reads) are recomputed.
              ``step.recompute_activations`` /
              ``step.recompute_activations_reason`` tell. Off under DP-SGD.
            * ``per_example_clip``, ``noise_multiplier``, ``seed``: DP-SGD.
              Each example's gradient (of its loss summed over its elements)
              is clipped to norm ``per_example_clip`` without forming
              per-example gradients (:func:`effgrad.per_example_norms`; one
              backward pass forms the norms and the clipped sum), the clipped sum gets Gaussian noise of
              standard deviation ``noise_multiplier * per_example_clip`` once
              per batch (the same draw on every replica, from ``seed`` and the
              optimizer's iteration), and is divided by the number of
              examples. ``noise_multiplier=0`` clips without noise. See
              ``docs/privacy.md`` and :func:`effgrad.privacy.epsilon`.
            * ``shard_state``: under MirroredStrategy or MultiWorkerMirroredStrategy
              with N replicas, each replica keeps 1/N of the optimizer state and
              of the reduced gradients (ZeRO stages 1 and 2): gradients are
              reduce-scattered, each replica updates its shard of every large
              variable and the weights are all-gathered
              (:mod:`effgrad.train.shard`). Same updates; checkpoints hold the
              whole state, so they restore with any number of replicas. With
              one replica it is a no-op; ``step.shard_state`` and
              ``step.shard_state_reason`` say what was done.

    Returns:
        A :class:`TrainStep`; call it as ``step(x, y, sample_weight=None)``.

    Trap:
        Keras losses reduce by default (``"sum_over_batch_size"``); effgrad
        calls ``loss.call`` to get the unreduced values, so a custom callable
        must not reduce over the batch either. ``effgrad.attach`` takes the
        compiled loss's reduction, so ``fit`` trains what stock Keras trains.
    """
    if planned(options):
        return PlannedTrainStep(model, loss, optimizer, **options)
    return TrainStep(model, loss, optimizer, **options)
