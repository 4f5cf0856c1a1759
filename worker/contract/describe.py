"""How an object in a namespace is described to the model (the system prompt's listing).

Both sides describe: the worker the objects that live there (handed-over functions, values),
the coordinator its host functions; one function, so the model reads one format.
"""

from __future__ import annotations

import inspect
from typing import Any

__all__ = ["describe_object"]


def _signature(value: Any) -> str:
    # Annotations postponed by `from __future__ import annotations` are resolved where possible, so the
    # model reads `path: str`, not `path: 'str'`. Some builtins have no introspectable signature: say so
    # instead of failing the whole prompt.
    try:
        return str(inspect.signature(value, eval_str=True))
    except Exception:  # a NameError or anything else an annotation's evaluation raises
        pass
    try:
        return str(inspect.signature(value))
    except (TypeError, ValueError):
        return "(...)"


def describe_object(name: str, value: Any) -> str:
    """One entry of the namespace listing: a callable as its signature and docstring, an object as its
    public methods, a plain value as its type and a repr cut at 80 characters."""
    if callable(value):
        prefix = "async " if inspect.iscoroutinefunction(value) else ""
        return f"{prefix}{name}{_signature(value)}: {inspect.getdoc(value) or ''}"
    if type(value).__module__ != "builtins":
        methods = [(attr, getattr(value, attr)) for attr in dir(value)
                   if not attr.startswith("_") and callable(getattr(value, attr, None))]
        if methods:
            doc = inspect.getdoc(value)
            lines = [f"{name}: {type(value).__name__}" + (f" — {doc.splitlines()[0]}" if doc else "")]
            for attr, method in methods:
                prefix = "async " if inspect.iscoroutinefunction(method) else ""
                lines.append(f" {prefix}{name}.{attr}{_signature(method)}: {inspect.getdoc(method) or ''}")
            return "\n".join(lines)
    preview = repr(value)
    if len(preview) > 80:
        preview = preview[:80] + "…"
    return f"{name}: {type(value).__name__} = {preview}"


