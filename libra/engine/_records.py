"""What a finished trajectory leaves behind: one record, everything the trainer needs."""

from __future__ import annotations

from typing import Literal

import msgspec

from libra import openai

Status = Literal["completed", "truncated", "failed"]
TokenSource = Literal["exact", "drift", "none"]


class ToolReturnRecord(msgspec.Struct):
    """One tool call's outcome. ``exception`` is the type of an unexpected exception the
    tool raised (a bug in the env); a deliberate ``ToolError`` leaves it None."""

    tool: str
    status: Literal["success", "failure", "timeout"]
    size_class: Literal["small", "medium", "large"]
    chars: int
    latency_s: float
    exception: str | None = None


class WeightSpan(msgspec.Struct, array_like=True):
    """Tokens ``[start, end)`` were sampled by weights of ``version``."""

    start: int
    end: int
    version: int


class Timings(msgspec.Struct):
    total_s: float = 0.0
    generation_s: float = 0.0
    tool_s: float = 0.0
    reward_s: float = 0.0


class SamplingRecord(msgspec.Struct):
    """The sampling parameters of every call (``seed`` is the base of the per-turn seeds;
    a turn's ``max_tokens`` is this, capped by the room left in the context)."""

    temperature: float
    top_p: float
    max_tokens_per_turn: int
    seed: int | None


class TrajectoryRecord(msgspec.Struct, omit_defaults=False):
    """One trajectory. ``token_ids``, ``loss_mask`` and ``logprobs`` are aligned.

    ``loss_mask`` is 1 for tokens the model sampled and 0 for prompt, tool and env tokens;
    ``logprobs`` holds the sampled token's logprob where the mask is 1 and null elsewhere.
    ``tokens`` says how far to trust the ids: ``exact`` (the sampled ids, as returned),
    ``drift`` (the server re-rendered earlier turns differently; ids stop at the drift),
    or ``none`` (the server returned no ids: text only).

    ``id`` (unique within a run), ``task_id`` and ``group_id`` are the typed ids
    (``libra.envs.TrajectoryId``, ``TaskId``, ``GroupId``) rendered as strings; read
    ``env``, ``step`` and ``sample`` from their own fields, never from the strings.
    ``weight_version`` is the version of the weights serving its first call (None if it
    made none).
    ``weight_versions`` gives each sampled span the version of its endpoint's weights when
    its call was routed; ``weights_changed_turns`` counts the turns whose endpoint loaded
    new weights while the call ran (their span may mix two versions).
    """

    id: str
    env: str
    task_id: str
    group_id: str
    step: int
    sample: int
    status: Status
    stop_reason: str
    reward: float | None
    turns: int
    messages: list[openai.Message]
    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float | None]
    tokens: TokenSource
    weight_versions: list[WeightSpan]
    tool_returns: list[ToolReturnRecord]
    endpoints: list[str]
    sampling: SamplingRecord
    weight_version: int | None
    timings: Timings
    error: str | None = None
    weights_changed_turns: int = 0
