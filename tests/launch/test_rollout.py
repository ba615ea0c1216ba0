"""A rollout's config, as the shipped examples write it."""

from __future__ import annotations

from libra.config import load_config
from libra.launch import RolloutConfig
from tests._helpers import DEMO


def test_the_demo_config_is_valid() -> None:
    config = load_config(RolloutConfig, DEMO)
    assert (config.env, config.server, config.n) == ("python_math", "embedded", 16)
    assert config.engine.on_max_tokens == "continue"
