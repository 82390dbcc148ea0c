"""``effgrad saliency`` on the command line: .npz inputs by name, --cast, --output, --layer, clear errors, Ctrl-C."""

import json
import signal
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

import effgrad
from effgrad import cli
from helpers import Forked

N = 48


class _Done:
    def __init__(self, returncode, stdout, stderr):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


@pytest.fixture
def run(capfd):
    """``effgrad saliency ARGS`` in this process (a TensorFlow import per command would dominate the test)."""

    def run(*args):
        code = cli.main(["saliency", *map(str, args), "--no-progress"])
        out, err = capfd.readouterr()
        return _Done(code, out, err)

    return run


def _two_input_two_output_model():
    keras.utils.set_random_seed(0)
    image = keras.Input((8, 8, 3), name="image")
    tabular = keras.Input((5,), name="tabular")
    a = keras.layers.Dense(6, activation="tanh")(keras.layers.Flatten()(keras.layers.Rescaling(1 / 255)(image)))
    h = keras.layers.Concatenate()([a, keras.layers.Dense(6, activation="tanh")(tabular)])
    return keras.Model(
        [image, tabular], [keras.layers.Dense(3, name="logits")(h), keras.layers.Dense(1, name="aux")(h)]
    )


@pytest.fixture
def saved(tmp_path, rng):
    model = _two_input_two_output_model()
    model.save(tmp_path / "m.keras")
    arrays = {
        "image": rng.integers(0, 256, (N, 8, 8, 3)).astype("uint8"),
        "tabular": rng.normal(size=(N, 5)).astype("float32"),
    }
    np.savez(tmp_path / "x.npz", **arrays)
    return model, arrays


def test_npz_inputs_by_name_cast_and_output(run, tmp_path, saved):
    model, arrays = saved
    done = run(tmp_path / "m.keras", tmp_path / "x.npz", "--out", tmp_path / "maps.npy", "--output", "aux",
                "--cast", "image=float32", "--batch-size", "16")  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "maps.image.npy" in done.stdout and "maps.tabular.npy" in done.stdout
    x = {"image": arrays["image"].astype("float32"), "tabular": arrays["tabular"]}
    expected = effgrad.saliency(model, x, output="aux", batch_size=16, progress=False)
    for name in x:
        np.testing.assert_allclose(np.load(tmp_path / f"maps.{name}.npy"), expected[name], rtol=1e-5, atol=1e-8)


def test_integer_images_are_passed_through_with_a_notice_unless_cast(run, tmp_path, saved):
    model, arrays = saved
    done = run(tmp_path / "m.keras", tmp_path / "x.npz", "--out", tmp_path / "maps.npy", "--output", "1")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "image are passed through" in done.stderr and "--cast" in done.stderr
    assert np.load(tmp_path / "maps.npy").shape == (N, 5)  # the one float input


def test_errors_are_one_clear_line_without_terminal_colours(run, tmp_path, saved, rng):
    model, arrays = saved
    no_output = run(tmp_path / "m.keras", tmp_path / "x.npz", "--out", tmp_path / "a.npy")
    assert no_output.returncode == 2 and "--output" in no_output.stderr
    np.savez(tmp_path / "wrong.npz", images=arrays["image"], tabular=arrays["tabular"])
    missing = run(tmp_path / "m.keras", tmp_path / "wrong.npz", "--out", tmp_path / "b.npy", "--output", "0")
    assert missing.returncode == 2 and "['image']" in missing.stderr and "np.savez" in missing.stderr
    single = keras.Sequential([keras.Input((8, 8, 3)), keras.layers.Flatten(), keras.layers.Dense(2)])
    single.save(tmp_path / "s.keras")
    np.save(tmp_path / "one.npy", rng.normal(size=(8, 8, 3)).astype("float32"))
    unbatched = run(tmp_path / "s.keras", tmp_path / "one.npy", "--out", tmp_path / "c.npy")
    assert unbatched.returncode == 2 and "x[None]" in unbatched.stderr
    assert "\x1b[" not in unbatched.stderr and "Traceback" not in unbatched.stderr
    bad_cast = run(tmp_path / "m.keras", tmp_path / "x.npz", "--out", tmp_path / "d.npy", "--cast", "images=float32")
    assert bad_cast.returncode == 2 and "no input 'images'" in bad_cast.stderr
    assert not list(tmp_path.glob("[abcd]*.npy"))


def test_token_model_from_npz_with_layer(run, tmp_path, rng):
    import keras_hub

    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=100, num_layers=1, num_heads=2, hidden_dim=8, intermediate_dim=16, max_sequence_length=10
    )
    model = keras_hub.models.BertTextClassifier(backbone=backbone, num_classes=2, preprocessor=None)
    model.save(tmp_path / "bert.keras")
    x = {
        "token_ids": rng.permutation(np.arange(1, 100))[:60].reshape(6, 10).astype("int32"),  # all distinct
        "segment_ids": np.zeros((6, 10), "int32"),
        "padding_mask": np.ones((6, 10), "int32"),
    }
    np.savez(tmp_path / "tokens.npz", **x)
    done = run(tmp_path / "bert.keras", tmp_path / "tokens.npz", "--out", tmp_path / "scores.npy",
                "--layer", "token_embedding", "--reduce", "sum")  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    # The tape's reference (no second job to trace): with distinct ids, the gradient at position t of the
    # embedding's output is row ids[t] of the gradient w.r.t. the embedding matrix.
    embedding = backbone.get_layer("token_embedding")
    with tf.GradientTape() as tape:
        outputs = model(x, training=False)
        score = tf.reduce_sum(tf.reduce_max(outputs, axis=-1))  # the default target: each row's arg-max
    expected = tf.convert_to_tensor(tape.gradient(score, embedding.embeddings)).numpy()[x["token_ids"]].sum(-1)
    np.testing.assert_allclose(np.load(tmp_path / "scores.npy"), expected, rtol=1e-4, atol=1e-7)


def test_ctrl_c_ends_with_one_line_and_resume_finishes(run, tmp_path, rng):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(64, activation="tanh"), keras.layers.Dense(3)])
    model.save(tmp_path / "m.keras")
    x = rng.normal(size=(3_000, 16)).astype("float32")
    np.save(tmp_path / "x.npy", x)
    out, journal = tmp_path / "maps.npy", tmp_path / "maps.npy.journal.json"
    arguments = ["saliency", tmp_path / "m.keras", tmp_path / "x.npy", "--out", out, "--batch-size", "8",
                 "--no-progress"]  # fmt: skip
    # The command line's own process (forked: a new interpreter's imports would be most of the test),
    # with Python's own Ctrl-C handler, as a new interpreter has it. It commits every 0.05 s, not 0.5:
    # its first commit (the cue to interrupt it) then comes after its first batch, not half a second of
    # rows, and 3,000 rows keep it running ~0.7 s past that cue (12,000 rows and 0.5 s commits left
    # ~2.5 s; the resume and the reference below cost in proportion to the rows).
    child = Forked(
        "import sys, effgrad.cli\nfrom effgrad.explain import engine\nengine._COMMIT_EVERY_SECONDS = 0.05\n"
        "sys.exit(effgrad.cli.main(sys.argv[1:]))",
        {"cli": arguments},
    )
    deadline = time.time() + 120
    while time.time() < deadline and child.running():
        if journal.exists() and json.loads(journal.read_text())["committed"] > 0:
            break
        time.sleep(0.05)
    assert child.running(), "the run ended before it could be interrupted"
    child.send_signal(signal.SIGINT)
    status, _, stderr = child.wait(timeout=60)["cli"]
    assert status == 130, stderr[-2000:]
    assert "Traceback" not in stderr
    assert stderr.strip().splitlines()[-1].startswith("interrupted:") and "--resume" in stderr
    resumed = run(tmp_path / "m.keras", tmp_path / "x.npy", "--out", out, "--batch-size", "8", "--resume")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    expected = effgrad.saliency(model, x, batch_size=8, progress=False)
    np.testing.assert_allclose(np.load(out), expected, rtol=1e-6)
