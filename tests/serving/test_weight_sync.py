"""WeightSync against real servers on loopback: the emulator answers vLLM's dev-mode
control API (``/pause``, ``/collective_rpc`` reload_weights, ``/reset_prefix_cache``)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from libra.emulation import running_emulator
from libra.engine import HttpxTransport
from libra.fleet import Endpoint
from libra.serving import WEIGHTS_FILE, WeightSync, WeightSyncError

pytestmark = pytest.mark.anyio


def weights_folder(tmp_path: Path) -> Path:
    (tmp_path / WEIGHTS_FILE).write_bytes(b"")
    return tmp_path


async def test_every_endpoint_gets_the_version(tmp_path: Path) -> None:
    with running_emulator() as first, running_emulator() as second:
        endpoints = [Endpoint(first), Endpoint(second)]
        report = await WeightSync(endpoints).sync(weights_folder(tmp_path), 3)
    assert [e.weight_version for e in endpoints] == [3, 3]
    assert set(report.endpoint_seconds) == {first, second} and report.version == 3


async def test_a_given_transport_carries_the_calls(tmp_path: Path) -> None:
    with running_emulator() as url:
        endpoint = Endpoint(url)
        async with HttpxTransport(httpx.AsyncClient()) as transport:
            await WeightSync([endpoint], transport=transport).sync(weights_folder(tmp_path), 1)
    assert endpoint.weight_version == 1


async def test_each_failed_endpoint_is_named_in_one_error(tmp_path: Path) -> None:
    with running_emulator() as url:
        good, gone = Endpoint(url), Endpoint("http://127.0.0.1:9", name="gone")
        with pytest.raises(WeightSyncError, match="gone: ") as caught:
            await WeightSync([good, gone]).sync(weights_folder(tmp_path), 2)
    assert "v2 not loaded" in str(caught.value) and url not in str(caught.value)
    assert (good.weight_version, gone.weight_version) == (2, 0)


async def test_a_folder_without_weights_is_refused(tmp_path: Path) -> None:
    with pytest.raises(WeightSyncError, match=f"holds neither {WEIGHTS_FILE} nor LoRA adapters"):
        await WeightSync([Endpoint("http://127.0.0.1:9")]).sync(tmp_path, 1)
