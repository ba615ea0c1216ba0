"""``launch.open_gateway``: the gateway over an engine, served on a loopback port behind
its keys, and every session still open recorded once it stops serving."""

from __future__ import annotations

import httpx
import openai
import pytest

from libra.engine import TrajectoryRecord
from libra.gateway import GatewayConfig, Keys
from libra.launch import open_gateway
from libra.openai import SESSION_HEADER
from tests._helpers import MODEL, emulated_engine

pytestmark = pytest.mark.anyio


async def test_it_serves_behind_its_keys_and_records_what_is_open_when_it_stops() -> None:
    ended: list[tuple[str | None, TrajectoryRecord]] = []
    question = [{"role": "user", "content": "Hi"}]
    async with (
        emulated_engine(["Hello there."]) as (engine, records),
        open_gateway(
            engine,
            GatewayConfig(env="greeter"),
            Keys.of(["user-key"], []),
            on_end=lambda key, record: ended.append((key, record)),
        ) as gateway,
    ):
        assert gateway.url.startswith("http://127.0.0.1:")
        async with httpx.AsyncClient() as http:
            keyless = await http.post(f"{gateway.url}/v1/chat/completions", json={})
        assert keyless.status_code == 401
        client = openai.AsyncOpenAI(
            base_url=f"{gateway.url}/v1",
            api_key="user-key",
            default_headers={SESSION_HEADER: "episode-1"},
        )
        reply = await client.chat.completions.create(model=MODEL, messages=question)  # type: ignore[arg-type]
        await client.close()
        assert reply.choices[0].message.content == "Hello there."
        assert len(gateway.sessions) == 1 and ended == []  # open until the gateway stops
    [(key, record)] = ended
    assert key == "episode-1" and record.env == "greeter" and record.tokens == "exact"
    assert records == []  # on_end takes the record: the engine's on_record gets none
