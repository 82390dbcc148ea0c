"""Silencing TensorFlow's start-up lines for the ``effgrad`` command.

TF_CPP_MIN_LOG_LEVEL silences TensorFlow's C++ logging, but some lines (CUDA
stubs on a machine without a GPU) are printed before that logging is
initialized; they only stop if file descriptor 2 is closed while TensorFlow
loads and picks its devices. Python exceptions still propagate as usual.
"""

import contextlib
import os
import sys


def running_as_command() -> bool:
    return os.path.basename(sys.argv[0] if sys.argv else "") == "effgrad"


def answering_help() -> bool:
    """``effgrad`` with no arguments or ``-h``/``--help``: argparse answers, nothing else runs."""
    args = sys.argv[1:]
    return running_as_command() and (not args or "-h" in args or "--help" in args)


@contextlib.contextmanager
def stderr_silenced():
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)
