"""The ``effgrad`` command: ``effgrad demo`` and ``effgrad saliency``."""

from __future__ import annotations

import argparse
import os
import sys


def _quiet_tensorflow() -> None:
    # Must precede the first TensorFlow import: its C++ logging reads these once.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="effgrad",
        description="Gradient computation in TensorFlow/Keras that fits in memory.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo = sub.add_parser("demo", help="train a small model with effgrad and show the measured memory savings")
    demo.add_argument("--out", default="effgrad-demo", help="directory for the demo's files (default: %(default)s)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    _quiet_tensorflow()
    if args.command == "demo":
        from effgrad import demo

        demo.run(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
