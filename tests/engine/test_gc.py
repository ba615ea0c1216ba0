"""Fewer garbage collections while rollout sessions are open, and the old setting after."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from libra.engine._gc import MIDDLE_THRESHOLD, YOUNG_THRESHOLD, fewer_collections


@pytest.fixture(autouse=True)
def default_threshold() -> Iterator[None]:
    saved = gc.get_threshold()
    gc.set_threshold(700, 10, 10)
    yield
    gc.set_threshold(*saved)


def test_the_young_threshold_is_raised_while_sessions_are_open_and_restored_by_the_last() -> None:
    with fewer_collections():
        assert gc.get_threshold() == (YOUNG_THRESHOLD, MIDDLE_THRESHOLD, 10)
        with fewer_collections():  # a second session, opened and closed inside the first
            pass
        assert gc.get_threshold() == (YOUNG_THRESHOLD, MIDDLE_THRESHOLD, 10)
    assert gc.get_threshold() == (700, 10, 10)


def test_a_threshold_set_meanwhile_is_kept() -> None:
    with fewer_collections():
        gc.set_threshold(50_000, 10, 10)
    assert gc.get_threshold() == (50_000, 10, 10)


def test_collection_turned_off_stays_off() -> None:
    gc.set_threshold(0, 10, 10)
    with fewer_collections():
        assert gc.get_threshold() == (0, 10, 10)
    assert gc.get_threshold() == (0, 10, 10)
