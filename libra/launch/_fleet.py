"""Where generation calls go: ``--server`` or a ``[fleet]`` turned into a fleet and a client.

``emulated`` runs the emulated OpenAI server in-process (through ``httpx.ASGITransport``,
no sockets); ``embedded`` is real vLLM serving the embedded model (a running ``libra
serve``, or one started for this command); a URL, or several separated by commas, names
any OpenAI-compatible servers, each its own instance in one bucket. A ``[fleet]`` table
(:class:`libra.fleet.FleetSpec`) names instances and groups them into buckets, for C-MLFQ.
This is the one place that composes a fleet: runtime code only ever sees endpoints and
an HTTP client.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import anyio
import httpx
import msgspec
from rich.console import Console

from libra import openai
from libra.config import UsageError
from libra.emulation import ByteTokenizer, EmulatorConfig, create_app
from libra.engine import (
    ChatTemplate,
    HTTPTransport,
    TransportError,
    TransportName,
    http_transport,
)
from libra.fleet import Endpoint, FleetSpec, InstanceSpec
from libra.serving import EMBEDDED_MODEL_NAME, ServerProcess, VLLMServer


class FleetError(UsageError, RuntimeError):
    """The servers named by ``--server`` cannot be used; the message says why."""


@dataclass
class Fleet:
    http: HTTPTransport
    spec: FleetSpec  # the instances (with the model each serves) and their buckets
    #: The servers this command started, by instance name: restarted if they die or hang.
    servers: dict[str, ServerProcess] = field(default_factory=dict)


def local_templates() -> list[ChatTemplate]:
    """The chat templates Libra renders in-process: the emulator's, with its tools
    section and without (``template_renders_tools = false``). The engine uses one in
    place of a server's ``/tokenize`` once it renders probes exactly as that server does
    (so for the emulator on any port; a real model's template differs, and keeps
    ``/tokenize``)."""
    tokenizer = ByteTokenizer()
    return [tokenizer, _WithoutTools(tokenizer)]


@dataclass(frozen=True)
class _WithoutTools:
    template: ByteTokenizer

    def render_chat(
        self,
        messages: Sequence[openai.Message],
        tools: Sequence[dict[str, object]] | None,
        add_generation_prompt: bool,
    ) -> list[int]:
        return self.template.render_chat(messages, None, add_generation_prompt)


class _Models(msgspec.Struct):
    data: list[dict[str, object]]


@asynccontextmanager
async def open_fleet(
    server: str | None,
    *,
    fleet: FleetSpec | None = None,
    model: str | None,
    transport: TransportName,
    max_connections: int,
    emulator: EmulatorConfig | None = None,
    probe_timeout_s: float = 10.0,
    headers: Mapping[str, str] | None = None,
) -> AsyncIterator[Fleet]:
    """The fleet ``server`` (or ``fleet``) names. Every server given by URL is asked for
    its models first, all at once, each for at most ``probe_timeout_s``: one that is not
    there, never answers or is no OpenAI server fails here, in one line, not every
    trajectory later. ``headers`` go with the probes (a gateway's ``Authorization``)."""
    if fleet is not None:
        if server is not None:
            raise FleetError("give either --server or a [fleet], not both")
        async with http_transport(transport, max_connections=max_connections) as http:
            yield Fleet(http, await _with_models(http, fleet, probe_timeout_s, headers))
        return
    if server is None or server == "emulated":
        config = emulator or EmulatorConfig()
        app = create_app(config)
        async with http_transport(httpx.ASGITransport(app=app)) as http:
            yield Fleet(
                http, _one_bucket([Endpoint("http://emulated", model=model or config.model_name)])
            )
        return
    if server == "embedded":
        async with (
            _embedded_server() as (url, started),
            http_transport(transport, max_connections=max_connections) as http,
        ):
            embedded = Endpoint(url, model=EMBEDDED_MODEL_NAME, name="embedded")
            owned: dict[str, ServerProcess] = {} if started is None else {"embedded": started}
            yield Fleet(http, _one_bucket([embedded]), owned)
        return
    urls = [url.strip() for url in server.split(",") if url.strip()]
    if not all(url.startswith(("http://", "https://")) for url in urls):
        raise FleetError(f"--server must be 'emulated', 'embedded' or http(s) URLs, got {server!r}")
    async with http_transport(transport, max_connections=max_connections) as http:
        served = await _models_of(http, urls, probe_timeout_s, headers)
        endpoints = [Endpoint(url, model=model or served[url]) for url in urls]
        yield Fleet(http, _one_bucket(endpoints))


def _one_bucket(endpoints: list[Endpoint]) -> FleetSpec:
    instances = [InstanceSpec(name=e.name, url=e.url, model=e.model, api=e.api) for e in endpoints]
    return FleetSpec(instances=instances)


async def _with_models(
    http: HTTPTransport, fleet: FleetSpec, timeout_s: float, headers: Mapping[str, str] | None
) -> FleetSpec:
    """The fleet, with the model each instance serves where it does not name one."""
    urls = [instance.url for instance in fleet.instances]
    served = await _models_of(http, urls, timeout_s, headers)
    instances = [
        instance
        if instance.model != "default"
        else instance.model_copy(update={"model": served[instance.url]})
        for instance in fleet.instances
    ]
    return fleet.model_copy(update={"instances": instances})


@asynccontextmanager
async def _embedded_server() -> AsyncIterator[tuple[str, VLLMServer | None]]:
    """A running ``libra vllm`` of the embedded model (not ours to restart), or a server
    started for this command."""
    from libra.serving import prepare_model, running_embedded_url, server_config

    url = await anyio.to_thread.run_sync(running_embedded_url)
    if url is not None:
        yield url, None
        return
    model = await anyio.to_thread.run_sync(prepare_model)
    console = Console(stderr=True)
    vllm = VLLMServer(model, served_model_name=EMBEDDED_MODEL_NAME, config=server_config())
    started = time.monotonic()
    with console.status(f"starting vLLM on the embedded model ({model})"):
        await vllm.astart()
    elapsed = time.monotonic() - started
    console.print(
        f"vLLM ready at {vllm.url} in {elapsed:.0f} s (log: {vllm.log_file})", soft_wrap=True
    )
    try:
        yield vllm.url, vllm
    finally:
        with anyio.CancelScope(shield=True):
            await vllm.astop()


async def _models_of(
    http: HTTPTransport, urls: list[str], timeout_s: float, headers: Mapping[str, str] | None
) -> dict[str, str]:
    """The first model each server serves, asked of all at once (what is wrong with each
    that fails, in one message)."""
    served: dict[str, str] = {}
    problems: list[str] = []

    async def ask(url: str) -> None:
        try:
            served[url] = await _first_model(http, url, timeout_s, headers)
        except FleetError as exc:
            problems.append(str(exc))

    async with anyio.create_task_group() as group:
        for url in dict.fromkeys(urls):
            group.start_soon(ask, url)
    if problems:
        raise FleetError("; ".join(problems))
    return served


async def _first_model(
    http: HTTPTransport, url: str, timeout_s: float, headers: Mapping[str, str] | None
) -> str:
    """The model a server serves (for requests that must name one), and the proof that
    it is an OpenAI-compatible server that answers."""
    models_url = url.rstrip("/") + "/v1/models"
    with anyio.move_on_after(timeout_s):
        try:  # the transport's own limit is a backstop: this scope's is the one meant
            if headers:
                status, content = await _get_with(headers, models_url, timeout_s + 5)
            else:
                status, content = await http.get(models_url, timeout_s=timeout_s + 5)
        except TransportError as exc:
            raise FleetError(f"cannot reach {url}: {exc}") from None
        return _model_in_listing(url, status, content)
    raise FleetError(
        f"{url} never answered: no reply to GET /v1/models in {timeout_s:g} s "
        "(is it still starting, or not an HTTP server?)"
    )


async def _get_with(headers: Mapping[str, str], url: str, timeout_s: float) -> tuple[int, bytes]:
    """A GET with ``headers`` (the transports' GET sends none: it only probes servers)."""
    async with httpx.AsyncClient(headers=dict(headers), timeout=timeout_s) as client:
        try:
            response = await client.get(url)
        except httpx.HTTPError as exc:
            raise TransportError(f"{type(exc).__name__}: {exc}") from exc
    return response.status_code, response.content


def _model_in_listing(url: str, status: int, content: bytes) -> str:
    """The first model of a ``/v1/models`` answer, or why it is not an OpenAI server's."""
    if status != 200:
        raise FleetError(
            f"{url} is not an OpenAI-compatible server: GET /v1/models answered HTTP {status}"
            f" ({_glimpse(content)})"
        )
    try:
        models = msgspec.json.decode(content, type=_Models).data
    except msgspec.DecodeError:
        raise FleetError(
            f"{url} is not an OpenAI-compatible server: GET /v1/models answered "
            f"{_glimpse(content)}, not a model list"
        ) from None
    if not models or not isinstance(models[0].get("id"), str):
        raise FleetError(f"{url}/v1/models lists no model; pass --model")
    return str(models[0]["id"])


def _glimpse(content: bytes) -> str:
    """The start of an answer, on one line."""
    text = " ".join(content[:200].decode("utf-8", "replace").split())
    return repr(text[:80] + ("..." if len(text) > 80 else "")) if text else "an empty body"
