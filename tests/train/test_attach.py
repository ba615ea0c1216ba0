"""``libra train --serve URL`` refuses servers that would train wrong: not in dev mode,
another logprobs mode, tied embeddings."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from libra.emulation import running_emulator
from libra.train import AttachError, check_attached, problems_of

pytestmark = pytest.mark.anyio


def server_info(model: Path, logprobs_mode: str = "processed_logprobs") -> dict[str, Any]:
    """The part of vLLM 0.32's ``/server_info?config_format=json`` the check reads, as
    a dev-mode server started by ``libra train`` answered it."""
    return {
        "vllm_config": {
            "model_config": {
                "model": str(model),
                "logprobs_mode": logprobs_mode,
                "dtype": "torch.float32",
                "served_model_name": "smollm2-135m-instruct",
            }
        }
    }


def folder(tmp_path: Path, *, tied: bool) -> Path:
    (tmp_path / "config.json").write_text(json.dumps({"tie_word_embeddings": tied}))
    return tmp_path


def test_a_server_started_as_the_loop_starts_its_own_passes(tmp_path: Path) -> None:
    assert problems_of(server_info(folder(tmp_path, tied=False)), "processed_logprobs") == []


def test_another_logprobs_mode_is_named(tmp_path: Path) -> None:
    info = server_info(folder(tmp_path, tied=False), "raw_logprobs")
    [problem] = problems_of(info, "processed_logprobs")
    assert "--logprobs-mode raw_logprobs" in problem and "processed_logprobs" in problem


def test_tied_embeddings_are_refused(tmp_path: Path) -> None:
    [problem] = problems_of(server_info(folder(tmp_path, tied=True)), "processed_logprobs")
    assert "tied" in problem and "servable_model" in problem


def test_a_folder_out_of_reach_is_not_judged(tmp_path: Path) -> None:
    """The server may run on another machine: its model path means nothing here."""
    assert problems_of(server_info(tmp_path / "elsewhere"), "processed_logprobs") == []


async def test_a_server_without_dev_mode_is_refused() -> None:
    # The emulator, like vLLM without VLLM_SERVER_DEV_MODE=1, has no /server_info.
    with (
        running_emulator() as url,
        pytest.raises(AttachError, match="not a vLLM server in dev mode"),
    ):
        await check_attached([url], "processed_logprobs")


async def test_a_server_that_is_not_there_is_named() -> None:
    with pytest.raises(AttachError, match="did not answer"):
        await check_attached(["http://127.0.0.1:9"], "processed_logprobs", timeout_s=5)
