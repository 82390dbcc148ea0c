"""Every TensorFlow/Keras internal effgrad borrows, in one place, checked at import.

effgrad needs a handful of non-public hooks (each module of this package lists its own, with why). A
TensorFlow or Keras release may rename any of them; effgrad must then fail
loudly at import, naming the versions, instead of silently falling back to a
path that computes something else (e.g. a second all-reduce that multiplies
every multi-replica update by the number of replicas).

Tested with TensorFlow 2.21 and Keras 3.15 (pinned in pyproject.toml).
"""

from __future__ import annotations

from effgrad._compat.keras_layers import (
    BaseConv,
    BaseDepthwiseConv,
    LayerCall,
    attention_classes,
    attention_internals,
    call_context_training,
    class_attention,
    flatten_layers,
    functional_graph,
    hook_method,
    inbound_nodes,
    intercepted_call,
    is_global_seed_state,
    model_state,
    override_method,
    own_variables,
    plain_convolution,
    producer,
    replaced,
    restore_method,
    rnn_loop,
    seed_states,
)
from effgrad._compat.keras_optimizers import (
    SavedAsVariable,
    SlotsOfStandIns,
    adam_slots,
    built_for,
    config_and_exclusions,
    exclude_from_weight_decay_as,
    gradients_already_reduced,
    learning_rate,
    optimizer_strategy,
    set_exclusions,
    set_learning_rate,
    show_built_for,
    slots_standing_in,
    track_variable,
    variable_key,
)
from effgrad._compat.keras_training import (
    apply_mask,
    build_compiled_metrics,
    build_empty_compiled_metrics,
    compile_state,
    compiled_loss,
    compiled_metric_objects,
    get_keras_mask,
    get_stateless_scope,
    has_compiled_metrics,
    loss_function_arguments,
    loss_tracker,
    loss_weights,
    recording_compiled_loss,
    set_compiled_optimizer,
    set_keras_mask,
    squeeze_or_expand_to_same_rank,
)
from effgrad._compat.tf_ops import (
    add_control_input,
    collective_arguments,
    collective_launchers,
    context_started,
    current_device,
    custom_gradient,
    dynamic_update_slice,
    empty_variable,
    function_def,
    gradient_function,
    in_xla_context,
    loops_one_iteration_at_a_time,
    optimization_barrier,
    refill_variable,
    stop_recording,
    tape_records,
)
from effgrad._compat.versions import TESTED

__all__ = [
    "BaseConv",
    "BaseDepthwiseConv",
    "LayerCall",
    "SavedAsVariable",
    "SlotsOfStandIns",
    "TESTED",
    "adam_slots",
    "add_control_input",
    "apply_mask",
    "attention_classes",
    "attention_internals",
    "build_compiled_metrics",
    "build_empty_compiled_metrics",
    "built_for",
    "call_context_training",
    "class_attention",
    "collective_arguments",
    "collective_launchers",
    "compile_state",
    "compiled_loss",
    "compiled_metric_objects",
    "config_and_exclusions",
    "context_started",
    "current_device",
    "custom_gradient",
    "dynamic_update_slice",
    "empty_variable",
    "exclude_from_weight_decay_as",
    "flatten_layers",
    "function_def",
    "functional_graph",
    "get_keras_mask",
    "get_stateless_scope",
    "gradient_function",
    "gradients_already_reduced",
    "has_compiled_metrics",
    "hook_method",
    "in_xla_context",
    "inbound_nodes",
    "intercepted_call",
    "is_global_seed_state",
    "learning_rate",
    "loops_one_iteration_at_a_time",
    "loss_function_arguments",
    "loss_tracker",
    "loss_weights",
    "mmap_of",
    "model_state",
    "optimization_barrier",
    "optimizer_strategy",
    "override_method",
    "own_variables",
    "plain_convolution",
    "producer",
    "recording_compiled_loss",
    "refill_variable",
    "replaced",
    "restore_method",
    "rnn_loop",
    "seed_states",
    "set_compiled_optimizer",
    "set_exclusions",
    "set_keras_mask",
    "set_learning_rate",
    "show_built_for",
    "slots_standing_in",
    "squeeze_or_expand_to_same_rank",
    "stop_recording",
    "tape_records",
    "track_variable",
    "variable_key",
]


def mmap_of(array):
    """The ``mmap`` under a ``np.memmap`` (to release its pages), or None: then nothing is released.

    An instance attribute (no class-level check at import): a NumPy without it
    only stops effgrad from handing read pages back to the OS early.
    """
    return getattr(array, "_mmap", None)
