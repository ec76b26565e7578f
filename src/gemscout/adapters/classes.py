"""Which package defined an object's class, read along its MRO: how adapters recognise a framework's objects
without importing the framework (so detection costs nothing when it is absent and cannot fail on a broken install)."""

from __future__ import annotations

from typing import Any


def mro_names(obj: Any) -> list[tuple[str, str]]:
    """(module, class name) of ``obj``'s class and every base class."""
    return [(cls.__module__ or "", cls.__name__) for cls in type(obj).__mro__]


def defined_in(obj: Any, package: str) -> bool:
    """True when ``obj``'s class, or a base class, is defined in ``package``."""
    return any(
        module == package or module.startswith(package + ".") for module, _ in mro_names(obj)
    )


def is_class(obj: Any, package: str, name: str) -> bool:
    """True when ``obj`` is an instance of a class ``name`` defined in ``package`` (or a subclass of one)."""
    return any(
        (module == package or module.startswith(package + ".")) and cls == name
        for module, cls in mro_names(obj)
    )


def class_names(obj: Any) -> set[str]:
    """The names of ``obj``'s class and every base class, whatever package defined them."""
    return {cls.__name__ for cls in type(obj).__mro__}
