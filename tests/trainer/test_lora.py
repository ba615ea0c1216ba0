"""LoRA: only the adapters train and are in the optimizer; the exports (adapters alone,
or folded into the weights) serve what the trainer computes; a checkpoint restores them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from libra.trainer import FSDPTrainer, LoRAConfig, TrainerConfig, export_weights, spawn
from libra.trainer._lora import add_adapters, merge_adapters, write_zero_adapter
from tests.trainer._ranks import MicroBatch, fixed_batch, masked_token_nll, save_tiny_llama

pytest.importorskip("peft")

LORA = LoRAConfig(rank=4, alpha=8)


def _model(folder: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)


def _adapted(folder: Path, adapter: Path) -> torch.nn.Module:
    from peft import PeftModel

    return PeftModel.from_pretrained(_model(folder), str(adapter))


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        logits: torch.Tensor = model(input_ids=ids, use_cache=False).logits
    return logits


def test_merged_weights_compute_what_the_adapters_do(tmp_path: Path) -> None:
    folder = save_tiny_llama(tmp_path / "tiny")
    model = add_adapters(_model(folder), LORA)
    for name, param in model.named_parameters():
        if "lora_B" in name:  # a fresh B is zero: give the adapters something to add
            torch.nn.init.normal_(param, std=0.5)
    plain = _model(folder)
    plain.load_state_dict(merge_adapters(model.state_dict(), LORA))
    ids = fixed_batch(64, sequences=2, length=12).ids
    torch.testing.assert_close(_logits(plain, ids), _logits(model, ids), rtol=1e-4, atol=1e-5)


def test_the_zero_adapter_serves_the_base_model(tmp_path: Path) -> None:
    folder = save_tiny_llama(tmp_path / "tiny")
    adapter = write_zero_adapter(folder, LORA, tmp_path / "adapter")
    ids = fixed_batch(64, sequences=1, length=10).ids
    torch.testing.assert_close(
        _logits(_adapted(folder, adapter), ids), _logits(_model(folder), ids)
    )
    assert write_zero_adapter(folder, LORA, adapter) == adapter  # written once


def lora_steps(model_dir: Path, batch: MicroBatch, run_dir: Path) -> dict[str, Any]:
    """Two steps with adapters, both exports, a checkpoint and its restore into a fresh
    trainer (each rank runs this)."""
    trainer = FSDPTrainer(model_dir, TrainerConfig(lr=5e-2, lora=LORA))
    trained = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    optimized = sum(len(group["params"]) for group in trainer.optimizer.param_groups)
    before = trainer.full_parameters()
    scale = 1.0 / float(batch.mask.sum())
    loss_fn = lambda model, mb: masked_token_nll(model, mb, scale)  # noqa: E731
    steps = [trainer.step([batch], loss_fn) for _ in range(2)]
    after = trainer.full_parameters()
    logprobs = trainer.logprobs(batch.ids)
    adapter = export_weights(trainer, run_dir, 1, adapter=True)
    merged = export_weights(trainer, run_dir, 2)
    trainer.save_checkpoint(run_dir / "checkpoint")
    restored = FSDPTrainer(model_dir, TrainerConfig(lr=5e-2, lora=LORA))
    restored.load_checkpoint(run_dir / "checkpoint")
    return {
        "trained": trained,
        "optimized": optimized,
        "before": before,
        "after": after,
        "restored": restored.full_parameters(),
        "losses": [s.loss for s in steps],
        "logprobs": logprobs,
        "adapter": adapter,
        "merged": merged,
    }


@pytest.mark.trainer
def test_only_the_adapters_train_and_every_export_serves_them(tmp_path: Path) -> None:
    from libra.trainer import token_logprobs

    model_dir = save_tiny_llama(tmp_path / "tiny")
    batch = fixed_batch(64, sequences=2, length=16)

    result, _ = spawn(2, lora_steps, model_dir, batch, tmp_path / "run")

    trained = result["trained"]
    assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained)
    assert result["optimized"] == len(trained)
    before, after = result["before"], result["after"]
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    assert changed and changed <= trained  # the base weights never move
    assert result["losses"][1] < result["losses"][0]
    for name, value in result["restored"].items():
        torch.testing.assert_close(value, after[name], msg=name)

    # Both exports compute what the trainer computes.
    targets = batch.ids[:, 1:]
    for served in (_adapted(model_dir, result["adapter"]), _model(result["merged"])):
        logprobs = token_logprobs(_logits(served, batch.ids)[:, :-1], targets)
        torch.testing.assert_close(logprobs, result["logprobs"], rtol=1e-4, atol=1e-4)
    assert not (result["adapter"] / "model.safetensors").exists()
