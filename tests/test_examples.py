"""Every shipped example config loads into the config of the command it is written for,
as that command loads it (``libra <command> --config examples/<file>``)."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import BaseModel

from libra.config import load_config
from libra.launch import RolloutConfig, ServeConfig, TrainRunConfig

EXAMPLES = Path(__file__).parents[1] / "examples"
COMMANDS: dict[str, type[BaseModel]] = {
    "agent.toml": TrainRunConfig,
    "alloc.toml": TrainRunConfig,
    "arith-long.toml": TrainRunConfig,
    "demo.toml": TrainRunConfig,
    "mixture.toml": TrainRunConfig,
    "rollout.toml": RolloutConfig,
    "serve.toml": ServeConfig,
}


def test_every_example_is_listed() -> None:
    assert sorted(path.name for path in EXAMPLES.glob("*.toml")) == sorted(COMMANDS)


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_the_example_loads(name: str) -> None:
    config = load_config(COMMANDS[name], EXAMPLES / name)
    assert isinstance(config, COMMANDS[name])


def test_the_alloc_example_lends_inside_a_step() -> None:
    config = load_config(TrainRunConfig, EXAMPLES / "alloc.toml")
    assert config.alloc is not None and config.alloc.enabled and config.alloc.tail is not None
    assert config.alloc.layout().hybrid == ((2,),)
