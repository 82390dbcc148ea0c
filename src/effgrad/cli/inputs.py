"""Input files of the ``effgrad`` command: ``.npy`` and ``.npz``, memory-mapped.

``np.load`` memory-maps a ``.npy`` but reads every array of an ``.npz`` into
memory. The arrays of an ``.npz`` written by ``np.savez`` are stored
uncompressed, so each is a ``.npy`` at some offset of the zip file: they are
memory-mapped here too, and only compressed ones (``np.savez_compressed``)
are read whole.
"""

from __future__ import annotations

import struct
import sys
import zipfile

import numpy as np
from numpy.lib import format as npy_format

from effgrad import _compat
from effgrad.explain.inputs import leaf_names

__all__ = ["load", "model_inputs", "cast"]


def load(path: str):
    """A read-only memmap of a ``.npy``, or a dict of the arrays of an ``.npz``.

    Raises:
        ValueError: the file is neither (a clear message instead of NumPy's
            "pickled data" or zipfile's ``BadZipFile``).
    """
    hint = "Write inputs with np.save(path, array), or np.savez(path, name=array, ...) for several inputs."
    if not zipfile.is_zipfile(path):
        with open(path, "rb") as f:
            if f.read(6) != b"\x93NUMPY":
                raise ValueError(f"{path} is not an array file (.npy or .npz): it has no NumPy header. {hint}")
    try:
        if not zipfile.is_zipfile(path):
            return np.load(path, mmap_mode="r")
        return _load_npz(path)
    except (ValueError, zipfile.BadZipFile, KeyError, EOFError, struct.error) as err:
        raise ValueError(
            f"{path} is not a readable .npy or .npz file ({type(err).__name__}: {err}). Write inputs with "
            "np.save(path, array), or np.savez(path, name=array, ...) for a model with several inputs."
        ) from None


def _load_npz(path: str) -> dict:
    arrays = {}
    with zipfile.ZipFile(path) as archive:
        for info in archive.infolist():
            name = info.filename.removesuffix(".npy")
            if info.compress_type == zipfile.ZIP_STORED:
                arrays[name] = _stored_member(path, info)
            else:
                print(
                    f"effgrad: {name} is compressed in {path}: read into memory (np.savez, not "
                    "np.savez_compressed, lets effgrad memory-map it)",
                    file=sys.stderr,
                )
                with archive.open(info) as member:
                    arrays[name] = np.load(member)
    if not arrays:
        raise ValueError(f"{path} holds no arrays.")
    return arrays


def _stored_member(path: str, info: zipfile.ZipInfo) -> np.memmap:
    """The ``.npy`` stored uncompressed at ``info`` in the zip file, memory-mapped."""
    with open(path, "rb") as f:
        f.seek(info.header_offset)
        local = f.read(30)  # the local file header: its name and extra field lengths end it
        name_length, extra_length = struct.unpack("<HH", local[26:30])
        f.seek(info.header_offset + 30 + name_length + extra_length)
        version = npy_format.read_magic(f)
        read = npy_format.read_array_header_1_0 if version == (1, 0) else npy_format.read_array_header_2_0
        shape, fortran, dtype = read(f)
        offset = f.tell()
    return np.memmap(path, dtype=dtype, mode="r", shape=shape, order="F" if fortran else "C", offset=offset)


def model_inputs(model, arrays):
    """``arrays`` (an array, or an ``.npz``'s dict) arranged as ``model``'s inputs.

    A model with several inputs gets a dict of the arrays named as its inputs
    (Keras matches a dict by input name, and the maps are then named after
    the inputs too), or, for ``np.savez(path, a, b)``'s ``arr_0, arr_1...``,
    a list in the model's input order.
    """
    if not isinstance(arrays, dict):
        return arrays
    graph = _compat.functional_graph(model)
    expected = graph[1] if graph is not None else None
    if isinstance(expected, (list, tuple)) and len(expected) == 1:
        expected = expected[0]
    by_name = True  # Keras takes a dict by input name for a model with a list of inputs too
    if isinstance(expected, dict):
        names = list(expected)
    elif isinstance(expected, (list, tuple)):
        names = [t.name for t in expected]
        positional = [f"arr_{i}" for i in range(len(names))]
        if not set(names) <= set(arrays) and set(positional) <= set(arrays):
            names, by_name = positional, False
    elif len(arrays) == 1:
        return next(iter(arrays.values()))
    else:
        names = [expected.name] if expected is not None else list(arrays)
    missing = [n for n in names if n not in arrays]
    if missing:
        raise ValueError(
            f"The .npz has no array for the model input(s) {missing}; it has {sorted(arrays)}. Save one array "
            f"per input under its name: np.savez(path, {', '.join(f'{n}=...' for n in names)})."
        )
    if len(names) == 1:
        return arrays[names[0]]
    return {n: arrays[n] for n in names} if by_name else [arrays[n] for n in names]


def cast(inputs, casts: list[str], batch_size: int):
    """``(inputs, num_examples)`` with ``--cast [NAME=]DTYPE`` applied batch by batch as rows are read.

    Without casts the inputs are returned as they are (``num_examples`` is
    then ``None``: the arrays tell). With casts, a generator of cast batches
    (memory stays one batch; a memmap is still read row by row).
    """
    if not casts:
        return inputs, None
    names = leaf_names(inputs)
    wanted = {}
    for item in casts:
        name, _, dtype = item.rpartition("=")
        try:
            dtype = np.dtype(dtype)
        except TypeError:
            raise ValueError(f"--cast {item}: {dtype!r} is not a NumPy dtype (e.g. float32).") from None
        if name and names == [""]:
            raise ValueError(f"--cast {item}: the model has one input, so name none: --cast {dtype}.")
        if name and name not in names:
            raise ValueError(f"--cast {item}: the model has no input {name!r}; its inputs are {names}.")
        for leaf in [name] if name else names:
            wanted[leaf] = dtype
    leaves = list(zip(names, _flatten(inputs)))
    rows = len(leaves[0][1])

    def batches():
        for start in range(0, rows, batch_size):
            batch = [
                a[start : start + batch_size].astype(wanted[n]) if n in wanted else a[start : start + batch_size]
                for n, a in leaves
            ]
            yield (_pack(inputs, batch),)  # (x,): a tuple element is (x, y, ...) to effgrad, as to Keras

    return batches(), rows


def integer_inputs(inputs, casts: list[str]) -> list[str]:
    """Names of the inputs that are integers and no ``--cast`` makes float (passed through, not explained)."""
    cast_all = any("=" not in c and np.dtype(c).kind == "f" for c in casts)
    cast_names = {c.split("=")[0] for c in casts if "=" in c and np.dtype(c.split("=")[1]).kind == "f"}
    names = leaf_names(inputs)
    return [
        n or "inputs"
        for n, a in zip(names, _flatten(inputs))
        if np.dtype(a.dtype).kind in "iub" and not cast_all and n not in cast_names
    ]


def _flatten(inputs) -> list:
    if isinstance(inputs, dict):
        return [inputs[k] for k in sorted(inputs)]
    return list(inputs) if isinstance(inputs, (list, tuple)) else [inputs]


def _pack(inputs, leaves: list):
    if isinstance(inputs, dict):
        return dict(zip(sorted(inputs), leaves))
    return list(leaves) if isinstance(inputs, (list, tuple)) else leaves[0]
