"""Loading a config: a TOML file, then command-line flags, then ``--set section.key=value``."""

from __future__ import annotations

from pathlib import Path

import pytest

from libra.config import ConfigError, load_config
from libra.launch import RolloutConfig


def test_config_precedence(tmp_path: Path) -> None:
    file = tmp_path / "run.toml"
    file.write_text('env = "guess"\nn = 8\n[engine]\nmax_turns = 3\nconcurrency = 2\n')
    config = load_config(
        RolloutConfig,
        file,
        {"n": 16, "seed": None},
        ["engine.concurrency=5", "engine.sampling.temperature=0.5", "model=plain text"],
    )
    assert (config.env, config.n, config.seed) == ("guess", 16, 0)
    assert config.engine.max_turns == 3 and config.engine.concurrency == 5
    assert config.engine.sampling.temperature == 0.5 and config.model == "plain text"
    with pytest.raises(ConfigError, match=r"expects section\.key=value"):
        load_config(RolloutConfig, None, {"env": "calc"}, ["novalue"])
    file.write_text("env = ")
    with pytest.raises(ConfigError, match=r"run\.toml"):
        load_config(RolloutConfig, file)
