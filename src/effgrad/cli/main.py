"""The ``effgrad`` command: ``effgrad demo``, ``effgrad saliency`` and ``effgrad plan``."""

from __future__ import annotations

import argparse
import sys


def _quiet_tensorflow() -> None:
    """Initializes TensorFlow's devices without their log lines (see effgrad._quiet)."""
    import tensorflow as tf

    from effgrad import _quiet

    with _quiet.stderr_silenced():
        tf.config.list_logical_devices()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="effgrad",
        description="Gradient computation in TensorFlow/Keras that fits in memory.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo = sub.add_parser("demo", help="train a small model with effgrad and show the measured memory savings")
    demo.add_argument("--out", default="effgrad-demo", help="directory for the demo's files (default: %(default)s)")

    sal = sub.add_parser(
        "saliency",
        help="stream saliency maps of a saved Keras model over .npy/.npz inputs into .npy files",
        description="Memory-maps the inputs in and the maps out, so neither has to fit in RAM. A model with "
        "several inputs reads them from an .npz (one array per input, by name); its maps go to one file per "
        "differentiated input (MAPS.npy -> MAPS.<input>.npy).",
    )
    sal.add_argument("model", metavar="MODEL.keras", help="a model saved with model.save('m.keras')")
    sal.add_argument(
        "inputs",
        metavar="INPUTS",
        help="a .npy (one example per row), an .npz with one array per model input, or a folder of images "
        "(read in file-name order at the model's input size; the file names go to MAPS.files.txt)",
    )
    sal.add_argument("--out", required=True, metavar="MAPS.npy", help="output file (never overwritten)")
    sal.add_argument(
        "--method", default="gradient", choices=["gradient", "gradient_x_input", "smoothgrad", "integrated_gradients"]
    )
    sal.add_argument("--reduce", default=None, choices=["abs", "abs_max", "abs_sum", "l2", "sum"])
    sal.add_argument("--batch-size", type=int, default=64)
    sal.add_argument("--target", type=int, default=None, help="output unit to explain (default: each arg-max)")
    sal.add_argument("--output", metavar="NAME_OR_INDEX", help="which output of a model with several to explain")
    sal.add_argument(
        "--layer", metavar="NAME", help="differentiate this layer's output (e.g. token_embedding of a text model)"
    )
    sal.add_argument(
        "--cast",
        action="append",
        default=[],
        metavar="[INPUT=]DTYPE",
        help="cast inputs as they are read, e.g. --cast float32 for uint8 images (all inputs), or --cast "
        "image=float32 (one input; repeatable)",
    )
    sal.add_argument("--samples", type=int, help="smoothgrad: noisy samples per example (default 25)")
    sal.add_argument("--noise", type=float, help="smoothgrad: noise std as a fraction of the value range (0.15)")
    sal.add_argument("--seed", type=int, help="smoothgrad: seed of the noise (0)")
    sal.add_argument("--steps", type=int, help="integrated_gradients: path steps (default 64)")
    sal.add_argument(
        "--baseline",
        metavar="NUMBER_OR_NPY",
        help="integrated_gradients: a constant (e.g. 0) or a .npy of one example (default: zeros)",
    )
    sal.add_argument("--dtype", default="float32", choices=["float32", "float16"])
    sal.add_argument("--resume", action="store_true", help="continue an interrupted run into --out")
    sal.add_argument("--no-progress", action="store_true", help="no progress bar")

    pln = sub.add_parser(
        "plan",
        help="find the micro-batches / checkpoint segments that fit a train step of a saved model in a memory budget",
        description="Measures a few train-step configurations of MODEL.keras on a random batch of --batch-shape "
        "and prints the table of predicted and measured peaks (effgrad.plan).",
    )
    pln.add_argument("model", metavar="MODEL.keras", help="a model saved with model.save('m.keras')")
    pln.add_argument("--batch-shape", required=True, help="the input batch shape, e.g. 256,32,32,3")
    pln.add_argument("--budget", required=True, help="bytes, a size such as 300MiB or 6GiB, or a fraction like 0.8")
    pln.add_argument("--loss", help="a Keras loss name (default: the model's compiled loss)")
    pln.add_argument("--optimizer", help="a Keras optimizer name (default: the model's compiled optimizer, else adam)")
    return parser


def _load_model(path: str):
    """``keras.models.load_model`` with one clear line for a file that is not a Keras model."""
    import os
    import zipfile

    import keras

    import effgrad  # noqa: F401 - registers effgrad layers before loading the model

    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such file (a model saved with model.save('m.keras')).")
    if not zipfile.is_zipfile(path):
        raise ValueError(f"{path} is not a .keras file (a zip written by model.save('m.keras')).")
    try:
        return keras.models.load_model(path)
    except (KeyError, zipfile.BadZipFile, EOFError) as err:
        raise ValueError(f"{path} is not a complete .keras file ({type(err).__name__}: {err}).") from None


def _method_options(args) -> dict:
    import numpy as np

    options = {k: getattr(args, k) for k in ("samples", "noise", "seed", "steps") if getattr(args, k) is not None}
    if args.baseline is not None:
        try:
            options["baseline"] = float(args.baseline)
        except ValueError:
            options["baseline"] = np.load(args.baseline)
    given = set(options)
    allowed = {"smoothgrad": {"samples", "noise", "seed"}, "integrated_gradients": {"steps", "baseline"}}
    wrong = sorted(given - allowed.get(args.method, set()))
    if wrong:
        raise ValueError(
            f"--{', --'.join(wrong)} {'does' if len(wrong) == 1 else 'do'} not apply to --method {args.method} "
            "(--samples/--noise/--seed: smoothgrad; --steps/--baseline: integrated_gradients)."
        )
    return options


def _image_folder(args, model):
    """The images of a folder, in file-name order at the model's input size, and their paths."""
    from pathlib import Path

    import keras

    shape = model.inputs[0].shape if len(model.inputs) == 1 else None
    if shape is None or len(shape) != 4:
        raise ValueError("A folder of images needs a model with one image input [batch, height, width, channels].")
    modes = {1: "grayscale", 3: "rgb", 4: "rgba"}
    if shape[3] not in modes or shape[1] is None or shape[2] is None:
        raise ValueError(f"The model's input {tuple(shape)} is not an image of known size with 1, 3 or 4 channels.")
    listing = Path(_files_list(args.out))
    if listing.exists() and not args.resume:
        raise FileExistsError(f"{listing} already exists; effgrad never overwrites it. Add --resume or remove it.")
    dataset = keras.utils.image_dataset_from_directory(
        args.inputs,
        labels=None,
        shuffle=False,  # file-name order: the rows are known, and a resume sees the same ones
        image_size=(shape[1], shape[2]),
        color_mode=modes[shape[3]],
        batch_size=args.batch_size,
        verbose=False,
    )
    files = "".join(f"{p}\n" for p in dataset.file_paths)
    if listing.exists() and listing.read_text() != files:
        raise ValueError(f"Cannot resume: {listing} names other files than {args.inputs} holds now.")
    return dataset, files, listing


def _files_list(out: str) -> str:
    return (out[: -len(".npy")] if out.endswith(".npy") else out) + ".files.txt"


def _saliency(args) -> int:
    import os

    from effgrad.cli import inputs as _arrays
    from effgrad.explain import saliency

    model = _load_model(args.model)
    options, folder = _method_options(args), None
    if os.path.isdir(args.inputs):
        inputs, files, listing = _image_folder(args, model)
        num_examples, passed, folder = None, [], (files, listing)
    else:
        arrays = _arrays.model_inputs(model, _arrays.load(args.inputs))
        inputs, num_examples = _arrays.cast(arrays, args.cast, args.batch_size)
        passed = _arrays.integer_inputs(arrays, args.cast)
    if passed and args.layer is None:
        print(
            f"effgrad saliency: integer input(s) {', '.join(passed)} are passed through, not explained "
            "(--cast NAME=float32 to explain an image stored as integers; --layer for token ids)",
            file=sys.stderr,
        )
    output = int(args.output) if args.output is not None and args.output.lstrip("-").isdigit() else args.output
    maps = saliency(
        model,
        inputs,
        method=args.method,
        reduce=args.reduce,
        batch_size=args.batch_size,
        target=args.target,
        output=output,
        layer=args.layer,
        dtype=args.dtype,
        out=args.out,
        resume=args.resume,
        progress=not args.no_progress,
        num_examples=num_examples,
        **options,
    )
    if folder is not None:
        files, listing = folder
        listing.write_text(files)
        print(f"wrote {listing}: the image file of each row")
    for result in [m for m in (maps.values() if isinstance(maps, dict) else _flat(maps)) if m is not None]:
        print(f"wrote {result.filename}: {result.shape} {result.dtype}")
    return 0


def _flat(maps) -> list:
    return list(maps) if isinstance(maps, (tuple, list)) else [maps]


def _plan(args) -> int:
    import keras
    import numpy as np

    import effgrad

    model = _load_model(args.model)
    compiled = getattr(model, "compiled", False)
    loss = args.loss or (model.loss if compiled else None)
    if loss is None:
        raise ValueError(f"{args.model} was saved without a compiled loss; pass --loss (e.g. --loss mse).")
    optimizer = keras.optimizers.get(args.optimizer or (model.optimizer if compiled and model.optimizer else "adam"))
    try:
        shape = tuple(int(s) for s in args.batch_shape.split(","))
    except ValueError:
        raise ValueError(
            f"--batch-shape takes integers separated by commas, e.g. 256,32,32,3; got {args.batch_shape!r}."
        ) from None
    if len(model.inputs) != 1:
        raise ValueError(
            "effgrad plan on the command line handles single-input models; call effgrad.plan() for others."
        )
    expected = tuple(model.inputs[0].shape[1:])
    if len(shape) != len(expected) + 1 or any(e is not None and e != d for e, d in zip(expected, shape[1:])):
        example = ",".join(str(d or "N") for d in (shape[0], *expected))
        raise ValueError(
            f"--batch-shape {args.batch_shape} does not fit the model's input shape {(None, *expected)}: "
            f"give BATCH followed by the input's axes, e.g. --batch-shape {example}."
        )
    rng = np.random.default_rng(0)
    dtype = np.dtype(model.inputs[0].dtype)
    x = rng.normal(size=shape).astype(dtype) if dtype.kind == "f" else np.zeros(shape, dtype)
    outputs = np.asarray(model(x[:1], training=False))
    name = loss if isinstance(loss, str) else type(loss).__name__
    # Sparse losses take class ids; every other loss a target shaped like the output.
    y = np.zeros(shape[0], "int32") if "sparse" in name.lower() else np.zeros((shape[0], *outputs.shape[1:]), "float32")
    print(effgrad.plan(model, loss, optimizer, x, y, memory_budget=args.budget))
    return 0


def _demo(args) -> int:
    from effgrad.cli import demo

    demo.run(args.out)
    return 0


def _one_line(err: BaseException, command: str) -> str:
    """The error as one line for a command-line user: no ANSI codes, the flag instead of the keyword."""
    import re

    text = re.sub(r"\x1b\[[0-9;]*m", "", str(err)).strip()
    text = text.replace("Pass resume=True", "Add --resume").replace("resume=True", "--resume")
    return " ".join(line.strip() for line in text.splitlines() if line.strip())


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    _quiet_tensorflow()
    run = {"demo": _demo, "saliency": _saliency, "plan": _plan}[args.command]
    try:
        return run(args)
    except (ValueError, TypeError, OSError) as err:  # FileExistsError, FileNotFoundError, no space, locked
        print(f"effgrad {args.command}: error: {_one_line(err, args.command)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if args.command == "saliency":
            print(
                f"\ninterrupted: the finished rows of {args.out} are kept; add --resume to continue.", file=sys.stderr
            )
        return 130
