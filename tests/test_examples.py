"""Every shipped example config loads into the config of the command it is written for,
as that command loads it (``libra <command> --config examples/<file>``)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from pydantic import BaseModel

from libra.config import load_config
from libra.launch import RolloutConfig, ServeConfig, TrainRunConfig
from libra.launch._train import _own_server_config
from libra.serving import vllm_command

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


@pytest.mark.parametrize("name", sorted(n for n, c in COMMANDS.items() if c is TrainRunConfig))
def test_the_run_s_own_vllm_schedules_by_priority_whatever_its_vllm_section_says(
    name: str,
) -> None:
    """Each example's ``[vllm]`` names a few keys; with C-MLFQ routing (which sends
    priorities), the run's own vLLM is still started with priority scheduling and the
    ``max_model_len`` the file documents (a section merges over its default)."""
    config = load_config(TrainRunConfig, EXAMPLES / name, overrides=["rollout.scheduler=cmlfq"])
    argv = vllm_command(_own_server_config(config), "model", "served", 8000)
    assert argv[argv.index("--scheduling-policy") + 1] == "priority"
    documented = tomllib.loads((EXAMPLES / name).read_text())["vllm"]["max_model_len"]
    assert argv[argv.index("--max-model-len") + 1] == str(documented)
    # It serves what the trainer exports, named once: the export's dtype, or the folder's.
    assert argv.count("--dtype") == 1
    assert argv[argv.index("--dtype") + 1] == (config.export_dtype or "auto")
