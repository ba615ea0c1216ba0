"""Text from env code made safe to send and record: valid UTF-8, of bounded size.

Tools often pass on what a program printed, and Python decodes undecodable bytes as lone
surrogates (``surrogateescape``: subprocess output, file names); such a string cannot be
encoded as UTF-8, so neither the next request nor the record could carry it. A tool that
prints a whole file or a runaway loop's output would fill the context and the record.
"""

from __future__ import annotations


def valid_utf8(text: str) -> str:
    """``text``, with what UTF-8 cannot encode shown as U+FFFD (the bytes a
    ``surrogateescape`` decoding kept are decoded again, each bad one replaced)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        if all(0xDC80 <= ord(c) <= 0xDCFF for c in text if _is_surrogate(c)):
            return text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
        return "".join("\ufffd" if _is_surrogate(c) else c for c in text)
    return text


def _is_surrogate(char: str) -> bool:
    return 0xD800 <= ord(char) <= 0xDFFF


def cut_middle(text: str, limit: int) -> str:
    """``text`` if it has at most ``limit`` characters, else its start and end around a
    note of what was cut (the end of a long output, an error's last lines, matters too)."""
    if len(text) <= limit:
        return text
    note = f"\n[... {len(text) - limit:,} characters cut ...]\n"
    head = max(0, limit - len(note)) // 2
    tail = max(0, limit - len(note) - head)
    return text[:head] + note + (text[-tail:] if tail else "")
