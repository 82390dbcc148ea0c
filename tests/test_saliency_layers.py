"""layer=: maps at a layer's output (token attribution for keras_hub text models), checked without effgrad.

The independent reference: when every token id of a batch is distinct, the
gradient of the score with respect to the embedding output at position t is
row ``ids[t]`` of the gradient with respect to the embedding *matrix*, which a
plain tape gives. Zeroing that matrix runs the model at IG's zero baseline.
"""

import sys
import threading
import time

import keras
import keras_hub
import numpy as np
import pytest
import tensorflow as tf

import effgrad
from helpers import png_pixels

V, T, B = 400, 12, 4
# One transformer layer in each model: the maps are read at the token embedding, below it, and what is
# checked does not depend on the depth; each layer more lengthens every trace (a second: 40% more time).


def _bert(seed=0):
    keras.utils.set_random_seed(seed)
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=V, num_layers=1, num_heads=2, hidden_dim=16, intermediate_dim=32, max_sequence_length=T
    )
    return keras_hub.models.BertTextClassifier(backbone=backbone, num_classes=3, preprocessor=None)


def _gpt2_classifier(seed=0):
    """keras_hub has no GPT-2 classifier: a GPT2Backbone, mean-pooled over the unpadded tokens, and a head."""
    keras.utils.set_random_seed(seed)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=V, num_layers=1, num_heads=2, hidden_dim=16, intermediate_dim=32, max_sequence_length=T
    )
    ids = keras.Input((None,), dtype="int32", name="token_ids")
    mask = keras.Input((None,), dtype="int32", name="padding_mask")
    hidden = backbone({"token_ids": ids, "padding_mask": mask})
    weights = keras.ops.cast(mask, "float32")[..., None]
    pooled = keras.ops.sum(hidden * weights, axis=1) / keras.ops.sum(weights, axis=1)
    return keras.Model({"token_ids": ids, "padding_mask": mask}, keras.layers.Dense(3)(pooled)), backbone


def _tokens(rng, segment_ids=True):
    ids = rng.permutation(np.arange(1, V))[: B * T].reshape(B, T).astype("int32")  # all distinct
    mask = np.ones((B, T), "int32")
    mask[0, 8:] = 0
    mask[2, 5:] = 0
    x = {"token_ids": ids, "padding_mask": mask}
    if segment_ids:
        x["segment_ids"] = np.zeros((B, T), "int32")
    return x


def _embedding_rows_gradient(model, embedding, x, unit):
    """d score / d (embedding output) through the embedding matrix: row ids[b, t] per position.

    ``unit``: the output unit scored, one for every row or one per row."""
    with tf.GradientTape() as tape:
        outputs = model(x, training=False)
        score = tf.reduce_sum(outputs * tf.one_hot(np.broadcast_to(unit, [B]), outputs.shape[-1]))
    return tf.convert_to_tensor(tape.gradient(score, embedding.embeddings)).numpy()[x["token_ids"]]


def _at_zero_embedding(model, embedding, x, unit):
    saved = embedding.embeddings.numpy()
    embedding.embeddings.assign(np.zeros_like(saved))
    try:
        return model(x, training=False)[:, unit].numpy()
    finally:
        embedding.embeddings.assign(saved)


@pytest.fixture(scope="module")
def bert():
    """``(BERT, x)``, shared by the tests below that read BERT and change nothing (one puts the embedding
    matrix back): a job one of them cached on it gives another the same maps it would trace."""
    return _bert(), _tokens(np.random.default_rng(0))


@pytest.fixture(scope="module", params=["bert", "gpt2"])
def text_model(request):
    """``(model, token embedding, x)``."""
    if request.param == "bert":
        model, x = request.getfixturevalue("bert")
        return model, model.backbone.get_layer("token_embedding"), x
    model, backbone = _gpt2_classifier()
    return model, backbone.get_layer("token_embedding"), _tokens(np.random.default_rng(0), segment_ids=False)


def test_gradient_at_the_token_embedding_equals_a_tape_on_the_embedding_output(text_model):
    model, embedding, x = text_model
    maps = effgrad.saliency(model, x, layer="token_embedding", target=1, batch_size=3, progress=False)
    assert maps.shape == (B, T, 16)
    expected = _embedding_rows_gradient(model, embedding, x, unit=1)
    np.testing.assert_allclose(maps, expected, rtol=1e-4, atol=1e-6)
    assert np.abs(maps[x["padding_mask"] == 1]).sum(-1).min() > 0
    np.testing.assert_allclose(maps[x["padding_mask"] == 0], 0.0, atol=1e-7)  # the padding mask reached the model
    by_object = effgrad.saliency(model, x, layer=embedding, target=1, batch_size=3, progress=False)
    np.testing.assert_array_equal(by_object, maps)


def test_integrated_gradients_complete_at_the_layer(text_model):
    model, embedding, x = text_model
    ig = effgrad.saliency(model, x, layer="token_embedding", method="integrated_gradients", steps=64, target=0)
    gap = model(x, training=False)[:, 0].numpy() - _at_zero_embedding(model, embedding, x, unit=0)
    assert np.abs(gap).min() > 1e-5  # the check below is not 0 == 0
    np.testing.assert_allclose(ig.reshape(B, -1).sum(1), gap, rtol=0.01, atol=1e-6)


def test_every_method_works_at_a_layer_and_reduces_to_one_score_per_token(bert, l2_scores):
    model, x = bert
    plain = effgrad.saliency(model, x, layer="token_embedding", target=2, progress=False)
    per_token = np.load(l2_scores[2])  # reduce="l2" of the same maps (target 2)
    np.testing.assert_allclose(per_token, np.sqrt((plain**2).sum(-1)), rtol=1e-5, atol=1e-7)
    noiseless = effgrad.saliency(
        model, x, layer="token_embedding", method="smoothgrad", samples=3, noise=0.0, target=2, progress=False
    )
    np.testing.assert_allclose(noiseless, plain, rtol=1e-5, atol=1e-7)
    times_input = effgrad.saliency(model, x, layer="token_embedding", method="gradient_x_input", target=2)
    embedded = model.backbone.get_layer("token_embedding")(x["token_ids"]).numpy()
    np.testing.assert_allclose(times_input, embedded * plain, rtol=1e-5, atol=1e-7)
    ds = tf.data.Dataset.from_tensor_slices((x, np.zeros(B, "int32"))).batch(3)  # (x, y) with x a dict of ints
    np.testing.assert_allclose(
        effgrad.saliency(model, ds, layer="token_embedding", target=2, progress=False), plain, rtol=1e-5, atol=1e-7
    )
    noisy = effgrad.saliency(model, x, layer="token_embedding", method="smoothgrad", samples=3, noise=0.2, target=2)
    assert np.abs(noisy - plain).max() > 1e-4  # the noise is added in the layer's output space


def test_layer_maps_shard_across_replicas(strategy, bert):
    model, x = bert
    sharded = effgrad.saliency(model, x, layer="token_embedding", strategy=strategy, progress=False)
    # Against the tape (the maps unsharded agree with it: the tests above), not a second job to trace.
    argmax = np.argmax(model(x, training=False), axis=-1)  # the default target
    expected = _embedding_rows_gradient(model, model.backbone.get_layer("token_embedding"), x, unit=argmax)
    np.testing.assert_allclose(sharded, expected, rtol=1e-5, atol=1e-7)


def _waits_to_patch(thread) -> bool:
    """``thread`` stands in effgrad's layer patch (``intercepted_call``) before patching: at its lock."""
    from effgrad import _compat

    frame = sys._current_frames().get(thread.ident)
    return frame is not None and frame.f_code is _compat.keras_layers.intercepted_call.__wrapped__.__code__


def test_traces_in_two_threads_take_turns_with_the_layer_patch(bert):
    from effgrad import _compat

    model, x = bert
    # The gradient test's target and batch size: its job, if still in the model's cache (the same maps either way).
    expected = effgrad.saliency(model, x, layer="token_embedding", target=1, batch_size=3, progress=False)
    found = {}

    def other_job():  # a target no other test of BERT asks for: a job of its own, traced (not from the cache)
        found["maps"] = effgrad.saliency(model, x, layer="token_embedding", target=0, progress=False)

    with _compat.keras_layers._INTERCEPTING:  # as while another thread's job is being traced with the layer patched
        worker = threading.Thread(target=other_job)
        worker.start()
        # Until its trace reaches the patch, whose lock this thread holds: it cannot get past it (unlocked,
        # it would go on, finish, and never be seen there). Watched, not waited out for a guessed time.
        deadline = time.monotonic() + 300
        while worker.is_alive() and not _waits_to_patch(worker) and time.monotonic() < deadline:
            time.sleep(0.005)
        assert _waits_to_patch(worker) and not found  # it waits for the patch to be undone
    worker.join()
    assert "call" not in model.backbone.get_layer("token_embedding").__dict__  # the layer is itself again
    again = effgrad.saliency(model, x, layer="token_embedding", target=1, batch_size=3, progress=False)
    np.testing.assert_array_equal(again, expected)
    np.testing.assert_allclose(
        found["maps"],
        _embedding_rows_gradient(model, model.backbone.get_layer("token_embedding"), x, unit=0),
        rtol=1e-4,
        atol=1e-6,
    )


def test_bad_layers_are_refused_before_any_work(tmp_path, bert):
    model, x = bert
    with pytest.raises(ValueError, match="no layer named 'token_embeddings'.*token_embedding"):
        effgrad.saliency(model, x, layer="token_embeddings", out=tmp_path / "m.npy", progress=False)
    with pytest.raises(ValueError, match="not a layer of this model"):
        effgrad.saliency(model, x, layer=keras.layers.Dense(2), progress=False)
    with pytest.raises(ValueError, match="is an input"):
        effgrad.saliency(model, x, layer="token_ids", progress=False)
    keras.utils.set_random_seed(0)
    shared = keras.layers.Dense(4, name="shared")
    inputs = keras.Input((4,))
    twice = keras.Model(inputs, shared(shared(inputs)))
    with pytest.raises(ValueError, match="runs 2 times"):
        effgrad.saliency(twice, np.ones((2, 4), "float32"), layer="shared", progress=False)
    assert not list(tmp_path.iterdir())


@pytest.fixture(scope="module")
def l2_scores(tmp_path_factory, bert):
    """``(model, x, out)``: BERT's per-token l2 scores of ``x`` (of class 2) written to ``out``, one job for
    the tests that read them (none changes the model or the file)."""
    model, x = bert
    out = tmp_path_factory.mktemp("l2_scores") / "m.npy"
    effgrad.saliency(model, x, layer="token_embedding", reduce="l2", target=2, out=out, progress=False)
    return model, x, out


def test_resume_with_another_layer_is_refused(l2_scores):
    model, x, out = l2_scores
    with pytest.raises(ValueError, match="layer"):
        effgrad.saliency(model, x, layer="position_embedding", reduce="l2", target=2, out=out, resume=True)


def test_token_scores_picture(tmp_path, l2_scores):
    from effgrad.explain import visualize

    _, x, out = l2_scores
    scores = np.load(out)
    words = [[f"w{i}" for i in row] for row in x["token_ids"]]
    path = visualize.save_tokens(tmp_path / "tokens.png", words, scores, mask=x["padding_mask"])
    flat = visualize.save_tokens(tmp_path / "flat.png", words, np.ones_like(scores), mask=x["padding_mask"])
    # The heat behind each token comes from its score: equal scores give another picture.
    assert png_pixels(path).shape == png_pixels(flat).shape and not np.allclose(png_pixels(path), png_pixels(flat))
