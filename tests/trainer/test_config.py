"""The ``[train]`` and ``[grpo]`` sections load from TOML and refuse what makes no sense."""

from __future__ import annotations

from pathlib import Path

import pytest

from libra.config import ConfigError, Section, load_config
from libra.trainer import GRPOConfig, TrainConfig


class Run(Section):
    train: TrainConfig = TrainConfig()
    grpo: GRPOConfig = GRPOConfig()


def test_sections_load_from_toml_with_overrides(tmp_path: Path) -> None:
    file = tmp_path / "run.toml"
    file.write_text(
        '[train]\nmicro_batch_tokens = 4096\nlayout = "padded"\n\n'
        '[grpo]\nclip_high = 0.28\nmax_staleness = 2\nstale = "reweight"\n'
    )
    run = load_config(Run, file, overrides=["grpo.aggregation=seq-mean-token-mean"])
    assert (run.train.micro_batch_tokens, run.train.layout) == (4096, "padded")
    assert (run.grpo.clip_low, run.grpo.clip_high) == (0.2, 0.28)
    assert (run.grpo.max_staleness, run.grpo.stale) == (2, "reweight")
    assert run.grpo.aggregation == "seq-mean-token-mean"


@pytest.mark.parametrize(
    "override",
    ["grpo.aggregation=mean", "grpo.clip_low=1.0", "grpo.clip_ratio_c=0.5", "train.layout=flat"],
)
def test_invalid_values_are_refused(override: str) -> None:
    with pytest.raises(ConfigError, match=override.split("=")[0].split(".")[1]):
        load_config(Run, overrides=[override])
