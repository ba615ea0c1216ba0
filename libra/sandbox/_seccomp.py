"""The seccomp filter of bubblewrap sandboxes, compiled with the system's libseccomp.

Every system call is allowed except those a sandboxed program has no business making and
that widen the kernel's attack surface: new namespaces and mounts, the kernel keyring, BPF,
perf events, userfaultfd, io_uring, modules, kexec, swap, reboot, the clock, the kernel log,
another process's memory, file handles. They fail with EPERM. Docker's default profile
refuses the same (and more) in Docker sandboxes. libseccomp also makes the filter refuse
system calls of other architectures (32-bit and x32 entry points), which could otherwise
bypass a filter written for the native one.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import logging
import os
import tempfile

__all__ = ["DENIED_SYSCALLS", "program_fd", "seccomp_program"]

_log = logging.getLogger(__name__)

DENIED_SYSCALLS = (
    # namespaces and mounts
    "unshare",
    "setns",
    "mount",
    "umount2",
    "pivot_root",
    "chroot",
    "fsopen",
    "fsconfig",
    "fsmount",
    "fspick",
    "move_mount",
    "open_tree",
    "mount_setattr",
    # the kernel keyring, BPF, perf, userfaultfd, io_uring
    "add_key",
    "request_key",
    "keyctl",
    "bpf",
    "perf_event_open",
    "userfaultfd",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    # the machine itself
    "init_module",
    "finit_module",
    "delete_module",
    "kexec_load",
    "kexec_file_load",
    "reboot",
    "swapon",
    "swapoff",
    "syslog",
    "acct",
    "quotactl",
    "settimeofday",
    "clock_settime",
    "clock_adjtime",
    "adjtimex",
    "iopl",
    "ioperm",
    "vhangup",
    "lookup_dcookie",
    "fanotify_init",
    # other processes' memory, files by handle, NUMA placement
    "process_vm_readv",
    "process_vm_writev",
    "open_by_handle_at",
    "name_to_handle_at",
    "mbind",
    "migrate_pages",
    "move_pages",
    "set_mempolicy",
)

_SCMP_ACT_ALLOW = 0x7FFF0000
_SCMP_ACT_ERRNO = 0x00050000


@functools.cache
def seccomp_program() -> bytes | None:
    """The compiled BPF program for bwrap's ``--seccomp``; None (logged) without libseccomp."""
    library_name = ctypes.util.find_library("seccomp")
    if library_name is None:
        _log.warning("libseccomp is not installed: bwrap sandboxes run without a seccomp filter")
        return None
    lib = ctypes.CDLL(library_name, use_errno=True)
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_rule_add.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    context = lib.seccomp_init(_SCMP_ACT_ALLOW)
    if not context:
        raise OSError("seccomp_init failed")
    try:
        for name in DENIED_SYSCALLS:
            number = lib.seccomp_syscall_resolve_name(name.encode())
            if number < 0:  # not a system call of this architecture
                continue
            if lib.seccomp_rule_add(context, _SCMP_ACT_ERRNO | errno.EPERM, number, 0) < 0:
                raise OSError(f"seccomp_rule_add({name}) failed")
        return _export(lib, context)
    finally:
        lib.seccomp_release(context)


def _export(lib: ctypes.CDLL, context: int) -> bytes:
    with tempfile.TemporaryFile() as program:
        if lib.seccomp_export_bpf(context, program.fileno()) < 0:
            raise OSError("seccomp_export_bpf failed")
        program.seek(0)
        return program.read()


def program_fd(program: bytes) -> int:
    """A pipe's read end holding ``program``, for one bwrap to read (the caller closes it)."""
    read_end, write_end = os.pipe()
    try:
        os.write(write_end, program)  # a few KiB: well within a pipe's buffer
    finally:
        os.close(write_end)
    return read_end
