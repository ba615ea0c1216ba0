"""What a finished trajectory leaves behind: one record, everything the trainer needs."""

from __future__ import annotations

from collections.abc import Sequence
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
    piece_starts: list[int] = msgspec.field(default_factory=list)


def join_pieces(pieces: Sequence[TrajectoryRecord]) -> TrajectoryRecord:
    """One episode of several contexts as one record: a client that edited its history
    went on in a new gateway session, each such piece with the exact ids its model saw
    and sampled. The ids, masks, logprobs and weight spans are laid end to end, and
    ``piece_starts`` marks where each piece after the first starts: the trainer takes
    each piece as a sequence of its own (attention never crosses a start) and all of
    them as one sample, with the episode's reward. The episode is ``exact`` only if every
    piece is (else the first other source: it does not train). Its id, messages and
    ending are the last piece's; its task (what it started as) and first call's weights,
    the first piece's."""
    if not pieces:
        raise ValueError("an episode of no pieces")
    last = pieces[-1]
    if len(pieces) == 1:
        return last
    token_ids: list[int] = []
    loss_mask: list[int] = []
    logprobs: list[float | None] = []
    spans: list[WeightSpan] = []
    starts: list[int] = []
    for piece in pieces:
        offset = len(token_ids)
        starts += [offset, *(offset + start for start in piece.piece_starts)]
        token_ids += piece.token_ids
        loss_mask += piece.loss_mask
        logprobs += piece.logprobs
        spans += [
            WeightSpan(s.start + offset, s.end + offset, s.version) for s in piece.weight_versions
        ]
    sources = [piece.tokens for piece in pieces if piece.tokens != "exact"]
    first = pieces[0]
    return msgspec.structs.replace(
        last,
        task_id=first.task_id,
        group_id=first.group_id,
        turns=sum(piece.turns for piece in pieces),
        token_ids=token_ids,
        loss_mask=loss_mask,
        logprobs=logprobs,
        tokens=sources[0] if sources else "exact",
        weight_versions=spans,
        tool_returns=[tool for piece in pieces for tool in piece.tool_returns],
        endpoints=[endpoint for piece in pieces for endpoint in piece.endpoints],
        weight_version=next(
            (p.weight_version for p in pieces if p.weight_version is not None), None
        ),
        timings=Timings(
            total_s=sum(piece.timings.total_s for piece in pieces),
            generation_s=sum(piece.timings.generation_s for piece in pieces),
            tool_s=sum(piece.timings.tool_s for piece in pieces),
            reward_s=sum(piece.timings.reward_s for piece in pieces),
        ),
        weights_changed_turns=sum(piece.weights_changed_turns for piece in pieces),
        piece_starts=sorted({start for start in starts if start > 0}),
    )
