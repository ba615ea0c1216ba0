"""The fleet behind the gateway: pausing it, new weights, its status, and the stateless
``/v1/completions`` call routed to one of its endpoints."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import anyio
import msgspec

from libra import openai
from libra._clock import now
from libra.engine import Engine, RequestRejected, ServerUnavailable, TransportError
from libra.fleet import Endpoint
from libra.gateway._config import GatewayConfig
from libra.gateway._protocol import FleetStatus
from libra.sched import CallOutcome, NoEndpointAvailable, RouteRequest
from libra.serving import WeightSync

log = logging.getLogger("libra.gateway")


@dataclass(slots=True)
class CompletionSession:
    """What the scheduler is told of a ``/v1/completions`` client's calls: one key for a
    client's whole multi-turn trajectory (``X-Libra-Session``), else one per call."""

    key: str  # the scheduler's
    prompt_key: str  # the task: the session's first prompt
    turns: int = 0
    output_tokens: int = 0
    last_endpoint: Endpoint | None = None
    last_used: float = 0.0
    in_flight: int = 0  # calls being answered (it does not idle out meanwhile)


class Admin:
    def __init__(self, engine: Engine, config: GatewayConfig) -> None:
        self.engine, self.config = engine, config
        self._resumed: anyio.Event | None = None  # set while paused

    @property
    def paused(self) -> bool:
        return self._resumed is not None

    async def unpaused(self) -> None:
        """Return at once, or when a pause ends: new generation calls wait here."""
        while self._resumed is not None:
            await self._resumed.wait()

    async def pause(self) -> None:
        """Hold new generation calls here, and pause the upstream servers that can be
        (vLLM's dev-mode ``/pause``, in ``config.pause_mode``; others are left alone)."""
        if self._resumed is None:
            self._resumed = anyio.Event()
        await self._each_endpoint(f"/pause?mode={self.config.pause_mode}")

    async def resume(self) -> None:
        await self._each_endpoint("/resume")
        if self._resumed is not None:
            self._resumed.set()
            self._resumed = None

    async def reload_weights(self, path: str, version: int) -> float:
        """Load the weights folder ``path`` into every endpoint as ``version``; seconds."""
        endpoints = list(self.engine.scheduler.router.endpoints().values())
        sync = WeightSync(endpoints, self.config.weight_sync, self.engine.http)
        report = await sync.sync(path, version)
        return report.seconds

    def status(self) -> FleetStatus:
        router = self.engine.scheduler.router
        at = router.clock()
        instances = router.instances
        return FleetStatus(
            versions={i.name: i.endpoint.weight_version for i in instances},
            healthy={i.name: i.state == "active" and not i.is_down(at) for i in instances},
            paused=self.paused,
        )

    async def complete(
        self, request: openai.CompletionRequest, session: CompletionSession
    ) -> openai.Completion:
        """One routed ``/v1/completions`` call of ``session`` (retried elsewhere on a
        server failure), which then counts the turn, its tokens and its endpoint."""
        prompt = request.prompt
        context = len(prompt) if isinstance(prompt, list) else len(prompt) // 4
        ask = RouteRequest(
            session.key,
            session.prompt_key,
            session.turns,
            context,
            session.last_endpoint,
            generated_tokens=session.output_tokens,
            env=self.config.env,
        )
        failed: set[str] = set()
        for _ in range(self.engine.config.max_attempts - 1):
            try:
                return await self._complete_once(request, ask, failed, session)
            except ServerUnavailable:
                await anyio.sleep(self.engine.config.retry_backoff_s)
        return await self._complete_once(request, ask, failed, session)

    async def tokenize(
        self, messages: list[openai.Message], tools: list[dict[str, object]] | None, add: bool
    ) -> list[int]:
        """``messages`` rendered by a healthy upstream's chat template (vLLM's
        ``/tokenize``, or in-process by a local template that renders as it does): the
        fleet serves one model, so any of them renders as all would."""
        router = self.engine.scheduler.router
        at = router.clock()
        healthy = [i for i in router.instances if i.state == "active" and not i.is_down(at)]
        if not healthy:
            raise ServerUnavailable("no healthy model server to render the chat")
        endpoint = healthy[0].endpoint
        return await self.engine.renderer.render(
            endpoint, messages, tools, add_generation_prompt=add
        )

    async def _complete_once(
        self,
        request: openai.CompletionRequest,
        ask: RouteRequest,
        failed: set[str],
        session: CompletionSession,
    ) -> openai.Completion:
        scheduler = self.engine.scheduler
        try:
            route = scheduler.route(ask, frozenset(failed))
        except NoEndpointAvailable as exc:
            failed.clear()
            raise ServerUnavailable(str(exc)) from exc
        outcome: CallOutcome = "cancelled"
        prompt, produced = ask.context_tokens, 0
        sent = now()
        try:
            upstream = msgspec.structs.replace(
                request, model=route.endpoint.model, priority=route.priority, stream=None
            )
            completion = await self.engine.client.completion(route.endpoint, upstream)
            outcome = "ok"
            if completion.usage is not None:
                prompt = completion.usage.prompt_tokens
                produced = completion.usage.completion_tokens
            session.turns += 1
            session.output_tokens += produced
            session.last_endpoint = route.endpoint
            return completion
        except ServerUnavailable:
            outcome = "failed"
            failed.add(route.endpoint.name)
            raise
        except RequestRejected:
            outcome = "rejected"
            raise
        finally:
            scheduler.release(route, outcome=outcome, new_tokens=produced)
            if self.engine.published is not None:
                self.engine.published.call(
                    session.key, ask.turn, route, now() - sent, (prompt, produced), outcome
                )

    async def _each_endpoint(self, path: str) -> None:
        async with anyio.create_task_group() as group:
            for endpoint in self.engine.scheduler.router.endpoints().values():
                group.start_soon(self._control, endpoint, path)

    async def _control(self, endpoint: Endpoint, path: str) -> None:
        timeout_s = self.config.weight_sync.timeout_s
        try:
            status, body = await self.engine.http.post(
                endpoint.url + path, b"", endpoint.headers, timeout_s
            )
        except TransportError as exc:
            log.warning("%s%s failed: %s", endpoint.name, path, exc)
            return
        if status not in (200, 404):  # 404: a server without the control API
            log.warning("%s%s answered %d: %s", endpoint.name, path, status, body[:200])
