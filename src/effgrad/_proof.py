"""When effgrad may stand in for user code: only where that code is proven to be what it replaces.

A fused loss, a closed-form per-example norm, a routed attention or an
update inside backward reimplements the maths of one Keras (or keras_hub)
class. It may replace an object only when the object runs that class's own
code: the exact class, or a subclass that inherits every method the
reimplementation stands for unchanged (no instance attribute shadows one, and
no patch replaced one on the class). Anything else, a subclass with its own
``call`` above all, keeps its own path; the caller falls back and says why
with the sentence returned here.

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

__all__ = ["stands_in_for", "library_class"]


def stands_in_for(obj, cls: type | None, methods: tuple[str, ...] = ("call",), ours: tuple = ()) -> str | None:
    """``None`` when ``obj`` runs ``cls``'s own ``methods``; else why not, as a short sentence.

    Own: not set on the instance (``ours``, effgrad's own hooks, aside), not overridden by a subclass,
    and each the function keras, keras_hub or TensorFlow defines on ``cls`` or a base of it (not
    replaced on the class by a patch). ``cls=None`` (a library that is not installed) is never proven.
    """
    if cls is None or not isinstance(obj, cls):
        return f"{type(obj).__name__} is not a {getattr(cls, '__name__', 'known class')}"
    instance = getattr(obj, "__dict__", {})
    shadowed = [m for m in methods if m in instance and not any(instance[m] is hook for hook in ours)]
    if shadowed:
        return f"{type(obj).__name__} has its own {', '.join(shadowed)} set on the instance"
    changed = [m for m in methods if getattr(type(obj), m, None) is not getattr(cls, m, None)]
    if changed:
        return f"{type(obj).__name__} overrides {', '.join(changed)} of {cls.__name__}"
    patched = [m for m in methods if hasattr(cls, m) and not _library_code(getattr(cls, m), cls, m)]
    if patched:
        return f"{', '.join(patched)} of {cls.__name__} is not the library's own code (patched)"
    return None


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
