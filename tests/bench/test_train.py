"""``libra bench train``: the trainer and the plain loop train the same tokens, timed; each
weight transport syncs the same weights into a real vLLM."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from libra.cli import main
from tests._helpers import tiny_qwen


@pytest.mark.slow
def test_bench_train_measures_the_trainer_against_a_plain_loop(
    embedded_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A tiny Qwen2 that reads the embedded model's tokens: real ids, seconds per step,
    # and a model vLLM serves for the transports' rows.
    model_dir = tiny_qwen(tmp_path / "model", embedded_model)

    argv = ["bench", "train", "--model", str(model_dir), "--steps", "1", "--groups", "2"]
    argv += ["--long", "200", "--chunk-tokens", "32"]
    assert main([*argv, "--per-group", "2", "--syncs", "1", "--json"]) == 0

    report = json.loads(capsys.readouterr().out)
    plain, one, two, hybrid, lora, tis, whole, chunked = report["results"]
    # The long sample's rows: the same step (200 positions, and the short one beside it),
    # its LM head in one pass and in chunks, one step each.
    assert whole["name"] == "FSDPTrainer, 1 rank, 200-token sample, LM head whole"
    assert chunked["name"] == "FSDPTrainer, 1 rank, 200-token sample, LM head in chunks of 32"
    assert whole["tokens_per_step"] == chunked["tokens_per_step"] > 200
    assert whole["steps"] == chunked["steps"] == 1
    assert whole["peak_rss_gb"] > 0 and chunked["peak_rss_gb"] > 0
    assert [row["ranks"] for row in report["results"]] == [1, 1, 2, 2, 1, 1, 1, 1]
    assert hybrid["name"] == "FSDPTrainer, 1 rank + 1 hybrid replica"
    assert lora["name"] == "FSDPTrainer, 1 rank, LoRA rank 8"
    assert tis["name"] == "FSDPTrainer, 1 rank, correction tis"
    assert plain["export_s"] is None
    assert all(r["export_s"] > 0 for r in (one, two, hybrid, lora, tis))
    assert all(r["peak_rss_gb"] > 0 for r in (plain, one, two, lora, tis))
    # The same micro-batches every way: 4 samples of a templated prompt and 40+ words.
    tokens = {row["tokens_per_step"] for row in report["results"][:6]}
    assert len(tokens) == 1 and tokens.pop() > 4 * 40
    assert plain["ratio_to_plain"] == 1.0
    disk, gloo = report["transports"]
    assert (disk["transport"], gloo["transport"]) == ("disk", "gloo")
    assert disk["sync_s"] > disk["export_s"] > 0 and gloo["sync_s"] > 0
    assert gloo["export_s"] is None and disk["megabytes"] == gloo["megabytes"] > 0
    for row in (one, two, hybrid, lora, tis):
        assert row["tokens_per_s"] == pytest.approx(row["tokens_per_step"] / row["step_s"])
        assert row["ratio_to_plain"] == pytest.approx(row["tokens_per_s"] / plain["tokens_per_s"])
