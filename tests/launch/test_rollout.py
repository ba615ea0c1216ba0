"""A rollout's config, as the shipped examples write it."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from libra.config import UsageError, load_config
from libra.envs import load_env
from libra.launch import RolloutConfig, TrainRunConfig, load_player
from tests._helpers import BREVITY, DEMO, Brevity


def test_the_demo_config_is_valid() -> None:
    config = load_config(RolloutConfig, DEMO)
    assert (config.env, config.server, config.n) == ("python_arith", "embedded", 16)
    assert config.samples_per_prompt == 4
    assert config.env is not None and load_env(config.env).__name__ == "PythonArith"
    assert config.engine.on_max_tokens == "continue"


def test_a_rollout_names_an_env_or_an_agent() -> None:
    with pytest.raises(UsageError, match="name an env"):
        load_player(RolloutConfig())
    player = load_player(RolloutConfig(agent="tests.agents.test_runner:adder", env=BREVITY))
    assert (player.name, player.env_cls) == ("adder", Brevity)
    assert player.agent is not None and player.agent.name == "adder"
    with pytest.raises(ValidationError, match="name an env"):
        TrainRunConfig.model_validate({"rollout": {}})
    online = TrainRunConfig.model_validate({"rollout": {}, "online": {}})
    assert online.online is not None and online.online.port == 8080
    with pytest.raises(ValidationError, match="agents elsewhere play"):
        TrainRunConfig.model_validate({"rollout": {"agent": "m:f"}, "online": {}})
    # A mixture is libra train's: libra rollout plays one env, and says so.
    with pytest.raises(UsageError, match="libra train's mixture"):
        load_player(RolloutConfig(envs=[{"env": BREVITY}]))
