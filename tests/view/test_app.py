"""The view's HTTP surface on a real loopback server: the page and its files from the
package, the events as server-sent events (the history, then what comes, then the end),
an ended trajectory's record, and the key."""

from __future__ import annotations

import json

import anyio
import httpx
import pytest

from libra.config import UsageError
from libra.events import EventBus, StepEnded, TrajectoryStarted
from libra.view import History, serve_view, view_key

pytestmark = pytest.mark.anyio


async def read_stream(url: str, until: str) -> list[str]:
    """The ``data:`` and ``event:`` lines of ``/events`` up to one that holds ``until``."""
    lines: list[str] = []
    async with httpx.AsyncClient() as client, client.stream("GET", url) as answer:
        assert answer.headers["content-type"] == "text/event-stream"
        async for line in answer.aiter_lines():
            if line:
                lines.append(line)
            if until in line:
                return lines
    raise AssertionError(f"the stream ended before {until!r}: {lines}")


async def test_a_live_page_gets_the_history_then_what_comes_then_the_end() -> None:
    bus = EventBus()
    history = History(live=True, find_record={"t1": b'{"id":"t1","messages":[]}'}.get)
    subscription = bus.subscribe()
    bus.publish(TrajectoryStarted(t=0.0, id="t1", env="calc", step=0, task="calc/1"))
    async with (
        anyio.create_task_group() as group,
        serve_view(history) as url,
        httpx.AsyncClient() as client,
    ):
        group.start_soon(history.follow, subscription)
        page = await client.get(url)
        assert page.status_code == 200 and "static/view.js" in page.text
        script = await client.get(url + "static/view.js")
        assert script.headers["content-type"] == "text/javascript"
        assert "new EventSource" in script.text

        async def later() -> None:
            await anyio.sleep(0.3)
            bus.publish(StepEnded(t=1.0, line={"step": 0, "reward_mean": 0.5}))
            await anyio.sleep(0.3)
            subscription.close()  # the run ended

        group.start_soon(later)
        lines = await read_stream(url + "events", "finished")
        batches = [
            json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: [")
        ]
        kinds = [event["kind"] for batch in batches for event in batch]
        assert kinds == ["start", "step"]
        assert lines[-2:] == ["event: state", "data: finished"]
        assert (await client.get(url + "record/t1")).json()["id"] == "t1"
        assert (await client.get(url + "record/t2")).status_code == 404
        assert (await client.get(url + "static/nothing.js")).status_code == 404


async def test_off_loopback_the_view_needs_its_key() -> None:
    assert view_key("127.0.0.1", None) is None
    made = view_key("0.0.0.0", None)
    assert made and view_key("0.0.0.0", made) == made
    with pytest.raises(UsageError, match="needs a key"):
        async with serve_view(History(live=False), "0.0.0.0"):
            pass
    history = History(live=False)
    async with serve_view(history, key="sesame") as url, httpx.AsyncClient() as client:
        assert url.endswith("?key=sesame")
        base = url.split("?")[0]
        assert (await client.get(base)).status_code == 401
        assert (await client.get(base + "events?key=wrong")).status_code == 401
        assert (await client.get(url)).status_code == 200
        bearer = {"Authorization": "Bearer sesame"}
        assert (await client.get(base + "static/view.css", headers=bearer)).status_code == 200
