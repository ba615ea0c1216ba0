"""``libra bench train``: the trainer and the plain loop train the same tokens, timed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from libra.cli import main
from libra.serving import prepare_model
from tests.trainer._ranks import save_llama

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


@pytest.mark.slow
def test_bench_train_measures_the_trainer_against_a_plain_loop(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A tiny Llama that reads the embedded model's tokens: real ids, seconds per step.
    model_dir = save_llama(tmp_path / "model", hidden=32, layers=2, vocab=49152)
    embedded = prepare_model()
    for name in _TOKENIZER_FILES:
        if (embedded / name).exists():
            shutil.copy(embedded / name, model_dir / name)

    argv = ["bench", "train", "--model", str(model_dir), "--steps", "1", "--groups", "2"]
    assert main([*argv, "--per-group", "2", "--json"]) == 0

    report = json.loads(capsys.readouterr().out)
    plain, one, two, hybrid, lora, tis = report["results"]
    assert [row["ranks"] for row in report["results"]] == [1, 1, 2, 2, 1, 1]
    assert hybrid["name"] == "FSDPTrainer, 1 rank + 1 hybrid replica"
    assert lora["name"] == "FSDPTrainer, 1 rank, LoRA rank 8"
    assert tis["name"] == "FSDPTrainer, 1 rank, correction tis"
    assert plain["export_s"] is None
    assert all(r["export_s"] > 0 for r in (one, two, hybrid, lora, tis))
    assert all(r["peak_rss_gb"] > 0 for r in (plain, one, two, lora, tis))
    # The same micro-batches every way: 4 samples of a templated prompt and 40+ words.
    tokens = {row["tokens_per_step"] for row in report["results"]}
    assert len(tokens) == 1 and tokens.pop() > 4 * 40
    assert plain["ratio_to_plain"] == 1.0
    for row in (one, two, hybrid, lora, tis):
        assert row["tokens_per_s"] == pytest.approx(row["tokens_per_step"] / row["step_s"])
        assert row["ratio_to_plain"] == pytest.approx(row["tokens_per_s"] / plain["tokens_per_s"])
