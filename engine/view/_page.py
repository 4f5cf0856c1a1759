"""One self-contained HTML page: our stylesheet and script inlined, the data as inert JSON.

Everything a model, a worker or a task file wrote reaches the page only as data: a JSON
document in a ``<script type="application/json">`` element, with ``<``, ``>``, ``&`` and the
two JavaScript line separators written as ``\\uXXXX`` escapes, so no string can close the
element or open another.  The page's script reads it with ``JSON.parse`` and puts it on the page
with ``textContent`` only, never as markup.  A Content-Security-Policy allows exactly our one
script (by its hash), our style, nothing from the network, no frames or forms: even a string
that got out as markup could neither run nor fetch anything.
"""

from __future__ import annotations

import base64
import hashlib
import html
import json
from functools import cache
from importlib.resources import files
from typing import Any

_JSON_ESCAPES = {ord("<"): "\\u003c", ord(">"): "\\u003e", ord("&"): "\\u0026", 0x2028: "\\u2028",
                 0x2029: "\\u2029"}


def inert_json(data: Any) -> str:
    """``data`` as JSON that is safe inside any HTML element's text."""
    return json.dumps(data, ensure_ascii=False, separators=(",", ":"), allow_nan=False).translate(_JSON_ESCAPES)


@cache
def _asset(name: str) -> str:
    return files("engine.view").joinpath(name).read_text(encoding="utf-8")


def page(title: str, kind: str, data: Any) -> str:
    """The page of ``kind`` (``timeline`` or ``report``: its script is ``KIND.js``) showing ``data``."""
    script = _asset("common.js") + "\n" + _asset(f"{kind}.js")
    digest = base64.b64encode(hashlib.sha256(script.encode()).digest()).decode()
    policy = (f"default-src 'none'; script-src 'sha256-{digest}'; style-src 'unsafe-inline'; img-src data:; "
              "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
    return (
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
        f"<meta http-equiv=\"Content-Security-Policy\" content=\"{policy}\">\n"
        "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n"
        "<meta name=\"referrer\" content=\"no-referrer\">\n"
        f"<title>{html.escape(title)}</title>\n<style>\n{_asset('view.css')}</style>\n</head>\n"
        f"<body class=\"{kind}\">\n<noscript>This page draws itself with JavaScript.</noscript>\n"
        f"<main id=\"app\"></main>\n"
        f"<script type=\"application/json\" id=\"data\">{inert_json(data)}</script>\n"
        f"<script>{script}</script>\n</body>\n</html>\n")


__all__ = ["inert_json", "page"]
