"""The live view in a real headless browser (Debian's Chromium, driven by Selenium
through Debian's ChromeDriver: nothing downloads a browser). During an emulated rollout
with C-MLFQ over two buckets, the fleet table fills, a move between buckets appears, and
a trajectory's timeline opens with its tool calls beside its conversation; on a finished
training run folder, the reward chart has one point per step.

With ``LIBRA_SCREENSHOTS=DIR`` the tests save what the page showed there (the docs'
screenshots: ``LIBRA_SCREENSHOTS=docs pytest tests/view/test_page.py``)."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import pytest

from libra.emulation import EmulatorConfig, LatencyModel, running_emulator
from libra.launch import RolloutConfig, TrainRunConfig, ViewOptions, rollout, train
from libra.view import History, RecordFiles, serve_view
from tests._helpers import BREVITY

if TYPE_CHECKING:
    from selenium.webdriver.remote.webdriver import WebDriver

pytestmark = pytest.mark.anyio

# A few milliseconds a token: the rollout lasts long enough to be watched live.
SLOW = LatencyModel(
    prefill_s_per_token=0.0, step_base_s=0.01, step_per_seq_s=0.0, step_per_ctx_token_s=0.0
)


@pytest.fixture(scope="module")
def two_buckets() -> Iterator[dict[str, Any]]:
    """Two emulated servers, each a real process, in a short bucket and a long one."""
    config = EmulatorConfig(latency=SLOW)
    with running_emulator(config) as short, running_emulator(config) as long:
        yield {
            "instances": [{"name": "short-1", "url": short}, {"name": "long-1", "url": long}],
            "buckets": [
                {"name": "short", "max_tokens": 40, "instances": ["short-1"]},
                {"name": "long", "max_tokens": 30000, "instances": ["long-1"]},
            ],
        }


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


async def until(
    browser: WebDriver, condition: Callable[[WebDriver], Any], timeout_s: float = 60
) -> Any:
    """Selenium's wait, in a thread: the run serving the page goes on meanwhile."""
    from selenium.webdriver.support.wait import WebDriverWait

    wait = WebDriverWait(browser, timeout_s, poll_frequency=0.2)
    return await anyio.to_thread.run_sync(wait.until, condition)


def rows(selector: str) -> Callable[[WebDriver], list[Any]]:
    from selenium.webdriver.common.by import By

    return lambda browser: browser.find_elements(By.CSS_SELECTOR, f"{selector} tbody tr")


def screenshot(browser: WebDriver, name: str) -> None:
    folder = os.environ.get("LIBRA_SCREENSHOTS")
    if folder:
        browser.save_screenshot(str(Path(folder) / name))


async def test_the_live_view_of_a_cmlfq_rollout(
    browser: WebDriver, two_buckets: dict[str, Any], tmp_path: Path
) -> None:
    from selenium.webdriver.common.by import By

    port = free_port()
    config = RolloutConfig.model_validate(
        {
            "env": "calc",
            "n": 256,
            "samples_per_prompt": 8,
            "scheduler": "cmlfq",
            "cmlfq": {"rule": "simple"},
            "engine": {"concurrency": 16},
            "fleet": two_buckets,
            "out": str(tmp_path / "rollout.jsonl"),
            "progress": False,
        }
    )
    url = f"http://127.0.0.1:{port}/"
    async with anyio.create_task_group() as group:
        group.start_soon(partial(rollout, config, view=ViewOptions(port=port)))
        while True:  # until the view listens
            try:
                await (await anyio.connect_tcp("127.0.0.1", port)).aclose()
                break
            except OSError:
                await anyio.sleep(0.1)
        await anyio.to_thread.run_sync(browser.get, url)

        def state(browser: WebDriver) -> str:
            return str(browser.find_element(By.ID, "state").text)

        assert await until(browser, lambda b: state(b) == "live")
        fleet = await until(browser, lambda b: len(rows("#fleet")(b)) == 2 and rows("#fleet")(b))
        assert {row.text.split()[0] for row in fleet} == {"short-1", "long-1"}
        moves = await until(browser, rows("#moves"))
        assert "calculator" in moves[0].text  # the tool return it moved on
        assert state(browser) == "live"  # all this while the rollout runs
        screenshot(browser, "view-rollout.png")

        # One ended trajectory: its timeline (calls and tool calls) and its conversation.
        await anyio.to_thread.run_sync(browser.find_element(By.ID, "filter").send_keys, "completed")
        first = await until(browser, lambda b: rows("#trajectories")(b)[0])
        await anyio.to_thread.run_sync(first.click)
        steps = await until(browser, lambda b: [r.text for r in rows("#steps")(b)] or None)
        assert any("tool calculator" in step for step in steps)
        assert any("call, turn 0" in step for step in steps)
        bars = browser.find_elements(By.CSS_SELECTOR, "#timeline rect")
        assert len(bars) == len(steps) - sum("move" in step for step in steps)
        messages = await until(
            browser, lambda b: b.find_elements(By.CSS_SELECTOR, "#conversation .message")
        )
        assert messages[0].text.startswith("system: ") or messages[0].text.startswith("user: ")
        screenshot(browser, "view-trajectory.png")
    assert await until(browser, lambda b: state(b) == "finished")


async def test_a_finished_training_run_shows_a_reward_point_per_step(
    browser: WebDriver, tiny_model: Path, tmp_path: Path
) -> None:
    from selenium.webdriver.common.by import By

    config = TrainRunConfig.model_validate(
        {
            "rollout": {
                "env": BREVITY,
                "engine": {"concurrency": 8, "sampling": {"max_tokens_per_turn": 48, "seed": 0}},
                "emulator": {"agent": {"think_tokens": [0, 40]}},
            },
            "model": str(tiny_model),
            "steps": 3,
            "prompts_per_step": 2,
            "samples_per_prompt": 3,
            "run_dir": str(tmp_path / "run"),
            "trainer": {"lr": 1e-3, "cpu_threads": 1, "backend": "gloo"},
        }
    )
    await train(config)
    run_dir = config.run_dir
    history = History(
        live=False, find_record=RecordFiles(lambda: sorted(run_dir.glob("rollouts/*")))
    )
    history.replay(run_dir / "events.jsonl")
    async with serve_view(history) as url:
        await anyio.to_thread.run_sync(browser.get, url)
        await until(browser, lambda b: b.find_element(By.ID, "state").text == "finished")
        chart = browser.find_element(By.ID, "reward-chart")
        await until(browser, lambda b: chart.get_attribute("data-points") is not None)
        assert chart.get_attribute("data-points") == "3"
        assert "3 steps done" in browser.find_element(By.ID, "step-now").text
        screenshot(browser, "view-training.png")
