"""Libra's cache folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from libra import libra_home


def test_libra_home_follows_the_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("LIBRA_HOME", str(tmp_path))
    assert libra_home() == tmp_path
    monkeypatch.setenv("LIBRA_HOME", "~/libra-cache")
    assert libra_home() == Path.home() / "libra-cache"
    monkeypatch.delenv("LIBRA_HOME")
    assert libra_home() == Path.home() / ".cache" / "libra"
