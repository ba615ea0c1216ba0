"""Opening a fleet: the rules on what a run may name."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from libra.cli._rollout import run_rollout
from libra.launch import FleetError, RolloutConfig


def test_a_fleet_and_a_server_are_exclusive(tmp_path: Path) -> None:
    fleet = {"instances": [{"name": "a", "url": "http://127.0.0.1:9"}]}
    config = RolloutConfig(env="calc", server="emulated", fleet=fleet, out=tmp_path / "o.jsonl")
    with pytest.raises(FleetError, match="either --server or a"):
        anyio.run(run_rollout, config)
