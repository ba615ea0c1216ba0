"""Host-side file access under a sandbox's directory that its commands' symlinks cannot
redirect: every path component is opened with ``O_NOFOLLOW`` relative to its parent, and
writes land through a rename, so a link planted by a command never sends the env's
reads or writes elsewhere on the host."""

from __future__ import annotations

import os
import secrets
import stat
from collections.abc import Sequence
from pathlib import Path

from libra.envs import SandboxError

READ_FILE_LIMIT = 256 * 1024 * 1024


def _open_parent(root: Path, parts: Sequence[str], *, create: bool) -> int:
    """An fd of the directory holding ``parts[-1]``, never following a symlink on the way."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    for part in parts[:-1]:
        fd = _enter(fd, part, create=create)
    return fd


def _enter(parent_fd: int, name: str, *, create: bool) -> int:
    """Open directory ``name`` under ``parent_fd`` (made with mode 1777 if missing); closes
    ``parent_fd``."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        try:
            return os.open(name, flags, dir_fd=parent_fd)
        except FileNotFoundError:
            if not create:
                raise
        os.mkdir(name, 0o700, dir_fd=parent_fd)
        child = os.open(name, flags, dir_fd=parent_fd)
        os.fchmod(child, 0o1777)
        return child
    finally:
        os.close(parent_fd)


def write_beneath(root: Path, parts: Sequence[str], data: bytes, mode: int) -> None:
    dir_fd = _open_parent(root, parts, create=True)
    try:
        temporary = f".{parts[-1]}.libra-{secrets.token_hex(4)}"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        file_fd = os.open(temporary, flags, 0o600, dir_fd=dir_fd)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(file_fd, view) :]
            os.fchmod(file_fd, mode)
        finally:
            os.close(file_fd)
        # rename replaces whatever a command left at the name, a symlink included.
        os.rename(temporary, parts[-1], src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    finally:
        os.close(dir_fd)


def read_beneath(root: Path, parts: Sequence[str]) -> bytes:
    dir_fd = _open_parent(root, parts, create=False)
    try:
        # O_NONBLOCK: a FIFO planted by a command must not hang the env.
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        file_fd = os.open(parts[-1], flags, dir_fd=dir_fd)
    finally:
        os.close(dir_fd)
    try:
        _check_readable(file_fd, parts[-1])  # before fdopen, which leaks a directory's fd
    except SandboxError:
        os.close(file_fd)
        raise
    with os.fdopen(file_fd, "rb") as handle:
        return handle.read(READ_FILE_LIMIT)


def _check_readable(file_fd: int, name: str) -> None:
    info = os.fstat(file_fd)
    if not stat.S_ISREG(info.st_mode):
        raise SandboxError(f"{name!r} is not a regular file")
    if info.st_size > READ_FILE_LIMIT:
        raise SandboxError(f"{name!r} is larger than {READ_FILE_LIMIT} bytes")
