"""Argument checks shared by every public entry point."""

from __future__ import annotations

import numbers


def positive_int(value, name: str, hint: str = "") -> int:
    """``value`` as an int >= 1 (NumPy ints accepted, bools refused), else ``ValueError``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be a positive int{hint}, got {value!r}.")
    return int(value)
