"""One agent episode, top to bottom, as a trajectory record.

The runner plays through a gateway over ``engine`` that its owner serves
(``libra.launch.open_agent``) on a free loopback port, with the runner's
:meth:`AgentRunner.gateway_config` and behind the runner's own key (the port is the
host's: no other local user may drive, or reload, the run's servers through it); the
gateway's ended sessions go to :meth:`AgentRunner.ended`, and its events name each
session by its episode (:meth:`AgentRunner.episode_of`). Then, for each job:

1. the agent gets the job's task and an ``openai.AsyncOpenAI`` client whose every call
   names the session ``str(job.id)`` (``X-Libra-Session``): the gateway routes each call
   through the run's scheduler, feeds it the tool results the agent sends back
   (``role: "tool"`` messages), and keeps the session's exact token ids and logprobs;
2. the agent returns its reward (or None), raises, or runs past ``timeout_s``;
3. the session ends (``report(done=True)``) and its record comes back through
   ``Sessions.on_end``; with no reward from the agent, the run's env scores the final
   conversation (its ``reset`` on the task, then its ``reward`` on the last reply);
4. the record takes the job's identity (id, task, group, step, sample; ``env`` is the
   agent's name), and so do the episode's events: its start and end, which the runner
   publishes, and its sessions' calls. A client that edited its history left several
   sessions under the key (the gateway starts a new one rather than train on tokens it
   never sampled): they are the episode's pieces, joined (``libra.engine.join_pieces``)
   into one sample of several sequences, each exact, all with the episode's reward.

An agent that raises or times out is ``failed`` (``agent_error``, ``agent_timeout``:
never the policy's doing, never trained), its traceback shown once per exception type
(``Engine.env_bugs``); a cancelled one is recorded as cancelled before the cancellation
goes on, like an env's trajectory.
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Callable
from contextlib import AsyncExitStack
from types import TracebackType
from typing import Any

import anyio
import httpx
import msgspec

from libra._clock import now
from libra.agents._agent import Agent
from libra.engine import (
    Engine,
    Status,
    Timings,
    TrajectoryJob,
    TrajectoryRecord,
    join_pieces,
    score_reply,
)
from libra.envs import Env
from libra.gateway import SESSION_HEADER, GatewayConfig, Keys, Sessions

#: What an agent's episode may take beyond its own limit: the session outlives it.
_TTL_MARGIN_S = 60.0


class AgentRunner:
    """Plays :class:`TrajectoryJob` s with ``agent`` on ``engine`` (see the module); a
    :class:`libra.engine.TrajectoryRunner`. ``scorer``: the env whose ``reward`` scores
    an episode the agent returned no reward for."""

    def __init__(
        self,
        engine: Engine,
        agent: Agent,
        *,
        scorer: type[Env] | None = None,
        timeout_s: float = 600.0,
    ) -> None:
        self.engine, self.agent, self.scorer, self.timeout_s = engine, agent, scorer, timeout_s
        self.key = secrets.token_urlsafe(24)
        self.url = ""  # the gateway's base URL (``{url}/v1`` for clients), once through one
        self.sessions: Sessions | None = None
        self._pieces: dict[str, list[TrajectoryRecord]] = {}  # by running episode
        self._stack = AsyncExitStack()
        self._client: Any = None

    def gateway_config(self) -> GatewayConfig:
        """How the gateway the runner plays through serves its episodes."""
        return GatewayConfig(
            env=self.agent.name,
            session_ttl_s=self.timeout_s + _TTL_MARGIN_S,
            sampling=self.engine.config.sampling,
            any_model=True,  # the agent may name any model: it trains the run's policy
        )

    def keys(self) -> Keys:
        """The gateway's one key: the runner's own."""
        return Keys.of([self.key], [])

    def through(self, url: str, sessions: Sessions) -> AgentRunner:
        """Play through the gateway served at ``url`` over ``sessions`` (enter it next)."""
        self.url, self.sessions = url, sessions
        return self

    async def __aenter__(self) -> AgentRunner:
        if self.sessions is None:
            raise RuntimeError("AgentRunner plays through a gateway: see libra.launch.open_agent")
        openai = _openai_sdk()
        async with AsyncExitStack() as stack:
            http = await stack.enter_async_context(httpx.AsyncClient(timeout=None))
            self._client = openai.AsyncOpenAI(
                base_url=f"{self.url}/v1",
                api_key=self.key,
                http_client=http,
                max_retries=0,  # the gateway retries elsewhere itself
                timeout=self.timeout_s,
            )
            self._stack = stack.pop_all()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> bool | None:
        return await self._stack.__aexit__(exc_type, exc, traceback)

    async def __call__(
        self,
        job: TrajectoryJob,
        engine: Engine,
        *,
        on_cancelled: Callable[[TrajectoryRecord], None] | None = None,
    ) -> TrajectoryRecord:
        key, started = str(job.id), now()
        self._pieces[key] = []
        if engine.published is not None:  # its sessions' calls go under the job's id
            engine.published.started(key, self.agent.name, job.step, str(job.task_id))
        client = self._client.with_options(default_headers={SESSION_HEADER: key})
        try:
            with anyio.move_on_after(self.timeout_s) as limit:
                reward = await self.agent.play(job.task, client)
        except anyio.get_cancelled_exc_class():
            with anyio.CancelScope(shield=True):
                record = await self._record(job, "failed", "cancelled", None, started)
            if on_cancelled is not None:
                on_cancelled(record)
            raise
        except Exception as exc:
            engine.env_bugs.report(f"agent {self.agent.name}", exc)
            error = f"{type(exc).__name__}: {exc}"
            return await self._record(job, "failed", "agent_error", None, started, error)
        if limit.cancelled_caught:
            error = f"the agent ran past agent_timeout_s ({self.timeout_s:g} s)"
            return await self._record(job, "failed", "agent_timeout", None, started, error)
        return await self._record(job, None, None, reward, started)

    # ------------------------------------------------------------------ internals

    def episode_of(self, client_key: str) -> str | None:
        """The gateway's ``episode_of``: a client key is its running episode's id."""
        return client_key if client_key in self._pieces else None

    def ended(self, client_key: str | None, record: TrajectoryRecord) -> None:
        """The gateway's ``on_end``: an ended session is a piece of its episode."""
        # A piece that ends after its episode's record was made (a call the agent left
        # running past its end, cut by the disconnect) is not kept: the episode is over.
        if client_key in self._pieces:
            self._pieces[client_key].append(record)

    async def _record(
        self,
        job: TrajectoryJob,
        status: Status | None,
        stop_reason: str | None,
        reward: float | None,
        started: float,
        error: str | None = None,
    ) -> TrajectoryRecord:
        """End the episode's session and make its record: ``status`` None keeps the
        session's own ending (and ``reward``, else the scorer's)."""
        key = str(job.id)
        # No live session: the agent made no call, or its session ended already.
        assert self.sessions is not None  # (entered: through a gateway)
        with contextlib.suppress(KeyError):
            await self.sessions.report(key, done=True)
        pieces = self._pieces.pop(key, [])
        last = pieces[-1] if pieces else None
        if status is None:
            if last is None:
                status, stop_reason = "failed", "no_call"
                error = "the agent made no call to the model"
            else:
                status, stop_reason = last.status, last.stop_reason
                error = last.error
        if status != "failed" and reward is None:
            reward, error = await self._score(job, last)
            if reward is None:
                status, stop_reason = "failed", "reward_error"
        identity = {
            "id": key,
            "env": self.agent.name,
            "task_id": str(job.task_id),
            "group_id": str(job.group_id),
            "step": job.step,
            "sample": job.sample,
            "status": status,
            "stop_reason": stop_reason,
            "reward": None if status == "failed" else reward,
            "error": error,
        }
        timings = Timings(total_s=now() - started)
        if last is None:
            record = self._empty(identity, timings)
        else:
            episode = join_pieces(pieces)
            timings.generation_s = episode.timings.generation_s
            record = msgspec.structs.replace(episode, timings=timings, **identity)
        if self.engine.published is not None:
            self.engine.published.ended(record)
        if self.engine.on_record is not None:
            self.engine.on_record(record)
        return record

    async def _score(
        self, job: TrajectoryJob, last: TrajectoryRecord | None
    ) -> tuple[float | None, str | None]:
        """The scorer's reward for the episode's last reply; or None and why not."""
        if self.scorer is None:
            return None, "the agent returned no reward, and the run has no env to score it"
        replies = [m for m in (last.messages if last else []) if m.role == "assistant"]
        reply = replies[-1].content or "" if replies else ""
        return await score_reply(self.engine, self.scorer, job.task, reply)

    def _empty(self, identity: dict[str, Any], timings: Timings) -> TrajectoryRecord:
        """The record of an episode that made no call to the model."""
        return TrajectoryRecord(
            turns=0,
            messages=[],
            token_ids=[],
            loss_mask=[],
            logprobs=[],
            tokens="none",
            weight_versions=[],
            tool_returns=[],
            endpoints=[],
            sampling=self.engine.config.sampling.record(),
            weight_version=None,
            timings=timings,
            **identity,
        )


def _openai_sdk() -> Any:
    try:
        import openai
    except ModuleNotFoundError:
        raise ModuleNotFoundError(
            "agents talk to the model through the openai SDK: pip install 'libra[agents]'"
        ) from None
    return openai
