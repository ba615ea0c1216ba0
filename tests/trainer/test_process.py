"""The trainer's processes as the loop drives them: a rank that dies is reported at once,
by ``watch`` between commands and by ``call`` during one, as ``trainer rank N died``."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import anyio
import pytest

from libra.trainer import TrainerConfig, TrainerError, TrainerProcess
from tests.trainer._ranks import Fail, RankPids, SleepThenMeet

pytestmark = pytest.mark.anyio
CONFIG = TrainerConfig(backend="gloo", cpu_threads=1)
# A death is noticed within seconds; the bound only keeps a regression from hanging.
PROMPTLY_S = 60


@pytest.mark.faults
@pytest.mark.slow
async def test_a_rank_killed_between_commands_stops_watch_and_every_later_call(
    tiny_model: Path,
) -> None:
    async with TrainerProcess(tiny_model, CONFIG, world_size=2) as trainer:
        pids = await trainer.call(RankPids())
        assert len(set(pids)) == 2
        os.kill(pids[1], signal.SIGKILL)
        with anyio.fail_after(PROMPTLY_S), pytest.raises(TrainerError) as watched:
            await trainer.watch()
        assert str(watched.value) == "trainer rank 1 died (SIGKILL)"
        with pytest.raises(TrainerError, match=r"^trainer rank 1 died \(SIGKILL\)$"):
            await trainer.call(RankPids())
    assert trainer._process.exitcode == 1  # its ranks are gone, and so is it


@pytest.mark.faults
@pytest.mark.slow
async def test_a_rank_killed_mid_command_fails_the_call_with_its_death(
    tiny_model: Path, tmp_path: Path
) -> None:
    started = tmp_path / "started"
    async with TrainerProcess(tiny_model, CONFIG, world_size=2) as trainer:
        pids = await trainer.call(RankPids())
        async with anyio.create_task_group() as group:

            async def kill_once_started() -> None:
                deadline = anyio.current_time() + PROMPTLY_S
                while not started.exists():  # a file another process writes: polled
                    assert anyio.current_time() < deadline
                    await anyio.sleep(0.05)
                os.kill(pids[1], signal.SIGKILL)

            group.start_soon(kill_once_started)
            with anyio.fail_after(PROMPTLY_S), pytest.raises(TrainerError) as failed:
                await trainer.call(SleepThenMeet(2.0, started))
        assert str(failed.value).startswith("trainer rank 1 died (SIGKILL)")


async def test_a_command_that_raises_reports_its_traceback(tiny_model: Path) -> None:
    async with TrainerProcess(tiny_model, CONFIG, world_size=1) as trainer:
        with pytest.raises(TrainerError, match="the trainer failed") as failed:
            await trainer.call(Fail())
        assert "ValueError: a bug in the command" in str(failed.value)
        # The trainer's processes end with it: a later call says so, without a hang.
        with anyio.fail_after(PROMPTLY_S), pytest.raises(TrainerError, match="rank 0 failed"):
            await trainer.call(RankPids())
