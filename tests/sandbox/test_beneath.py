"""Host-side file access under a sandbox's directory that a command's symlinks cannot
redirect, on a real directory: links are refused or replaced, never followed."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from libra.envs import SandboxError
from libra.sandbox._beneath import read_beneath, write_beneath


@pytest.fixture
def root(tmp_path: Path) -> Path:
    (tmp_path / "work").mkdir()
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "secret").write_bytes(b"host data")
    return tmp_path / "work"


def test_files_round_trip_and_missing_directories_are_made_shared(root: Path) -> None:
    write_beneath(root, ["pkg", "sub", "data.txt"], b"payload", 0o640)
    assert read_beneath(root, ["pkg", "sub", "data.txt"]) == b"payload"
    assert stat.S_IMODE((root / "pkg" / "sub" / "data.txt").stat().st_mode) == 0o640
    # Made by the host, used by the sandbox's user: world-writable, sticky.
    assert stat.S_IMODE((root / "pkg").stat().st_mode) == 0o1777
    write_beneath(root, ["pkg", "sub", "data.txt"], b"new", 0o600)
    assert read_beneath(root, ["pkg", "sub", "data.txt"]) == b"new"
    assert sorted(os.listdir(root / "pkg" / "sub")) == ["data.txt"]  # no temporary left


def test_a_linked_file_is_not_read_and_is_replaced_not_followed_on_write(root: Path) -> None:
    secret = root.parent / "outside" / "secret"
    (root / "link").symlink_to(secret)
    with pytest.raises(OSError):
        read_beneath(root, ["link"])
    write_beneath(root, ["link"], b"env data", 0o644)
    assert not (root / "link").is_symlink() and (root / "link").read_bytes() == b"env data"
    assert secret.read_bytes() == b"host data"


def test_a_linked_directory_on_the_way_is_refused_both_ways(root: Path) -> None:
    (root / "dir").symlink_to(root.parent / "outside")
    with pytest.raises(OSError):
        read_beneath(root, ["dir", "secret"])
    with pytest.raises(OSError):
        write_beneath(root, ["dir", "evil"], b"x", 0o644)
    assert sorted(os.listdir(root.parent / "outside")) == ["secret"]


def test_a_fifo_or_a_directory_is_not_a_file_to_read_and_leaves_no_fd_open(root: Path) -> None:
    os.mkfifo(root / "fifo")
    (root / "folder").mkdir()
    open_fds = len(os.listdir("/proc/self/fd"))
    for name in ("fifo", "folder"):  # a FIFO must not hang the reader
        with pytest.raises(SandboxError, match="is not a regular file"):
            read_beneath(root, [name])
    assert len(os.listdir("/proc/self/fd")) == open_fds
    with pytest.raises(FileNotFoundError):
        read_beneath(root, ["missing", "file"])
