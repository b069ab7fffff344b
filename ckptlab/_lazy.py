"""One way to import a name on first use.

Several modules keep some public names out of their import: ``ckptlab`` itself when the
command starts (so ``--version`` answers without numpy or torch), ``ckptlab.plan``'s
``CachedSavePlanner`` (it subclasses torch's planner), ``ckptlab.write``'s writer, the CLI's
verbs. Each does it with :func:`lazy_attributes`: a module ``__getattr__`` (PEP 562) built from
a table ``name -> "module:attribute"`` (or ``"module"`` for a submodule), which imports on
first access and caches the value in the module's globals, so the next access is a plain
attribute lookup.

:func:`lazy_callable` is the same for a function looked up in a table (the checkpoint format
adapters): the module is imported when the function is first called.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_attributes", "lazy_callable", "resolve_target"]


def resolve_target(target: str) -> Any:
    """Import ``"package.module:attribute"`` (the attribute) or ``"package.module"`` (the
    module) and return it.

    Parameters
    ----------
    target
        ``module`` or ``module:attribute``; the attribute may be dotted.

    Returns
    -------
    Any
        The module or the attribute.
    """
    module, _, attribute = target.partition(":")
    value: Any = importlib.import_module(module)
    for part in attribute.split(".") if attribute else ():
        value = getattr(value, part)
    return value


def lazy_attributes(module_name: str, namespace: dict[str, Any],
                    targets: Mapping[str, str]) -> tuple[Callable[[str], Any],
                                                         Callable[[], list[str]]]:
    """A module ``__getattr__`` and ``__dir__`` that import ``targets`` on first use.

    Parameters
    ----------
    module_name
        The module's ``__name__`` (for the AttributeError of an unknown name).
    namespace
        The module's ``globals()``: a resolved value is stored there, so ``__getattr__`` runs
        once per name.
    targets
        name -> ``"module:attribute"`` or ``"module"``.

    Returns
    -------
    tuple
        ``(__getattr__, __dir__)`` to assign at module level.

    Examples
    --------
    >>> __getattr__, __dir__ = lazy_attributes(__name__, globals(),
    ...                                        {"AsyncWriter": "ckptlab.write.writer:AsyncWriter"})
    """
    table = dict(targets)

    def __getattr__(name: str) -> Any:
        target = table.get(name)
        if target is None:
            raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
        value = resolve_target(target)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *table, *namespace.get("__all__", ())})

    return __getattr__, __dir__


def lazy_callable(target: str) -> Callable[..., Any]:
    """A function that imports ``"module:function"`` when first called and calls it.

    Parameters
    ----------
    target
        ``"module:function"``.

    Returns
    -------
    Callable
        A wrapper with the same call signature as the target.
    """
    resolved: list[Callable[..., Any]] = []

    def call(*args: Any, **kwargs: Any) -> Any:
        if not resolved:
            resolved.append(resolve_target(target))
        return resolved[0](*args, **kwargs)

    call.__name__ = target.rpartition(":")[2] or target
    call.__qualname__ = call.__name__
    call.__doc__ = f"``{target}``, imported on first call."
    return call
