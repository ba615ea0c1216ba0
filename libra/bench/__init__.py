"""``libra bench``'s measurements: the engine's overhead, scheduling policies and worker
splits on an emulated fleet, a fault soak, sandboxes, ``libra serve`` and the trainer, and
the docs' tables written from saved runs. The command line (``libra/cli/_bench.py``) runs
them through this package's API only."""

from libra.bench._alloc_report import add_arguments as add_alloc_arguments
from libra.bench._alloc_report import main_alloc
from libra.bench._docs import add_arguments as add_docs_arguments
from libra.bench._docs import main_docs
from libra.bench._engine import as_json as engine_as_json
from libra.bench._engine import run_engine_bench
from libra.bench._engine_view import as_json as view_as_json
from libra.bench._engine_view import run_view_bench
from libra.bench._sandbox import bench_sandbox
from libra.bench._sched import (
    DEFAULT_WORKLOAD,
    default_jobs,
    main_sched,
    parse_policies,
    run_policy,
    run_sched_bench,
)
from libra.bench._sched_bound import lower_bound
from libra.bench._sched_fleet import (
    DEFAULT_FLEET,
    DEFAULT_MISMATCH,
    MISMATCH_PRESETS,
    FleetFile,
    load_fleet,
    with_mismatch,
)
from libra.bench._sched_report import LowerBound, PolicyResult, PolicyRun, SchedReport
from libra.bench._serve import as_json as serve_as_json
from libra.bench._serve import bench_serve
from libra.bench._soak import add_arguments as add_soak_arguments
from libra.bench._soak import main_soak
from libra.bench._sync import TransportResult, bench_sync
from libra.bench._train import as_json as train_as_json
from libra.bench._train import bench_train
from libra.sched.policies import ABLATIONS, POLICIES  # what --policies and --ablate name

__all__ = [
    "ABLATIONS",
    "DEFAULT_FLEET",
    "DEFAULT_MISMATCH",
    "DEFAULT_WORKLOAD",
    "MISMATCH_PRESETS",
    "POLICIES",
    "FleetFile",
    "LowerBound",
    "PolicyResult",
    "PolicyRun",
    "SchedReport",
    "TransportResult",
    "add_alloc_arguments",
    "add_docs_arguments",
    "add_soak_arguments",
    "bench_sandbox",
    "bench_serve",
    "bench_sync",
    "bench_train",
    "default_jobs",
    "engine_as_json",
    "load_fleet",
    "lower_bound",
    "main_alloc",
    "main_docs",
    "main_sched",
    "main_soak",
    "parse_policies",
    "run_engine_bench",
    "run_policy",
    "run_sched_bench",
    "run_view_bench",
    "serve_as_json",
    "train_as_json",
    "view_as_json",
    "with_mismatch",
]
