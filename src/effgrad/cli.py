"""The ``effgrad`` command: ``effgrad demo`` and ``effgrad saliency``."""

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
        help="stream saliency maps of a saved Keras model over a .npy file into a .npy file",
        description="Memory-maps INPUTS.npy in and MAPS.npy out, so neither has to fit in RAM.",
    )
    sal.add_argument("model", metavar="MODEL.keras", help="a model saved with model.save('m.keras')")
    sal.add_argument("inputs", metavar="INPUTS.npy", help="float inputs, one example per row")
    sal.add_argument("--out", required=True, metavar="MAPS.npy", help="output file (never overwritten)")
    sal.add_argument(
        "--method", default="gradient", choices=["gradient", "gradient_x_input", "smoothgrad", "integrated_gradients"]
    )
    sal.add_argument("--reduce", default=None, choices=["abs", "abs_max", "abs_sum", "l2", "sum"])
    sal.add_argument("--batch-size", type=int, default=64)
    sal.add_argument("--target", type=int, default=None, help="output unit to explain (default: each arg-max)")
    sal.add_argument("--dtype", default="float32", choices=["float32", "float16"])
    sal.add_argument("--resume", action="store_true", help="continue an interrupted run into --out")
    sal.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def _saliency(args) -> int:
    import keras
    import numpy as np

    import effgrad  # noqa: F401 - registers effgrad layers before loading the model
    from effgrad.explain import saliency

    model = keras.models.load_model(args.model)
    inputs = np.load(args.inputs, mmap_mode="r")
    maps = saliency(
        model,
        inputs,
        method=args.method,
        reduce=args.reduce,
        batch_size=args.batch_size,
        target=args.target,
        dtype=args.dtype,
        out=args.out,
        resume=args.resume,
        progress=not args.no_progress,
    )
    print(f"wrote {args.out}: {maps.shape} {maps.dtype}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    _quiet_tensorflow()
    if args.command == "demo":
        from effgrad import demo

        demo.run(args.out)
        return 0
    try:
        return _saliency(args)
    except (ValueError, TypeError, FileExistsError, FileNotFoundError) as err:
        print(f"effgrad saliency: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
