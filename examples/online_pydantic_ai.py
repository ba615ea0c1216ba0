"""An agent framework's own client as the agent of ``libra train --online``.

    libra train --online --no-auth --set rollout.server=embedded &
    python examples/online_pydantic_ai.py http://127.0.0.1:8080

pydantic-ai (``pip install 'libra[examples]'``) runs its agent loop with its own
OpenAI model class, as its users do; all this script adds is the session protocol:
each episode's HTTP client names its session (``X-Libra-Session``), and the episode's
reward and end are reported with ``POST /v1/libra/report``. It plays until the run
stops serving. Nothing here imports Libra.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import sys
import uuid

import httpx
from pydantic_ai import Agent
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider

SESSION_HEADER = "X-Libra-Session"


async def episode(base: str, api_key: str, question: str, truth: int) -> None:
    session = uuid.uuid4().hex
    async with httpx.AsyncClient(headers={SESSION_HEADER: session}, timeout=600) as http:
        provider = OpenAIProvider(base_url=f"{base}/v1", api_key=api_key, http_client=http)
        agent = Agent(OpenAIChatModel("policy", provider=provider), instructions="Be brief.")

        @agent.tool_plain
        def multiply(a: int, b: int) -> int:
            """Multiply two whole numbers."""
            return a * b

        try:
            result = await agent.run(question)
            reward: float | None = 1.0 if str(truth) in str(result.output) else 0.0
        except Exception:  # the framework gave up (a malformed call, say): no score
            reward = None
        body = {"session": session, "done": True}
        if reward is not None:
            body["reward"] = reward
        await http.post(f"{base}/v1/libra/report", json=body)


async def main(base: str, api_key: str = "-") -> None:
    rng = random.Random(0)
    questions = [(a, b) for a, b in ((rng.randint(2, 20), rng.randint(2, 20)) for _ in range(2))]
    async with httpx.AsyncClient() as probe:
        while True:  # wait for the run to serve
            try:
                (await probe.get(f"{base}/health")).raise_for_status()
                break
            except httpx.HTTPError:
                await asyncio.sleep(0.2)
    for a, b in itertools.cycle(questions):
        try:
            await episode(base, api_key, f"What is {a} times {b}?", a * b)
        except httpx.TransportError:
            return  # the run is over


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:]))
