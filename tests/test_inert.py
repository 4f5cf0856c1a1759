"""engine.inert: what survives (printable text, newline, tab), what goes (every control and
escape sequence), and that chunking never changes the outcome."""

from __future__ import annotations

import random
import re

import pytest

from engine.inert import MAX_CSI, MAX_SGR_PARAMETERS, MAX_STRING, InertStream, InertText, inert, is_style

# What must never come out: C0 but tab and newline, DEL, C1.
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
_SGR = re.compile(r"\x1b\[[0-9;]*m")


@pytest.mark.parametrize("raw, shown", [
    ("clip\x1b]52;c;U0VDUkVU\x07board", "clipboard"),  # OSC 52, BEL-terminated
    ("a\x1b]0;title\x1b\\b", "ab"),  # OSC 0, ST-terminated
    ("a\x1b]8;;http://x\x9cb", "ab"),  # OSC 8 ended by C1 ST
    ("a\x1bPq#0;2;0;0;0\x1b\\b", "ab"),  # DCS (sixel)
    ("a\x1bXsos\x1b\\b\x1b^pm\x07c\x1b_apc\x1b\\d", "abcd"),  # SOS, PM, APC
    ("\x1b[2J\x1b[Hcleared", "cleared"),  # CSI 2J, cursor home
    ("a\x1b[?1049h\x1b[6nb", "ab"),  # private CSI, device status report
    ("c1\x9b2J csi\x9d0;t\x07 osc", "c1 csi osc"),  # C1 CSI and OSC
    ("a\x90dcs\x9cb\x98s\x9cc\x9ep\x9cd\x9fa\x9ce", "abcde"),  # C1 DCS, SOS, PM, APC
    ("a\x1b7b\x1b8c\x1bcd\x1b(Be\x1b#8f", "abcdef"),  # two-character and nF escapes
    ("a\x1b]0;x\x18b\x1b]0;y\x1ac", "abc"),  # CAN and SUB cancel a string
    ("a\x1b]0;x\x1b[2Jb", "ab"),  # ESC ends a string and starts the next sequence
    ("a\x1b[3\nb", "a\nb"),  # a sequence cut short: the character that ended it is text again
    ("a\x1b\x1b[2Jb", "ab"),  # ESC ESC: the first is dropped alone
    ("bell\x07 bs\x08 del\x7f nul\x00 vt\x0b ff\x0c", "bell bs del nul vt ff"),
    ("c1 \x80\x85\x8d\x9c done", "c1  done"),
    ("tab\tnewline\n", "tab\tnewline\n"),
    ("é 世界 🙂 ÿ", "é 世界 🙂 ÿ"),
    ("a\rb\r\nc\r", "a\nb\nc\n"),  # a lone \r is a newline: nothing gets overwritten
    ("lone \ud800 surrogate", "lone \ufffd surrogate"),
    ("ends in ESC\x1b", "ends in ESC"),
    ("ends in OSC\x1b]52;c;QUJD", "ends in OSC"),
])
def test_inert(raw, shown):
    assert inert(raw) == shown


def test_plain_text_is_returned_as_is():
    text = "nothing to do here\n\tat all — ünïcödé\n"
    assert inert(text) is text


@pytest.mark.parametrize("raw, kept", [
    ("\x1b[31mred\x1b[0m", "\x1b[31mred\x1b[0m"),
    ("\x1b[38;5;196mx\x1b[m", "\x1b[38;5;196mx\x1b[m"),
    ("\x9b1mbold", "\x1b[1mbold"),  # the C1 form comes out 7-bit
    ("\x1b[?5mx", "x"),  # a private parameter: not a colour
    ("\x1b[1 mx", "x"),  # an intermediate: not a colour
    ("\x1b[31;1Hx\x1b[2J", "x"),  # cursor moves are not colours
    ("\x1b]52;c;QUJD\x07x", "x"),
])
def test_sgr_only_when_allowed(raw, kept):
    assert inert(raw, allow_sgr=True) == kept
    assert not _CONTROL.search(inert(raw))


@pytest.mark.parametrize("parameters", [
    "", "0", "1;31", "2;3;4;7;9", "21;22;23;24;27;28;29", "39;49", "97;107", "38;5;0", "48;5;255",
    "38;2;0;128;255", "1;4;38;2;255;255;255;48;2;0;0;0", ";".join(["1"] * MAX_SGR_PARAMETERS),
])
def test_styles(parameters):
    assert is_style(parameters)
    assert inert(f"\x1b[{parameters}mx", allow_sgr=True) == f"\x1b[{parameters}mx"


@pytest.mark.parametrize("parameters", [
    "8", "1;8", "8;31", "5", "6", "10", "20", "26", "50", "38", "38;5", "38;5;256", "38;2;1;2", "38;2;1;2;300",
    "38;6;1", "48;5;999", "1;;31", ";", ";1", "1;", "0031", "9999", "38:2::1:2:3", "1:3",
    ";".join(["1"] * (MAX_SGR_PARAMETERS + 1)),
])
def test_not_styles(parameters):
    assert not is_style(parameters)
    assert inert(f"\x1b[{parameters}mx", allow_sgr=True) == "x"


def test_an_unterminated_string_is_abandoned_after_the_bound():
    tail = "visible again"
    raw = "a\x1b]52;c;" + "A" * (MAX_STRING - 5) + tail
    assert inert(raw) == "a" + tail  # the bound counts the characters after "ESC ]"
    stream = InertText()
    out = stream.feed("a\x1b]0;") + "".join(stream.feed("x" * 1000) for _ in range(MAX_STRING // 1000))
    assert out == "a" and stream.feed("x" * 1000).startswith("x")


def test_a_colour_sequence_past_the_bound_is_dropped():
    long_sgr = "\x1b[" + "1;" * MAX_CSI + "1m"
    assert inert(long_sgr + "x", allow_sgr=True) == "x"


def _chunked(text: str, cuts: list[int], **kwargs) -> str:
    stream, pieces, start = InertText(**kwargs), [], 0
    for cut in [*cuts, len(text)]:
        pieces.append(stream.feed(text[start:cut]))
        start = cut
    return "".join(pieces) + stream.flush()


_SAMPLE = ("one\x1b]52;c;U0VDUkVU\x07two\x1b[2Jthree\x9b31mfour\x9d0;t\x1b\\five\r\nsix\rseven"
           "\x1b[31mred\x1b[0m\x1bPdcs\x9ceight\x1b(Bnine\x1b")


@pytest.mark.parametrize("allow_sgr", [False, True])
def test_every_single_split_gives_the_whole_result(allow_sgr):
    whole = inert(_SAMPLE, allow_sgr=allow_sgr)
    assert whole == ("onetwothree" + ("\x1b[31m" if allow_sgr else "") + "fourfive\nsix\nseven"
                     + ("\x1b[31mred\x1b[0m" if allow_sgr else "red") + "eightnine")
    for cut in range(len(_SAMPLE) + 1):
        assert _chunked(_SAMPLE, [cut], allow_sgr=allow_sgr) == whole, cut


def test_random_chunkings_agree_and_leave_no_control():
    pieces = ["a", "é", "\n", "\t", "\r", "\x1b", "[", "]", "P", "(", "3", "1", ";", "m", "?", " ", "\\",
              "\x07", "\x18", "\x9b", "\x9c", "\x9d", "\x00", "\x7f"]
    rng = random.Random(6)
    for _ in range(3000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 40)))
        cuts = sorted(rng.sample(range(len(text) + 1), rng.randint(0, min(6, len(text) + 1))))
        for allow_sgr in (False, True):
            whole = inert(text, allow_sgr=allow_sgr)
            assert _chunked(text, cuts, allow_sgr=allow_sgr) == whole, (text, cuts)
            assert not _CONTROL.search(_SGR.sub("", whole) if allow_sgr else whole), (text, whole)


def test_stream_decodes_bytes_split_anywhere():
    data = ("naïve €\x1b]0;x\x07 世界\n".encode() + b"raw \x9b2J \x9d0;t\x07 bad \xff\xfe end\n"
            + "\u009b2J c1 as UTF-8\n".encode())
    expected = ("naïve € 世界\nraw \ufffd2J \ufffd0;t bad \ufffd\ufffd end\n"
                " c1 as UTF-8\n").encode()
    for cut in range(len(data) + 1):
        stream = InertStream()
        assert stream.feed(data[:cut]) + stream.feed(data[cut:]) + stream.flush() == expected, cut


def test_stream_flush_ends_a_cut_character_and_resets():
    stream = InertStream()
    assert stream.feed(b"x\xe2\x82") == b"x"
    assert stream.flush() == "\ufffd".encode()
    assert stream.feed(b"\x1b[31mfresh") == b"fresh"


def test_stream_sgr_and_encoding():
    assert InertStream(allow_sgr=True).feed(b"\x1b[1mhi\x1b]0;t\x07") == b"\x1b[1mhi"
    # A single-byte terminal gets single bytes: no UTF-8 continuation byte in 0x80-0x9f to act as C1.
    assert InertStream(encoding="latin-1").feed("Û€!".encode()) == b"\xdb?!"
