"""Weights out of the trainer and into vLLM: exported folders, and changed weights taking
effect in a real server whose logprobs then match the trainer's."""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import load_file

from libra.engine import TrajectoryRecord
from libra.fleet import Endpoint
from libra.serving import VLLMServer, VLLMServerConfig, WeightSync, WeightSyncConfig
from libra.trainer import (
    FSDPTrainer,
    TrainerConfig,
    export_weights,
    logprob_gap,
    servable_model,
    server_prompt_logprobs,
    spawn,
    write_weights_folder,
)
from tests._helpers import record_of
from tests.trainer._ranks import MicroBatch, masked_token_nll

pytestmark = pytest.mark.anyio

SERVED = "trained"
SAMPLING_TEMPERATURE = 0.7
# Mean |trainer - vLLM| logprob, both in fp32. Measured here: 0.0000 before the step,
# 0.0000 (max 1e-4) on sampled tokens, and, once the reloaded head is untied, the same
# after it; 10x margin over the largest single-token difference seen.
BOUND = 1e-3
PROMPT = "The capital of France is Paris. The capital of Italy is"


# ----------------------------------------- the trainer side (module level: spawned)


def train_and_export(
    model_dir: Path,
    run_dir: Path,
    batch: MicroBatch,
    config: TrainerConfig,
    probe: list[int],
    sampled: Sequence[TrajectoryRecord] = (),
    sampling_temperature: float = 1.0,
    export_dtype: str | None = None,
) -> dict[str, Any]:
    """One step that pushes ``batch`` up, export as version 1; logprobs of ``probe`` before
    and after (at temperatures 1 and 0.7), the gap to the server's ``sampled`` records
    (processed logprobs) before the step, the step's metrics and the exported parameters."""
    trainer = FSDPTrainer(model_dir, config)
    probe_ids = torch.tensor([probe])
    before = {t: trainer.logprobs(probe_ids, t)[0] for t in (1.0, 0.7)}
    gap = trainer.compare_logprobs(sampled, "processed_logprobs", sampling_temperature)
    scale = 1.0 / float(batch.mask.sum())
    metrics = trainer.step([batch], lambda model, mb: masked_token_nll(model, mb, scale))
    after = {t: trainer.logprobs(probe_ids, t)[0] for t in (1.0, 0.7)}
    folder = export_weights(trainer, run_dir, version=1, dtype=export_dtype)
    return {
        "before": before,
        "after": after,
        "metrics": metrics,
        "sampled_gap": gap,
        "folder": folder,
        "parameters": trainer.full_parameters(),
    }


# --------------------------------------------------------------- export (fast, tiny model)


def _tiny_tied_llama(folder: Path) -> dict[str, torch.Tensor]:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
        dtype="bfloat16",
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)  # saved as bf16, like SmolLM2
    model.save_pretrained(folder)
    (folder / "tokenizer.json").write_text("{}")
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_exported_folder_is_complete_servable_and_never_overwritten(tmp_path: Path) -> None:
    source = tmp_path / "source"
    state = _tiny_tied_llama(source)
    source_files = {p.name: p.read_bytes() for p in source.iterdir()}
    target = tmp_path / "run" / "weights" / "v3"

    write_weights_folder(state, source, target)

    written = load_file(target / "model.safetensors")
    assert written.keys() == state.keys()
    assert all(t.dtype == torch.bfloat16 for t in written.values())  # the config's dtype
    assert all(torch.equal(written[k], state[k].to(torch.bfloat16)) for k in written)
    # Untied for serving: the head is a copy of the embeddings, and the config says so.
    assert torch.equal(written["lm_head.weight"], written["model.embed_tokens.weight"])
    config = json.loads((target / "config.json").read_text())
    assert config["tie_word_embeddings"] is False
    assert config["num_hidden_layers"] == 2
    assert (target / "tokenizer.json").exists()
    assert [p.name for p in target.parent.iterdir()] == ["v3"]  # no staging left behind
    assert {p.name: p.read_bytes() for p in source.iterdir()} == source_files
    with pytest.raises(FileExistsError):
        write_weights_folder(state, source, target)


def test_exported_folder_loads_back_untied_with_the_same_values(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    source = tmp_path / "source"
    state = _tiny_tied_llama(source)
    source_bytes = (source / "model.safetensors").read_bytes()
    target = servable_model(source, tmp_path / "run")
    assert target == tmp_path / "run" / "weights" / "v0"
    assert servable_model(source, tmp_path / "run") == target  # once per run

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    assert torch.equal(model.lm_head.weight, state["model.embed_tokens.weight"].float())
    assert (source / "model.safetensors").read_bytes() == source_bytes


# ------------------------------------------------------------- sync into a real server


def _folder_digest(folder: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            digest.update(path.name.encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"  # one backend: the server and the trainer run once for the module


@pytest.fixture(scope="module")
def server(embedded_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    """A server of our own: its weights change, so it cannot be the session's.

    ``processed_logprobs``: sampled-token logprobs after temperature, as the trainer
    needs them for importance ratios (prompt logprobs stay raw). fp32 (the later
    ``--dtype`` wins), like the trainer's master weights: served in bf16, an Adam step's
    updates partly vanish in the rounding (measured: 0.16 mean |logprob| gap between the
    fp32 trainer and its own bf16 export after one step at lr 5e-4), which would hide
    whether the reload itself is exact.
    """
    config = VLLMServerConfig(
        startup_timeout_s=900.0,  # 2 shared cores: a start has taken over 400 s here
        max_model_len=2048,
        dev_mode=True,
        log_file=tmp_path_factory.mktemp("vllm-logs") / "server.log",
        dtype="float32",
        extra_args=("--logprobs-mode", "processed_logprobs"),
    )
    served = servable_model(embedded_model, tmp_path_factory.mktemp("run"))
    with VLLMServer(served, served_model_name=SERVED, config=config) as running:
        yield running


async def _sample(
    client: httpx.AsyncClient, url: str, prompt: list[int]
) -> tuple[list[int], list[float]]:
    body = {
        "model": SERVED,
        "prompt": prompt,
        "max_tokens": 12,
        "temperature": SAMPLING_TEMPERATURE,
        "seed": 1,
        "logprobs": 0,
        "return_token_ids": True,
    }
    response = await client.post(f"{url}/v1/completions", json=body)
    response.raise_for_status()
    choice = response.json()["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


def _logprobs_of_folder(folder: Path, ids: list[int]) -> list[float]:
    from transformers import AutoModelForCausalLM

    from libra.trainer import sequence_logprobs

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    logprobs: list[float] = sequence_logprobs(model, torch.tensor([ids]))[0].tolist()
    return logprobs


@pytest.mark.slow
async def test_changed_weights_take_effect_and_match_the_trainer(
    server: VLLMServer,
    embedded_model: Path,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    from transformers import AutoTokenizer

    shared_before = _folder_digest(embedded_model)
    prompt = AutoTokenizer.from_pretrained(embedded_model)(PROMPT)["input_ids"]
    async with httpx.AsyncClient(timeout=120) as client:
        sampled, sampled_logprobs = await _sample(client, server.url, prompt)
        probe = prompt + sampled
        record = record_of(
            probe, [0] * len(prompt) + [1] * len(sampled), [None] * len(prompt) + sampled_logprobs
        )
        served_before = await server_prompt_logprobs(client, server.url, SERVED, probe)

        # One Adam step towards the probe: every weight moves by about lr, several bf16
        # steps of a typical weight, so the change survives the export to bf16.
        batch = MicroBatch(torch.tensor([probe]), torch.ones(1, len(probe) - 1))
        config = TrainerConfig(backend="gloo", lr=5e-4, grad_clip=None, cpu_threads=1)
        [trained] = spawn(
            1,
            train_and_export,
            embedded_model,
            tmp_path,
            batch,
            config,
            probe,
            [record],
            SAMPLING_TEMPERATURE,
            "float32",
        )

        endpoint = Endpoint(url=server.url, model=SERVED, name="vllm-0")
        caplog.set_level(logging.INFO, logger="libra.serving")
        report = await WeightSync([endpoint], WeightSyncConfig(pause_mode="keep")).sync(
            trained["folder"], version=1
        )
        served_after = await server_prompt_logprobs(client, server.url, SERVED, probe)
        paused = (await client.get(f"{server.url}/is_paused")).json()["is_paused"]

        await server.areload_weights_from(server.model)  # v0: the embedded weights
        served_restored = await server_prompt_logprobs(client, server.url, SERVED, probe)

    # Like with like: prompt logprobs are raw (T = 1); the sampled ones, in processed
    # mode, are at the sampling temperature (the trainer's compare_logprobs knows that).
    exported = _logprobs_of_folder(trained["folder"], probe)
    gaps = {
        "before": logprob_gap(trained["before"][1.0].tolist(), served_before),
        "sampled": trained["sampled_gap"],
        "after": logprob_gap(trained["after"][1.0].tolist(), served_after),
        "moved": logprob_gap(trained["before"][1.0].tolist(), served_after),
        "exported_vs_served": logprob_gap(exported, served_after),
        "exported_vs_trainer": logprob_gap(exported, [None, *trained["after"][1.0].tolist()]),
        "restored": logprob_gap([x for x in served_before[1:] if x is not None], served_restored),
    }
    logging.getLogger(__name__).warning(
        "gaps %s; sync %.2f s; step %s",
        json.dumps(
            {k: [round(g.mean_abs, 4), round(g.max_abs, 4), g.tokens] for k, g in gaps.items()}
        ),
        report.seconds,
        trained["metrics"],
    )

    assert gaps["before"].tokens == len(probe) - 1
    assert gaps["sampled"].tokens == len(sampled)
    assert gaps["before"].mean_abs < BOUND
    assert gaps["sampled"].mean_abs < BOUND
    assert gaps["after"].mean_abs < BOUND
    assert gaps["moved"].mean_abs > 100 * BOUND  # the change is real, far beyond noise
    assert gaps["exported_vs_served"].max_abs < 10 * BOUND
    assert gaps["restored"].max_abs < 1e-3
    assert endpoint.weight_version == 1
    assert not paused
    assert report.seconds > 0 and set(report.endpoint_seconds) == {"vllm-0"}
    assert any("weights v1 synced" in r.getMessage() for r in caplog.records)
    assert _folder_digest(embedded_model) == shared_before
