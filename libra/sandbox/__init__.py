"""Real sandboxes behind Libra's sandbox protocol (:mod:`libra.envs`).

- :class:`DockerSandboxProvider`: warm pools of locked-down Docker containers.
- :class:`BwrapSandboxProvider`: bubblewrap, for machines without Docker.
- :func:`build_image` / :func:`build_rootfs`: the sandbox images, built without a registry.

Command line: ``libra images build|reap``; ``libra bench sandbox`` measures them.
"""

from typing import TYPE_CHECKING

from libra.sandbox._bwrap import BwrapSandbox, BwrapSandboxProvider, reap_stale_workdirs
from libra.sandbox._docker_container import PoolStats, connect_docker, reap_stale_containers
from libra.sandbox._docker_pool import DockerSandboxProvider
from libra.sandbox._docker_sandbox import DockerSandbox
from libra.sandbox._images import (
    RECIPES,
    BuiltImage,
    ImageBuildError,
    ImageRecipe,
    build_image,
    build_rootfs,
    debian_mirror,
    rootfs_dir,
)

__all__ = [
    "RECIPES",
    "BuiltImage",
    "BwrapSandbox",
    "BwrapSandboxProvider",
    "DockerSandbox",
    "DockerSandboxProvider",
    "ImageBuildError",
    "ImageRecipe",
    "PoolStats",
    "build_image",
    "build_rootfs",
    "connect_docker",
    "debian_mirror",
    "reap_stale_containers",
    "reap_stale_workdirs",
    "rootfs_dir",
]

if TYPE_CHECKING:  # mypy proves that both providers implement libra.envs' protocol
    from libra.envs import Sandbox, SandboxProvider

    def _implements_protocol(
        docker_provider: DockerSandboxProvider,
        bwrap_provider: BwrapSandboxProvider,
        docker_box: DockerSandbox,
        bwrap_box: BwrapSandbox,
    ) -> tuple[SandboxProvider, SandboxProvider, Sandbox, Sandbox]:
        return docker_provider, bwrap_provider, docker_box, bwrap_box
