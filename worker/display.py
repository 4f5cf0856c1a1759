"""``display()`` in a worker: Jupyter's display protocol, for blocks that run at the same time.

``display(obj, ...)`` (in every agent's namespace) sends the richest representations of
``obj`` as a MIME bundle, found as IPython finds them: an object that shows itself
(``_ipython_display_``) is asked to; otherwise ``_repr_mimebundle_``, then ``_repr_html_``,
``_repr_markdown_``, ``_repr_svg_``, ``_repr_png_``, ``_repr_json_`` and ``_repr_latex_`` for
the types the bundle lacks, and ``text/plain`` (the ``repr``) always.  A method raising
``NotImplementedError`` gives nothing for its type; any other exception is said on the block's
stderr and the other types still go.  A matplotlib ``Figure`` is drawn as a PNG (an empty one
gives nothing), a Pillow image is a PNG by its own ``_repr_png_``.  Methods are looked up as
IPython's ``get_real_method`` does, so a proxy that claims every attribute, or a class, gives
its ``repr`` only.

Which block a display belongs to is the block whose code (or a thread or task it started)
called it, as for output (``capture``); it leaves after the output the block wrote before it,
and before the block's ``done``.  What goes beyond the contract's bounds (``contract.display``)
is said in words on the block's stderr, never sent: an image over ``MAX_IMAGE``, data that is
not a PNG, displays beyond ``MAX_DISPLAYS`` a block; a text over ``MAX_DISPLAY_TEXT`` is cut,
saying so.

matplotlib and Pillow are adapted once the code imports them (``_after_import``), never
imported here: matplotlib's backend becomes ``module://worker.mpl_backend`` (unless
``MPLBACKEND`` says otherwise), whose ``plt.show()`` and ``fig.show()`` display the block's
figures, and every figure of the block still open when it ends is displayed then and closed, as
Jupyter's inline backend does; ``Image.show()`` displays the image.  A script run (``exec``) is
``python``: it gets none of this.
"""

from __future__ import annotations

import base64
import binascii
import inspect
import io
import json
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

from ._after_import import after_import
from .capture import Router, current_block
from .contract import wire
from .contract.display import MIME_TYPES, PNG, SVG, png_size
from .contract.limits import MAX_DISPLAY_TEXT, MAX_DISPLAYS, MAX_IMAGE

__all__ = ["BACKEND", "Displays", "active", "bundle_of"]

#: The matplotlib backend of a worker (``worker/mpl_backend.py``).
BACKEND = "module://worker.mpl_backend"
_BLOCK_ATTR = "_agentloop_block"  # on a figure: the block whose code made it
_SHOWN_ATTR = "_agentloop_shown"  # on a figure: displayed, and not drawn on since

#: (MIME type, method) in the order IPython's formatters are asked.
_METHODS = (("text/html", "_repr_html_"), ("text/markdown", "_repr_markdown_"), (SVG, "_repr_svg_"),
            (PNG, "_repr_png_"), ("application/json", "_repr_json_"), ("text/latex", "_repr_latex_"))

_active: Displays | None = None


def active() -> Displays | None:
    """The worker's displays (None outside a worker that serves blocks)."""
    return _active


def _real_method(obj: Any, name: str) -> Callable | None:
    """``obj``'s method ``name`` if it really has one (IPython's ``get_real_method``): not for a
    proxy that answers any attribute, a class's unbound function, or anything not callable."""
    try:
        if getattr(obj, "_ipython_canary_method_should_not_exist_", None) is not None:
            return None
        method = getattr(obj, name, None)
    except Exception:  # noqa: BLE001 - a property that raises: no such method
        return None
    if inspect.isclass(obj) and not inspect.ismethod(method):
        return None
    return method if callable(method) else None


def _is_figure(obj: Any) -> bool:
    figure = sys.modules.get("matplotlib.figure")  # only where the code imported matplotlib
    return figure is not None and isinstance(obj, figure.Figure)


def figure_png(fig: Any) -> bytes | None:
    """A figure drawn as Jupyter's inline backend draws it (its dpi and colours, a tight box);
    None for a figure with nothing on it."""
    if not fig.axes and not fig.lines:
        return None
    buf = io.BytesIO()
    fig.canvas.print_figure(buf, format="png", bbox_inches="tight", facecolor=fig.get_facecolor(),
                            edgecolor=fig.get_edgecolor(), dpi=fig.dpi)
    # What print_figure set and put back marked it stale; drawing on it from here on marks it
    # again (a figure displayed and not changed since is not shown again when the block ends).
    fig.stale = False
    return buf.getvalue()


def _short_repr(obj: Any) -> str:
    try:
        text = repr(obj)
    except Exception as exc:  # noqa: BLE001 - a broken __repr__
        text = f"<{type(obj).__name__} object (its repr raised {type(exc).__name__})>"
    return text


def bundle_of(obj: Any, warn: Callable[[str], None], include=None, exclude=None) -> dict[str, Any] | None:
    """The MIME bundle of ``obj`` as IPython's ``DisplayFormatter.format`` builds it (values as the
    methods gave them); None when the object showed itself (``_ipython_display_``)."""
    shows_itself = _real_method(obj, "_ipython_display_")
    if shows_itself is not None:
        _call(shows_itself, warn, f"{type(obj).__name__}._ipython_display_")
        return None
    data: dict[str, Any] = {}
    if _is_figure(obj):
        png = _call(figure_png, warn, "drawing the figure", obj)
        if png is None:
            return None  # an empty figure shows nothing, as in Jupyter
        data[PNG] = png
        setattr(obj, _SHOWN_ATTR, True)
    else:
        method = _real_method(obj, "_repr_mimebundle_")
        if method is not None:
            got = _call(method, warn, f"{type(obj).__name__}._repr_mimebundle_", include=include, exclude=exclude)
            if isinstance(got, tuple) and len(got) == 2:
                got = got[0]
            if isinstance(got, dict):
                data.update((k, v) for k, v in got.items() if isinstance(k, str))
        for mime, name in _METHODS:
            if mime in data:
                continue
            method = _real_method(obj, name)
            if method is None:
                continue
            value = _call(method, warn, f"{type(obj).__name__}.{name}")
            if isinstance(value, tuple) and len(value) == 2:
                value = value[0]  # (data, metadata)
            if value is not None:
                data[mime] = value
    data.setdefault("text/plain", _short_repr(obj))
    if include is not None:
        data = {k: v for k, v in data.items() if k in include}
    if exclude is not None:
        data = {k: v for k, v in data.items() if k not in exclude}
    return data


def _call(fn: Callable, warn: Callable[[str], None], what: str, *args: Any, **kwargs: Any) -> Any:
    try:
        return fn(*args, **kwargs)
    except NotImplementedError:
        return None
    except Exception as exc:  # noqa: BLE001 - one representation lost, said; the others still go
        warn(f"{what}() raised {type(exc).__name__}: {exc}")
        return None


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 1024:.0f} KiB"


def carried(data: dict[str, Any], warn: Callable[[str], None]) -> dict[str, bytes | str]:
    """Of a bundle, what crosses the boundary, each value as the contract wants it (a PNG as
    bytes, text as str, cut to its bound); what is refused is said with ``warn``."""
    out: dict[str, bytes | str] = {}
    for mime, value in data.items():
        if mime not in MIME_TYPES:
            continue  # (image/jpeg, application/pdf, ...: not carried; text/plain stands in)
        if mime == PNG:
            if isinstance(value, str):  # IPython takes a PNG as base64 text too
                try:
                    value = base64.b64decode(value)
                except (binascii.Error, ValueError):
                    value = b""
            if isinstance(value, bytearray | memoryview):
                value = bytes(value)
            if not isinstance(value, bytes) or png_size(value) is None:
                warn("an image/png that is not PNG data was not shown")
            elif len(value) > MAX_IMAGE:
                warn(f"an image/png of {_size(len(value))} was not shown: over the limit of {_size(MAX_IMAGE)} "
                     "an image (save it to a file instead, or make it smaller)")
            else:
                out[mime] = value
            continue
        if mime == "application/json" and not isinstance(value, str):
            try:
                value = json.dumps(value, ensure_ascii=False, default=repr)
            except (TypeError, ValueError):
                value = _short_repr(value)
        elif isinstance(value, bytes):
            value = value.decode("utf-8", "replace")
        elif not isinstance(value, str):
            value = str(value)
        if len(value) > MAX_DISPLAY_TEXT:
            note = f"\n[... {len(value) - MAX_DISPLAY_TEXT + 100} characters cut]"
            value = value[:MAX_DISPLAY_TEXT - 100] + note
        out[mime] = value
    return out


class Displays:
    """The displays of a worker's blocks: ``display`` for their namespace, ``end`` for the runtime
    when a block ends (its figures shown and closed), counted per block."""

    def __init__(self, send: Callable[[wire.Message], None], router: Router) -> None:
        self._send = send
        self._router = router
        self._counts: dict[str, int] = {}
        self._lock = threading.Lock()
        self._pid = os.getpid()
        #: Blocks run as scripts (``exec``): python's, without displays.
        self.scripts: set[str] = set()

    def rewire(self, send: Callable[[wire.Message], None], router: Router) -> None:
        """Send by ``send`` and ``router`` from now on (a fork's copy of the worker)."""
        self._send = send
        self._router = router

    def install(self) -> None:
        """Be the worker's displays, and adapt matplotlib and Pillow once the code imports them."""
        global _active
        _active = self
        after_import("matplotlib", self._matplotlib)
        after_import("matplotlib.pyplot", _pyplot)
        after_import("PIL.ImageShow", _pillow)

    def _matplotlib(self, module: Any) -> None:
        if os.environ.get("MPLBACKEND") or current_block.get() in self.scripts:
            return  # the user's choice; a script run is python's
        module.rcParams["backend"] = BACKEND

    # -- what the code calls -------------------------------------------------------------------
    def display(self, *objs: Any, include=None, exclude=None, metadata=None, raw: bool = False,
                **kwargs: Any) -> None:
        """Show each of ``objs`` with the block's result: its richest representations (see the module)."""
        for obj in objs:
            self.show(obj, include=include, exclude=exclude, raw=raw)

    def show(self, obj: Any, *, include=None, exclude=None, raw: bool = False) -> None:
        if os.getpid() != self._pid:  # a forked child has no channel of its own: what a script's child prints
            print(_short_repr(obj))
            return
        block = self._router.owner()
        if block is None or block in self.scripts:
            return
        bundle = dict(obj) if raw and isinstance(obj, dict) else bundle_of(obj, _warn, include, exclude)
        if bundle is None:
            return
        data = carried(bundle, _warn)
        if not data:
            return
        with self._lock:
            count = self._counts[block] = self._counts.get(block, 0) + 1
        if count > MAX_DISPLAYS:
            if count == MAX_DISPLAYS + 1:
                _warn(f"this block reached the limit of {MAX_DISPLAYS} displays: the later ones are not shown")
            return
        self._router.flush_block(block)  # the output written before it goes first
        self._send(wire.Display(block, data))

    # -- what the runtime calls ------------------------------------------------------------------
    def end(self, block_id: str, shown: bool = True) -> None:
        """The block's code is over: display (``shown``) and close the figures it left open."""
        try:
            for fig in self.figures(block_id):
                if shown and not (getattr(fig, _SHOWN_ATTR, False) and not fig.stale):
                    self.show(fig)
                _close(fig)
        except Exception as exc:  # noqa: BLE001 - the block's end is not to be lost over a figure
            _warn(f"showing the figures at the end of the block failed: {type(exc).__name__}: {exc}")
        finally:
            with self._lock:
                self._counts.pop(block_id, None)
            self.scripts.discard(block_id)

    @staticmethod
    def figures(block_id: str | None) -> list[Any]:
        """The open figures ``block_id``'s code made with the worker's backend (none before
        matplotlib was imported)."""
        helpers = sys.modules.get("matplotlib._pylab_helpers")
        if helpers is None:
            return []
        return [m.canvas.figure for m in helpers.Gcf.get_all_fig_managers()
                if getattr(m.canvas.figure, _BLOCK_ATTR, None) == block_id and block_id is not None]

    def show_figures(self, block_id: str | None) -> None:
        """``plt.show()``: display the block's open figures and close them."""
        for fig in self.figures(block_id):
            self.show(fig)
            _close(fig)


def _close(fig: Any) -> None:
    helpers = sys.modules.get("matplotlib._pylab_helpers")
    if helpers is not None:
        helpers.Gcf.destroy_fig(fig)


def _warn(words: str) -> None:
    sys.stderr.write(f"display(): {words}\n")


def _pyplot(module: Any) -> None:
    """pyplot's backend, loaded while pyplot is imported (under the import's lock), not when a
    figure first needs it: two blocks that make their first figures at once would each load it,
    and loading a backend closes every open figure (``switch_backend``), the other block's too."""
    backend = sys.modules["matplotlib"].rcParams._get("backend")
    if backend == BACKEND:
        module.switch_backend(BACKEND)


def _pillow(module: Any) -> None:
    """``Image.show()`` displays the image (Pillow asks its viewers in order: this one first)."""

    class _Displayed(module.Viewer):
        def show(self, image: Any, **options: Any) -> int:
            displays = active()
            if displays is None or current_block.get() in displays.scripts:
                return 0  # (the next viewer's: a script run is python's)
            displays.show(image)
            return 1

    module.register(_Displayed, order=-1)
