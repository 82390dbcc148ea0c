"""Saliency of models with several inputs: nests in, the same nests of maps out, streamed and resumable."""

import json
import signal
import textwrap
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

import effgrad
from effgrad.explain import engine, sinks
from helpers import Forked, assert_summary_equals_numpy

N = 40


def _two_input_model(seed=0, dict_inputs=True):
    """Image + tabular features -> 3 logits (a product couples the two, so each map depends on the other input)."""
    keras.utils.set_random_seed(seed)
    image = keras.Input((8, 8, 2), name="image")
    tabular = keras.Input((5,), name="tabular")
    a = keras.layers.Dense(6, activation="tanh")(keras.layers.Flatten()(keras.layers.Conv2D(3, 3)(image)))
    b = keras.layers.Dense(6, activation="tanh")(tabular)
    logits = keras.layers.Dense(3)(keras.layers.Concatenate()([a, b, keras.layers.Multiply()([a, b])]))
    return keras.Model({"image": image, "tabular": tabular} if dict_inputs else [image, tabular], logits)


# Saliency reads the model and never changes it: the tests of the dict-input model share one, so each
# compiled job (cached on the model) is traced once for the file, not again in every test that uses it.
@pytest.fixture(scope="module")
def model():
    return _two_input_model()


@pytest.fixture
def data(rng):
    return {
        "image": rng.normal(size=(N, 8, 8, 2)).astype("float32"),
        "tabular": rng.normal(size=(N, 5)).astype("float32"),
    }


def _tape(model, inputs, unit):
    tensors = tf.nest.map_structure(tf.constant, inputs)
    with tf.GradientTape() as tape:
        tape.watch(tensors)
        score = tf.reduce_sum(model(tensors, training=False)[:, unit])
    return tf.nest.map_structure(lambda g: g.numpy(), tape.gradient(score, tensors))


def test_two_input_model_equals_a_hand_written_tape_for_each_input(model, data):
    expected = _tape(model, data, unit=1)
    maps = effgrad.saliency(model, data, target=1, batch_size=16, progress=False)
    assert set(maps) == {"image", "tabular"}
    for name in maps:
        np.testing.assert_allclose(maps[name], expected[name], rtol=1e-5, atol=1e-7)
    x_times = effgrad.saliency(model, data, method="gradient_x_input", target=1, batch_size=16, progress=False)
    for name in maps:
        np.testing.assert_allclose(x_times[name], data[name] * expected[name], rtol=1e-5, atol=1e-7)


def test_tuple_inputs_dataset_of_nests_and_generator_give_the_same_maps(data):
    model = _two_input_model(dict_inputs=False)
    pair = (data["image"], data["tabular"])
    expected = _tape(model, list(pair), unit=2)
    from_tuple = effgrad.saliency(model, pair, target=2, batch_size=16, progress=False)
    assert isinstance(from_tuple, tuple) and len(from_tuple) == 2
    labels = np.zeros(N, "int32")
    dataset = tf.data.Dataset.from_tensor_slices((pair, labels)).batch(12)  # elements (x, y), x a tuple
    from_dataset = effgrad.saliency(model, dataset, target=2, progress=False)
    generator = ((tuple(a[i : i + 7] for a in pair),) for i in range(0, N, 7))  # elements (x,)
    from_generator = effgrad.saliency(model, generator, target=2, progress=False)
    for maps in (from_tuple, from_dataset, from_generator):
        for got, want in zip(maps, expected):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


def test_dict_dataset_smoothgrad_and_ig_over_both_inputs(model, data):
    dataset = tf.data.Dataset.from_tensor_slices(data).batch(16)
    ig = effgrad.saliency(model, dataset, method="integrated_gradients", steps=64, target=0, progress=False)
    zeros = {k: np.zeros_like(v) for k, v in data.items()}
    gap = (model(data)[:, 0] - model(zeros)[:, 0]).numpy()
    total = ig["image"].reshape(N, -1).sum(1) + ig["tabular"].sum(1)
    np.testing.assert_allclose(total, gap, rtol=0.01, atol=1e-4)  # completeness over all inputs together
    # The same noise stream for both inputs would make an image channel and a feature share noise:
    # each input has its own. SmoothGrad with no noise is the plain gradient of each input (the tape's).
    smooth = effgrad.saliency(model, data, method="smoothgrad", samples=2, noise=0.0, target=0, progress=False)
    plain = _tape(model, data, unit=0)
    for name in data:
        np.testing.assert_allclose(smooth[name], plain[name], rtol=1e-5, atol=1e-7)


def test_integer_inputs_are_passed_through_and_mapped_to_none(rng):
    keras.utils.set_random_seed(0)
    ids = keras.Input((6,), dtype="int32", name="ids")
    weights = keras.Input((6,), name="weights")
    embedded = keras.layers.Embedding(30, 4)(ids)
    logits = keras.layers.Dense(2)(keras.layers.Flatten()(embedded * weights[..., None]))
    model = keras.Model({"ids": ids, "weights": weights}, logits)
    x = {"ids": rng.integers(0, 30, (10, 6)).astype("int32"), "weights": rng.normal(size=(10, 6)).astype("float32")}
    maps = effgrad.saliency(model, x, target=1, progress=False)
    assert maps["ids"] is None
    np.testing.assert_allclose(maps["weights"], _tape_one(model, x, "weights", 1), rtol=1e-5, atol=1e-7)
    with pytest.raises(TypeError, match="layer="):  # nothing float to differentiate
        effgrad.saliency(model, {"ids": x["ids"]}, progress=False)


def _tape_one(model, x, name, unit):
    tensors = {k: tf.constant(v) for k, v in x.items()}
    with tf.GradientTape() as tape:
        tape.watch(tensors[name])
        score = tf.reduce_sum(model(tensors, training=False)[:, unit])
    return tape.gradient(score, tensors[name]).numpy()


def test_outputs_are_one_file_or_buffer_per_input(model, tmp_path, data):
    expected = effgrad.saliency(model, data, reduce="abs_sum", batch_size=16, progress=False)
    maps = effgrad.saliency(model, data, reduce="abs_sum", batch_size=16, out=tmp_path / "maps.npy", progress=False)
    assert sorted(p.name for p in tmp_path.glob("*.npy")) == ["maps.image.npy", "maps.tabular.npy"]
    for name in data:
        np.testing.assert_array_equal(np.load(tmp_path / f"maps.{name}.npy"), expected[name])
        assert isinstance(maps[name], np.memmap)
    buffers = {"image": np.empty((N, 8, 8), "float32"), "tabular": np.empty((N,), "float32")}
    result = effgrad.saliency(model, data, reduce="abs_sum", batch_size=16, out=buffers, progress=False)
    assert result["image"] is buffers["image"]
    np.testing.assert_array_equal(buffers["tabular"], expected["tabular"])
    with pytest.raises(ValueError, match="several differentiated inputs"):
        effgrad.saliency(model, data, out=np.empty((N, 8, 8, 2), "float32"), progress=False)
    with pytest.raises(ValueError, match=r"\['image'\]"):  # a buffer missing for one input, before any work
        effgrad.saliency(model, data, out={"image": buffers["image"]}, reduce="abs_sum", progress=False)
    (tmp_path / "other.tabular.npy").write_bytes(b"mine")
    with pytest.raises(FileExistsError):  # the second file exists: the first is not left behind either
        effgrad.saliency(model, data, out=tmp_path / "other.npy", progress=False)
    assert not (tmp_path / "other.image.npy").exists()
    assert (tmp_path / "other.tabular.npy").read_bytes() == b"mine"


def test_summary_statistics_per_input_equal_numpy(model, data):
    maps = effgrad.saliency(model, data, reduce="abs_sum", progress=False)
    classes = model(data).numpy().argmax(-1)
    summary = effgrad.saliency_summary(model, data, reduce="abs_sum", batch_size=16, progress=False)
    assert_summary_equals_numpy(summary, maps, classes)


def test_ig_baseline_per_input(model, data):
    baseline = {"tabular": np.full(5, 0.5, "float32")}  # image: zeros
    ig = effgrad.saliency(model, data, method="integrated_gradients", steps=64, baseline=baseline, target=0)
    start = {"image": np.zeros_like(data["image"]), "tabular": np.full_like(data["tabular"], 0.5)}
    gap = (model(data)[:, 0] - model(start)[:, 0]).numpy()
    np.testing.assert_allclose(ig["image"].reshape(N, -1).sum(1) + ig["tabular"].sum(1), gap, rtol=0.01, atol=1e-4)
    with pytest.raises(ValueError, match="dict"):
        effgrad.saliency(model, data, method="integrated_gradients", baseline=np.zeros(5, "float32"))
    with pytest.raises(ValueError, match="not differentiated"):
        effgrad.saliency(model, data, method="integrated_gradients", baseline={"images": 0.0})


def test_members_committed_at_different_rows_resume_to_the_same_files(model, tmp_path, data, monkeypatch):
    """A kill between the two files' commits leaves them at different rows: the resume starts at the fewer."""
    expected = effgrad.saliency(model, data, batch_size=8, progress=False)
    monkeypatch.setattr(engine, "_COMMIT_EVERY_SECONDS", -1.0)  # commit after every batch
    real_commit = sinks.NpyFileSink.commit

    def dies_between_members(self, rows, input_crc=0):
        if self.path.name == "maps.tabular.npy" and rows >= 24:
            raise OSError("killed between the two files' commits")
        real_commit(self, rows, input_crc)

    monkeypatch.setattr(sinks.NpyFileSink, "commit", dies_between_members)
    with pytest.raises(OSError, match="killed"):
        effgrad.saliency(model, data, batch_size=8, out=tmp_path / "maps.npy", progress=False)
    monkeypatch.setattr(sinks.NpyFileSink, "commit", real_commit)
    committed = {
        name: json.loads((tmp_path / f"maps.{name}.npy.journal.json").read_text())["committed"] for name in data
    }
    assert committed["image"] > committed["tabular"] > 0, committed
    maps = effgrad.saliency(model, data, batch_size=8, out=tmp_path / "maps.npy", resume=True, progress=False)
    for name in data:
        np.testing.assert_array_equal(maps[name], expected[name])


_CHILD = textwrap.dedent(
    """
    import sys, time
    import numpy as np, keras, effgrad
    model = keras.models.load_model(sys.argv[1])
    x = {k: np.load(sys.argv[2], mmap_mode="r")[k] for k in ("image", "tabular")}
    def slow():
        for i in range(0, len(x["image"]), 8):
            time.sleep(0.05)
            yield ({k: v[i : i + 8] for k, v in x.items()}, np.zeros(8))
    effgrad.saliency(model, slow(), batch_size=8, num_examples=400, out=sys.argv[3], progress=False)
    """
)


def test_sigkilled_run_with_nested_inputs_resumes_to_the_same_files(model, tmp_path, rng):
    x = {
        "image": rng.normal(size=(400, 8, 8, 2)).astype("float32"),
        "tabular": rng.normal(size=(400, 5)).astype("float32"),
    }
    model.save(tmp_path / "m.keras")
    np.savez(tmp_path / "x.npz", **x)
    expected = effgrad.saliency(model, x, batch_size=8, progress=False)
    out = tmp_path / "maps.npy"
    child = Forked(_CHILD, {"run": [tmp_path / "m.keras", tmp_path / "x.npz", out]})  # forked: no new imports
    journals = [tmp_path / f"maps.{name}.npy.journal.json" for name in x]
    deadline = time.time() + 120
    while time.time() < deadline and child.running():
        if all(j.exists() for j in journals) and min(json.loads(j.read_text())["committed"] for j in journals) >= 40:
            break
        time.sleep(0.05)
    child.send_signal(signal.SIGKILL)
    child.wait()
    states = [json.loads(j.read_text()) for j in journals]
    assert all(0 < s["committed"] < 400 and not s["complete"] for s in states), states
    maps = effgrad.saliency(model, x, batch_size=8, out=out, resume=True, progress=False)
    for name in x:
        np.testing.assert_array_equal(np.load(tmp_path / f"maps.{name}.npy"), expected[name])
        np.testing.assert_array_equal(maps[name], expected[name])


def test_unbatched_inputs_get_a_clear_message_before_any_work(model, tmp_path, data):
    with pytest.raises(ValueError, match=r"dataset\.batch"):
        effgrad.saliency(model, tf.data.Dataset.from_tensor_slices(data), progress=False)
    single = {k: v[0] for k, v in data.items()}
    with pytest.raises(ValueError, match=r"x\[None\]"):
        effgrad.saliency(model, single, out=tmp_path / "maps.npy", progress=False)
    assert not list(tmp_path.iterdir())
    with pytest.raises(ValueError, match="same number of rows"):
        effgrad.saliency(model, {"image": data["image"], "tabular": data["tabular"][:5]}, progress=False)


def test_multi_output_model_explains_the_named_output(data):
    # Its own model: Keras's names restart with each test's clear_session, so the Dense added below would be
    # named like the shared model's first one, and Keras refuses a model with two layers of one name.
    model = _two_input_model()
    both = keras.Model(model.inputs, {"logits": model.outputs[0], "score": keras.layers.Dense(1)(model.outputs[0])})
    with pytest.raises(ValueError, match="output=NAME_OR_INDEX"):
        effgrad.saliency(both, data, progress=False)
    by_name = effgrad.saliency(both, data, output="logits", target=2, progress=False)
    expected = effgrad.saliency(model, data, target=2, progress=False)
    np.testing.assert_allclose(by_name["image"], expected["image"], rtol=1e-6)
    by_callable = effgrad.saliency(both, data, target=lambda outputs: outputs["logits"][:, 2], progress=False)
    np.testing.assert_allclose(by_callable["tabular"], expected["tabular"], rtol=1e-6)
    with pytest.raises(ValueError, match="no output 'logit'"):
        effgrad.saliency(both, data, output="logit", progress=False)
