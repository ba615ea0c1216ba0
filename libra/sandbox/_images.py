"""Sandbox images built without an image registry.

An image is described by an :class:`ImageRecipe`. :func:`build_image` makes it available to
Docker under its name, idempotently: an existing image is kept unless ``force``; otherwise it
first tries ``docker pull`` of the recipe's public image (fast on machines with a registry) and,
when that fails, builds a Debian root filesystem with ``debootstrap --variant=minbase`` from the
machine's configured Debian mirror and imports it with the Engine API (``docker import``).

The root filesystem stays on disk under ``$LIBRA_HOME/images/<name>`` (``LIBRA_HOME`` defaults
to ``~/.cache/libra``) so that bubblewrap sandboxes run the very same interpreter as Docker
ones (:func:`build_rootfs` makes only that directory, for machines without Docker).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from libra._home import libra_home
from libra.envs import SandboxError

if TYPE_CHECKING:
    import docker

__all__ = [
    "RECIPES",
    "BuiltImage",
    "ImageBuildError",
    "ImageRecipe",
    "build_image",
    "build_rootfs",
    "debian_mirror",
    "image_exists",
    "rootfs_dir",
]

# The environment an imported root filesystem lacks (an image made by `docker import` has no
# config); the entrypoint keeps a pooled container alive until it is removed.
_IMPORT_CHANGES = (
    "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "ENV LANG=C.UTF-8",
    'CMD ["sleep", "infinity"]',
)

# What a sandbox never needs; removing it makes every container start copy less (Docker's vfs
# storage driver copies the whole image per container).
_STRIPPED_PATHS = (
    "usr/share/doc",
    "usr/share/man",
    "usr/share/info",
    "usr/share/locale",
    "var/cache/apt/archives",
    "var/lib/apt/lists",
    "var/cache/debconf",
)


# What an image's /etc says about its machine: nothing of the one that built it.
_NEUTRAL_IDENTITY = {
    "hostname": "sandbox\n",
    "hosts": "127.0.0.1\tlocalhost\n::1\tlocalhost\n",
    "resolv.conf": "",
}


class ImageBuildError(SandboxError):
    """A sandbox image or root filesystem could not be built."""


@dataclass(frozen=True, slots=True)
class ImageRecipe:
    """How to obtain one sandbox image: a public image to pull, else a Debian bootstrap."""

    name: str
    suite: str = "bookworm"
    packages: tuple[str, ...] = ("python3",)
    pull_ref: str | None = "python:3.11-slim"


# `python3` (rather than python3-minimal) brings the whole standard library: json, unittest,
# asyncio... which hidden unit tests and contributed envs rely on.
RECIPES: Mapping[str, ImageRecipe] = {
    "libra/python": ImageRecipe("libra/python"),
}


@dataclass(frozen=True, slots=True)
class BuiltImage:
    """The outcome of :func:`build_image`."""

    name: str
    source: Literal["existing", "pull", "debootstrap"]
    rootfs: Path | None
    seconds: float


def rootfs_dir(name: str) -> Path:
    """Where the root filesystem of image ``name`` lives (it may not exist yet)."""
    return libra_home() / "images" / _repository(name).replace(":", "_")


def recipe_for(name: str) -> ImageRecipe:
    try:
        return RECIPES[_repository(name)]
    except KeyError:
        known = ", ".join(sorted(RECIPES))
        raise ImageBuildError(f"no recipe for image {name!r}; known images: {known}") from None


# ---------------------------------------------------------------------------------------------
# Debian mirror discovery


def debian_mirror(suite: str = "bookworm", apt_dir: Path = Path("/etc/apt")) -> str:
    """The Debian archive URI this machine's apt uses for ``suite``.

    ``LIBRA_DEBIAN_MIRROR`` overrides it. Both apt source formats are read: one-line ``.list``
    files and deb822 ``.sources`` files. An entry for ``suite`` itself wins; failing that, any
    entry whose URI path ends in ``/debian`` (e.g. on a machine of another Debian release).
    """
    override = os.environ.get("LIBRA_DEBIAN_MIRROR")
    if override:
        return override
    entries = list(_apt_entries(apt_dir))
    for uri, suites in entries:
        if suite in suites:
            return uri
    for uri, _ in entries:
        if uri.rstrip("/").endswith("/debian"):
            return uri
    raise ImageBuildError(
        f"no Debian mirror for {suite!r} found in {apt_dir}/sources.list(.d); "
        "set LIBRA_DEBIAN_MIRROR to a Debian archive URI"
    )


def _apt_entries(apt_dir: Path) -> Iterator[tuple[str, list[str]]]:
    """(URI, suites) of every enabled binary ("deb") source, in apt's reading order."""
    main_list = apt_dir / "sources.list"
    if main_list.is_file():
        yield from _one_line_entries(main_list.read_text(errors="replace"))
    parts = apt_dir / "sources.list.d"
    if not parts.is_dir():
        return
    for path in sorted(parts.iterdir()):
        if path.suffix == ".list":
            yield from _one_line_entries(path.read_text(errors="replace"))
        elif path.suffix == ".sources":
            yield from _deb822_entries(path.read_text(errors="replace"))


def _one_line_entries(text: str) -> Iterator[tuple[str, list[str]]]:
    for raw in text.splitlines():
        line = re.sub(r"\[[^]]*\]", " ", raw.split("#", 1)[0]).split()
        if len(line) >= 3 and line[0] == "deb":
            yield line[1], [line[2]]


def _deb822_entries(text: str) -> Iterator[tuple[str, list[str]]]:
    for stanza in re.split(r"\n\s*\n", text):
        fields: dict[str, str] = {}
        for raw in stanza.splitlines():
            if raw.startswith("#") or ":" not in raw or raw[:1].isspace():
                continue
            key, value = raw.split(":", 1)
            fields[key.strip().lower()] = value.strip()
        if "deb" not in fields.get("types", "").split():
            continue
        if fields.get("enabled", "yes").lower() == "no":
            continue
        suites = fields.get("suites", "").split()
        for uri in fields.get("uris", "").split():
            yield uri, suites


# ---------------------------------------------------------------------------------------------
# Root filesystem


def build_rootfs(name: str = "libra/python", *, force: bool = False) -> Path:
    """Bootstrap the Debian root filesystem of image ``name`` (kept if present, unless ``force``).

    Needs root and ``debootstrap``; takes ~30-60 s and ~200 MB. Safe against concurrent
    callers (a lock file) and interrupted runs (built in a temporary directory, then renamed).
    """
    recipe = recipe_for(name)
    target = rootfs_dir(name)
    target.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(target.with_name(target.name + ".lock")):
        if _rootfs_complete(target) and not force:
            return target
        _check_can_bootstrap()
        staging = target.with_name(f".{target.name}.tmp-{os.getpid()}")
        shutil.rmtree(staging, ignore_errors=True)
        try:
            _debootstrap(recipe, staging)
            _strip(staging)
            (staging / ".libra-image").write_text(f"{recipe}\n")
            _replace_dir(staging, target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target


def _rootfs_complete(path: Path) -> bool:
    return (path / ".libra-image").is_file()


def _check_can_bootstrap() -> None:
    if shutil.which("debootstrap") is None:
        raise ImageBuildError(
            "debootstrap is not installed; install it with `apt-get install -y debootstrap` "
            "(or run scripts/ensure-docker.sh as root)"
        )
    if os.geteuid() != 0:
        raise ImageBuildError("building a root filesystem with debootstrap needs root")


def _debootstrap(recipe: ImageRecipe, into: Path) -> None:
    mirror = debian_mirror(recipe.suite)
    argv = [
        "debootstrap",
        "--variant=minbase",
        f"--include={','.join(recipe.packages)}",
        recipe.suite,
        str(into),
        mirror,
    ]
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-15:])
        raise ImageBuildError(f"debootstrap failed ({done.returncode}) from {mirror}:\n{tail}")


def _strip(rootfs: Path) -> None:
    for relative in _STRIPPED_PATHS:
        directory = rootfs / relative
        if directory.is_dir():
            shutil.rmtree(directory)
            directory.mkdir(mode=0o755)
    # debootstrap copies the building machine's name and resolver into the image.
    for name, text in _NEUTRAL_IDENTITY.items():
        path = rootfs / "etc" / name
        path.unlink(missing_ok=True)  # may be a link to the host's resolver
        path.write_text(text)


def _replace_dir(new: Path, target: Path) -> None:
    if target.exists():
        trash = target.with_name(f".{target.name}.old-{os.getpid()}")
        target.rename(trash)
        shutil.rmtree(trash, ignore_errors=True)
    new.rename(target)


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


# ---------------------------------------------------------------------------------------------
# Docker image


def image_exists(client: docker.DockerClient, name: str) -> bool:
    import docker.errors

    try:
        client.images.get(name)
    except docker.errors.ImageNotFound:
        return False
    return True


def build_image(
    name: str = "libra/python",
    *,
    force: bool = False,
    pull: bool = True,
    pull_timeout_s: float = 30.0,
    client: docker.DockerClient | None = None,
) -> BuiltImage:
    """Make image ``name`` available to Docker; see the module docstring for the strategy."""
    from libra.sandbox._docker_container import connect_docker

    started = time.monotonic()
    recipe = recipe_for(name)
    client = client or connect_docker()
    if image_exists(client, name) and not force:
        return BuiltImage(name, "existing", _existing_rootfs(name), time.monotonic() - started)
    if pull and recipe.pull_ref and _try_pull(recipe.pull_ref, name, pull_timeout_s):
        return BuiltImage(name, "pull", _existing_rootfs(name), time.monotonic() - started)
    rootfs = build_rootfs(name, force=force)
    _import_rootfs(client, rootfs, name)
    return BuiltImage(name, "debootstrap", rootfs, time.monotonic() - started)


def _existing_rootfs(name: str) -> Path | None:
    path = rootfs_dir(name)
    return path if _rootfs_complete(path) else None


def _try_pull(reference: str, name: str, timeout_s: float) -> bool:
    """Pull ``reference`` and tag it ``name``; False when no registry answers in time."""
    import docker
    import docker.errors
    import requests

    repository, _, tag = reference.partition(":")
    # A separate client: its socket timeout bounds a pull that hangs on an unreachable registry.
    client = docker.from_env(timeout=max(1, round(timeout_s)))
    try:
        image = client.images.pull(repository, tag=tag or "latest")
        image.tag(*_split_reference(name))
    except (docker.errors.DockerException, requests.RequestException):
        return False
    finally:
        client.close()
    return True


def _import_rootfs(client: docker.DockerClient, rootfs: Path, name: str) -> None:
    """`tar -C rootfs -c . | docker import - name`, streamed through the Engine API."""
    repository, tag = _split_reference(name)
    # stderr to a file: a pipe nobody reads while the archive streams could fill and stall tar.
    with tempfile.TemporaryFile() as errors:
        tar = subprocess.Popen(
            ["tar", "--numeric-owner", "-C", str(rootfs), "-c", "."],
            stdout=subprocess.PIPE,
            stderr=errors,
        )
        assert tar.stdout is not None
        stdout = tar.stdout

        def chunks() -> Iterator[bytes]:
            while chunk := stdout.read(1 << 20):
                yield chunk

        try:
            client.api.import_image_from_data(
                chunks(), repository=repository, tag=tag, changes=list(_IMPORT_CHANGES)
            )
        finally:
            stdout.close()
            tar.wait()
        if tar.returncode != 0:
            errors.seek(0)
            detail = errors.read().decode(errors="replace")[-500:]
            raise ImageBuildError(f"tar of {rootfs} failed: {detail}")
    if not image_exists(client, name):
        raise ImageBuildError(f"docker import of {rootfs} did not create {name}")


def _repository(name: str) -> str:
    return _split_reference(name)[0]


def _split_reference(name: str) -> tuple[str, str]:
    """("libra/python", "latest") from "libra/python"; a registry port is not a tag."""
    head, _, last = name.rpartition("/")
    if ":" in last:
        last, tag = last.split(":", 1)
        return (f"{head}/{last}" if head else last), tag
    return name, "latest"
