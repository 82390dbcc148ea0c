"""The command line: every error one clear line (exit 2), method options, image folders; pictures people read."""

import re
import zipfile

import keras
import numpy as np
import pytest

import effgrad
from effgrad import cli
from effgrad.explain import visualize

ANSI = re.compile(r"\x1b\[")


@pytest.fixture
def run(capfd):
    """``effgrad ARGS`` in this process; returns (exit code, stdout, stderr)."""

    def run(*args):
        code = cli.main([*map(str, args)])
        out, err = capfd.readouterr()
        return code, out, err

    return run


def _image_model(channels=3):
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((8, 8, channels)),
            keras.layers.Rescaling(1 / 255),
            keras.layers.Conv2D(4, 3, activation="relu"),
            keras.layers.Flatten(),
            keras.layers.Dense(3),
        ]
    )


@pytest.fixture
def saved(tmp_path, rng):
    _image_model().save(tmp_path / "m.keras")
    np.save(tmp_path / "x.npy", rng.uniform(0, 255, size=(20, 8, 8, 3)).astype("float32"))
    return tmp_path / "m.keras", tmp_path / "x.npy"


def _one_clear_line(code, err, *fragments):
    assert code == 2
    assert "Traceback" not in err and not ANSI.search(err)
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_files_that_are_not_models_or_inputs_are_one_line_errors(run, tmp_path, saved):
    model, inputs = saved
    no_config = tmp_path / "no_config.keras"
    with zipfile.ZipFile(no_config, "w") as archive:
        archive.writestr("metadata.json", "{}")
    _one_clear_line(*run("saliency", no_config, inputs, "--out", tmp_path / "a.npy")[::2], "not a complete .keras")
    not_zip = tmp_path / "text.keras"
    not_zip.write_text("hello")
    _one_clear_line(*run("saliency", not_zip, inputs, "--out", tmp_path / "a.npy")[::2], "is not a .keras file")
    _one_clear_line(*run("saliency", tmp_path / "none.keras", inputs, "--out", tmp_path / "a.npy")[::2], "no such file")
    damaged = tmp_path / "damaged.npz"
    np.savez(damaged, x=np.zeros((4, 8, 8, 3), "float32"))
    damaged.write_bytes(damaged.read_bytes()[:-40])  # cut: the zip directory is gone
    text = tmp_path / "inputs.txt"
    text.write_text("1 2 3\n")
    for bad in (damaged, text):
        code, _, err = run("saliency", model, bad, "--out", tmp_path / "a.npy")
        _one_clear_line(code, err, "is not an array file")
        assert "pickle" not in err  # a text file is no pickled data (NumPy's own message said so)
    assert not (tmp_path / "a.npy").exists()


def test_demo_out_that_cannot_be_a_directory(run, tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("mine")
    for out in (afile, afile / "sub"):
        _one_clear_line(*run("demo", "--out", out)[::2], "is a file, not a directory")
    assert afile.read_text() == "mine"


def test_plan_batch_shape_that_does_not_fit_the_model(run, tmp_path):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss="mse")
    model.save(tmp_path / "m.keras")
    code, _, err = run("plan", tmp_path / "m.keras", "--batch-shape", "8,6,3", "--budget", "100MiB")
    _one_clear_line(code, err, "(None, 6)", "--batch-shape 8,6")


def test_cast_resume_and_method_option_messages_speak_the_command_line(run, tmp_path, saved):
    model, inputs = saved
    out = tmp_path / "maps.npy"
    _one_clear_line(*run("saliency", model, inputs, "--out", out, "--cast", "foo=float32")[::2], "--cast float32")
    _one_clear_line(*run("saliency", model, inputs, "--out", out, "--samples", "4")[::2], "--samples", "smoothgrad")
    assert run("saliency", model, inputs, "--out", out, "--no-progress")[0] == 0
    code, _, err = run("saliency", model, inputs, "--out", out)
    _one_clear_line(code, err, "--resume")
    assert "resume=True" not in err


def test_smoothgrad_and_ig_options_reach_the_method(run, tmp_path, saved, rng):
    model_path, inputs = saved
    model, x = keras.models.load_model(model_path), np.load(inputs)
    smooth = tmp_path / "smooth.npy"
    args = ["--method", "smoothgrad", "--samples", "3", "--noise", "0.3", "--seed", "5", "--no-progress"]
    assert run("saliency", model_path, inputs, "--out", smooth, *args)[0] == 0
    expected = effgrad.saliency(model, x, method="smoothgrad", samples=3, noise=0.3, seed=5, progress=False)
    np.testing.assert_allclose(np.load(smooth), expected, rtol=1e-5, atol=1e-7)
    baseline = tmp_path / "baseline.npy"
    np.save(baseline, np.full((8, 8, 3), 128.0, "float32"))
    ig = tmp_path / "ig.npy"
    args = ["--method", "integrated_gradients", "--steps", "8", "--baseline", baseline, "--no-progress"]
    assert run("saliency", model_path, inputs, "--out", ig, *args)[0] == 0
    expected = effgrad.saliency(
        model, x, method="integrated_gradients", steps=8, baseline=np.load(baseline), progress=False
    )
    np.testing.assert_allclose(np.load(ig), expected, rtol=1e-5, atol=1e-6)
    zero = effgrad.saliency(model, x, method="integrated_gradients", steps=8, progress=False)
    assert not np.allclose(np.load(ig), zero)  # the baseline was used


def test_a_folder_of_images_in_file_name_order_with_the_names_recorded(run, tmp_path, rng):
    folder = tmp_path / "images"
    folder.mkdir()
    images = rng.integers(0, 256, size=(7, 8, 8, 3)).astype("uint8")
    names = [f"img_{i:02d}.png" for i in range(7)]
    for name, image in zip(names[::-1], images[::-1]):  # written out of order on purpose
        keras.utils.save_img(folder / name, image)
    _image_model().save(tmp_path / "m.keras")
    code, out, err = run("saliency", tmp_path / "m.keras", folder, "--out", tmp_path / "maps.npy", "--batch-size", "3")
    assert code == 0, err
    assert "7/7" in out and "Unknown" not in out and not ANSI.search(out)  # the length is known; a plain log line
    listed = (tmp_path / "maps.files.txt").read_text().splitlines()
    assert [line.rsplit("/", 1)[-1] for line in listed] == names
    expected = effgrad.saliency(_image_model(), images.astype("float32"), progress=False)
    np.testing.assert_allclose(np.load(tmp_path / "maps.npy"), expected, rtol=1e-4, atol=1e-6)


def test_summary_of_a_class_that_never_occurred(rng):
    model = _image_model()
    x = rng.uniform(0, 255, size=(12, 8, 8, 3)).astype("float32")
    summary = effgrad.saliency_summary(model, x, target=np.zeros(12, "int64"), progress=False)
    assert summary.count[0] == 12 and summary.count[2] == 0
    with pytest.raises(KeyError, match=r"class 2 never occurred.*classes present: \[0\]"):
        summary.mean[2]


def test_token_picture_wraps_to_a_readable_width(tmp_path, rng):
    from PIL import Image

    # 150 words a row wrap to 14 lines at 80 characters: 1089 px high, 902 wide (each token is a text
    # matplotlib draws: 300 words took twice as long). Unwrapped, each row would be one line: a strip.
    words = [[f"word{i}" for i in range(150)] for _ in range(2)]
    path = visualize.save_tokens(tmp_path / "t.png", words, rng.normal(size=(2, 150)), signed=True)
    width, height = Image.open(path).size
    assert width <= 1100 and height > width  # a paragraph, not a strip
    pixels = np.asarray(Image.open(path).convert("RGB")).reshape(-1, 3)
    assert (pixels[:, 0] > pixels[:, 2] + 60).any() and (pixels[:, 2] > pixels[:, 0] + 60).any()  # red and blue


def test_grid_has_a_labelled_colour_bar(tmp_path, rng):
    from PIL import Image

    path = visualize.save_grid(tmp_path / "g.png", rng.uniform(size=(4, 8, 8)), rng.normal(size=(4, 8, 8)), columns=4)
    bottom = np.asarray(Image.open(path).convert("RGB"))[-60:]
    assert (bottom.std(axis=(0, 1)) > 10).all()  # the colour bar's gradient is drawn below the maps
