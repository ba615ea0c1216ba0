"""The embedded server's settings: defaults, a TOML file, flags and overrides."""

from __future__ import annotations

from pathlib import Path

import pytest

from libra.config import ConfigError
from libra.serving import server_config


def test_serve_config_precedence(tmp_path: Path) -> None:
    assert (server_config().max_model_len, server_config().scheduling_policy) == (8192, "priority")
    file = tmp_path / "serve.toml"
    file.write_text("tensor_parallel_size = 2\nmax_model_len = 4096\nport = 1\n")
    flags = {"port": 9000, "enforce_eager": False, "scheduling_policy": None}
    config = server_config(file, flags, ["gpu_memory_utilization=0.8"])
    assert (config.tensor_parallel_size, config.max_model_len, config.port) == (2, 4096, 9000)
    assert config.scheduling_policy == "priority" and not config.enforce_eager
    assert config.gpu_memory_utilization == 0.8
    with pytest.raises(ConfigError, match="gpu_memory_utilization"):
        server_config(overrides=["gpu_memory_utilization=2"])
