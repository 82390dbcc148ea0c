"""checkpoint_model on architectures nobody here wrote: keras.applications and keras_hub backbones.

Built from constructor arguments with random weights (``weights=None``, no
presets): nothing is downloaded.
"""

import os

import keras
import keras_hub
import numpy as np
import pytest
import tensorflow as tf

import effgrad
from conftest import assert_variables_close
from helpers import numpy_vars, tiny_gpt2_lm
from test_checkpoint_model import _outputs_and_grads, assert_same_computation


def _same_as_eager_plain(make, x, mode, trainings=(True, False), atol=1e-4):
    """assert_same_computation in each of ``trainings``, on one model and its one checkpointed model, with
    the plain model, the reference, run eagerly: only the checkpointed model is traced in ``mode``."""
    model, checkpointed = make(), None
    for training in trainings:
        before = numpy_vars(model.non_trainable_variables)
        y0, g0 = _outputs_and_grads(model, model.trainable_variables, x, "eager", training)
        after = numpy_vars(model.non_trainable_variables)
        for variable, value in zip(model.non_trainable_variables, before):
            variable.assign(value)
        checkpointed = checkpointed or effgrad.checkpoint_model(model)
        y1, g1 = _outputs_and_grads(checkpointed, model.trainable_variables, x, mode, training)
        assert_variables_close(y1, y0, atol=atol)
        assert_variables_close(g1, g0, atol=atol, rtol=1e-4)
        # Seeds moved exactly as in the plain step (twice would differ).
        assert_variables_close(model.non_trainable_variables, after, atol=atol)
    return checkpointed


# ResNet50 (residual adds) and MobileNetV2 (depthwise, inverted residuals) run by default. EfficientNetB0
# (squeeze-and-excitation multiplies, 24 s) and DenseNet121 (78 cuts, each a concatenation, 45 s) also pass;
# they run with EFFGRAD_ALL_ARCHITECTURES=1, out of the default run for the suite's time.
APPLICATIONS = ["ResNet50", "MobileNetV2"] + (
    ["EfficientNetB0", "DenseNet121"] if os.environ.get("EFFGRAD_ALL_ARCHITECTURES") == "1" else []
)


def _application(name):
    def make():
        keras.utils.set_random_seed(0)
        return getattr(keras.applications, name)(weights=None, input_shape=(32, 32, 3), classes=5)

    return make


@pytest.mark.parametrize("name", APPLICATIONS)
def test_applications_equal_plain_in_training_and_inference(rng, name):
    x = tf.constant(rng.normal(size=(2, 32, 32, 3)).astype("float32"))
    # Eagerly: the cuts are the same in every mode (each mode: test_checkpoint_model), and a trace of
    # these hundreds of layers costs more than running them on 2 images of 32 x 32.
    checkpointed, plain = assert_same_computation(_application(name), x, mode="eager", training=True, atol=1e-4)
    np.testing.assert_allclose(checkpointed(x, training=False), plain(x, training=False), atol=1e-5)
    segments = sum(isinstance(layer, effgrad.Checkpoint) for layer in checkpointed.layers)
    assert segments >= 4
    # ResNet50's layers are no chain (residual adds): checkpoint_sequential refuses them, asked here of
    # the model built already (another costs 2 s to build).
    if name == "ResNet50":
        with pytest.raises(ValueError, match="not a chain.*checkpoint_model"):
            effgrad.checkpoint_sequential(plain.layers)


def _backbone(kind, dropout=0.1, layers=2):
    def make():
        keras.utils.set_random_seed(0)
        cls = {"gpt2": keras_hub.models.GPT2Backbone, "bert": keras_hub.models.BertBackbone}[kind]
        return cls(
            vocabulary_size=50,
            num_layers=layers,  # 2: 3 segments (sqrt), a cut between the transformer layers
            num_heads=2,
            hidden_dim=16,
            intermediate_dim=32,
            max_sequence_length=8,
            dropout=dropout,
        )

    return make


def _tokens(rng, kind):
    padding_mask = np.array([[1] * 8, [1] * 5 + [0] * 3], dtype="int32")
    x = {"token_ids": rng.integers(1, 50, size=(2, 8)).astype("int32") * padding_mask, "padding_mask": padding_mask}
    if kind == "bert":
        x["segment_ids"] = np.zeros((2, 8), dtype="int32")
    return {k: tf.constant(v) for k, v in x.items()}


# One mode each (BERT's compile alone took 18 s of the suite): the cut is the same code. XLA, in training
# (dropout), is the task model's test below: the same GPT-2 transformer layers, cut, with padding. BERT has
# two transformer layers, a cut between them: the padding mask goes into two segments. GPT-2 has one (its
# mask goes into one later segment): each layer more nearly doubles a trace, and an input carried into
# several segments of a traced function is test_checkpoint_model's residual model's.
@pytest.mark.parametrize("kind, mode, layers", [("gpt2", "function", 1), ("bert", "eager", 2)])
def test_keras_hub_backbones_equal_plain_with_padding_and_dropout(rng, kind, mode, layers):
    x = _tokens(rng, kind)
    make = _backbone(kind, layers=layers)
    checkpointed = _same_as_eager_plain(make, x, mode)  # training: dropout masks must match the plain model's
    # The padding mask is carried to every segment, not dropped: padded tokens change nothing.
    other = dict(x, token_ids=tf.where(x["padding_mask"] > 0, x["token_ids"], 7))
    first = tf.nest.flatten(checkpointed(x))[-1 if kind == "bert" else 0]
    second = tf.nest.flatten(checkpointed(other))[-1 if kind == "bert" else 0]
    np.testing.assert_allclose(first[1, :5], second[1, :5], atol=1e-5)
    assert sum(isinstance(layer, effgrad.Checkpoint) for layer in checkpointed.layers) >= 2


def test_keras_hub_round_trip(rng, tmp_path):
    x = _tokens(rng, "bert")
    original = _backbone("bert")()
    checkpointed = effgrad.checkpoint_model(original, segments=3)
    checkpointed.save(tmp_path / "bert.keras")
    loaded = keras.models.load_model(tmp_path / "bert.keras")
    for a, b in zip(tf.nest.flatten(loaded(x)), tf.nest.flatten(original(x))):
        np.testing.assert_allclose(a, b, atol=1e-6)


@pytest.mark.parametrize("mode", ["xla"])  # tf.function and eager: the backbones' test above
def test_a_keras_hub_task_model_is_cut_inside_its_backbone(rng, mode, tmp_path):
    # GPT2CausalLM's graph is two calls: its backbone (a functional model) and the tied
    # projection. The backbone's layers are the cuts; the projection stays outside. One transformer
    # layer: the embeddings and it are cuts enough for 2 segments (each layer more: seconds of XLA).
    x = _tokens(rng, "gpt2")
    # The plain model compiled too (not run eagerly): XLA draws other dropout masks than TensorFlow's kernels.
    checkpointed, _ = assert_same_computation(lambda: tiny_gpt2_lm(dropout=0.1, layers=1), x, mode=mode, segments=2)
    assert sum(isinstance(layer, effgrad.Checkpoint) for layer in checkpointed.layers) == 2
    assert checkpointed.layers[-1].name == "token_embedding"  # the projection, called as it is
    checkpointed.save(tmp_path / "lm.keras")
    loaded = keras.models.load_model(tmp_path / "lm.keras")
    np.testing.assert_allclose(loaded(x, training=False), checkpointed(x, training=False), atol=1e-6)


def test_a_sub_model_called_in_inference_mode_stays_one_call(rng):
    # base(x, training=False) (a frozen base's BatchNorm) is an argument its layers would not get
    # if its calls were walked one by one: it stays one call. Called plainly, its blocks are cuts.
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    h = inputs
    for _ in range(3):
        h = keras.layers.BatchNormalization()(keras.layers.Dense(8, activation="relu")(h))
    base = keras.Model(inputs, h, name="base")
    frozen = keras.Input((8,))
    frozen_model = keras.Model(frozen, keras.layers.Dense(3)(base(frozen, training=False)))
    assert [node.layer.name for node in effgrad.model_graph.layer_graph(frozen_model).nodes][0] == "base"
    walked = effgrad.model_graph.layer_graph(keras.Model(frozen, keras.layers.Dense(3)(base(frozen))))
    assert len(walked.nodes) == 7 and len(walked.cuts) == 5
    x = tf.constant(rng.normal(size=(4, 8)).astype("float32"))
    light = effgrad.checkpoint_model(frozen_model, segments=1)
    np.testing.assert_allclose(light(x, training=True), frozen_model(x, training=True), atol=1e-6)


def test_checkpoint_sequential_refuses_what_it_cannot_carry():
    # A model whose layers are no chain (ResNet50's): test_applications_equal_plain_in_training_and_inference.
    bert = _backbone("bert")()
    # each transformer layer was called with padding_mask=: a stack would drop it
    with pytest.raises(ValueError, match="padding_mask.*checkpoint_model"):
        effgrad.checkpoint_sequential(bert.transformer_layers)
