"""When effgrad may stand in for user code: only where that code is proven to be what it replaces.

A fused loss, a closed-form per-example norm, a routed attention or an
update inside backward reimplements the maths of one Keras (or keras_hub)
class. It may replace an object only when the object runs that class's own
code: the exact class, or a subclass that redefines none of the class's
members but its construction, configuration and shapes (``NOT_COMPUTATION``):
not ``call``, nor a property it reads (``kernel``), nor a helper it calls
(``_compute_causal_padding``). No instance attribute may shadow the methods
stood in for, and no patch may have replaced one on the class. Anything else
keeps its own path; the caller falls back and says why with the sentence
returned here. (A stand-in for one method only, the attention kernel for
``_compute_attention`` whatever ``call`` does, names its methods and passes
``whole=False``.)

Example:
    >>> class Half(keras.layers.Dense):
    ...     def call(self, x):
    ...         return super().call(x) * 0.5
    >>> stands_in_for(keras.layers.Dense(3), keras.layers.Dense) is None
    True
    >>> stands_in_for(Half(3), keras.layers.Dense)
    'Half overrides call of Dense'
"""

from __future__ import annotations

__all__ = ["stands_in_for", "library_class", "NOT_COMPUTATION"]

# What a subclass may redefine and still compute what its library class computes.
NOT_COMPUTATION = frozenset(
    {
        "__init__", "__repr__", "__str__", "get_config", "from_config", "build", "get_build_config",
        "build_from_config", "compute_output_shape", "save_own_variables", "load_own_variables",
    }
)  # fmt: skip


def stands_in_for(
    obj, cls: type | None, methods: tuple[str, ...] = ("call",), ours: tuple = (), whole: bool = True
) -> str | None:
    """``None`` when ``obj`` runs ``cls``'s own code; else why not, as a short sentence.

    ``methods``: not set on the instance (``ours``, effgrad's own hooks, aside) and each the function
    keras, keras_hub or TensorFlow defines on ``cls`` or a base of it (not replaced on the class by a
    patch). ``whole``: no class between ``type(obj)`` and ``cls`` redefines a method or property of
    ``cls`` outside ``NOT_COMPUTATION``; else only ``methods`` must be inherited. ``cls=None`` (a
    library that is not installed) is never proven.
    """
    if cls is None or not isinstance(obj, cls):
        return f"{type(obj).__name__} is not a {getattr(cls, '__name__', 'known class')}"
    instance = getattr(obj, "__dict__", {})
    shadowed = [m for m in methods if m in instance and not any(instance[m] is hook for hook in ours)]
    if shadowed:
        return f"{type(obj).__name__} has its own {', '.join(shadowed)} set on the instance"
    changed = [m for m in methods if getattr(type(obj), m, None) is not getattr(cls, m, None)]
    if whole:
        changed += sorted(_redefined(type(obj), cls) - set(changed))
    if changed:
        return f"{type(obj).__name__} overrides {', '.join(changed)} of {cls.__name__}"
    patched = [m for m in methods if hasattr(cls, m) and not _library_code(getattr(cls, m), cls, m)]
    if patched:
        return f"{', '.join(patched)} of {cls.__name__} is not the library's own code (patched)"
    return None


def _redefined(kind: type, cls: type) -> set[str]:
    """Methods and properties of ``cls`` that a class between ``kind`` and ``cls`` defines again."""
    between = kind.__mro__[: kind.__mro__.index(cls)]
    return {
        name
        for c in between
        for name, value in vars(c).items()
        if (name == "__call__" or not name.startswith("__"))
        and name not in NOT_COMPUTATION
        and (callable(value) or isinstance(value, (property, classmethod, staticmethod)))
        and hasattr(cls, name)
    }


def _library_code(fn, cls: type, name: str) -> bool:
    """Whether ``fn`` is ``name`` as keras, keras_hub or TensorFlow defines it on ``cls`` or a base."""
    fn = getattr(fn, "__func__", fn)
    owner, _, method = (getattr(fn, "__qualname__", "") or "").rpartition(".")
    library = (getattr(fn, "__module__", "") or "").split(".")[0] in ("keras", "keras_hub", "tensorflow")
    return library and method == name and owner in {c.__qualname__ for c in cls.__mro__}


def library_class(obj, module_prefix: str, name: str) -> type | None:
    """The class named ``name`` from a module under ``module_prefix`` in ``type(obj)``'s MRO, or None.

    Finds a class of an optional library (keras_hub) without importing it: an
    object that is not one of its instances cannot be one of them.
    """
    for cls in type(obj).__mro__:
        if cls.__name__ == name and cls.__module__.startswith(module_prefix):
            return cls
    return None
