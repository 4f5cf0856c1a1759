"""Code that runs right after a module is first imported, never before, and never imports it.

The worker adapts a few libraries to itself (matplotlib's backend, Pillow's ``Image.show``)
only once the code imports them: importing them itself would cost every worker their import
time and change what a block finds in ``sys.modules``.  ``after_import(name, hook)`` runs
``hook(module)`` once ``name`` has been executed by its own loader, in the thread that imported
it; a module already imported (a ``--preload``) gets its hook at once.  The finder answers
None for every other name, a dictionary lookup, so it costs imports nothing else.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from importlib.machinery import ModuleSpec, SourceFileLoader
from types import ModuleType

__all__ = ["after_import"]

Hook = Callable[[ModuleType], None]


class _AfterImport:
    """A ``sys.meta_path`` finder that finds nothing itself: for a name with a hook, it asks
    the finders after it and wraps the loader's ``exec_module`` of the spec they give (a
    source file's loader is made for that one module, so nothing else is touched)."""

    def __init__(self) -> None:
        self.hooks: dict[str, Hook] = {}
        self._busy = threading.local()

    def find_spec(self, name: str, path=None, target=None) -> ModuleSpec | None:
        hook = self.hooks.get(name)
        if hook is None or getattr(self._busy, "name", None) == name:
            return None
        self._busy.name = name  # the finders below may import: not this name again
        try:
            spec = _find(self, name, path, target)
        finally:
            self._busy.name = None
        loader = spec.loader if spec is not None else None
        if not isinstance(loader, SourceFileLoader):
            return spec  # (a module that is not a source file: left as it is, without its hook)
        self.hooks.pop(name, None)
        run = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            _call(hook, module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def _find(me: _AfterImport, name: str, path, target) -> ModuleSpec | None:
    for finder in list(sys.meta_path):
        if finder is me or not hasattr(finder, "find_spec"):
            continue
        spec = finder.find_spec(name, path, target)
        if spec is not None:
            return spec
    return None


def _call(hook: Hook, module: ModuleType) -> None:
    try:
        hook(module)
    except Exception as exc:  # noqa: BLE001 - the import the code asked for has succeeded
        sys.stderr.write(f"agentloop: could not adapt {module.__name__} to the worker: {type(exc).__name__}: {exc}\n")


_finder: _AfterImport | None = None


def after_import(name: str, hook: Hook) -> None:
    """Run ``hook(module)`` once module ``name`` is imported (at once if it is already)."""
    global _finder
    module = sys.modules.get(name)
    if module is not None:
        _call(hook, module)
        return
    if _finder is None:
        _finder = _AfterImport()
        sys.meta_path.insert(0, _finder)  # first: the finder that would find it must not be asked before
    _finder.hooks[name] = hook
