"""Model-written attacks on the sandboxes, each run as ``python_math``'s ``run_python`` runs code.

Every attack is a short Python program fed to ``python3 -`` on stdin in a sandbox made from the
contributed envs' spec, on both backends (``[docker]``, ``[bwrap]``). Each test asserts that
the attack is contained (the host, other trajectories and the next trajectory see nothing of
it) and reported (the exec result says how it ended). The Docker provider keeps one warm
container per spec, so "the next trajectory" really is the same container after its reset.
Bombs stay small and time-limited (the host is shared); the heaviest are marked slow.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import platform
import secrets
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from envs_contrib.python_math import PythonMath
from libra.envs import ExecResult, Sandbox, SandboxProvider
from libra.sandbox import BwrapSandbox, BwrapSandboxProvider, DockerSandbox, DockerSandboxProvider
from tests._helpers import LIST_PROCESSES, assert_hidden_file_is_unreadable, processes_of

pytestmark = pytest.mark.anyio

SPEC = PythonMath.sandbox_spec  # also code_tests': 256 MiB, 1 CPU, 64 pids, 64 MiB work dir
AS_ROOT = os.geteuid() == 0
BACKENDS = [
    pytest.param("docker", marks=pytest.mark.docker),
    pytest.param("bwrap", marks=pytest.mark.bwrap),
]


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module", params=BACKENDS)
async def provider(request: pytest.FixtureRequest) -> AsyncIterator[SandboxProvider]:
    if request.param == "docker":
        client = request.getfixturevalue("docker_client")
        async with DockerSandboxProvider(pool_size=1, client=client) as docker_provider:
            yield docker_provider
    else:
        root = request.getfixturevalue("bwrap_root")
        if not AS_ROOT:
            pytest.skip(
                "without root, bwrap commands run as the env's own uid (docs/guides/sandboxes.md)"
            )
        async with BwrapSandboxProvider(root=root) as bwrap_provider:
            yield bwrap_provider


async def run_python(box: Sandbox, code: str, timeout_s: float = 10.0) -> ExecResult:
    """Run a model's program exactly as ``PythonMath.run_python`` does."""
    return await box.exec(["python3", "-"], stdin=code.encode(), timeout_s=timeout_s)


async def all_gone(uid: int) -> bool:
    """Whether no process of ``uid`` is left once the exiting ones are gone (the host's init
    reaps bwrap's namespace init, which can take a moment here)."""
    for _ in range(60):
        if not processes_of(uid):
            return True
        await anyio.sleep(0.05)
    return False


def report(result: ExecResult) -> Any:
    """The JSON an attack prints on its last line."""
    assert result.stdout.strip(), result
    return json.loads(result.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------ the network


NETWORK_ATTACK = """
import json, socket
out = {}
def attempt(name, connect):
    try:
        connect()
        out[name] = "open"
    except OSError:
        out[name] = "blocked"
attempt("tcp", lambda: socket.create_connection(("1.1.1.1", 443), timeout=2))
attempt("dns", lambda: socket.getaddrinfo("example.com", 443))
udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
attempt("udp", lambda: udp.sendto(b"x", ("8.8.8.8", 53)))
attempt("host_loopback", lambda: socket.create_connection(("127.0.0.1", PORT), timeout=2))
attempt("host_abstract_socket", lambda: socket.socket(socket.AF_UNIX).connect("\\0" + "ABSTRACT"))
print(json.dumps(out))
"""


@contextlib.contextmanager
def host_listeners() -> Iterator[tuple[int, str]]:
    """A TCP port on the host's loopback and an abstract unix socket, both listening."""
    name = f"libra-attack-{secrets.token_hex(4)}"
    with socket.socket() as tcp, socket.socket(socket.AF_UNIX) as unix:
        tcp.bind(("127.0.0.1", 0))
        tcp.listen()
        unix.bind("\0" + name)
        unix.listen()
        yield tcp.getsockname()[1], name


async def test_network_egress_and_host_services_are_unreachable(
    provider: SandboxProvider,
) -> None:
    with host_listeners() as (port, abstract):
        code = NETWORK_ATTACK.replace("PORT", str(port)).replace("ABSTRACT", abstract)
        async with provider.sandbox(SPEC) as box:
            result = await run_python(box, code)
    assert report(result) == dict.fromkeys(
        ["tcp", "dns", "udp", "host_loopback", "host_abstract_socket"], "blocked"
    )


# ---------------------------------------------------------------- hidden tests and host files


HIDDEN_FILE_ATTACK = """
import json, os, shutil
out = {}
for name, attempt in [
    ("open", lambda: open("tests/test_hidden.py").read()),
    ("chmod", lambda: os.chmod("tests/test_hidden.py", 0o644)),
    ("hardlink", lambda: os.link("tests/test_hidden.py", "copy.py")),
    ("copy", lambda: shutil.copy("tests/test_hidden.py", "copy.py")),
    ("replace", lambda: os.replace("mine.py", "tests/test_hidden.py")),
]:
    open("mine.py", "w").write("assert True")
    try:
        attempt()
        out[name] = "done"
    except OSError:
        out[name] = "refused"
print(json.dumps(out))
"""


async def test_hidden_tests_cannot_be_read_or_replaced(provider: SandboxProvider) -> None:
    async with provider.sandbox(SPEC) as box:
        await assert_hidden_file_is_unreadable(box)
        result = await run_python(box, HIDDEN_FILE_ATTACK)
        assert report(result) == dict.fromkeys(
            ["open", "chmod", "hardlink", "copy", "replace"], "refused"
        )
        assert await box.read_file("tests/test_hidden.py") == b"assert solve() == 42\n"


HOST_SECRETS_ATTACK = """
import json, os
canary = "CANARY"
found = []
for root, dirs, files in os.walk("/"):
    if root in ("/proc", "/sys"):
        dirs[:] = []
    found += [os.path.join(root, n) for n in dirs + files if canary in n]
for pid in filter(str.isdigit, os.listdir("/proc")):
    for what in ("cmdline", "environ"):
        try:
            if canary.encode() in open(f"/proc/{pid}/{what}", "rb").read():
                found.append(f"/proc/{pid}/{what}")
        except OSError:
            pass
found += [key for key, value in os.environ.items() if canary in value]
readable = []
for path in ("HOST_FILE", "/etc/shadow", "/root", "/var/run/docker.sock", "/run/docker.sock"):
    try:
        os.listdir(path) if os.path.isdir(path) else open(path, "rb").read(1)
        readable.append(path)
    except OSError:
        pass
print(json.dumps({"found": found, "readable": readable}))
"""


async def test_host_files_processes_and_environment_stay_hidden(
    provider: SandboxProvider, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    canary = f"libra-canary-{secrets.token_hex(6)}"
    secret = tmp_path / f"{canary}.txt"
    secret.write_text(canary)
    secret.chmod(0o644)  # world-readable on the host
    monkeypatch.setenv("LIBRA_ATTACK_SECRET", canary)
    host_process = subprocess.Popen(["sh", "-c", "sleep 60", canary])  # noqa: ASYNC220 (its cmdline)
    try:
        code = HOST_SECRETS_ATTACK.replace("CANARY", canary).replace("HOST_FILE", str(secret))
        async with provider.sandbox(SPEC) as box:
            result = await run_python(box, code, timeout_s=30)
    finally:
        host_process.kill()
        host_process.wait()
    assert report(result) == {"found": [], "readable": []}


PROC_ATTACK = """
import json, os
processes = {}
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        processes[pid] = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\\0", b" ").decode()
    except OSError:
        processes[pid] = None
writes = {}
for path in ("/proc/sys/kernel/hostname", "/proc/sysrq-trigger", "/proc/sys/vm/drop_caches",
             "/sys/kernel/mm/transparent_hugepage/enabled", "/proc/sys/kernel/core_pattern"):
    try:
        with open(path, "w") as target:
            target.write("1")
        writes[path] = "written"
    except OSError:
        writes[path] = "refused"
print(json.dumps({"processes": processes, "writes": writes}))
"""

# What a sandbox's own processes are: its init, the keep-alive, the timeout wrapper, the program.
SANDBOX_PROGRAMS = ("python3 -", "docker-init", "sleep infinity", "timeout -s KILL", "bwrap")


async def test_proc_shows_only_the_sandbox_and_takes_no_writes(provider: SandboxProvider) -> None:
    async with provider.sandbox(SPEC) as box:
        result = await run_python(box, PROC_ATTACK)
    seen = report(result)
    commands = [command for command in seen["processes"].values() if command]
    assert commands and len(commands) <= 5, commands
    assert all(any(p in command for p in SANDBOX_PROGRAMS) for command in commands), commands
    assert set(seen["writes"].values()) == {"refused"}


# -------------------------------------------------------- writes outside the work dir, persistence


PERSIST_ATTACK = """
import ctypes, json, os
marker = "libra-persisted-MARK"
writable = []
for root, dirs, files in os.walk("/"):
    if root in ("/proc", "/sys"):
        dirs[:] = []
        continue
    try:
        with open(os.path.join(root, marker), "w") as planted:
            planted.write("x")
        writable.append(root)
    except OSError:
        pass
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
class Message(ctypes.Structure):
    _fields_ = [("mtype", ctypes.c_long), ("mtext", ctypes.c_char * 16)]
shm = libc.shmget(0x4C1B, 8 << 20, 0o1666)  # IPC_CREAT, readable by all
ctypes.memset(libc.shmat(shm, None, 0), 0x41, 8 << 20)  # and charged to this memory limit
queue = libc.msgget(0x4C1B, 0o1666)
libc.msgsnd(queue, ctypes.byref(Message(1, b"for the next one")), 16, 0)
semaphores = libc.semget(0x4C1B, 1, 0o1666)
posix_queue = libc.mq_open(b"/" + marker.encode(), os.O_CREAT | os.O_RDWR, 0o666, None)
print(json.dumps({"writable": writable, "ipc": [shm, queue, semaphores, posix_queue]}))
"""

FIND_PERSISTED = """
import ctypes, json, os
marker = "libra-persisted-MARK"
found = []
for root, dirs, files in os.walk("/"):
    if root in ("/proc", "/sys"):
        dirs[:] = []
    found += [os.path.join(root, name) for name in files if name == marker]
libc = ctypes.CDLL(None, use_errno=True)
found += [f"sysv {kind}" for kind in ("shm", "msg", "sem")
          if open(f"/proc/sysvipc/{kind}").read().splitlines()[1:]]
found += ["shmget"] if libc.shmget(0x4C1B, 0, 0) >= 0 else []
found += ["mq_open"] if libc.mq_open(b"/" + marker.encode(), os.O_RDONLY) >= 0 else []
if os.path.isdir("/dev/mqueue"):
    found += [f"/dev/mqueue/{name}" for name in os.listdir("/dev/mqueue")]
print(json.dumps(found))
"""

# Where commands may write: the work dir, /tmp and the IPC file systems (all per trajectory).
WRITABLE = ("/work", "/tmp", "/dev/shm", "/dev/mqueue")


async def test_writes_stay_in_the_work_dirs_and_nothing_reaches_the_next_trajectory(
    provider: SandboxProvider,
) -> None:
    marker = secrets.token_hex(4)
    async with provider.sandbox(SPEC) as box:
        planted = report(await run_python(box, PERSIST_ATTACK.replace("MARK", marker)))
        first = box
    writable = planted["writable"]
    assert writable and all(path.startswith(WRITABLE) for path in writable), writable
    assert all(handle >= 0 for handle in planted["ipc"])  # the attack did make its objects
    async with provider.sandbox(SPEC) as box:
        if isinstance(box, DockerSandbox):  # the very container, after the pool's reset
            assert isinstance(first, DockerSandbox) and box.container_id == first.container_id
        left = report(await run_python(box, FIND_PERSISTED.replace("MARK", marker)))
    assert left == []


# --------------------------------------------------------------------------- resource bombs


SPREAD_MEMORY_ATTACK = """
import json, os, time
r, w = os.pipe()
children = []
for i in range(5):
    pid = os.fork()
    if pid == 0:
        block = b"\\1" * (96 << 20)  # written, so really resident
        os.write(w, b"%d " % i)
        time.sleep(30)
        os._exit(0)
    children.append(pid)
time.sleep(4)
os.set_blocking(r, False)
try:
    holding = {int(i) for i in os.read(r, 100).split()}
except BlockingIOError:
    holding = set()
alive = {i for i, pid in enumerate(children) if os.waitpid(pid, os.WNOHANG) == (0, 0)}
for pid in children:
    try:
        os.kill(pid, 9)
    except ProcessLookupError:
        pass
print(json.dumps(len(holding & alive)))
"""


async def test_memory_spread_over_processes_stays_under_the_limit(
    provider: SandboxProvider,
) -> None:
    async with provider.sandbox(SPEC) as box:
        result = await run_python(box, SPREAD_MEMORY_ATTACK, timeout_s=20)
        held_at_once = report(result)
        assert held_at_once * 96 < SPEC.memory_mb, held_at_once  # five would hold 480 MiB
        assert (await run_python(box, "print('alive')")).stdout == "alive\n"


CPU_ATTACK = """
import json, os, time
started = time.monotonic()
children = []
for _ in range(2):
    pid = os.fork()
    if pid == 0:
        while time.monotonic() - started < 2:
            pass
        os._exit(0)
    children.append(pid)
for pid in children:
    os.waitpid(pid, 0)
times = os.times()
cpu = times.children_user + times.children_system
print(json.dumps({"wall": time.monotonic() - started, "cpu": cpu}))
"""


async def test_cpu_use_is_held_to_the_spec(provider: SandboxProvider) -> None:
    spec = dataclasses.replace(SPEC, cpus=0.2)
    async with provider.sandbox(spec) as box:
        used = report(await run_python(box, CPU_ATTACK))
    # Two busy processes for 2 s would take up to 4 CPU-seconds; the spec grants 0.4.
    assert used["cpu"] <= spec.cpus * used["wall"] * 1.25 + 0.1, used


@pytest.mark.slow
async def test_fork_bomb_is_contained_and_the_host_stays_responsive(
    provider: SandboxProvider,
) -> None:
    bomb = "import os\nwhile True:\n    try: os.fork()\n    except OSError: pass"
    async with provider.sandbox(SPEC) as box:
        started = time.monotonic()
        result = await run_python(box, bomb, timeout_s=3)
        assert result.timed_out and time.monotonic() - started < 4.5
        with anyio.fail_after(5):  # the host still starts processes at once
            assert (await anyio.run_process(["true"])).returncode == 0
        assert (await run_python(box, "print('alive')")).stdout == "alive\n"


FILL_DISK_ATTACK = """
import json, os
written = {}
for directory in ("/work", "/tmp", "/dev/shm", "/"):
    total = 0
    try:
        for n in range(1000):
            with open(f"{directory}/fill-{n}", "wb") as f:
                for _ in range(4):
                    f.write(b"\\0" * (1 << 20))
                    total += 1 << 20
    except OSError as error:
        written[directory] = [total >> 20, error.errno]
print(json.dumps(written))
"""


async def test_filling_the_disk_stops_at_the_caps(provider: SandboxProvider) -> None:
    async with provider.sandbox(SPEC) as box:
        result = await run_python(box, FILL_DISK_ATTACK, timeout_s=30)
        filled = report(result)
        assert (await run_python(box, "print('alive')")).stdout == "alive\n"
    assert filled["/work"][0] <= SPEC.workdir_size_mb
    assert filled["/tmp"][0] <= SPEC.workdir_size_mb
    assert filled["/dev/shm"][0] <= 64  # Docker's default; bwrap's is smaller
    assert filled["/"][0] == 0  # read-only


# ------------------------------------------------------------------ time, signals and output


async def test_sleeping_forever_is_stopped_and_reported(provider: SandboxProvider) -> None:
    code = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(1e9)"
    async with provider.sandbox(SPEC) as box:
        started = time.monotonic()
        result = await run_python(box, code, timeout_s=2)
        assert time.monotonic() - started < 3.5
        assert result.timed_out and result.status == "timeout"
        assert (await run_python(box, "print('alive')")).stdout == "alive\n"


KILL_ATTACK = """
import os, signal
for target in (-1, 1, HOST_PID):
    try:
        os.kill(target, signal.SIGKILL)
    except OSError:
        pass
print("done")
"""


async def test_killing_other_processes_reaches_only_the_sandbox(
    provider: SandboxProvider,
) -> None:
    host_process = subprocess.Popen(["sleep", "60"])  # noqa: ASYNC220 (a host bystander)
    neighbour: list[ExecResult] = []

    async def run_neighbour(other: Sandbox) -> None:
        neighbour.append(await other.exec(["sh", "-c", "sleep 3; echo fine"], timeout_s=10))

    try:
        async with provider.sandbox(SPEC) as box, provider.sandbox(SPEC) as other:
            async with anyio.create_task_group() as group:
                group.start_soon(run_neighbour, other)
                await anyio.sleep(1)
                code = KILL_ATTACK.replace("HOST_PID", str(host_process.pid))
                await run_python(box, code)  # it may well kill itself
            assert (await run_python(box, "print('alive')")).stdout == "alive\n"
        assert host_process.poll() is None
        assert neighbour[0].stdout == "fine\n"
    finally:
        host_process.kill()
        host_process.wait()


async def test_huge_output_is_capped_and_reported(provider: SandboxProvider) -> None:
    code = (
        "import os, sys\nfor _ in range(200):\n"
        "    sys.stdout.buffer.write(b'\\xff' * (1 << 18))\n"
        "    sys.stderr.write('e' * (1 << 18))"
    )
    async with provider.sandbox(SPEC) as box:
        started = time.monotonic()
        result = await run_python(box, code, timeout_s=20)
        env = PythonMath()
        env.sandbox = box
        seen = await env.run_python(code)  # what the model reads
    assert time.monotonic() - started < 20
    assert result.truncated and result.exit_code == 0
    assert len(result.stdout.encode()) <= 3 * SPEC.output_limit_bytes  # U+FFFD per bad byte
    assert len(result.stderr) == SPEC.output_limit_bytes
    assert len(seen.content) < 5000


DAEMON_ATTACK = """
import os, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        for fd in range(3):
            os.close(fd)
        while True:
            with open("/work/heartbeat", "a") as beat:
                beat.write(".")
            time.sleep(0.05)
    os._exit(0)
time.sleep(0.3)
print("started")
"""


# A daemon that, after the call, writes what Docker's sandbox prints when a call left nothing.
FORGING_DAEMON_ATTACK = DAEMON_ATTACK.replace(
    """        for fd in range(3):
            os.close(fd)
""",
    """        os.close(0)
        os.close(1)
        time.sleep(0.6)
        os.write(2, b"\\0libra-leftovers=0")
        os.close(2)
""",
)


async def heartbeats(box: Sandbox) -> int:
    try:
        return len(await box.read_file("heartbeat"))
    except FileNotFoundError:
        return 0


@pytest.mark.parametrize("attack", [DAEMON_ATTACK, FORGING_DAEMON_ATTACK], ids=["plain", "forging"])
async def test_daemons_die_with_the_call(provider: SandboxProvider, attack: str) -> None:
    async with provider.sandbox(SPEC) as box:
        assert (await run_python(box, attack)).stdout == "started\n"
        beats = await heartbeats(box)
        await anyio.sleep(0.8)
        assert await heartbeats(box) == beats  # nobody writes it any more
        left = await box.exec(LIST_PROCESSES, timeout_s=10)
        assert "python3" not in left.stdout
        if isinstance(box, BwrapSandbox) and box.host_uid is not None:
            assert await all_gone(box.host_uid)


SOCKETS_ATTACK = """
import json, os, stat
found = []
for root, dirs, files in os.walk("/"):
    if root in ("/proc", "/sys"):
        dirs[:] = []
    for name in files:
        try:
            if stat.S_ISSOCK(os.lstat(os.path.join(root, name)).st_mode):
                found.append(os.path.join(root, name))
        except OSError:
            pass
print(json.dumps(found))
"""


async def test_no_host_socket_is_mounted(provider: SandboxProvider) -> None:
    async with provider.sandbox(SPEC) as box:
        assert report(await run_python(box, SOCKETS_ATTACK, timeout_s=30)) == []


# -------------------------------------------------------------- kernel surface and identity


SYSCALL_ATTACK = """
import ctypes, json
libc = ctypes.CDLL(None, use_errno=True)
calls = {
    "unshare(CLONE_NEWUSER)": (272, 0x10000000),
    "keyctl(JOIN_SESSION_KEYRING)": (250, 1, 0),
    "add_key": (248, b"user", b"libra", b"secret", 6, -2),
    "mount": (165, b"none", b"/tmp", b"tmpfs", 0, 0),
    "pivot_root": (155, b"/tmp", b"/tmp"),
    "swapon": (167, b"/tmp/swap", 0),
    "reboot": (169, 0, 0, 0, 0),
    "init_module": (175, 0, 0, b""),
}
out = {}
for name, (number, *args) in calls.items():
    out[name] = "allowed" if libc.syscall(number, *args) >= 0 else "refused"
print(json.dumps(out))
"""


async def test_new_namespaces_keys_and_mounts_are_refused(provider: SandboxProvider) -> None:
    if platform.machine() != "x86_64":
        pytest.skip("the attack names x86_64 system call numbers")
    async with provider.sandbox(SPEC) as box:
        seen = report(await run_python(box, SYSCALL_ATTACK))
        nested = await box.exec(["unshare", "-r", "true"], timeout_s=10)
    assert set(seen.values()) == {"refused"}, seen
    assert nested.exit_code != 0


IDENTITY_PROBE = """
import json, os, socket
def read(path):
    try:
        return open(path).read()
    except OSError:
        return ""
servers = [line for line in read("/etc/resolv.conf").splitlines() if line.startswith("nameserver")]
print(json.dumps({"hostname": socket.gethostname(), "file": read("/etc/hostname").strip(),
                  "resolver": servers}))
"""


async def test_the_sandbox_carries_no_host_identity(provider: SandboxProvider) -> None:
    async with provider.sandbox(SPEC) as box:
        seen = report(await run_python(box, IDENTITY_PROBE))
    assert seen["hostname"] == "sandbox"
    assert seen["file"] in ("sandbox", "")
    if isinstance(provider, BwrapSandboxProvider):  # Docker writes its own resolver file
        assert seen["resolver"] == []  # no network: no name servers to reveal


# ------------------------------------------------------------------------------- no leaks


@pytest.mark.parametrize("backend", BACKENDS)
async def test_nothing_outlives_the_provider(request: pytest.FixtureRequest, backend: str) -> None:
    """After an attack leaves a daemon and files behind, closing the provider leaves nothing."""
    if backend == "docker":
        client = request.getfixturevalue("docker_client")
        docker = DockerSandboxProvider(pool_size=1, client=client, reap_stale=False)
        async with docker, docker.sandbox(SPEC) as box:
            await run_python(box, DAEMON_ATTACK)
        label = f"libra.run={docker.run_id}"
        assert client.containers.list(all=True, filters={"label": label}) == []
        return
    root = request.getfixturevalue("bwrap_root")
    bwrap = BwrapSandboxProvider(root=root, reap_stale=False)
    async with bwrap, bwrap.sandbox(SPEC) as jail:
        await run_python(jail, DAEMON_ATTACK)
        uid, base = jail.host_uid, jail._scratch.base
    assert uid is None or await all_gone(uid)
    assert not base.exists()


async def test_a_program_cannot_pass_its_failure_off_as_a_sandbox_fault(
    provider: SandboxProvider,
) -> None:
    """A sandbox fault is not the model's doing and is not scored; printing what a broken
    sandbox prints must not turn the program's own failure into one."""
    code = (
        'import sys\nsys.stderr.write("bwrap: Can\'t mount proc on /newroot/proc\\n")\nsys.exit(1)'
    )
    async with provider.sandbox(SPEC) as box:
        result = await run_python(box, code)
    assert (result.exit_code, result.status) == (1, "failure")
    assert result.stderr.startswith("bwrap: ")
