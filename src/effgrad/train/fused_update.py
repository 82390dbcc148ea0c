"""``fused_update``: with one micro-batch, each variable's update runs as backprop makes its gradient.

Gathering every gradient before the one update costs a gradient-sized buffer
more than Keras's own step when the gradients outweigh the activations
freed while they are made (fine-tuning: weights >> activations). Keras's
graph avoids it by running each variable's update as soon as its gradient
exists; effgrad must first know global facts (every gradient finite, the
global norm for clipping), so it checks them before the first update,
backpropagating through the layers once (:mod:`effgrad.train.local_grad`)::

    forward once, keeping the tape
    pass 1: backprop the activation chain; keep the gradient dz of the output
            of every op that uses a weight (activation-sized); reduce each
            weight gradient to a finiteness flag, from a bound on x and dz
            where it suffices (a matmul's dW is then never made here), else
            made and summed (and, with clip_norm, its squared norm)
    if every flag is finite (and the batch has weight):
        pass 2: each weight gradient made from its kept dz (dW = x^T dz),
                unscaled, regularized, clipped, handed to the optimizer the
                moment it exists, so only a few are ever alive
        commit the forward pass's state (BatchNorm statistics)
    loss_scale.update(finite)

Same update as the gathered step, and a skipped step still changes nothing.
Pass 2 runs inside a ``tf.cond`` on the flags, so neither Grappler nor XLA
merges it with pass 1 (which would gather the gradients again). A weight
whose uses cannot be told (read inside a recomputed block, a loop, a fused
loss's custom gradient) keeps its gradient from pass 1 while such gradients
add up to at most 1.2x the largest weight (a tied embedding that a fused loss
reads). Beyond that (a checkpointed model), pass 2 is a second whole backward
pass, LOMO's (Lv et al. 2024), which costs a backward pass more than sharing
the chain (``python -m benchmarks run step_floor`` measures both).

Trap: in a graph the forward pass is recorded on a one-use tape, and traced
again on a persistent one only where the second whole backward pass is
needed. Under a persistent tape TensorFlow wraps every loop for higher-order
gradients, and the wrapper keeps what each iteration read: a recurrent
layer's weights once per time step (tests/test_fused_update.py measures a GRU
against the gathered step). A second backward
pass through such a loop keeps them as well, so a model whose loop-read
weights would need it takes the gathered step (:class:`Unfusable`).

Backprop waits for the updates (:func:`pace`): each gradient is made only
once the updates before it have written, all but at most the largest
variable's worth (twice that with compact int8 state, whose single-threaded
updates would otherwise run one at a time on a 2-core machine).
Without it nothing stops the executor from running the whole backward pass
ahead of the updates and holding every gradient, as the gathered step does;
how far it runs ahead depends on its threads and the machine's load.
"""

from __future__ import annotations

import math

import tensorflow as tf

from effgrad import _compat
from effgrad import model_graph as graph
from effgrad.train import flows, inplace, local_grad, update
from effgrad.train import objective as objective_lib

__all__ = ["decide", "why_not", "gradients_dominate", "step", "Unfusable"]


def decide(train_step, hint: tuple[int, int] | None) -> bool:
    """Whether ``train_step`` applies each update as backprop makes its gradient.

    ``"auto"`` fuses when the gradients outweigh 2x the batch's layer outputs
    (from the layer graph; a sequence model's unknown axes counted as the
    batch's ``T``).
    """
    options = train_step.options
    option = options.fused_update
    if option is False or train_step.micro_batches > 1 or options.private:
        # With micro-batches the accumulators hold the one gradient-sized buffer anyway; DP-SGD
        # needs every example's norm first (options refuse fused_update=True with it).
        return False
    why = why_not(train_step.strategy.num_replicas_in_sync, train_step.optimizer)
    if why is not None:
        if option is True:
            raise ValueError(f"fused_update=True cannot apply updates inside backward here: {why}.")
        return False
    return option is True or gradients_dominate(train_step.model, hint)


def why_not(replicas: int, optimizer) -> str | None:
    """Why a one-micro-batch step cannot apply its updates inside backward here, or None: it can."""
    if replicas > 1:
        return (
            "with several replicas the gradients are all-reduced before any update, which gathers them; "
            "use micro_batches >= 2 (the accumulators are the floor) or fused_update=False"
        )
    if getattr(optimizer, "global_clipnorm", None):
        return (
            "the optimizer's global_clipnorm needs every gradient before any update; use "
            "build_train_step(clip_norm=...) instead (computed in the first backward pass)"
        )
    return None


def gradients_dominate(model, hint: tuple[int, int] | None) -> bool:
    """Whether ``model``'s float32 gradients outweigh 2x the layer outputs of a batch shaped ``hint``
    (``(rows, largest other axis)``; a sequence model's unknown axes counted as that axis): where
    weights dominate (fine-tuning). ``False`` when the layer graph is unknown (subclassed models).
    """
    if hint is None:
        return False
    rows, extent = hint
    per_row = graph.activation_bytes_per_row(model, unknown=extent)  # a sequence: T per unknown axis
    if per_row is None:
        return False
    gradient_bytes = 4 * sum(int(math.prod(v.shape)) for v in model.trainable_variables)
    # Layer outputs understate what backprop keeps (inputs, pre-activations, attention
    # probabilities), and the fused step also keeps every weight use's output gradient until
    # pass 2: where weights and outputs are even it is better gathered, from twice the outputs
    # fused (benchmarks/step_floor.py measures both sides of the line).
    return gradient_bytes > 2 * per_row * rows


class Unfusable(Exception):
    """Raised while tracing :func:`step` when the traced forward pass shows that fusing would cost memory."""


def step(train_step, x, y, sample_weight) -> dict:
    """One micro-batch on one replica, each variable updated as backprop makes its gradient.

    Raises:
        Unfusable: weights read inside a loop (``local_grad.read_in_loops``) would need a second
            backward pass; nothing was traced into the caller's graph, which runs the gathered step.
    """

    def fused(persistent: bool):
        def run(x, y, sample_weight):
            return _step(train_step, x, y, sample_weight, persistent)

        return tf.function(run, jit_compile=train_step.options.jit_compile, autograph=False)

    try:
        return fused(False)(x, y, sample_weight)
    except _SecondPass:  # traced again, from the start: the failed trace left nothing in the caller's graph
        return fused(True)(x, y, sample_weight)


class _SecondPass(Exception):
    """Raised while tracing with a one-use tape when the step needs a second whole backward pass."""


def _step(train_step, x, y, sample_weight, persistent: bool) -> dict:
    model, options, loss_scale = train_step.model, train_step.options, train_step.loss_scale
    variables = model.trainable_variables
    facts = flows.Facts()
    forward = train_step.forward(split=False)
    reduction = train_step.reduction
    func_graph = None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()
    known = 0 if func_graph is None else len(func_graph.get_operations())
    persistent = persistent or func_graph is None  # eager: no graph to read the uses from
    with tf.GradientTape(persistent=persistent) as tape:  # see Trap above
        y_pred, pending = forward(
            (x, y, sample_weight), [tf.convert_to_tensor(v) for v in forward.state_variables], facts
        )
        total, normalizer = forward.objective.sums(y, y_pred, sample_weight, exact=True)
        divisor = 1.0 if reduction == "sum" else normalizer
        target = loss_scale.scale(tf.math.divide_no_nan(total, divisor))
    commit = [(forward.state_variables[i], pending[i]) for i in sorted(facts.written)] + facts.stray
    forward_ops = [] if func_graph is None else func_graph.get_operations()[known:]
    uses = None if func_graph is None else local_grad.uses_of(forward_ops, variables)
    outputs = [] if uses is None else list({id(u.output): u.output for us in uses if us for u in us}.values())
    asked, derived = local_grad.unchained(outputs)
    # One backward pass: every weight gradient (only used when the uses cannot stand in for them:
    # unused ops are pruned) and the gradients of the uses' outputs, the activation chain shared.
    with _compat.loops_one_iteration_at_a_time():  # as the gathered step (effgrad.train.flows)
        grads = tape.gradient(target, [*variables, *asked])
    first = grads[: len(variables)]  # an embedding's IndexedSlices kept for the optimizer, as Keras hands them
    output_grads = {id(t): g for t, g in zip(asked, grads[len(variables) :]) if g is not None}
    local_grad.derive(derived, output_grads)
    if uses is not None:
        uses = _local_or_kept(uses, output_grads, first, target, variables)
    if uses is None:  # a second whole backward pass is needed
        looped = local_grad.read_in_loops(forward_ops, variables)  # (a persistent tape hides loops in functions)
        if looped:
            name = getattr(variables[looped[0]], "path", variables[looped[0]].name)
            raise Unfusable(
                f"{name} is read inside a loop (a recurrent layer), and a second backward pass through a loop "
                "keeps its weights once per iteration"
            )
        if not persistent:
            raise _SecondPass
    regularized = {i: v for i, v in enumerate(variables) if getattr(v, "regularizer", None) is not None}
    connected = [i for i, g in enumerate(first) if g is not None or i in regularized]
    update.warn_unconnected(variables, connected)
    trained = [variables[i] for i in connected]

    def loss_grads(grads):
        return [tf.zeros(v.shape, tf.float32) if g is None else g for v, g in zip(trained, grads)]

    def regularizer_grads(after) -> dict:
        # Each after its variable's loss gradient: computed up front they would all be alive at once.
        reg = {}
        for j, (i, g) in enumerate(zip(connected, after)):
            if i in regularized:
                with tf.control_dependencies([g]), tf.GradientTape() as t:
                    value = tf.cast(regularized[i].regularizer(regularized[i]), tf.float32)
                reg[j] = t.gradient(value, regularized[i])
        return reg

    def local(i):
        if uses is None or uses[i] is None:  # no uses to make it from: pass 1's gradient
            return first[i]
        return local_grad.weight_gradient(uses[i], output_grads)

    factor = loss_scale.unscale_factor()
    if uses is None or options.clip_norm is not None:  # every weight gradient: pass 1's, or from the kept dz
        summed = loss_grads([local(i) for i in connected])
        gate = update.Update(summed, regularizer_grads(summed), factor=factor, clip_norm=options.clip_norm)
        finite = gate.finite()
    else:  # finiteness from bounds where they suffice: most weight gradients are made once, in pass 2
        flags = [_finite(lambda i=i: local(i), uses[i], output_grads, variables[i]) for i in connected]
        gate = update.Update([], regularizer_grads(flags), factor=factor)
        finite = tf.reduce_all([gate.finite(), *flags])
    clip = gate.clip()
    reg_loss = tf.zeros([], tf.float32)
    if regularized:
        reg_loss = tf.add_n([tf.cast(v.regularizer(v), tf.float32) for v in regularized.values()])
    has_weight = tf.constant(True)
    if reduction == "mean_with_sample_weight" and options.skip_zero_weight_batches:
        has_weight = normalizer > 0

    def apply():
        branch = tf.compat.v1.get_default_graph()
        if uses is None:  # backprop again
            with _compat.loops_one_iteration_at_a_time():
                made = tape.gradient(target, trained)
            makers = [[] if g is None or tf.executing_eagerly() else [g.op] for g in made]
        else:  # each weight gradient from the kept dz: the ops that start it wait (pace)
            made, makers = [], []
            for i in connected:
                start = len(branch.get_operations())
                made.append(local(i))
                makers.append(_roots(branch.get_operations()[start:]))
        second = loss_grads(made)
        final = update.Update(second, regularizer_grads(second), factor=factor)
        grads = [final.gradient(j, clip) for j in range(len(second))]
        known = len(branch.get_operations())
        with _compat.gradients_already_reduced(train_step.optimizer), inplace.compiled(train_step.optimizer):
            update.apply_gradients(train_step.optimizer, grads, trained)
        sizes = [math.prod(v.shape) for v in trained]
        overlap = getattr(train_step.optimizer, "updates_in_flight", 1)
        pace(makers, grads, branch.get_operations()[known:], sizes, overlap)
        for variable, value in commit:
            variable.assign(value)
        return tf.constant(True)

    applied = tf.cond(finite & has_weight, apply, lambda: tf.constant(False))
    with tf.control_dependencies([applied]):
        updated = tf.cond(has_weight, lambda: train_step.update_loss_scale(finite), lambda: tf.constant(False))
    with tf.control_dependencies([updated]):
        loss = tf.identity(objective_lib.normalize(total, normalizer, reduction) + reg_loss)
        return {"loss": loss, "loss_scale": tf.identity(loss_scale.value), "grads_finite": finite}


def pace(makers: list, grads: list, update_ops: list, sizes: list[int], overlap: float = 1) -> None:
    """Makes backprop wait for the updates: each gradient is made after the earlier ones' updates.

    Without it the executor is free to run the whole backward pass ahead of
    slow updates (one inter-op thread, compact state, a loaded machine) and
    hold every gradient, as the gathered step does. Variables are taken in
    backprop's order (the reverse of the model's); the ops that start making
    the gradient at position ``p`` wait for the updates of every position up
    to ``q``: the updates still running, those between ``q`` and ``p``, add
    up to at most ``overlap`` times the largest variable. With ``overlap=1``,
    on 8 equal Dense kernels one kernel's update runs at a time (a second
    would hold another kernel-sized gradient, for no time); on a transformer
    whose largest variable is its token embedding, the small kernels of many
    layers update side by side (one at a time would leave a core idle).
    Nothing is added where it could deadlock: when an
    update depends on the gradient it would delay (an optimizer that reads
    every gradient before any update).

    Args:
        makers: Per trained variable, the ops that start making its gradient (empty where it has none).
        grads: The gradients handed to the optimizer, same order.
        update_ops: The ops the optimizer's ``apply`` created.
        sizes: Per trained variable, its number of elements.
        overlap: See above; 0: one update at a time.
    """
    if tf.executing_eagerly():  # op by op: the tape has made every gradient already
        return
    writes = _writes_per_gradient(grads, update_ops)
    order = [j for j in reversed(range(len(makers))) if makers[j] and writes.get(j)]
    largest = max((sizes[j] for j in order), default=0)
    retired, done, before = -1, None, set()  # the updates up to position `retired`, grouped in `done`
    for p in range(len(order)):
        between, q = 0, p - 1
        while q >= 0 and between + sizes[order[q]] <= overlap * largest:
            between += sizes[order[q]]
            q -= 1
        while retired < q:  # q only grows: each update joins the group once
            retired += 1
            writes_r = writes[order[retired]]
            _ancestors(writes_r, before)
            done = tf.group(*writes_r, *([] if done is None else [done]))
        if done is None:
            continue
        for maker in makers[order[p]]:
            if maker.graph is done.graph and id(maker) not in before:
                _compat.add_control_input(maker, done)


def _roots(ops: list) -> list:
    """The ops among ``ops`` that take no input computed by another of them: where the computation starts.

    Placeholders (a cond branch's captured inputs) and constants are no computation.
    """
    computed = [op for op in ops if op.type not in ("Placeholder", "Const")]
    made = {id(op) for op in computed}
    return [op for op in computed if not any(id(t.op) in made for t in op.inputs)]


def _local_or_kept(uses: list, output_grads: dict, first: list, target, variables: list) -> list | None:
    """Per variable, the uses its gradient is made from in pass 2, or None: pass 1's gradient is kept.

    A variable's uses do not account for its gradient when it has none found
    or when one that computes the loss (an ancestor of ``target``) has no
    gradient: the tape did not record it as such because it sits inside a
    custom gradient (a recomputed block, a fused loss), whose gradient
    reaches the variable another way. Such variables keep pass 1's gradient
    while that is at most 1.2 times the largest variable (a tied embedding
    read by a fused loss); beyond (a checkpointed model), None: two whole
    backward passes.
    """
    computes_loss = _ancestors([target.op])

    def accounted(i):
        return bool(uses[i]) and all(
            id(use.output) in output_grads or id(use.op) not in computes_loss for use in uses[i]
        )

    local = [uses[i] if first[i] is None or accounted(i) else None for i in range(len(uses))]
    kept = sum(math.prod(v.shape) for v, us, g in zip(variables, local, first) if us is None and g is not None)
    return local if kept <= 1.2 * max(math.prod(v.shape) for v in variables) else None


def _finite(make, uses: list, output_grads: dict, variable) -> tf.Tensor:
    """Whether ``variable``'s loss gradient (``make()``) is finite: from the bound, or made and summed."""

    def made():
        g = make()
        if isinstance(g, tf.IndexedSlices):
            g = g.values  # its rows: the table itself is not made for a check
        return tf.constant(True) if g is None else tf.math.is_finite(tf.reduce_sum(g))

    bound = None if uses is None else local_grad.finite_bound(uses, output_grads, math.prod(variable.shape))
    return made() if bound is None else tf.cond(bound, lambda: tf.constant(True), made)


def _writes_per_gradient(grads: list, update_ops: list) -> dict:
    """``{j: [variable writes of the update made from grads[j]]}``, among the ops ``apply`` created.

    Downstream of the gradient, and of what those writes wrote: Keras's Adam
    writes its moments from the gradient, then reads them again (a new read,
    ordered after the write only when the function is finished) to write the
    variable.
    """
    created = {id(op) for op in update_ops}
    users = {}  # a resource handle -> the created ops that take it
    for op in update_ops:
        for tensor in op.inputs:
            if tensor.dtype == tf.resource:
                users.setdefault(id(tensor), []).append(op)
    found = {}
    for j, gradient in enumerate(grads):
        if gradient is None:
            continue
        seen, stack, writes = set(), [gradient.op], []
        while stack:
            op = stack.pop()
            following = [c for out in op.outputs for c in out.consumers()]
            if _is_write(op):
                writes.append(op)
                following += users.get(id(op.inputs[0]), [])
            for consumer in following:
                if id(consumer) in created and id(consumer) not in seen:
                    seen.add(id(consumer))
                    stack.append(consumer)
        found[j] = writes
    return found


def _is_write(op) -> bool:
    kind = op.type
    if kind == "StatefulPartitionedCall":  # a compiled update (effgrad.train.inplace) writes inside
        return any(t.dtype == tf.resource for t in op.inputs)
    return (kind.startswith("Assign") and kind.endswith("VariableOp")) or kind.startswith("ResourceScatter")


def _ancestors(ops: list, seen: set | None = None) -> set:
    """``id`` of every op that ``ops`` depend on (data or control), theirs included, added to ``seen``.

    What ``seen`` holds already is not walked again (its ancestors are taken to be in it).
    """
    seen = set() if seen is None else seen
    stack = [op for op in ops if id(op) not in seen]
    seen.update(id(op) for op in stack)
    while stack:
        op = stack.pop()
        for parent in [t.op for t in op.inputs] + list(op.control_inputs):
            if id(parent) not in seen:
                seen.add(id(parent))
                stack.append(parent)
    return seen
