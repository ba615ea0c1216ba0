"""LoRA adapters into a real vLLM: a server started with the zero adapter serves the base
model under the adapter's name, and a synced adapter serves what peft computes with it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from libra.fleet import Endpoint
from libra.serving import (
    VLLMServer,
    VLLMServerConfig,
    WeightSync,
    WeightSyncConfig,
    with_lora_adapter,
)
from libra.trainer import (
    LoRAConfig,
    logprob_gap,
    sequence_logprobs,
    servable_model,
    server_prompt_logprobs,
    write_zero_adapter,
)
from libra.trainer._lora import adapter_keys, add_adapters, write_adapter_folder

pytest.importorskip("peft")
pytestmark = pytest.mark.anyio

ADAPTER, BASE = "policy", "policy-base"
LORA = LoRAConfig(rank=8)
BOUND = 1e-3  # fp32 on both sides: what tests/trainer/test_weights.py allows
PROMPT = "The capital of France is Paris. The capital of Italy is"


@pytest.fixture(scope="module")
def served(embedded_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return servable_model(embedded_model, tmp_path_factory.mktemp("run"))


@pytest.fixture(scope="module")
def server(served: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    zero = write_zero_adapter(served, LORA, tmp_path_factory.mktemp("weights") / "adapter-v0")
    config = VLLMServerConfig(
        startup_timeout_s=900.0,
        max_model_len=2048,
        dev_mode=True,
        log_file=tmp_path_factory.mktemp("vllm-logs") / "server.log",
        dtype="float32",
    )
    config = with_lora_adapter(config, ADAPTER, zero, LORA.rank)
    with VLLMServer(served, served_model_name=BASE, config=config) as running:
        yield running


def _adapter_and_its_logprobs(served: Path, target: Path, ids: list[int]) -> list[float]:
    """A random adapter (its B nonzero) written at ``target``; the model's logprobs with it."""
    from transformers import AutoModelForCausalLM

    model = add_adapters(AutoModelForCausalLM.from_pretrained(served, dtype=torch.float32), LORA)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.01)
    write_adapter_folder(adapter_keys(model.state_dict()), LORA, served, target)
    logprobs: list[float] = sequence_logprobs(model, torch.tensor([ids]))[0].tolist()
    return logprobs


async def test_a_synced_adapter_serves_what_peft_computes(
    server: VLLMServer, served: Path, tmp_path: Path
) -> None:
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(served)(PROMPT)["input_ids"]
    expected = _adapter_and_its_logprobs(served, tmp_path / "v1", ids)
    endpoint = Endpoint(url=server.url, model=ADAPTER, name="vllm-0")
    async with httpx.AsyncClient(timeout=120) as client:
        base = await server_prompt_logprobs(client, server.url, BASE, ids)
        zero = await server_prompt_logprobs(client, server.url, ADAPTER, ids)
        report = await WeightSync([endpoint], WeightSyncConfig()).sync(tmp_path / "v1", 1)
        after = await server_prompt_logprobs(client, server.url, ADAPTER, ids)
        base_after = await server_prompt_logprobs(client, server.url, BASE, ids)

    assert zero == base  # the zero adapter is the base model
    assert logprob_gap(expected, after).mean_abs < BOUND
    moved = [x for x in base[1:] if x is not None]
    assert logprob_gap(moved, after).mean_abs > 10 * BOUND  # the adapter changed something
    assert base_after == base  # the base model is untouched
    assert endpoint.weight_version == 1 and report.seconds > 0
