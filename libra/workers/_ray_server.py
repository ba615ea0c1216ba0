"""A serving instance on Ray: an actor that owns a vLLM server (see ``_ray``)."""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio

from libra.serving import VLLMServer, VLLMServerConfig

if TYPE_CHECKING:
    pass

from libra.workers._ray import import_ray, ray_get

_EXIT_POLL_S = 2.0  # how often a supervised Ray server is asked whether it runs
_STOP_WAIT_S = 60.0


class ServerActor:
    """A vLLM server owned by a Ray actor (made remote by :func:`_server_class`): when
    the actor dies, the server's guard stops the server's whole tree (``_vllm``)."""

    def __init__(self, model: Path, served_model_name: str, config: VLLMServerConfig) -> None:
        self.server = VLLMServer(model, served_model_name=served_model_name, config=config)

    def start(self) -> tuple[str, Path | None, str]:
        """Start the server; its URL as the driver reaches it, its log file, and the id of
        the Ray node it runs on."""
        import ray

        self.server.start()
        host = self.server.config.host
        if host in ("0.0.0.0", "::"):  # listening on every interface: the node's address
            host = ray.util.get_node_ip_address()
        node_id: str = ray.get_runtime_context().get_node_id()
        return f"http://{host}:{self.server.port}", self.server.log_file, node_id

    def reload_weights_from(self, folder: Path, timeout_s: float) -> None:
        self.server.reload_weights_from(folder, timeout_s)

    def stop(self) -> None:
        self.server.stop()

    def is_running(self) -> bool:
        return self.server.is_running


@cache
def _server_class() -> Any:
    return import_ray().remote(ServerActor)


class RayServer:
    """A serving instance: a :class:`ServerActor` in its first worker's bundle (an
    instance over several workers: in the first one's, the others' held by the group)."""

    def __init__(
        self, model: Path, served_model_name: str, config: VLLMServerConfig, options: dict[str, Any]
    ) -> None:
        self.model, self.served_model_name, self.config = model, served_model_name, config
        self.options = options
        self._actor: Any = None
        self._url: str | None = None
        self._log_file: Path | None = None
        #: The Ray node it runs on (its hex id), once started: where its log file is.
        self.node_id: str | None = None

    @property
    def url(self) -> str:
        if self._url is None:
            raise RuntimeError("the instance has not been started")
        return self._url

    @property
    def log_file(self) -> Path | None:
        """On the node that runs it."""
        return self._log_file

    async def astart(self) -> None:
        actor_class = _server_class()
        self._actor = actor_class.options(**self.options).remote(
            self.model, self.served_model_name, self.config
        )
        try:
            self._url, self._log_file, self.node_id = await ray_get(self._actor.start.remote())
        except BaseException:
            self._kill()  # its guard stops the server's tree as the actor dies
            raise

    async def areload_weights_from(
        self, weights_path: str | Path, timeout_s: float = 300.0
    ) -> None:
        await ray_get(self._actor.reload_weights_from.remote(Path(weights_path), timeout_s))

    async def astop(self) -> None:
        if self._actor is None:
            return
        try:
            # The server's own stop is bounded (grace, then SIGKILL); past that, the kill
            # below ends the actor, and its server's guard the server's tree.
            with anyio.move_on_after(_STOP_WAIT_S, shield=True):
                await ray_get(self._actor.stop.remote())
        finally:
            self._kill()

    async def wait_exited(self) -> None:
        """Return once the server or its actor is gone (polled: an actor's server may
        run on another node, so there is no process to wait on here)."""
        while self._actor is not None:
            try:
                if not await ray_get(self._actor.is_running.remote()):
                    return
            except Exception:  # the actor died with it (Ray's RayActorError)
                return
            await anyio.sleep(_EXIT_POLL_S)

    def _kill(self) -> None:
        if self._actor is not None:
            import_ray().kill(self._actor, no_restart=True)
            self._actor = None
