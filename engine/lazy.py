"""Names a package imports when first used (PEP 562): a command loads only what it runs."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_names"]


def lazy_names(package: str, where: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for ``package``: each name of ``where`` is imported from
    its module (named relative to the package) when first asked for, then kept in the package."""
    namespace = sys.modules[package].__dict__

    def get(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        namespace[name] = value
        return value

    def listing() -> list[str]:
        return sorted({*namespace, *where})

    return get, listing
