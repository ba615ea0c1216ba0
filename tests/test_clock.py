"""The event loop's clock: anyio's, on either backend, virtual clocks included."""

from __future__ import annotations

import anyio
import pytest
import trio.testing

from libra._clock import now


@pytest.mark.anyio
async def test_it_reads_the_running_loops_clock() -> None:
    before = anyio.current_time()
    read = now()
    assert before - 0.002 <= read <= anyio.current_time() + 0.002  # (uvloop's: to the ms)


def test_it_reads_uvloops_clock_to_the_millisecond() -> None:
    async def both() -> tuple[float, float]:
        return anyio.current_time(), now()

    loop_time, read = anyio.run(both, backend_options={"use_uvloop": True})
    assert read == pytest.approx(loop_time, abs=0.002)


def test_it_follows_trios_virtual_clock() -> None:
    async def sleep_an_hour() -> float:
        started = now()
        await anyio.sleep(3600)
        return now() - started

    clock = trio.testing.MockClock(autojump_threshold=0)
    slept = anyio.run(sleep_an_hour, backend="trio", backend_options={"clock": clock})
    assert slept == pytest.approx(3600)
