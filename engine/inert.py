"""Inert text: what a model or a worker wrote cannot drive the terminal agentloop prints it on.

The rule: only printable characters, newline and tab reach the terminal.  Everything else is
*removed*, never shown escaped (an escaped form would be model-chosen text that merely looks
like a control sequence; removal keeps the display readable and leaves nothing to act on):

- every escape sequence, whole: CSI (``ESC [`` or U+009B, parameters, intermediates, final
  byte), the strings OSC, DCS, SOS, PM and APC (``ESC ] P X ^ _`` or U+009D, U+0090, U+0098,
  U+009E, U+009F) up to their BEL, ST (``ESC \\`` or U+009C), CAN or SUB, and two-character
  and nF escapes (``ESC 7``, ``ESC c``, ``ESC ( B``); a sequence cut short by a character it
  cannot contain ends there, and that character is read as text again;
- every other C0 control (U+0000–U+001F but tab and newline), DEL and C1 control
  (U+0080–U+009F); lone surrogates become U+FFFD;
- a carriage return: ``\\r\\n`` becomes ``\\n`` and a lone ``\\r`` becomes ``\\n`` too, so a
  line can never be overwritten to hide what it said (a progress bar shows one line per
  update).  ``carriage_returns=True`` passes ``\\r`` through for a caller that resolves it
  itself and never prints it (the console display keeps a rewritten line's last state), or
  for the user's own program at a terminal, whose progress bars redraw a line (``exec``,
  which passes backspaces too: ``backspaces=True``).

With ``allow_sgr`` a colour or style sequence (SGR) is kept, in its 7-bit form, when it is
well formed and bounded (``is_style``): at most ``MAX_SGR_PARAMETERS`` parameters, each a
colour (the 8 and 16 colours, ``38;5;N``, ``38;2;R;G;B`` and their background forms), bold,
dim, italic, underline, reverse, strike or one of their resets.  Conceal (8) is not a style:
it hides text from the reader, so a sequence that asks for it is dropped whole, as are blink,
fonts, sub-parameters (``38:2::R:G:B``), empty or out-of-range parameters; nothing else is
kept.  The filters are incremental, so a sequence or a UTF-8 character split
across chunks is handled as if it came whole, and their state is bounded: a string longer than
``MAX_STRING`` characters is abandoned (what follows shows as text), a CSI keeps at most
``MAX_CSI`` parameter characters.  Text with nothing to remove goes through one regex search.
"""

from __future__ import annotations

import codecs
import re

__all__ = ["InertStream", "InertText", "MAX_CSI", "MAX_STRING", "inert"]

#: Characters of an OSC/DCS/SOS/PM/APC string dropped before it is abandoned as unterminated.
MAX_STRING = 64 * 1024
#: Parameter characters of a CSI kept to decide whether it is a colour (SGR) sequence.
MAX_CSI = 64
#: Parameters of one SGR sequence that ``allow_sgr`` passes at most (a bold underlined text in
#: two 24-bit colours takes 13).
MAX_SGR_PARAMETERS = 16

# Everything not passed as is: C0 but tab and newline, DEL, C1, surrogates.
_SPECIAL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\ud800-\udfff]")
_CSI_BODY = re.compile(r"[ -?]*")  # parameters (0x30-0x3f) and intermediates (0x20-0x2f)
_ESC_INTERMEDIATES = re.compile(r"[ -/]*")
_STRING_END = re.compile(r"[\x07\x18\x1a\x1b\x9c]")  # BEL, CAN, SUB, ESC (ST is ESC \), C1 ST
# Single SGR parameters that style text: reset, bold, dim, italic, underline, reverse, strike,
# double underline and their resets, the 8 foreground and background colours with their
# defaults, and the bright 8 of each.  Not 8 (conceal), 5 and 6 (blink), 10-20 (fonts).
_STYLES = frozenset({0, 1, 2, 3, 4, 7, 9, 21, 22, 23, 24, 27, 28, 29, *range(30, 38), 39, *range(40, 48), 49,
                     *range(90, 98), *range(100, 108)})
_EXTENDED = (38, 48)  # then 5;N (256 colours) or 2;R;G;B (24-bit)

_GROUND, _ESC, _ESC_NF, _CSI, _STRING = range(5)
_STRING_OPENERS = "]PX^_"  # after ESC: OSC, DCS, SOS, PM, APC
_C1_STRINGS = "\x9d\x90\x98\x9e\x9f"


class InertText:
    """An incremental filter over text: ``feed`` chunks, then ``flush`` once at the end.

    ``feed(a) + feed(b) + flush()`` equals ``inert(a + b)``: what a chunk ends in the middle
    of (an escape sequence, a ``\\r`` whose ``\\n`` may follow) waits for the next chunk, in
    a few fields, never in a buffer that grows."""

    def __init__(self, *, allow_sgr: bool = False, carriage_returns: bool = False, backspaces: bool = False) -> None:
        self.allow_sgr = allow_sgr
        self.carriage_returns = carriage_returns
        self.backspaces = backspaces
        self._state = _GROUND
        self._csi: str | None = ""  # the CSI's parameters so far; None when too long to be a colour
        self._skipped = 0  # characters of the current string dropped so far
        self._cr = False  # a \r ended the last chunk: a \n may follow

    def feed(self, text: str) -> str:
        out: list[str] = []
        i, n = 0, len(text)
        if self._cr and n:
            self._cr = False
            if text[0] != "\n":
                out.append("\n")
        while i < n:
            state = self._state
            if state == _GROUND:
                found = _SPECIAL.search(text, i)
                if found is None:
                    out.append(text[i:])
                    break
                j = found.start()
                if j > i:
                    out.append(text[i:j])
                i = self._control(text, j, out)
            elif state == _ESC:
                c = text[i]
                i += 1
                if c == "[":
                    self._state, self._csi = _CSI, ""
                elif c in _STRING_OPENERS:
                    self._state, self._skipped = _STRING, 0
                elif " " <= c <= "/":
                    self._state = _ESC_NF
                elif "0" <= c <= "~":
                    self._state = _GROUND  # a two-character sequence (ST included): dropped
                else:
                    self._state, i = _GROUND, i - 1  # a lone ESC: dropped; c is read again
            elif state == _ESC_NF:
                i = _ESC_INTERMEDIATES.match(text, i).end()
                if i < n:
                    self._state = _GROUND
                    if "0" <= text[i] <= "~":
                        i += 1  # the final byte; anything else ends the sequence and is read again
            elif state == _CSI:
                end = _CSI_BODY.match(text, i).end()
                if self._csi is not None:
                    self._csi += text[i:min(end, i + MAX_CSI + 1)]
                    if len(self._csi) > MAX_CSI:
                        self._csi = None
                i = end
                if i < n:
                    self._state = _GROUND
                    if "@" <= text[i] <= "~":
                        if self.allow_sgr and text[i] == "m" and self._csi is not None and is_style(self._csi):
                            out.append(f"\x1b[{self._csi}m")
                        i += 1
            else:  # _STRING
                found = _STRING_END.search(text, i)
                end = found.start() if found else n
                if self._skipped + (end - i) > MAX_STRING:  # unterminated: give up, the rest is text
                    i += MAX_STRING - self._skipped
                    self._state = _GROUND
                    continue
                self._skipped += end - i
                i = end
                if found is not None:
                    # BEL and ST end the string, CAN and SUB cancel it, ESC ends it and starts a
                    # sequence (ESC \ being ST, a two-character sequence, dropped)
                    self._state = _ESC if text[i] == "\x1b" else _GROUND
                    i += 1
        return "".join(out)

    def _control(self, text: str, j: int, out: list[str]) -> int:
        """Handles the special character at ``text[j]`` in ground state; the next index."""
        c = text[j]
        if c == "\x1b":
            self._state = _ESC
        elif c == "\x9b":
            self._state, self._csi = _CSI, ""
        elif c in _C1_STRINGS:
            self._state, self._skipped = _STRING, 0
        elif c == "\r":
            if self.carriage_returns:
                out.append(c)
            elif j + 1 == len(text):
                self._cr = True  # decided by the next chunk
            elif text[j + 1] != "\n":
                out.append("\n")
        elif c == "\b" and self.backspaces:
            out.append(c)
        elif "\ud800" <= c <= "\udfff":
            out.append("\ufffd")
        return j + 1  # any other control: dropped

    def flush(self) -> str:
        """The end of the text: an unfinished sequence is dropped, a last lone ``\\r`` is a newline."""
        self._state = _GROUND
        if self._cr:
            self._cr = False
            return "\n"
        return ""


def is_style(parameters: str) -> bool:
    """Whether ``ESC [ parameters m`` only sets colours and styles (see the module docstring):
    "" (a reset) or at most ``MAX_SGR_PARAMETERS`` ``;``-separated decimal parameters, each
    of one to three digits, that make up styles and colours and nothing else."""
    if not parameters:
        return True
    fields = parameters.split(";")
    if len(fields) > MAX_SGR_PARAMETERS or not all(0 < len(f) <= 3 and f.isdigit() and f.isascii()
                                                   for f in fields):
        return False
    numbers = [int(f) for f in fields]
    i = 0
    while i < len(numbers):
        n = numbers[i]
        if n in _EXTENDED:
            rest = numbers[i + 1:]
            if rest[:1] == [5] and len(rest) >= 2 and rest[1] <= 255:
                i += 3
            elif rest[:1] == [2] and len(rest) >= 4 and max(rest[1:4]) <= 255:
                i += 5
            else:
                return False
        elif n in _STYLES:
            i += 1
        else:
            return False
    return True


def inert(text: str, *, allow_sgr: bool = False) -> str:
    """``text`` with nothing a terminal acts on but newlines and tabs (see the module docstring)."""
    if not _SPECIAL.search(text):
        return text
    text_filter = InertText(allow_sgr=allow_sgr)
    return text_filter.feed(text) + text_filter.flush()


class InertStream:
    """An incremental filter over bytes, for program output bound for a terminal.

    Input is decoded as UTF-8 with replacement (so a raw 0x9b or 0x9d byte, not being valid
    UTF-8, becomes U+FFFD and never reaches the terminal), filtered as by ``InertText`` and
    encoded in ``encoding`` (the terminal's; unencodable characters become ``?``)."""

    def __init__(self, *, allow_sgr: bool = False, encoding: str = "utf-8", carriage_returns: bool = False,
                 backspaces: bool = False) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._text = InertText(allow_sgr=allow_sgr, carriage_returns=carriage_returns, backspaces=backspaces)
        self.encoding = encoding

    def feed(self, data: bytes) -> bytes:
        return self._text.feed(self._decoder.decode(data)).encode(self.encoding, "replace")

    def flush(self) -> bytes:
        """The end of the stream: a UTF-8 character cut short becomes U+FFFD, a sequence cut
        short is dropped.  The filter can be fed again afterwards, from a clean state."""
        text = self._text.feed(self._decoder.decode(b"", final=True)) + self._text.flush()
        self._decoder.reset()
        return text.encode(self.encoding, "replace")
