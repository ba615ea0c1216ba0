"""A Ray head in a process of its own: a driver attaches to it, and stopping it (or the
thread that started it exiting) leaves no Ray process behind."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from libra.workers._ray import import_ray, ray_missing
from libra.workers._ray_head import ray_head
from tests._helpers import children_of, is_alive, unavailable

pytestmark = pytest.mark.ray


@pytest.fixture
def ray_module() -> Iterator[Any]:
    if missing := ray_missing():
        unavailable(missing)
    ray = import_ray()
    yield ray
    ray.shutdown()


def descendants() -> set[int]:
    """This process's descendants (a head started here, its GCS, raylet and workers, and
    whatever else the session runs, such as its shared vLLM server)."""
    found, parents = set(), [os.getpid()]
    while parents:
        children = children_of(parents.pop())
        found.update(children)
        parents += children
    return found


def all_exit(pids: set[int], timeout_s: float = 60) -> bool:
    deadline = time.monotonic() + timeout_s
    while any(is_alive(pid) for pid in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def test_a_driver_attaches_to_the_head_and_its_exit_leaves_no_process(ray_module: Any) -> None:
    ray = ray_module
    before = descendants()
    with ray_head(cpus=3) as address:
        ray.init(address=address, log_to_driver=False)
        assert ray.cluster_resources()["CPU"] == 3
        assert ray.get(ray.remote(lambda: 2 + 2).remote()) == 4
        ray.shutdown()
        head = descendants() - before
        assert len(head) >= 3  # `ray start`, its GCS and raylet
    assert all_exit(head)


def test_the_head_stops_when_the_thread_that_started_it_exits(ray_module: Any) -> None:
    started = threading.Event()
    pids: set[int] = set()
    before = descendants()

    def start_then_exit() -> None:
        stack = ray_head(cpus=1)
        stack.__enter__()  # left open: the thread's exit alone must stop the head
        pids.update(descendants() - before)
        started.set()

    thread = threading.Thread(target=start_then_exit)
    thread.start()
    thread.join()
    assert started.is_set() and pids
    assert all_exit(pids)
