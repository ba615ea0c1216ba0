"""Sandbox images without a registry: mirror discovery, paths, idempotent builds, contents."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

from libra.envs import SandboxError
from libra.sandbox import (
    ImageBuildError,
    build_image,
    build_rootfs,
    connect_docker,
    debian_mirror,
    rootfs_dir,
)
from libra.sandbox._images import _split_reference, _strip
from tests._helpers import unavailable


def _apt_dir(tmp_path: Path, files: dict[str, str]) -> Path:
    apt = tmp_path / "apt"
    (apt / "sources.list.d").mkdir(parents=True)
    for name, text in files.items():
        (apt / name).write_text(text)
    return apt


def test_mirror_from_deb822_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LIBRA_DEBIAN_MIRROR", raising=False)
    apt = _apt_dir(
        tmp_path,
        {
            "sources.list.d/debian.sources": (
                "Types: deb\n# a comment\nURIs: http://mirror.example/debian\n"
                "Suites: bookworm bookworm-updates\nComponents: main\n\n"
                "Types: deb\nURIs: http://mirror.example/debian-security\n"
                "Suites: bookworm-security\nComponents: main\n"
            ),
            "sources.list.d/other.list.disabled": "deb http://wrong.example/debian bookworm main\n",
        },
    )
    assert debian_mirror("bookworm", apt) == "http://mirror.example/debian"


def test_mirror_from_one_line_sources_with_options(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("LIBRA_DEBIAN_MIRROR", raising=False)
    apt = _apt_dir(
        tmp_path,
        {
            "sources.list": (
                "# deb http://commented.example/debian bookworm main\n"
                "deb-src http://src.example/debian bookworm main\n"
                "deb [arch=amd64 signed-by=/k.gpg] http://one.example/debian bookworm main\n"
            )
        },
    )
    assert debian_mirror("bookworm", apt) == "http://one.example/debian"


def test_mirror_falls_back_to_any_debian_archive_then_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("LIBRA_DEBIAN_MIRROR", raising=False)
    apt = _apt_dir(tmp_path, {"sources.list": "deb http://old.example/debian bullseye main\n"})
    assert debian_mirror("bookworm", apt) == "http://old.example/debian"
    empty = _apt_dir(tmp_path / "empty", {})
    with pytest.raises(ImageBuildError, match="LIBRA_DEBIAN_MIRROR"):
        debian_mirror("bookworm", empty)
    monkeypatch.setenv("LIBRA_DEBIAN_MIRROR", "http://override.example/debian")
    assert debian_mirror("bookworm", empty) == "http://override.example/debian"


def test_this_machine_has_a_mirror() -> None:
    if not Path("/etc/apt").is_dir():
        pytest.skip("not a Debian-family machine")
    assert debian_mirror().startswith(("http://", "https://", "file:"))


def test_paths_follow_libra_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LIBRA_HOME", str(tmp_path))
    assert rootfs_dir("libra/python") == tmp_path / "images" / "libra" / "python"
    assert rootfs_dir("libra/python:latest") == rootfs_dir("libra/python")


def test_references_split_into_repository_and_tag() -> None:
    assert _split_reference("libra/python") == ("libra/python", "latest")
    assert _split_reference("libra/python:3.11") == ("libra/python", "3.11")
    assert _split_reference("registry:5000/libra/python") == (
        "registry:5000/libra/python",
        "latest",
    )


def test_unknown_images_have_no_recipe() -> None:
    with pytest.raises(ImageBuildError, match="known images: libra/python"):
        build_rootfs("libra/unknown")
    assert issubclass(ImageBuildError, SandboxError)


@pytest.mark.slow
def test_rootfs_has_python_with_its_standard_library() -> None:
    if os.geteuid() != 0 or shutil.which("debootstrap") is None:
        unavailable("building a root filesystem needs root and debootstrap")
    rootfs = build_rootfs("libra/python")  # once per machine (~1-2 min), then instant
    started = time.monotonic()
    assert build_rootfs("libra/python") == rootfs
    assert time.monotonic() - started < 1.0  # idempotent
    stdlib = rootfs / "usr" / "lib" / "python3.11"
    for module in ("json", "unittest", "asyncio", "subprocess.py"):
        assert (stdlib / module).exists(), module
    assert (rootfs / "usr" / "bin" / "timeout").exists()  # Docker exec timeouts rely on it
    assert not any((rootfs / "usr" / "share" / "doc").iterdir())  # stripped


@pytest.mark.slow
def test_docker_image_is_built_once_and_runs_python() -> None:
    try:
        client = connect_docker()
    except SandboxError as error:
        unavailable(f"no Docker engine reachable (run scripts/ensure-docker.sh as root): {error}")
    first = build_image("libra/python", client=client)
    assert first.source in {"existing", "pull", "debootstrap"}
    again = build_image("libra/python", client=client)
    assert again.source == "existing" and again.seconds < 2.0
    output = client.containers.run(
        "libra/python",
        ["python3", "-c", "import json, unittest, sys; print(sys.version_info[:2])"],
        remove=True,
        network_mode="none",
        user="65534:65534",
    )
    assert output.decode().strip() == "(3, 11)"
    client.close()


def test_a_built_root_filesystem_carries_no_trace_of_the_building_machine(
    tmp_path: Path,
) -> None:
    etc = tmp_path / "etc"
    etc.mkdir()
    (etc / "hostname").write_text("build-host\n")
    (etc / "resolv.conf").symlink_to("/etc/resolv.conf")  # the host's, through a link
    _strip(tmp_path)
    assert (etc / "hostname").read_text() == "sandbox\n"
    assert not (etc / "resolv.conf").is_symlink()
    assert (etc / "resolv.conf").read_text() == ""
    assert "build-host" not in (etc / "hosts").read_text()
