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
        "inputs", metavar="INPUTS", help="a .npy (one example per row) or an .npz with one array per model input"
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


def _saliency(args) -> int:
    import keras

    import effgrad  # noqa: F401 - registers effgrad layers before loading the model
    from effgrad import _arrays
    from effgrad.explain import saliency

    model = keras.models.load_model(args.model)
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
    )
    for result in [m for m in (maps.values() if isinstance(maps, dict) else _flat(maps)) if m is not None]:
        print(f"wrote {result.filename}: {result.shape} {result.dtype}")
    return 0


def _flat(maps) -> list:
    return list(maps) if isinstance(maps, (tuple, list)) else [maps]


def _budget(text: str):
    """'300MiB' stays a string; '0.8' is a fraction; '1000000' bytes."""
    try:
        value = float(text)
    except ValueError:
        return text
    return value if value <= 1 and "." in text else int(value)


def _plan(args) -> int:
    import keras
    import numpy as np

    import effgrad

    model = keras.models.load_model(args.model)
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
    rng = np.random.default_rng(0)
    dtype = np.dtype(model.inputs[0].dtype)
    x = rng.normal(size=shape).astype(dtype) if dtype.kind == "f" else np.zeros(shape, dtype)
    outputs = np.asarray(model(x[:1], training=False))
    name = loss if isinstance(loss, str) else type(loss).__name__
    # Sparse losses take class ids; every other loss a target shaped like the output.
    y = np.zeros(shape[0], "int32") if "sparse" in name.lower() else np.zeros((shape[0], *outputs.shape[1:]), "float32")
    print(effgrad.plan(model, loss, optimizer, x, y, budget=_budget(args.budget)))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    _quiet_tensorflow()
    if args.command == "demo":
        from effgrad import demo

        demo.run(args.out)
        return 0
    try:
        return _saliency(args) if args.command == "saliency" else _plan(args)
    except (ValueError, TypeError, OSError) as err:  # FileExistsError, FileNotFoundError, no space, locked
        print(f"effgrad {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if args.command == "saliency":
            print(
                f"\ninterrupted: the finished rows of {args.out} are kept; add --resume to continue.", file=sys.stderr
            )
        return 130


if __name__ == "__main__":
    sys.exit(main())
