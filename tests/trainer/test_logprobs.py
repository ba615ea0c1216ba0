"""The trainer's logprobs (temperature aware) and their gap to the server's.

The comparison with a real vLLM server is in ``test_weights.py``, which starts the one
server these tests may start.
"""

from __future__ import annotations

import pytest
import torch

from libra.trainer import (
    LogprobGap,
    logprob_gap,
    records_logprob_gap,
    sequence_logprobs,
    server_logprob_temperature,
)
from tests._helpers import record_of


@pytest.fixture(scope="module")
def tiny_model() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=50,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def _by_hand(model: torch.nn.Module, ids: torch.Tensor, temperature: float) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    rows = []
    for b in range(ids.shape[0]):
        row = []
        for t in range(ids.shape[1] - 1):
            distribution = torch.log_softmax(logits[b, t] / temperature, dim=-1)
            row.append(distribution[ids[b, t + 1]])
        rows.append(torch.stack(row))
    return torch.stack(rows)


@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.5])
def test_sequence_logprobs_are_the_tempered_log_softmax_at_the_next_token(
    tiny_model: torch.nn.Module, temperature: float
) -> None:
    ids = torch.randint(0, 50, (3, 9), generator=torch.Generator().manual_seed(1))
    mine = sequence_logprobs(tiny_model, ids, temperature)
    assert mine.shape == (3, 8)
    assert mine.dtype == torch.float32
    torch.testing.assert_close(mine, _by_hand(tiny_model, ids, temperature))


def test_temperature_changes_the_logprobs_and_must_be_positive(
    tiny_model: torch.nn.Module,
) -> None:
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    assert not torch.allclose(
        sequence_logprobs(tiny_model, ids), sequence_logprobs(tiny_model, ids, 0.5)
    )
    with pytest.raises(ValueError, match="positive"):
        sequence_logprobs(tiny_model, ids, 0.0)


def test_raw_server_logprobs_are_compared_at_temperature_one() -> None:
    assert server_logprob_temperature("raw_logprobs", 0.7) == 1.0
    assert server_logprob_temperature("processed_logprobs", 0.7) == 0.7


def test_gap_skips_positions_without_a_server_logprob() -> None:
    gap = logprob_gap([-1.0, -2.0, -3.0], [None, -1.5, None, -2.0])
    assert gap == LogprobGap(mean_abs=0.75, max_abs=1.0, tokens=2)
    assert logprob_gap([-1.0], [None, None]) == LogprobGap(0.0, 0.0, 0)
    with pytest.raises(ValueError, match="one fewer"):
        logprob_gap([-1.0, -2.0], [None, -1.0])
    assert gap.as_metrics()["logprob_gap/mean_abs"] == 0.75


def test_records_gap_compares_sampled_tokens_of_exact_records_only(
    tiny_model: torch.nn.Module,
) -> None:
    ids = [3, 7, 1, 4, 9, 2]
    mask = [0, 0, 0, 1, 1, 1]  # a 3-token prompt, then 3 sampled tokens
    exact = sequence_logprobs(tiny_model, torch.tensor([ids]), 0.7)[0].tolist()
    served: list[float | None] = [None, None, None, exact[2] + 0.1, exact[3] - 0.3, exact[4]]
    drifted = record_of(ids, mask, [None, None, None, 0.0, 0.0, 0.0], "drift")

    gap = records_logprob_gap(tiny_model, [record_of(ids, mask, served, "exact"), drifted], 0.7)

    assert gap.tokens == 3
    assert gap.mean_abs == pytest.approx(0.4 / 3, abs=1e-5)
    assert gap.max_abs == pytest.approx(0.3, abs=1e-5)
