"""What a display carries across the boundary: its MIME types, their bounds, and a PNG's size.

A display (``display(obj)``, a matplotlib figure shown) is a MIME bundle: one representation of
an object per type.  Only the types listed here cross, each as the type it must be (an image as
bytes, every other representation as text) and within its bound (``limits``).  Both sides check
with the same functions: the worker before it sends, so that what it refuses it can say in
words; the coordinator when it receives, so that a worker that sends anything else is broken.

An image is a PNG, and the only thing either side reads of it is its header: the signature and
the ``IHDR`` chunk that follows, whose width and height are read with bounds checks.  Nothing
here, or anywhere in the coordinator, decodes the pixels of an image a worker made.
"""

from __future__ import annotations

import struct
from typing import Any

from .limits import MAX_DISPLAY_TEXT, MAX_IMAGE
from .schema import ContractError

__all__ = ["IMAGE_TYPES", "MAX_SIDE", "MIME_TYPES", "PNG", "SVG", "TEXT_TYPES", "check_bundle", "png_size"]

PNG = "image/png"
SVG = "image/svg+xml"
#: Representations carried as bytes (images a model can be shown), and as text, in the order
#: a reader that takes only one of them prefers.
IMAGE_TYPES = (PNG,)
TEXT_TYPES = ("text/markdown", "text/plain", SVG, "text/html", "application/json", "text/latex")
MIME_TYPES = (*IMAGE_TYPES, *TEXT_TYPES)

#: The longest side of an image, in pixels, that either side takes (a header claiming more is
#: not an image anyone made to be looked at).
MAX_SIDE = 32768

_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_IHDR = struct.Struct(">I4sII")  # the first chunk's length, its type, then width and height


def png_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) from a PNG's header, or None when ``data`` does not start as a PNG does
    (the signature, then an ``IHDR`` chunk of 13 bytes) or claims a side of 0 or over ``MAX_SIDE``."""
    if len(data) < len(_SIGNATURE) + _IHDR.size or not data.startswith(_SIGNATURE):
        return None
    length, kind, width, height = _IHDR.unpack_from(data, len(_SIGNATURE))
    if length != 13 or kind != b"IHDR" or not (0 < width <= MAX_SIDE and 0 < height <= MAX_SIDE):
        return None
    return width, height


def check_bundle(value: Any) -> dict[str, bytes | str]:
    """A received bundle, checked: a map of listed MIME types, each an image (bytes of a PNG of
    at most ``MAX_IMAGE``) or a text of at most ``MAX_DISPLAY_TEXT`` characters.  ContractError
    for anything else."""
    if type(value) is not dict or len(value) > len(MIME_TYPES):
        raise ContractError("a display's data is not a map of MIME types")
    for mime, data in value.items():
        if mime in IMAGE_TYPES:
            if type(data) is not bytes or len(data) > MAX_IMAGE:
                raise ContractError(f"a display's {mime} is not bytes, at most {MAX_IMAGE}")
            if png_size(data) is None:
                raise ContractError(f"a display's {mime} does not start as a PNG does")
        elif mime in TEXT_TYPES:
            if type(data) is not str or len(data) > MAX_DISPLAY_TEXT:
                raise ContractError(f"a display's {mime} is not a string of at most {MAX_DISPLAY_TEXT} characters")
        else:
            raise ContractError("a display names a MIME type that is not carried")
    return value
