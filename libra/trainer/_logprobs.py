"""The trainer's logprobs for given tokens, the server's for the same tokens, and their gap.

What vLLM returns depends on its ``--logprobs-mode``. The default, ``raw_logprobs``, is
``log_softmax(logits)`` before any sampling processor, so before temperature: it matches
the trainer at temperature 1 whatever temperature the rollout sampled at.
``processed_logprobs`` is taken after the processors (temperature, top-k, top-p): it
matches the trainer at the sampling temperature when top-k and top-p are off. Prompt
logprobs never go through the sampling processors, so they are raw in every mode.
:func:`server_logprob_temperature` says which temperature to give the trainer so that
both sides compute the same quantity.

Alignment: the trainer's logprobs for ids ``t_0 .. t_{n-1}`` cover ``t_1 .. t_{n-1}``
(``n - 1`` values); the server's (prompt logprobs, or a record's ``logprobs``) hold one
entry per id, ``None`` where there is none (always at ``t_0``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import httpx

from libra.engine import TrajectoryRecord
from libra.trainer._head import forward_logprobs

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = [
    "LogprobGap",
    "LogprobsMode",
    "logprob_gap",
    "records_logprob_gap",
    "sequence_logprobs",
    "server_logprob_temperature",
    "server_prompt_logprobs",
]

LogprobsMode = Literal["raw_logprobs", "processed_logprobs"]


def sequence_logprobs(
    model: nn.Module,
    token_ids: torch.Tensor,
    temperature: float = 1.0,
    chunk_tokens: int | None = None,
) -> torch.Tensor:
    """``log_softmax(logits / temperature)`` at each next token of ``token_ids [B, T]``
    (through the head ``chunk_tokens`` positions at a time: ``libra.trainer._head``).

    Returns ``[B, T - 1]`` in fp32, whatever dtype the model computes in. Under FSDP this
    is collective: every rank calls it.
    """
    import torch

    if temperature <= 0:
        raise ValueError(f"temperature must be positive, not {temperature}")
    # The last position predicts nothing here: its target is a placeholder, dropped.
    targets = torch.cat([token_ids[:, 1:], token_ids[:, :1]], dim=1)
    with torch.no_grad():
        logprobs = forward_logprobs(
            model, targets, temperature=temperature, chunk_tokens=chunk_tokens, input_ids=token_ids
        )
    return logprobs[:, :-1]


def server_logprob_temperature(mode: LogprobsMode, sampling_temperature: float) -> float:
    """The temperature at which the trainer reproduces the server's sampled-token logprobs."""
    return sampling_temperature if mode == "processed_logprobs" else 1.0


@dataclass(frozen=True, slots=True)
class LogprobGap:
    """How far the trainer's logprobs are from the server's, over ``tokens`` positions."""

    mean_abs: float
    max_abs: float
    tokens: int

    def as_metrics(self, prefix: str = "logprob_gap") -> dict[str, float]:
        return {
            f"{prefix}/mean_abs": self.mean_abs,
            f"{prefix}/max_abs": self.max_abs,
            f"{prefix}/tokens": float(self.tokens),
        }


def logprob_gap(trainer: Sequence[float], server: Sequence[float | None]) -> LogprobGap:
    """Compare ``trainer`` (one value per id after the first) with ``server`` (one per id).

    Positions where the server has no logprob (``None``: the first id, or a token the
    model did not sample in a record) are skipped.
    """
    if len(server) != len(trainer) + 1:
        raise ValueError(
            f"the server has {len(server)} entries for {len(trainer) + 1} ids; "
            "the trainer has one fewer than the ids"
        )
    diffs = [
        abs(mine - theirs)
        for mine, theirs in zip(trainer, server[1:], strict=True)
        if theirs is not None and math.isfinite(theirs)
    ]
    if not diffs:
        return LogprobGap(mean_abs=0.0, max_abs=0.0, tokens=0)
    return LogprobGap(mean_abs=sum(diffs) / len(diffs), max_abs=max(diffs), tokens=len(diffs))


async def server_prompt_logprobs(
    client: httpx.AsyncClient, url: str, model: str, token_ids: Sequence[int]
) -> list[float | None]:
    """vLLM's logprob of each of ``token_ids`` given the ones before it (``None`` first).

    Uses ``/v1/completions`` with the ids as the prompt and ``prompt_logprobs``; prompt
    logprobs are raw in every logprobs mode (see the module's docstring).
    """
    body = {
        "model": model,
        "prompt": list(token_ids),
        "max_tokens": 1,
        "temperature": 0.0,
        "prompt_logprobs": 0,
    }
    response = await client.post(f"{url}/v1/completions", json=body)
    response.raise_for_status()
    entries = response.json()["choices"][0]["prompt_logprobs"]
    return [_own_logprob(entry, token) for entry, token in zip(entries, token_ids, strict=True)]


def _own_logprob(entry: dict[str, dict[str, float]] | None, token: int) -> float | None:
    """The logprob of ``token`` itself in one prompt-logprobs entry (keys are ids)."""
    if entry is None:
        return None
    return float(entry[str(token)]["logprob"])


def records_logprob_gap(
    model: nn.Module, records: Sequence[TrajectoryRecord], temperature: float
) -> LogprobGap:
    """The gap between ``model`` and the logprobs the server recorded in ``records``.

    Pass :func:`server_logprob_temperature` of the rollout's mode and temperature. Only
    records whose ids are exactly what the server saw (``tokens == "exact"``) count.
    """
    import torch

    device = next(model.parameters()).device
    gaps = []
    for record in records:
        if record.tokens != "exact" or len(record.token_ids) < 2:
            continue
        ids = torch.tensor([record.token_ids], device=device)
        mine = sequence_logprobs(model, ids, temperature)[0].tolist()
        gaps.append(logprob_gap(mine, record.logprobs))
    return _pooled(gaps)


def _pooled(gaps: Sequence[LogprobGap]) -> LogprobGap:
    tokens = sum(gap.tokens for gap in gaps)
    if tokens == 0:
        return LogprobGap(mean_abs=0.0, max_abs=0.0, tokens=0)
    return LogprobGap(
        mean_abs=sum(gap.mean_abs * gap.tokens for gap in gaps) / tokens,
        max_abs=max(gap.max_abs for gap in gaps),
        tokens=tokens,
    )
