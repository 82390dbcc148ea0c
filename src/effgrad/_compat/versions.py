"""The versions effgrad's internals are checked against, and the error naming them."""

from __future__ import annotations

import keras
import tensorflow as tf

__all__ = ["TESTED", "missing"]

TESTED = "TensorFlow 2.21 / Keras 3.15"


def missing(what: str, err: Exception) -> ImportError:
    """The ``ImportError`` raised at import when ``what`` is absent: it names the versions found and tested."""
    return ImportError(
        f"effgrad relies on {what}, which TensorFlow {tf.__version__} / Keras {keras.__version__} "
        f"does not provide ({type(err).__name__}: {err}). effgrad is tested with {TESTED}: install "
        "those versions (pip install 'tensorflow>=2.21,<2.22' 'keras>=3.15,<3.16') or an effgrad "
        "release made for your versions."
    )
