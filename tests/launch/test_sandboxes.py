"""Warming sandboxes beside opening the servers."""

from __future__ import annotations

import anyio
import pytest

from libra.launch import FleetError, beside


def test_beside_waits_for_both_and_raises_the_main_error_as_itself() -> None:
    warmed: list[str] = []

    async def warm() -> None:
        await anyio.sleep(0.05)
        warmed.append("containers")

    async def open_servers() -> int:
        return 7

    assert anyio.run(beside, open_servers, warm) == 7 and warmed == ["containers"]

    async def no_servers() -> int:
        raise FleetError("no servers")

    with pytest.raises(FleetError, match="no servers"):  # and the endless side is cancelled
        anyio.run(beside, no_servers, anyio.sleep_forever)
