"""``libra vllm``: the bare vLLM launcher keeps its flags under its new name."""

from __future__ import annotations

import pytest

from libra.cli import main


def test_libra_vllm_takes_the_launchers_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["vllm", "--help"])
    assert done.value.code == 0
    usage = capsys.readouterr().out
    for flag in ("--model", "--port", "--dev-mode", "--tool-call-parser", "--enforce-eager"):
        assert flag in usage
