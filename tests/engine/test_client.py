"""The client's shared probes of a server."""

from __future__ import annotations

import anyio
import pytest

from libra.engine import ServerUnavailable
from libra.engine._client import ProbeCache

pytestmark = pytest.mark.anyio


async def test_concurrent_callers_share_a_probes_failure_then_probe_again() -> None:
    cache: ProbeCache[str, bool] = ProbeCache()
    probes, errors = 0, 0

    async def probe() -> bool:
        nonlocal probes
        probes += 1
        await anyio.sleep(0.001)
        if probes == 1:
            raise ServerUnavailable("down")
        return True

    async def ask() -> None:
        nonlocal errors
        try:
            await cache.get("server", probe)
        except ServerUnavailable:
            errors += 1

    async with anyio.create_task_group() as group:
        for _ in range(8):
            group.start_soon(ask)
    assert (probes, errors) == (1, 8)
    assert await cache.get("server", probe) and probes == 2
