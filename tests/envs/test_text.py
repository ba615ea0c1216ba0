"""Text from env code, made valid UTF-8 and cut to size."""

from __future__ import annotations

import pytest

from libra.envs import cut_middle, valid_utf8


@pytest.mark.parametrize(
    ("text", "valid"),
    [
        ("plain é ✓", "plain é ✓"),
        (b"ok \xff\xfe then \xc3\xa9".decode("utf-8", "surrogateescape"), "ok \ufffd\ufffd then é"),
        ("lone \ud800 surrogate", "lone \ufffd surrogate"),
    ],
)
def test_text_is_made_valid_utf8(text: str, valid: str) -> None:
    assert valid_utf8(text) == valid
    valid_utf8(text).encode("utf-8")


def test_long_text_keeps_its_start_and_end() -> None:
    assert cut_middle("short", 10) == "short"
    text = "a" * 500 + "b" * 500
    cut = cut_middle(text, 100)
    assert len(cut) == 100 and "[... 900 characters cut ...]" in cut
    assert cut.startswith("aaaa") and cut.endswith("bbbb")
