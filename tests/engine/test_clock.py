"""The engine's clock reads anyio's clock, on every backend."""

from __future__ import annotations

import anyio
import pytest

from libra.engine._clock import now

pytestmark = pytest.mark.anyio


async def test_now_is_anyio_time() -> None:
    before = anyio.current_time()
    read = now()
    after = anyio.current_time()
    assert before <= read <= after
    await anyio.sleep(0.01)
    assert now() - read >= 0.01
