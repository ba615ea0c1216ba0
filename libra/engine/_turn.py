"""One model turn of a conversation, in as many generation calls as it takes.

A rollout's trajectory and a gateway's session both ask the model for turns the same
way: :func:`generate_turn` routes each call through the scheduler, calls the endpoint
(exact token ids where it speaks them, chat otherwise), releases the route with what
happened, retries server failures elsewhere with backoff, waits for capacity when no
endpoint is usable, and continues a generation that a paused or drained server aborted.
What it needs of the conversation is the :class:`Dialogue` protocol.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Any, Protocol

import anyio
import msgspec

from libra import openai
from libra._clock import now
from libra.engine._client import (
    CallDeadline,
    Generation,
    RequestRejected,
    ServerUnavailable,
    call_deadline,
)
from libra.engine._config import EngineConfig, SamplingConfig, TurnSampling
from libra.engine._engine import Engine
from libra.engine._records import (
    Status,
    Timings,
    ToolReturnRecord,
    TrajectoryRecord,
)
from libra.engine._tokens import TemplateRenderer, TokenLog
from libra.fleet import Endpoint
from libra.sched import CallOutcome, NoEndpointAvailable, Route, Router, RouteRequest, Scheduler


class Dialogue(Protocol):
    """What one turn's mechanics read and update of the conversation it belongs to."""

    key: str  # the scheduler's keys (see ``RouteRequest``)
    prompt_key: str
    turns: int  # model turns so far
    tokens: TokenLog
    messages: list[openai.Message]
    tools: list[dict[str, Any]]  # sent with requests; [] once described in the prompt
    pending: list[openai.Message]  # messages not yet in ``tokens``
    last_endpoint: Endpoint | None
    weight_version: int | None  # of the endpoint of its first call
    weights_changed_turns: int
    output_tokens: int
    stop_strings: list[str] | None
    sampling: SamplingConfig
    timings: Timings

    @property
    def env_name(self) -> str: ...

    @property
    def event_id(self) -> str:
        """What its events name it (``libra.events``): its key, or the episode it is a
        piece of, whose start and end its owner publishes (an agent's job)."""
        ...

    def describe_tools_in_system_message(self) -> None:
        """For servers whose chat template drops ``tools``: put them in the prompt."""
        ...


class Recorded(Dialogue, Protocol):
    """A conversation that ends as a trajectory record (a rollout's, a gateway's)."""

    messages: list[openai.Message]
    tool_returns: list[ToolReturnRecord]
    endpoints: list[str]


def record_of(
    d: Recorded,
    *,
    env: str,
    task_id: str,
    group_id: str,
    step: int,
    sample: int,
    status: Status,
    stop_reason: str,
    reward: float | None,
    error: str | None,
) -> TrajectoryRecord:
    """``d`` as a record: its tokens (when exact or drifted), turns, tools, timings and
    sampling, under the identity and outcome given."""
    exact = d.tokens.source != "none"
    sampling = d.sampling
    return TrajectoryRecord(
        id=d.key,
        env=env,
        task_id=task_id,
        group_id=group_id,
        step=step,
        sample=sample,
        status=status,
        stop_reason=stop_reason,
        reward=reward,
        turns=d.turns,
        messages=d.messages,
        token_ids=d.tokens.ids if exact else [],
        loss_mask=d.tokens.mask if exact else [],
        logprobs=d.tokens.logprobs if exact else [],
        tokens=d.tokens.source,
        weight_versions=d.tokens.spans if exact else [],
        tool_returns=d.tool_returns,
        endpoints=d.endpoints,
        sampling=sampling.record(),
        weight_version=d.weight_version,
        timings=d.timings,
        error=error,
        weights_changed_turns=d.weights_changed_turns,
    )


def with_tools_described(messages: list[openai.Message], guide: str) -> list[openai.Message]:
    """``messages`` with ``guide`` (the tools and how to call them) in the system message,
    for servers whose chat template drops ``tools`` (SmolLM2's does)."""
    first = messages[0] if messages else None
    if first is not None and first.role == "system":
        system = openai.Message(role="system", content=f"{first.content}\n\n{guide}")
        return [system, *messages[1:]]
    return [openai.Message(role="system", content=guide), *messages]


class ContextFull(Exception):
    """The conversation has no room left in ``max_context_tokens`` for another turn."""


class NoCapacity(ServerUnavailable):
    """No endpoint became usable within ``capacity_wait_s``."""


@dataclass(slots=True)
class ServerTrouble:
    """What went wrong with the servers in the turn in progress, and is not over yet: a
    failed attempt, or a wait for a usable endpoint (None once a generation returns).
    A caller that is stopped mid-turn (its wall-clock limit) reads here whether the
    servers were failing it, rather than the model being slow."""

    unresolved: str | None = None


async def generate_turn(d: Dialogue, engine: Engine, trouble: ServerTrouble | None = None) -> Turn:
    """One model turn, in as many generations as it takes.

    A generation that ends with ``finish_reason: "abort"`` (a paused or drained server)
    is not the end of the turn. On the token path its sampled tokens are kept and the
    same turn is asked for again, through routing (so maybe on another endpoint), as a
    continuation of the token list with what is left of the turn's token budget; the
    pieces make one turn. The chat path cannot continue a partial reply, so there the
    turn starts over (what it had sampled is dropped). After ``max_continuations`` such
    restarts a further abort raises ``ServerUnavailable``. A generation that stopped at
    its route's quantum (``Route.max_tokens``; on the token path, without stop strings) is
    continued the same way, routed again, so the scheduler can move a turn that runs
    long; those pieces are no restarts.
    ``trouble``, if given, follows the servers' failures while the turn runs.
    """
    config = engine.config
    trouble = trouble if trouble is not None else ServerTrouble()
    turn = Turn()
    aborts = 0
    while True:
        if turn.pieces and _turn_budget(d, config, turn) <= 0:
            return turn.ended("length")  # the abort came on the turn's last token
        piece = await _attempt(d, engine, turn, trouble)
        if piece.generation.path == "chat":
            turn.pieces.clear()  # a chat reply is always the whole turn
        turn.pieces.append(piece)
        if piece.quantum_reached:
            continue
        if piece.generation.finish_reason != "abort":
            return turn
        aborts += 1
        if aborts > config.max_continuations:
            raise ServerUnavailable(f"a turn was aborted {aborts} times")


async def _attempt(d: Dialogue, engine: Engine, turn: Turn, trouble: ServerTrouble) -> Piece:
    """One generation call: route, call, release with what happened; on a server failure
    (a hung server's call timing out too) retry, elsewhere if possible, with the same
    context. A failure on an instance the fleet has retired since (drained, removed)
    costs no attempt; with no usable endpoint the call waits for capacity. An aborted
    generation came from a healthy server (paused or drained): it is released as
    ``migrated``, and the turn goes on in the next piece."""
    config, scheduler = engine.config, engine.scheduler
    failed: set[str] = set()
    backoff = config.retry_backoff_s
    attempts = 0
    capacity = _CapacityWait(config.capacity_wait_s, trouble)
    while True:
        route = await _route(d, turn, scheduler, failed, capacity)
        generation: Generation | None = None
        outcome: CallOutcome = "cancelled"  # unless the call says otherwise below
        sent = now()
        try:
            generation, reached = await _call(d, engine, route, turn)
            outcome = "migrated" if generation.finish_reason == "abort" else "ok"
            d.weights_changed_turns += route.weights_changed
            trouble.unresolved = None
            return Piece(generation, route.endpoint, route.weight_version, route.bucket, reached)
        except ServerUnavailable as exc:
            capacity.last_error = str(exc)
            if route.retired:
                outcome = "migrated"
                continue  # planned: go on elsewhere at once, no attempt spent
            outcome = "failed"
            failed.add(route.endpoint.name)
            attempts += 1
            trouble.unresolved = _failed_attempts(attempts, exc)
            engine.generations.failed(str(exc))
            if attempts >= config.max_attempts:
                raise ServerUnavailable(trouble.unresolved) from exc
        except RequestRejected:
            outcome = "rejected"
            raise
        finally:
            sampled = len(generation.token_ids or ()) if generation is not None else 0
            scheduler.release(route, outcome=outcome, new_tokens=sampled)
            if engine.published is not None:
                tokens = (_prompt_tokens(d, turn, generation), sampled)
                engine.published.call(d.event_id, d.turns, route, now() - sent, tokens, outcome)
        await anyio.sleep(backoff)
        backoff *= 2


def _prompt_tokens(d: Dialogue, turn: Turn, generation: Generation | None) -> int:
    """The prompt a call sent, in tokens: the server's count of a chat, else the token
    list (0 for a chat that got no answer)."""
    if generation is not None and generation.prompt_token_ids is not None:
        return len(generation.prompt_token_ids)
    if d.tokens.source == "exact" and (generation is None or generation.path == "tokens"):
        return len(d.tokens) + turn.produced
    return 0


def _failed_attempts(attempts: int, last: Exception) -> str:
    if attempts == 1:
        return f"1 failed attempt: {last}"
    return f"{attempts} failed attempts, the last: {last}"


class _CapacityWait:
    """What one call may still wait for an endpoint, and the failure to report if none."""

    def __init__(self, budget_s: float, trouble: ServerTrouble) -> None:
        self.budget_s = budget_s
        self.last_error = ""
        self.trouble = trouble

    async def wait(self, router: Router, why: str) -> None:
        """Until the router gains a usable endpoint (or the budget is spent: fail)."""
        if self.budget_s <= 0:
            after = f" (last failure: {self.last_error})" if self.last_error else ""
            raise NoCapacity(f"no endpoint for {why}{after}")
        if self.trouble.unresolved is None:
            self.trouble.unresolved = f"waiting for a usable endpoint ({why})"
        started = now()
        with anyio.move_on_after(self.budget_s):
            await router.membership.wait()
        self.budget_s -= now() - started


async def _route(
    d: Dialogue, turn: Turn, scheduler: Scheduler, failed: set[str], capacity: _CapacityWait
) -> Route:
    request = RouteRequest(
        d.key,
        d.prompt_key,
        d.turns,
        len(d.tokens) + turn.produced,
        d.last_endpoint,
        generated_tokens=d.output_tokens + turn.produced,
        env=d.env_name,
    )
    while True:
        try:
            route = scheduler.route(request, frozenset(failed))
        except NoEndpointAvailable as exc:
            if failed:
                failed.clear()  # every endpoint failed once: they may be back, try them all
                continue
            await capacity.wait(scheduler.router, str(exc))
            continue
        if d.weight_version is None:  # the weights it started on
            d.weight_version = route.weight_version
        return route


async def _call(d: Dialogue, engine: Engine, route: Route, turn: Turn) -> tuple[Generation, bool]:
    """The generation, and whether it stopped at the route's quantum, within the call's
    timeout (past it the server is taken as hung: ``CallTimedOut``). Each of the call's
    requests gets the time left to its deadline."""
    timeout_s = _call_timeout(engine.config, route.endpoint, _turn_budget(d, engine.config, turn))
    watch = engine.generations
    watch.started()
    started = now()
    deadline = call_deadline.set(CallDeadline(started + timeout_s, timeout_s))
    try:
        generated = await _generate(d, engine, route, turn)
    finally:
        call_deadline.reset(deadline)
        watch.ended()
    returned = now()
    watch.returned(returned)
    d.timings.generation_s += returned - started
    return generated


def _call_timeout(config: EngineConfig, endpoint: Endpoint, max_tokens: int) -> float:
    """What a healthy server needs at most for a call that may sample ``max_tokens``:
    a long generation is not a hang."""
    base = endpoint.call_timeout_s or config.call_timeout_s
    return base + config.call_timeout_per_token_s * max(max_tokens, 0)


async def _generate(
    d: Dialogue, engine: Engine, route: Route, turn: Turn
) -> tuple[Generation, bool]:
    """The generation, and whether it stopped at the route's quantum with the turn's own
    budget not spent (the turn goes on)."""
    endpoint, client = route.endpoint, engine.client
    if d.turns == 0 and d.tools and not await client.renders_tools(endpoint):
        d.describe_tools_in_system_message()
    on_tokens = d.tokens.source == "exact" and await client.speaks_tokens(endpoint)
    if on_tokens:
        await render_pending(d, engine.renderer, endpoint)  # the budget sees the whole prompt
    # A chat reply cannot be continued; a stop string could straddle two calls, where the
    # server would not see it: such turns are never cut at a quantum.
    quantum = route.max_tokens if on_tokens and not d.stop_strings else None
    budget = _turn_budget(d, engine.config, turn)
    max_tokens = budget if quantum is None else min(budget, quantum)
    sampling = _turn_sampling(d, engine.config, route, max_tokens)
    generation = await client.generate(endpoint, _Prompt(d, turn, engine.renderer), sampling)
    if generation.path == "chat":
        d.tokens.absorb_prompt(generation.prompt_token_ids)
    d.last_endpoint = endpoint
    reached = (
        max_tokens < budget
        and generation.finish_reason == "length"
        and generation.completion_tokens >= max_tokens
    )
    return generation, reached


class _Prompt(msgspec.Struct, frozen=True):
    """A generation request's conversation (see ``OpenAIClient.generate``): the chat, or
    the exact token list, a partial turn included, with pending messages rendered."""

    d: Dialogue
    turn: Turn
    renderer: TemplateRenderer

    @property
    def messages(self) -> list[openai.Message]:
        return self.d.messages

    @property
    def tools(self) -> list[dict[str, Any]]:
        return self.d.tools

    async def token_ids(self, endpoint: Endpoint) -> list[int] | None:
        if self.d.tokens.source != "exact":
            return None
        await render_pending(self.d, self.renderer, endpoint)
        return self.d.tokens.ids + self.turn.token_ids


async def render_pending(d: Dialogue, renderer: TemplateRenderer, endpoint: Endpoint) -> None:
    """Append the messages that arrived since the last model turn as token ids."""
    if not d.tokens.ids:
        d.tokens.add_context(await renderer.prompt(endpoint, d.messages, d.tools))
    elif d.pending:
        d.tokens.add_context(await renderer.continuation(endpoint, d.pending, d.tokens.ids[-1]))
    d.pending = []


def _turn_budget(d: Dialogue, config: EngineConfig, turn: Turn) -> int:
    """Tokens the turn may still sample: its own limit, and the room left in the context."""
    room = config.max_context_tokens - len(d.tokens)
    return min(room, d.sampling.max_tokens_per_turn) - turn.produced


def _turn_sampling(
    d: Dialogue, config: EngineConfig, route: Route, max_tokens: int
) -> TurnSampling:
    """Every sampling parameter of the next request: ``max_tokens`` (the turn's remaining
    budget, capped by the room left in the context and by the route's quantum), a per-turn
    seed, the route's priority."""
    if config.max_context_tokens - len(d.tokens) <= 0:
        raise ContextFull(f"{len(d.tokens)} tokens fill max_context_tokens")
    sampling = d.sampling
    seed = sampling.seed
    if seed is not None:  # reproducible, yet different for every sample and turn
        seed = zlib.crc32(f"{seed}/{d.key}/{d.turns}".encode())
    return TurnSampling(
        max_tokens=max_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        seed=seed,
        priority=route.priority,
        stop=d.stop_strings,
        session=d.key,
    )


class Piece(msgspec.Struct, frozen=True):
    """One generation of a turn, where and by which weights it was sampled, and whether
    it stopped at its route's quantum (the turn goes on)."""

    generation: Generation
    endpoint: Endpoint
    weight_version: int
    bucket: str = ""
    quantum_reached: bool = False


@dataclass(slots=True)
class Turn:
    """A model turn: one generation, or several when aborted or quantum-cut ones were
    continued."""

    pieces: list[Piece] = field(default_factory=list)
    finish_reason: str | None = None  # set when the turn ended for a reason of its own

    @property
    def produced(self) -> int:
        pieces = self.pieces
        if not pieces:  # (read several times a call: most turns have no piece yet, or one)
            return 0
        if len(pieces) == 1:
            return pieces[0].generation.completion_tokens
        return sum(piece.generation.completion_tokens for piece in pieces)

    @property
    def token_ids(self) -> list[int]:
        return [i for piece in self.pieces for i in piece.generation.token_ids or ()]

    def ended(self, finish_reason: str) -> Turn:
        self.finish_reason = finish_reason
        return self

    @property
    def generation(self) -> Generation:
        """The pieces as one generation (the text joined, the ids and logprobs too)."""
        last = self.pieces[-1].generation
        if len(self.pieces) == 1 and self.finish_reason is None:
            return last
        generations = [piece.generation for piece in self.pieces]
        return Generation(
            text="".join(g.text for g in generations),
            finish_reason=self.finish_reason or last.finish_reason,
            completion_tokens=self.produced,
            token_ids=self.token_ids,
            logprobs=[lp for g in generations for lp in g.logprobs or ()],
            prompt_token_ids=last.prompt_token_ids,
            tool_calls=last.tool_calls,
            path=last.path,
        )

    def add_to(self, tokens: TokenLog) -> None:
        """Its sampled tokens, piece by piece (each with the weight version of the
        endpoint that sampled it), while the log is exact."""
        for piece in self.pieces:
            if tokens.source != "exact":
                return
            if piece.generation.token_ids is None:
                tokens.source = "none"
                return
            if piece.generation.token_ids:  # an abort can come before the first token
                ids, logprobs = piece.generation.token_ids, piece.generation.logprobs
                tokens.add_sampled(ids, logprobs, piece.weight_version)
