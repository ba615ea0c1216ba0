"""A rollout's config, as the shipped examples write it."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from libra.config import load_config
from libra.envs import load_env
from libra.launch import RolloutConfig
from tests._helpers import DEMO


def test_the_demo_config_is_valid() -> None:
    config = load_config(RolloutConfig, DEMO)
    assert (config.env, config.server, config.n) == ("python_arith", "embedded", 16)
    assert config.samples_per_prompt == 4
    assert config.env is not None and load_env(config.env).__name__ == "PythonArith"
    assert config.engine.on_max_tokens == "continue"


def test_a_rollout_names_an_env_or_an_agent() -> None:
    with pytest.raises(ValidationError, match="name an env"):
        RolloutConfig()
    config = RolloutConfig(agent="tests.agents.test_runner:adder")
    assert (config.env, config.agent_timeout_s) == (None, 600.0)
