"""The gateway's core: :class:`Sessions`, the table of live sessions behind ``libra serve``.

``async with Sessions(engine, config) as core:`` serves :class:`GatewayCore`:

- **Finding a session.** A request's explicit key (``ChatTurn.session``: the client's
  own, or the session id a reply carried) names it; without one, it continues the idle
  session whose client view (everything the client was sent, its last reply included)
  its messages start with, up to their last assistant message: one dict access by
  digest (``_session.py``). Otherwise a new session starts.
  A keyed request whose messages do not extend its session (the client edited history,
  or re-sent an old request) ends that session and starts a new one under the key.
  Requests on one keyed session take turns. A ``/v1/completions`` request with a key is
  the next turn of that client's completion session (``CompletionSession``: what the
  scheduler needs of a token-level client's trajectory, no messages); without one it
  is a one-off.
- **Tool results are signals.** The ``role: "tool"`` messages after the session's last
  reply are reduced as the engine reduces tool returns (``signal_of``) and fed to the
  scheduler before the turn is routed, so C-MLFQ promotes and demotes external agents.
- **Generating** is the engine's own turn (``libra.engine.generate_turn``): routing,
  exact token ids, retries elsewhere, continuation after a paused server's abort. A
  request cancelled mid-turn (the client went away) or refused by the server leaves the
  session as it was before it; a turn that no server could serve ends the session as
  ``failed`` (``server_error``) and raises ``ServerUnavailable``.
- **Ending.** An idle session ends after ``session_ttl_s``: a background task sweeps
  every ``sweep_every_s`` (sessions are kept in order of last use, so a sweep visits only
  the expired ones), and a request that finds its session expired starts a new one. The
  scheduler forgets every ended session (``on_finish``); with recording on, its record is
  written and streamed (``_recording.py``).
"""

from __future__ import annotations

import hashlib
import itertools
import logging
from array import array
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from types import TracebackType

import anyio
import anyio.abc
import pydantic

from libra import openai
from libra._clock import now
from libra.engine import (
    ContextFull,
    Engine,
    RequestRejected,
    SamplingConfig,
    ServerUnavailable,
    TrajectoryRecord,
    generate_turn,
)
from libra.gateway._admin import Admin, CompletionSession
from libra.gateway._config import GatewayConfig
from libra.gateway._protocol import ChatReply, ChatTurn, FleetStatus
from libra.gateway._recording import Recorder
from libra.gateway._session import (
    Digest,
    Mark,
    Session,
    Status,
    digests_of,
    new_session_key,
    prompt_key_of,
)
from libra.signals import ToolStatus, signal_of

log = logging.getLogger("libra.gateway")

#: Ends the gateway imposed on a live session: its length says nothing of its task's.
_CUT_SHORT = frozenset({"evicted", "shutdown"})
_SAMPLINGS_KEPT = 1024


class Sessions:
    """Live sessions over ``engine``'s fleet and scheduler (see the module)."""

    def __init__(
        self,
        engine: Engine,
        config: GatewayConfig | None = None,
        *,
        on_end: Callable[[str | None, TrajectoryRecord], None] | None = None,
        episode_of: Callable[[str], str | None] | None = None,
    ) -> None:
        self.engine = engine
        self.config = config if config is not None else GatewayConfig()
        #: Called with the client's key (None: it gave none) and the record of each
        #: session as it ends, instead of ``Engine.on_record``: how an agent's runner
        #: finds its episode's sessions (and makes the episode's one record).
        self.on_end = on_end
        #: The episode a client's key names, if its owner publishes the episode's start
        #: and end itself (an agent's runner: the job's id): a session of it publishes
        #: its calls under that id, and no start or end of its own.
        self.episode_of = episode_of
        self.recorder = Recorder(
            self.config.record_path,
            stream=self.config.record_stream,
            buffer=self.config.record_buffer,
        )
        self.admin = Admin(engine, self.config)
        self._by_id: OrderedDict[str, Session] = OrderedDict()  # least recently used first
        self._by_key: dict[str, Session] = {}  # the clients' own keys
        # Idle sessions by their client view (several when identical conversations got
        # identical replies: each follow-up takes one, the latest first).
        self._by_digest: dict[Digest, list[Session]] = {}
        # Keyed /v1/completions sessions by the client's key, least recently used first.
        self._completions: OrderedDict[str, CompletionSession] = OrderedDict()
        self._counter = itertools.count(1)
        # Validated sampling settings by the request's values: validating each request's
        # anew was a measurable share of a turn's cost, and clients repeat theirs.
        self._samplings: dict[
            tuple[float | None, float | None, int | None, int | None], SamplingConfig
        ] = {}
        self._group: anyio.abc.TaskGroup | None = None

    async def __aenter__(self) -> Sessions:
        self.recorder.open()
        self._group = anyio.create_task_group()
        await self._group.__aenter__()
        self._group.start_soon(self._sweep)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> bool | None:
        assert self._group is not None
        self._group.cancel_scope.cancel()
        try:
            return await self._group.__aexit__(exc_type, exc, traceback)
        finally:
            for session in list(self._by_id.values()):
                self._end(session, "truncated", "shutdown")
            for client_key in list(self._completions):
                self._end_completion(client_key, "shutdown")
            self.recorder.close()

    # ------------------------------------------------------------------ GatewayCore

    def models(self) -> list[str]:
        return sorted({i.endpoint.model for i in self.engine.scheduler.router.instances})

    async def chat(self, turn: ChatTurn) -> ChatReply:
        sampling = self._sampling(turn)  # (invalid values raise before a session starts)
        digests = digests_of(turn.messages)
        session = await self._claim(turn, digests, sampling)
        try:
            return await self._generate(session, turn, digests, sampling)
        finally:
            session.busy = False
            if session.idle is not None:  # a request waits for this one to end
                session.idle.set()
                session.idle = None
            if session.key in self._by_id:
                self._touch(session)
                if session.done:
                    self._end(session, "completed", "done")

    async def tokenize(
        self,
        messages: list[openai.Message],
        tools: list[dict[str, object]] | None,
        add_generation_prompt: bool,
    ) -> list[int]:
        return await self.admin.tokenize(messages, tools, add_generation_prompt)

    async def complete(
        self, request: openai.CompletionRequest, session: str | None = None
    ) -> openai.Completion:
        """A ``/v1/completions`` call: of the client's session ``session`` (the scheduler
        sees its calls as one trajectory's turns, until it idles out or is reported
        done), or else a one-off the scheduler forgets at once."""
        await self.admin.unpaused()
        if session is not None:
            live = self._completion_session(session, request)
            live.in_flight += 1
            try:
                return await self.admin.complete(request, live)
            finally:
                live.in_flight -= 1
                live.last_used = now()
                if session in self._completions:
                    self._completions.move_to_end(session)
        key = f"c{next(self._counter)}"
        try:
            return await self.admin.complete(request, CompletionSession(key, key))
        finally:
            self.engine.scheduler.on_finish(key, key, output_tokens=0, failed=True)
            self._forget(key)

    def _completion_session(
        self, client_key: str, request: openai.CompletionRequest
    ) -> CompletionSession:
        live = self._completions.get(client_key)
        idle_s = now() - live.last_used if live is not None else 0.0
        if live is not None and not live.in_flight and idle_s > self.config.session_ttl_s:
            self._end_completion(client_key, "idle_ttl")
            live = None
        if live is None:
            key = new_session_key(next(self._counter))
            live = CompletionSession(key, _prompt_key(request.prompt), last_used=now())
            self._completions[client_key] = live
        return live

    def _end_completion(self, client_key: str, reason: str) -> None:
        live = self._completions.pop(client_key, None)
        if live is not None:
            self.engine.scheduler.on_finish(
                live.key,
                live.prompt_key,
                output_tokens=live.output_tokens,
                failed=reason in _CUT_SHORT,
            )
            self._forget(live.key)

    def _forget(self, key: str) -> None:
        if self.engine.published is not None:
            self.engine.published.forget(key)

    async def report(
        self,
        session: str,
        *,
        tool: tuple[str, ToolStatus] | None = None,
        reward: float | None = None,
        done: bool = False,
    ) -> None:
        """A client's account of its session (by its key or id; unknown ones raise
        ``KeyError``): a tool outcome becomes a signal, a reward is kept for the record,
        ``done`` ends it now (or once the turn in progress ends)."""
        found = self._by_key.get(session) or self._by_id.get(session)
        if found is None and session in self._completions:
            self._report_completions(session, tool, done)
            return
        if found is None:
            raise KeyError(f"no live session {session!r}")
        if tool is not None:
            signal = signal_of(tool[0], "", tool[1])
            found.record_tool(signal, 0, 0.0)
            self.engine.scheduler.on_tool_return(found.key, signal)
        if reward is not None:
            found.reward = reward
        if done:
            found.done = True
            if not found.busy:
                self._end(found, "completed", "done")

    def _report_completions(
        self, client_key: str, tool: tuple[str, ToolStatus] | None, done: bool
    ) -> None:
        """A report on a ``/v1/completions`` session: its tool outcome reaches the
        scheduler, ``done`` ends it (a reward has no record to go to: the client keeps
        its own)."""
        if tool is not None:
            key = self._completions[client_key].key
            self.engine.scheduler.on_tool_return(key, signal_of(tool[0], "", tool[1]))
        if done:
            self._end_completion(client_key, "done")

    async def pause(self) -> None:
        await self.admin.pause()

    async def resume(self) -> None:
        await self.admin.resume()

    async def reload_weights(self, path: str, version: int) -> float:
        return await self.admin.reload_weights(path, version)

    def status(self) -> FleetStatus:
        return self.admin.status()

    # --------------------------------------------------------------- beyond the core

    def records(self) -> AsyncIterator[TrajectoryRecord]:
        """Ended sessions' records (with ``record_stream``), until the core closes."""
        return self.recorder.records()

    def __len__(self) -> int:
        """Live sessions (chat and keyed ``/v1/completions`` ones)."""
        return len(self._by_id) + len(self._completions)

    @property
    def indexed(self) -> int:
        """Entries of the lookup tables (by client key, by digest): none without sessions."""
        return len(self._by_key) + len(self._by_digest)

    def expire(self) -> int:
        """End every session idle for longer than the TTL; how many ended."""
        deadline = now() - self.config.session_ttl_s
        expired = []
        for session in self._by_id.values():
            if session.last_used > deadline:
                break  # the rest were used later
            if not session.busy:
                expired.append(session)
        for session in expired:
            self._end(session, "completed", "idle_ttl")
        idle = []
        for client_key, live in self._completions.items():
            if live.last_used > deadline:
                break  # the rest were used later
            if not live.in_flight:
                idle.append(client_key)
        for client_key in idle:
            self._end_completion(client_key, "idle_ttl")
        return len(expired) + len(idle)

    # -------------------------------------------------------------- finding sessions

    async def _claim(
        self, turn: ChatTurn, digests: list[Digest], sampling: SamplingConfig
    ) -> Session:
        """The session ``turn`` continues (or a new one), marked busy."""
        while True:
            session = self._lookup(turn, digests)
            if session is None:
                session = self._open(turn, digests, sampling)
            elif session.busy:  # keyed, and its last request is still being answered
                if session.idle is None:
                    session.idle = anyio.Event()
                await session.idle.wait()
                continue
            elif not session.extended_by(turn.messages, digests):
                self._end(session, "completed", "history_edited")
                session = self._open(turn, digests, sampling)
            self._unindex(session)
            session.busy = True
            self._touch(session)
            return session

    def _lookup(self, turn: ChatTurn, digests: list[Digest]) -> Session | None:
        """The session the client named, or else the idle one its messages extend."""
        if turn.session is not None:
            # A client's own key, or the id the gateway answered with, sent back.
            session = self._by_key.get(turn.session) or self._by_id.get(turn.session)
        else:
            messages = turn.messages
            last = max((i for i, m in enumerate(messages) if m.role == "assistant"), default=-1)
            extends = 0 <= last < len(messages) - 1  # a reply, and something after it
            idle = self._by_digest.get(digests[last]) if extends else None
            session = idle[-1] if idle else None
        if session is not None and self._expired(session):
            self._end(session, "completed", "idle_ttl")
            return None
        return session

    def _expired(self, session: Session) -> bool:
        idle = now() - session.last_used
        return not session.busy and idle > self.config.session_ttl_s

    def _open(self, turn: ChatTurn, digests: list[Digest], sampling: SamplingConfig) -> Session:
        while len(self._by_id) >= self.config.max_sessions:
            oldest = next((s for s in self._by_id.values() if not s.busy), None)
            if oldest is None:
                break  # every one is generating: go past the limit rather than refuse
            self._end(oldest, "truncated", "evicted")
        key = new_session_key(next(self._counter))
        prompt_key = prompt_key_of(turn.messages, digests)
        session = Session(key, self.config.env, prompt_key, sampling, turn.tools)
        self._by_id[key] = session
        if turn.session is not None:
            session.client_key = turn.session
            self._by_key[turn.session] = session
            if self.episode_of is not None:
                session.event_id = self.episode_of(turn.session) or key
        if self.engine.published is not None and session.event_id == key:
            self.engine.published.started(key, self.config.env, 0, prompt_key)
        return session

    def _index(self, session: Session) -> None:
        self._by_digest.setdefault(session.digest, []).append(session)

    def _unindex(self, session: Session) -> None:
        idle = self._by_digest.get(session.digest)
        if idle is not None and session in idle:
            idle.remove(session)
            if not idle:
                del self._by_digest[session.digest]

    def _touch(self, session: Session) -> None:
        session.last_used = now()
        self._by_id.move_to_end(session.key)

    # ------------------------------------------------------------------ generating

    async def _generate(
        self, session: Session, turn: ChatTurn, digests: list[Digest], sampling: SamplingConfig
    ) -> ChatReply:
        mark = session.mark()
        session.sampling = sampling
        session.stop_strings = list(turn.stop) or None
        for signal in session.take(turn.messages):
            self.engine.scheduler.on_tool_return(session.key, signal)
        try:
            await self.admin.unpaused()
            generated = await generate_turn(session, self.engine)
        except ContextFull as exc:
            self._end(session, "truncated", "max_context_tokens")
            raise RequestRejected(f"the session's context is full: {exc}") from exc
        except ServerUnavailable as exc:
            self._end(session, "failed", "server_error", str(exc))
            raise
        except (RequestRejected, anyio.get_cancelled_exc_class()) as exc:
            self._give_up(session, mark, exc)
            raise
        reply = session.add_reply(generated, turn.messages, digests)
        if session.key in self._by_id:  # (not ended by a shutdown meanwhile)
            self._index(session)
        return reply

    def _give_up(self, session: Session, mark: Mark, exc: BaseException) -> None:
        """A request refused or cancelled: a session with replies goes back to before it
        (the client may send it again); a new one ends, recorded as failed."""
        if session.turns == 0:
            reason = "rejected" if isinstance(exc, RequestRejected) else "cancelled"
            self._end(session, "failed", reason, str(exc) or reason)
        else:
            session.rollback(mark)
            self._index(session)

    def _sampling(self, turn: ChatTurn) -> SamplingConfig:
        """The request's sampling parameters, the config's where it gives none."""
        key = (turn.temperature, turn.top_p, turn.max_tokens, turn.seed)
        sampling = self._samplings.get(key)
        if sampling is None:
            if len(self._samplings) >= _SAMPLINGS_KEPT:
                self._samplings.clear()
            sampling = self._samplings[key] = self._validated_sampling(turn)
        return sampling

    def _validated_sampling(self, turn: ChatTurn) -> SamplingConfig:
        default = self.config.sampling
        try:
            return SamplingConfig(
                temperature=default.temperature if turn.temperature is None else turn.temperature,
                top_p=default.top_p if turn.top_p is None else turn.top_p,
                max_tokens_per_turn=turn.max_tokens or default.max_tokens_per_turn,
                seed=default.seed if turn.seed is None else turn.seed,
            )
        except pydantic.ValidationError as exc:
            raise RequestRejected(f"invalid sampling parameters: {exc}") from exc

    # -------------------------------------------------------------------- ending

    def _end(self, session: Session, status: Status, reason: str, error: str | None = None) -> None:
        """Forget the session (the scheduler too) and record it, once."""
        if self._by_id.pop(session.key, None) is None:
            return
        if session.client_key is not None and self._by_key.get(session.client_key) is session:
            del self._by_key[session.client_key]
        self._unindex(session)
        self.engine.scheduler.on_finish(
            session.key,
            session.prompt_key,
            output_tokens=session.output_tokens,
            failed=status == "failed" or reason in _CUT_SHORT,
        )
        published = self.engine.published
        wanted = self.recorder.on or self.engine.on_record or self.on_end or published
        if not wanted:
            return
        record = session.record(status, reason, error)
        if published is not None and session.event_id == session.key:  # (else its owner's)
            published.ended(record)
        self.recorder.add(record)
        if self.on_end is not None:  # its owner makes the trajectory's record of it
            self.on_end(session.client_key, record)
        elif self.engine.on_record is not None:
            self.engine.on_record(record)

    async def _sweep(self) -> None:
        while True:
            await anyio.sleep(self.config.sweep_every_s)
            if ended := self.expire():
                log.debug("%d idle sessions ended", ended)


def _prompt_key(prompt: str | list[int]) -> str:
    """The task a ``/v1/completions`` session is an instance of: its first prompt."""
    data = prompt.encode() if isinstance(prompt, str) else array("q", prompt).tobytes()
    return hashlib.blake2b(data, digest_size=8).hexdigest()
