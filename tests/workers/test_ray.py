"""The cluster's Ray backend on a local Ray instance: a trainer world of Ray actors grows
1 -> 2 and shrinks back and trains exactly as a local world; a rank whose actor dies is
reported as a local rank's death is; (slow) a vLLM server in a Ray actor serves and stops."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from urllib.parse import urlsplit

import anyio
import httpx
import pytest

from libra._process import exited_within
from libra.config import ConfigError, UsageError, load_config
from libra.launch import TrainRunConfig
from libra.serving import EMBEDDED_MODEL_NAME
from libra.trainer import GRPOConfig, Train, TrainerConfig, TrainerError, TrainerProcess
from libra.workers import AllocConfig, ElasticTrainer, open_cluster
from libra.workers._ray import import_ray, ray_missing
from libra.workers._ray_head import ray_head
from libra.workers._ray_trainer import RayTrainer
from libra.workers._ray_workers import RayWorkers
from tests._helpers import BREVITY, real_config, unavailable
from tests.trainer._ranks import (
    Fail,
    FullParameters,
    RankPids,
    SleepThenMeet,
    assert_close,
    assert_equal,
    batch,
)

pytestmark = [pytest.mark.anyio, pytest.mark.ray]

CONFIG = TrainerConfig(backend="gloo", cpu_threads=1, lr=1e-2)
GRPO = GRPOConfig()
ROOT = Path(__file__).resolve().parents[2]  # Ray's workers import this checkout
PROMPTLY_S = 60  # a death is noticed within seconds; the bound only stops a hang


@pytest.fixture(scope="module")
def ray_instance() -> Iterator[None]:
    """A local Ray instance of two CPUs for the module (``ray.init`` takes seconds)."""
    if missing := ray_missing():
        unavailable(missing)
    ray = import_ray()
    started = time.perf_counter()
    with ray_head(cpus=2) as address:
        ray.init(
            address=address,
            log_to_driver=False,
            runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}},
        )
        print(f"ray.init: {time.perf_counter() - started:.1f} s")
        yield
        ray.shutdown()


def two_workers() -> list[tuple[int, ...]]:
    cores = sorted(os.sched_getaffinity(0))
    return [(cores[0],), (cores[-1],)]  # one core each (the same one on one core)


# ------------------------------------------------------------------------ training


@asynccontextmanager
async def ray_world(model: Path, workers: list[tuple[int, ...]]) -> AsyncIterator[RayTrainer]:
    """A world of one rank per worker, as Ray actors in the workers' bundles."""
    members = tuple(range(len(workers)))
    async with (
        RayWorkers(workers, gpus=False) as ray,
        ray.worlds(model, CONFIG)(members) as world,
    ):
        yield world


@asynccontextmanager
async def local_and_ray_elastic(
    model: Path,
) -> AsyncIterator[tuple[TrainerProcess, ElasticTrainer]]:
    """A local one-rank trainer to compare with, and an elastic one of Ray ranks whose
    core is worker 0 of two."""
    workers = two_workers()
    async with (
        RayWorkers(workers, gpus=False) as ray,
        TrainerProcess(model, CONFIG, world_size=1) as local,
        ElasticTrainer(
            model,
            CONFIG,
            dict(enumerate(workers)),
            members=(0,),
            worlds=ray.worlds(model, CONFIG),
        ) as elastic,
    ):
        yield local, elastic


async def test_a_ray_world_grows_and_shrinks_and_trains_as_a_local_world_does(
    ray_instance: None, tiny_model: Path
) -> None:
    started = time.perf_counter()
    async with local_and_ray_elastic(tiny_model) as (local, elastic):
        await elastic.ready()
        print(f"ray world of 1 ready: {time.perf_counter() - started:.1f} s")
        for seed, members in enumerate([(0,), (0, 1), (0,)]):
            if members != elastic.members:
                before = await elastic.call(FullParameters())
                await elastic.prepare(members)
                assert elastic.members != members  # the old world trains meanwhile
                assert await elastic.switch() == seed  # the step count came along
                assert elastic.world_size == len(members)
                assert_equal(await elastic.call(FullParameters()), before)
            expected = await local.call(Train(batch(seed, ranks=1), GRPO, 1.0))
            result = await elastic.call(Train(batch(seed, ranks=elastic.world_size), GRPO, 1.0))
            assert result.step.loss == pytest.approx(expected.step.loss, rel=1e-5)
            assert_close(await elastic.call(FullParameters()), await local.call(FullParameters()))
    assert [resize.members for resize in elastic.resizes] == [(0, 1), (0,)]
    for resize in elastic.resizes:
        print(
            f"resize to {resize.members}: prepare {resize.prepare_s:.1f} s, "
            f"switch {resize.switch_s:.1f} s"
        )


async def test_a_ray_replica_joins_the_hybrid_gradient_group_and_trains_a_share_exactly(
    ray_instance: None, tiny_model: Path
) -> None:
    async with local_and_ray_elastic(tiny_model) as (local, elastic):
        started = time.perf_counter()
        await elastic.fetch_replica(1)
        fetched = time.perf_counter()
        await elastic.sync_replica(1)
        await elastic.activate_replica(1)
        synced = time.perf_counter()
        print(f"ray replica: fetch {fetched - started:.1f} s, sync {synced - fetched:.1f} s")
        for seed in range(2):
            expected = await local.call(Train(batch(seed, ranks=1), GRPO, 1.0))
            result = await elastic.call(Train(batch(seed, ranks=2), GRPO, 1.0))
            assert result.step.loss == pytest.approx(expected.step.loss, rel=1e-5)
            trained = await elastic.call(FullParameters())
            # Two halves summed over the bridge, in another order than one rank's sum.
            assert_close(trained, await local.call(FullParameters()), atol=1e-5)
        await elastic.drop_replica(1)
        assert elastic.training == (0,)
    assert elastic.resizes == []


async def test_a_rank_actor_killed_between_commands_stops_watch_and_every_later_call(
    ray_instance: None, tiny_model: Path
) -> None:
    async with ray_world(tiny_model, two_workers()) as world:
        pids = await world.call(RankPids())
        assert len(set(pids)) == 2 and os.getpid() not in pids
        os.kill(pids[1], signal.SIGKILL)
        with anyio.fail_after(PROMPTLY_S), pytest.raises(TrainerError) as watched:
            await world.watch()
        assert str(watched.value).startswith("trainer rank 1 died (")
        with pytest.raises(TrainerError, match=r"^trainer rank 1 died \("):
            await world.call(RankPids())


async def test_a_rank_actor_killed_mid_command_fails_the_call_with_its_death(
    ray_instance: None, tiny_model: Path, tmp_path: Path
) -> None:
    started = tmp_path / "started"
    async with ray_world(tiny_model, two_workers()) as world:
        pids = await world.call(RankPids())
        async with anyio.create_task_group() as group:

            async def kill_once_started() -> None:
                deadline = anyio.current_time() + PROMPTLY_S
                while not started.exists():  # a file another process writes: polled
                    assert anyio.current_time() < deadline
                    await anyio.sleep(0.05)
                os.kill(pids[1], signal.SIGKILL)

            group.start_soon(kill_once_started)
            with anyio.fail_after(PROMPTLY_S), pytest.raises(TrainerError) as failed:
                await world.call(SleepThenMeet(2.0, started))
        assert str(failed.value).startswith("trainer rank 1 died (")


async def test_a_command_that_raises_on_ray_reports_its_traceback(
    ray_instance: None, tiny_model: Path
) -> None:
    async with ray_world(tiny_model, two_workers()[:1]) as world:
        with pytest.raises(TrainerError, match="the trainer failed") as failed:
            await world.call(Fail())
        assert "ValueError: a bug in the command" in str(failed.value)
        with anyio.fail_after(PROMPTLY_S), pytest.raises(TrainerError, match="failed"):
            await world.call(RankPids())


# ------------------------------------------------------------------------ Ray itself

# Ray started by libra from a thread that has exited since, then used: as `libra train`
# starts it from one of anyio's worker threads, which exit when idle.
OUTLIVES = """
import threading
import time

import ray
from libra.workers._ray_workers import ray_started

held = ray_started([(0,)], None)
starter = threading.Thread(target=held.__enter__)
starter.start()
starter.join()
time.sleep(3)  # a kill asked of the starter's exit lands at once


@ray.remote
def square(x):
    return x * x


print(ray.get(square.remote(7)))
held.__exit__(None, None, None)
"""


def test_a_ray_started_here_outlives_the_thread_that_started_it() -> None:
    if missing := ray_missing():
        unavailable(missing)
    # In a process of its own: had Ray's head died, Ray's driver would exit (status 1,
    # after 60 s, with no word to pytest's report) and take this test's process with it.
    done = subprocess.run(
        [sys.executable, "-c", OUTLIVES], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert (done.returncode, done.stdout.split()) == (0, ["49"]), done.stderr[-3000:]


# ------------------------------------------------------------------------ config


def alloc_section(backend: str) -> dict[str, object]:
    return {
        "enabled": True,
        "workers": [list(w) for w in two_workers()],
        "training": [0],
        "rollout": [[1]],
        "backend": backend,
    }


def test_the_ray_backend_loads_from_toml_and_says_when_ray_is_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if missing := ray_missing():
        unavailable(missing)
    data = {
        "rollout": {"env": BREVITY, "server": "embedded"},
        "run_dir": str(tmp_path / "run"),
        "alloc": alloc_section("ray") | {"ray_address": "auto"},
    }
    config = TrainRunConfig.model_validate(data)
    (tmp_path / "config.toml").write_text(config.to_toml())
    again = load_config(TrainRunConfig, tmp_path / "config.toml")
    assert again.alloc == config.alloc and again.alloc is not None
    assert (again.alloc.backend, again.alloc.ray_address) == ("ray", "auto")
    monkeypatch.setitem(sys.modules, "ray", None)  # as if it were not installed
    with pytest.raises(ConfigError, match=r"alloc\.backend: Ray is not installed: pip install"):
        load_config(TrainRunConfig, tmp_path / "config.toml")
    with pytest.raises(UsageError, match="Ray is not installed"):
        import_ray()
    assert AllocConfig.model_validate(alloc_section("local")).backend == "local"


# ------------------------------------------------------------------------ serving


@pytest.mark.slow
async def test_a_ray_cluster_serves_from_an_actor_sees_its_server_die_and_stops_it(
    ray_instance: None, embedded_model: Path, tmp_path: Path
) -> None:
    alloc = AllocConfig.model_validate(alloc_section("ray"))
    server = real_config(max_model_len=1024, kv_cache_gib=1)
    async with open_cluster(
        alloc,
        CONFIG,
        embedded_model,
        base=embedded_model,
        server=server,
        weights=lambda: (None, 0),
        weights_lock=anyio.Lock(),
    ) as cluster:
        started = time.perf_counter()
        url = await cluster.start_instance("w1", (1,))
        print(f"vLLM in a Ray actor answers after {time.perf_counter() - started:.1f} s")
        async with httpx.AsyncClient(timeout=120) as client:
            reply = await client.post(
                f"{url}/v1/completions",
                json={"model": EMBEDDED_MODEL_NAME, "prompt": "1, 2, 3,", "max_tokens": 4},
            )
            assert reply.status_code == 200, reply.text
            assert reply.json()["choices"][0]["text"]
            # The server's guard killed in its actor: seen from here (what a supervisor
            # waits on), and stopping the instance stops the tree the guard left.
            guard, api_server = server_pids(url)
            os.kill(guard, signal.SIGKILL)
            with anyio.fail_after(60):
                await cluster.servers["w1"].wait_exited()
            await cluster.stop_instance("w1")
            with pytest.raises(httpx.TransportError):
                await client.get(f"{url}/health")
        assert cluster.servers == {}
        assert exited_within(api_server, timeout_s=0)
    assert [kind for kind, _, _ in cluster.timings] == ["start", "stop"]


def server_pids(url: str) -> tuple[int, int]:
    """The guard and the vLLM API server of the instance at ``url`` (a local Ray: here)."""
    port = f"--port\0{urlsplit(url).port}\0".encode()
    found: dict[bool, int] = {}  # is the guard -> pid
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        with contextlib.suppress(OSError):  # it exited meanwhile
            if b"api_server" in (line := cmdline.read_bytes()) and port in line:
                found[b"_guard.py" in line] = int(cmdline.parent.name)
    assert set(found) == {True, False}, f"no guard and vLLM server at {url}: {found}"
    return found[True], found[False]
