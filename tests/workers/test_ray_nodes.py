"""The Ray backend on more than one node: ``alloc.ray_labels`` loads from TOML and is
checked, and (slow) a run on a Ray cluster of three nodes of this machine
(``ray.cluster_utils.Cluster``, each node a raylet of its own with a label) finds each
worker's trainer rank and vLLM server on the node its selector names, before and after
a borrow and a release of the hybrid worker. The nodes share this machine's disk: what
is checked is where Ray ran each actor, not the file system."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import suppress
from pathlib import Path
from typing import Any

import anyio
import pytest

from libra.config import UsageError, load_config
from libra.launch import TrainRunConfig, train
from libra.train import METRICS_FILE, StepRecord, TrainRun
from libra.trainer import TrainerConfig
from libra.workers import Allocation, AllocConfig, WorkerCluster, _ray_workers
from libra.workers._ray import import_ray, ray_missing
from libra.workers._ray_server import RayServer
from libra.workers._ray_workers import open_ray_workers
from tests._helpers import (
    BREVITY,
    NEVER,
    embedded_alloc_run,
    hybrid_alloc_section,
    unavailable,
)
from tests.trainer._ranks import RankNodes

pytestmark = [pytest.mark.anyio, pytest.mark.ray]

ROOT = Path(__file__).resolve().parents[2]
#: The label that tells the nodes apart, and each node's value: the head first. Worker
#: ``w`` of ``hybrid_alloc_section`` (0 trains, 1 serves, 2 is hybrid) is held on ``NODES[w]``.
LABEL = "libra-node"
NODES = ("trainer", "server", "hybrid")
SELECTORS = [{LABEL: node} for node in NODES]
START_S = 180.0  # three raylets start in ~5 s here; the bound only stops a hang
STOP_S = 60.0
TRAINER = TrainerConfig(backend="gloo", cpu_threads=1)

# A Ray cluster of one node per label set (one CPU each), started in a fresh interpreter:
# ``Cluster`` starts each node's processes from the process that calls it, and a fork of
# a process with many threads (pytest's, after torch's and anyio's) may hang or crash
# (see ``libra.workers._ray_head``). It prints the address, then lives until its stdin
# closes: the test's teardown, or the test process's death.
CLUSTER = """
import json
import sys

from ray.cluster_utils import Cluster

head, *others = json.loads(sys.argv[1])
cluster = Cluster(
    initialize_head=True,
    head_node_args={"num_cpus": 1, "labels": head, "include_dashboard": False},
)
for labels in others:
    cluster.add_node(num_cpus=1, labels=labels)
print(cluster.address, flush=True)
sys.stdin.read()
cluster.shutdown()
"""


@pytest.fixture(scope="module")
def ray_nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Ray cluster of the :data:`NODES`, on this machine: its address. One for the
    module (no test leaves anything on it); shut down, every raylet with it, after."""
    if missing := ray_missing():
        unavailable(missing)
    log = tmp_path_factory.mktemp("ray-nodes") / "ray-cluster.log"
    with log.open("w") as output:
        cluster = subprocess.Popen(
            [sys.executable, "-c", CLUSTER, json.dumps(SELECTORS)],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=output,
            text=True,
            start_new_session=True,  # so that the teardown reaches every process it started
        )
    try:
        yield _address_of(cluster, log)
    finally:
        _stop(cluster)


def _address_of(cluster: subprocess.Popen[str], log: Path) -> str:
    assert cluster.stdout is not None
    timer = threading.Timer(START_S, _kill_group, args=(cluster,))  # ends a hung start
    timer.start()
    try:
        address = cluster.stdout.readline().strip()
    finally:
        timer.cancel()
    assert address, f"the Ray cluster did not start:\n{log.read_text()[-3000:]}"
    return address


def _stop(cluster: subprocess.Popen[str]) -> None:
    """Close its stdin (it shuts the cluster down), then end whatever outlived that."""
    assert cluster.stdin is not None and cluster.stdout is not None
    cluster.stdin.close()
    with suppress(subprocess.TimeoutExpired):
        cluster.wait(timeout=STOP_S)
    _kill_group(cluster)
    cluster.wait()
    cluster.stdout.close()


def _kill_group(cluster: subprocess.Popen[str]) -> None:
    with suppress(ProcessLookupError):
        os.killpg(cluster.pid, signal.SIGKILL)


# ------------------------------------------------------------------------ config


def labelled_alloc(address: str) -> dict[str, Any]:
    """The run's ``[alloc]`` on the cluster at ``address``: worker w on ``NODES[w]``."""
    section = hybrid_alloc_section(sorted(os.sched_getaffinity(0)))
    return section | {"backend": "ray", "ray_address": address, "ray_labels": SELECTORS}


def test_ray_labels_load_back_from_the_run_s_toml_and_are_one_per_worker(
    tmp_path: Path,
) -> None:
    if missing := ray_missing():
        unavailable(missing)
    data = {
        "rollout": {"env": BREVITY, "server": "embedded"},
        "run_dir": str(tmp_path / "run"),
        "alloc": labelled_alloc("auto"),
    }
    config = TrainRunConfig.model_validate(data)
    (tmp_path / "config.toml").write_text(config.to_toml())
    again = load_config(TrainRunConfig, tmp_path / "config.toml")
    assert again.alloc == config.alloc and again.alloc is not None
    assert again.alloc.ray_labels == tuple(SELECTORS)
    with pytest.raises(ValueError, match=r"alloc\.ray_labels: one selector per worker \(3\)"):
        AllocConfig.model_validate(labelled_alloc("auto") | {"ray_labels": SELECTORS[:2]})
    with pytest.raises(ValueError, match=r"alloc\.ray_labels: only Ray places workers"):
        AllocConfig.model_validate(labelled_alloc("auto") | {"backend": "local"})


# ------------------------------------------------------------------------ placement


async def placement(cluster: WorkerCluster) -> dict[str, str]:
    """Which node (its :data:`LABEL`) each trainer rank, replica and vLLM server of the
    cluster runs on, as Ray reports it from inside each rank and each server's actor."""
    ray = import_ray()
    nodes = await anyio.to_thread.run_sync(ray.nodes)
    label_of = {node["NodeID"]: node["Labels"][LABEL] for node in nodes if node["Alive"]}
    assert sorted(label_of.values()) == sorted(NODES)  # three nodes, one per label
    trainer = cluster.trainer
    found: dict[str, str] = {}
    for worker, node in zip(trainer.members, await trainer.call(RankNodes()), strict=True):
        found[f"rank w{worker}"] = label_of[node]
    for worker, replica in trainer.hybrid.replicas.items():
        (node,) = await replica.world.call(RankNodes())
        found[f"replica w{worker}"] = label_of[node]
    for name, server in cluster.servers.items():
        assert isinstance(server, RayServer) and server.node_id is not None
        found[f"server {name}"] = label_of[server.node_id]
    return found


async def test_each_worker_s_rank_runs_on_the_node_its_selector_names(
    ray_nodes: str, tiny_model: Path
) -> None:
    """The selectors reversed (worker 0 on the last node added): one world of a rank per
    worker meets across the three nodes, each rank on its worker's node."""
    on_nodes = NODES[::-1]
    core = sorted(os.sched_getaffinity(0))[0]
    labels = [{LABEL: node} for node in on_nodes]
    async with open_ray_workers([(core,)] * 3, "gloo", ray_nodes, labels) as workers:
        nodes = await anyio.to_thread.run_sync(import_ray().nodes)
        label_of = {node["NodeID"]: node["Labels"][LABEL] for node in nodes}
        async with workers.worlds(tiny_model, TRAINER)((0, 1, 2)) as world:
            ranks = await world.call(RankNodes())
    assert [label_of[node] for node in ranks] == list(on_nodes)


async def test_a_selector_no_node_matches_is_waited_for_with_a_line_then_stops_the_run(
    ray_nodes: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ray holds no worker until it can hold all: worker 2's node never joins. A line
    says so while the run waits, and past ``alloc.ray_wait_s`` the run stops with what is
    missing and what the cluster has."""
    monkeypatch.setattr(_ray_workers, "_PLACING_POLL_S", 1.0)
    core = sorted(os.sched_getaffinity(0))[0]
    labels = [{LABEL: "trainer"}, {LABEL: "server"}, {LABEL: "nowhere"}]
    with pytest.raises(UsageError) as stopped:
        async with open_ray_workers([(core,)] * 3, "gloo", ray_nodes, labels, wait_s=2.5):
            pytest.fail("placed on a node that does not exist")
    message = str(stopped.value)
    assert message.startswith("Ray has not placed the workers after 2.5 s: w0 {'CPU': 1.0}")
    assert "w2 {'CPU': 1.0} on {'libra-node': 'nowhere'}" in message
    assert all(f"{{'{LABEL}': '{node}'}} CPU 1" in message for node in NODES)
    assert message.endswith("(alloc.ray_wait_s = 2.5)")
    waiting = [r.getMessage() for r in caplog.records if r.name == _ray_workers.__name__]
    assert len(waiting) == 2 and all("waiting up to alloc.ray_wait_s = 2.5 s" in w for w in waiting)


SERVING = {"rank w0": "trainer", "server w1": "server", "server w2": "hybrid"}
LENT = {"rank w0": "trainer", "replica w2": "hybrid", "server w1": "server"}


@pytest.mark.slow
@pytest.mark.trainer
async def test_a_run_on_three_ray_nodes_runs_each_worker_on_its_labelled_node_as_it_moves(
    ray_nodes: str, embedded_model: Path, tmp_path: Path
) -> None:
    """Two steps: after step 0 the hybrid worker w2 is lent to training, after step 1 it
    is given back. The pool moves it (the loop's own rule never fires here: which step
    its ratio rule would pick depends on this machine's load)."""
    run_dir = tmp_path / "run"
    alloc = labelled_alloc(ray_nodes)
    alloc["loop"] |= {"borrow_ratio": NEVER}
    # Servers listen on every interface and are reached at their node's address, as on
    # machines of their own.
    vllm = {"max_model_len": 1024, "startup_timeout_s": 400, "kv_cache_gib": 1, "host": "0.0.0.0"}
    # Micro-batches of a sample or two: the step in several pieces, the replica takes some.
    # Groups of four and a slow learning rate keep step 1 something to train: at 1e-4 the
    # policy may answer in 8 digits by then, every reward tied (a step of no pieces).
    config = embedded_alloc_run(
        run_dir,
        alloc,
        steps=2,
        samples_per_prompt=4,
        vllm=vllm,
        train={"micro_batch_tokens": 64},
        trainer={"lr": 1e-6},
    )
    seen: list[dict[str, str]] = []
    moves: list[tuple[str, str, str]] = []

    async def move_w2(run: TrainRun, record: StepRecord) -> None:
        assert isinstance(run.allocation, Allocation)
        pool, cluster = run.allocation.pool, run.allocation.cluster
        await pool.settled()
        seen.append(await placement(cluster))
        started = pool.borrow(1) if record.step == 0 else pool.release(1)
        assert [move.unit for move in started] == ["w2"]
        await pool.settled()
        seen.append(await placement(cluster))
        moves[:] = [(m.direction, m.unit, m.outcome) for m in pool.moves]

    await train(config, checkpoint=move_w2)

    print("placement after each step, before and after its move:", json.dumps(seen, indent=1))
    assert seen == [SERVING, LENT, LENT, SERVING]
    assert moves == [("borrow", "w2", "done"), ("release", "w2", "done")]
    lines = [json.loads(line) for line in (run_dir / METRICS_FILE).read_text().splitlines()]
    allocs = [line["alloc"] for line in lines]
    print("pieces per step:", [alloc["pieces"] for alloc in allocs])
    assert lines[1]["groups_used"] > 0, lines[1]  # (else it trained nothing)
    # Step 1 was trained by the core on the trainer node and the replica on the hybrid one.
    assert allocs[1]["training"] == [0, 2] and allocs[1]["pieces"].get("w2", 0) > 0
    assert allocs[1]["trained_on"] == 2
