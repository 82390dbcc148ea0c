"""When effgrad may stand in for user code: only where that code is proven to be what it replaces.

A fused loss, a closed-form per-example norm, a routed attention or an
update inside backward reimplements the maths of one Keras (or keras_hub)
class. It may replace an object only when the object runs that class's own
code: the exact class, or a subclass that inherits every method the
reimplementation stands for unchanged (and no instance attribute shadows
one). Anything else, a subclass with its own ``call`` above all, keeps its
own path; the caller falls back and says why with the sentence returned here.

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


def stands_in_for(obj, cls: type | None, methods: tuple[str, ...] = ("call",)) -> str | None:
    """``None`` when ``obj`` runs ``cls``'s own ``methods``; else why not, as a short sentence.

    ``cls=None`` (a library that is not installed) is never proven.
    """
    if cls is None or not isinstance(obj, cls):
        return f"{type(obj).__name__} is not a {getattr(cls, '__name__', 'known class')}"
    shadowed = [m for m in methods if m in getattr(obj, "__dict__", {})]
    if shadowed:
        return f"{type(obj).__name__} has its own {', '.join(shadowed)} set on the instance"
    if type(obj) is cls:
        return None
    changed = [m for m in methods if getattr(type(obj), m, None) is not getattr(cls, m, None)]
    if changed:
        return f"{type(obj).__name__} overrides {', '.join(changed)} of {cls.__name__}"
    return None


def library_class(obj, module_prefix: str, name: str) -> type | None:
    """The class named ``name`` from a module under ``module_prefix`` in ``type(obj)``'s MRO, or None.

    Finds a class of an optional library (keras_hub) without importing it: an
    object that is not one of its instances cannot be one of them.
    """
    for cls in type(obj).__mro__:
        if cls.__name__ == name and cls.__module__.startswith(module_prefix):
            return cls
    return None
