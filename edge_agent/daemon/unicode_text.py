"""Whether a ``str`` is text a tokenizer can take: no surrogate code points.

A ``str`` can hold code points U+D800-U+DFFF although no character is one: JSON spells them as
``\\uD800`` escapes (valid JSON, not valid Unicode unless paired), and Python's
``surrogateescape`` turns each byte of a command-line argument or a terminal line that is not
UTF-8 into U+DC80-U+DCFF. UTF-8 cannot encode them and the tokenizers refuse them with a
``TypeError``, so every front end checks its text first and names the fault.
"""

from __future__ import annotations

import re

#: One surrogate code point (a valid pair in JSON decodes to one astral character, not two).
SURROGATE = re.compile("[\ud800-\udfff]")


def text_error(s: str) -> str | None:
    """None when ``s`` is text; else what is wrong with it, for an error message."""
    m = SURROGATE.search(s)
    if m is None:
        return None
    cp = ord(m.group())
    if 0xDC80 <= cp <= 0xDCFF:  # surrogateescape: byte cp - 0xDC00, not UTF-8
        return f"is not UTF-8: byte 0x{cp - 0xDC00:02x} at character {m.start()}"
    return f"holds a lone UTF-16 surrogate U+{cp:04X} at character {m.start()}"
