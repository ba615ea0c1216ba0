"""A rollout's config, as the shipped examples write it."""

from __future__ import annotations

from libra.config import load_config
from libra.envs import load_env
from libra.launch import RolloutConfig
from tests._helpers import DEMO


def test_the_demo_config_is_valid() -> None:
    config = load_config(RolloutConfig, DEMO)
    assert (config.env, config.server, config.n) == ("python_arith", "embedded", 16)
    assert config.samples_per_prompt == 4
    assert load_env(config.env).__name__ == "PythonArith"
    assert config.engine.on_max_tokens == "continue"
