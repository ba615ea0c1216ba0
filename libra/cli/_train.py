"""``libra train``: the RL loop (``libra.launch.train`` assembles the run, ``libra.train``
loops over it); ``libra plot RUN_DIR``: its curves."""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anyio
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from libra.cli._config import add_config_arguments
from libra.cli._groups import single_failure
from libra.cli._progress import counters
from libra.cli._view import add_view_arguments, view_options
from libra.config import load_config
from libra.launch import (
    RolloutStats,
    TrainRunConfig,
    ViewOptions,
    evaluate,
    own_server_command,
    train,
)
from libra.train import (
    EVAL_FILE,
    METRICS_FILE,
    AttachError,
    GatewaySyncError,
    NothingToResume,
    StepRecord,
    iter_metrics,
)
from libra.trainer import TrainerError, find_latest


def add_parsers(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "train", help="GRPO: rollouts, FSDP2 training, weights synced into the servers"
    )
    parser.add_argument("--steps", type=int, help="RL steps (default 2)")
    parser.add_argument(
        "--agent", help="rollout.agent: an async def (task, client) plays the episodes"
    )
    parser.add_argument(
        "--tasks",
        type=Path,
        help="rollout.tasks: JSONL file of tasks, played in epochs (default: seeded tasks)",
    )
    parser.add_argument(
        "--serve",
        help="attach to running vLLM server URL(s) in dev mode, or to a libra serve gateway "
        "($LIBRA_ADMIN_KEY), instead of starting one",
    )
    parser.add_argument("--run-dir", type=Path, help="where the run is written (runs/train)")
    parser.add_argument(
        "--dry-run", action="store_true", help="print the resolved config (TOML) and exit"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--resume",
        action="store_true",
        help="go on from the run folder's newest checkpoint (same config, same --run-dir)",
    )
    online = parser.add_argument_group(
        "online", "serve the gateway to agents elsewhere and train on the sessions they end"
    )
    online.add_argument("--online", action="store_true", help="no task source of its own")
    online.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    online.add_argument("--port", type=int, help="port (default 8080; 0: any free one)")
    online.add_argument(
        "--no-auth", action="store_true", help="no API key (only on a loopback address)"
    )
    online.add_argument(
        "--api-key-file", type=Path, help="user keys, one a line (else $LIBRA_API_KEY)"
    )
    online.add_argument(
        "--admin-key-file", type=Path, help="admin keys, one a line (else $LIBRA_ADMIN_KEY)"
    )
    add_view_arguments(parser)
    add_config_arguments(parser, "the run's settings", "trainer.lr=1e-5")
    parser.set_defaults(run=run)
    plot = commands.add_parser("plot", help="draw a training run's curves as RUN_DIR/plot.png")
    plot.add_argument("run_dir", type=Path, help="a `libra train` run folder")
    plot.set_defaults(run=run_plot)
    evaluate = commands.add_parser(
        "eval", help="evaluate a training run's checkpoint alone (its config's [eval])"
    )
    evaluate.add_argument("--run-dir", type=Path, required=True, help="a `libra train` run folder")
    evaluate.add_argument(
        "--checkpoint", type=int, metavar="K", help="the checkpoint after K steps (the newest)"
    )
    evaluate.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override the run's settings, e.g. eval.samples=8",
    )
    evaluate.set_defaults(run=run_eval)


def run(args: argparse.Namespace) -> int:
    flags = {
        "steps": args.steps,
        "serve": args.serve,
        "run_dir": args.run_dir,
        "rollout.agent": args.agent,
        "rollout.tasks": args.tasks,
    }
    if args.online:
        flags |= {
            "online.host": args.host,
            "online.port": args.port,
            "online.no_auth": True if args.no_auth else None,
            "online.api_key_file": args.api_key_file,
            "online.admin_key_file": args.admin_key_file,
        }
    defaults: dict[str, object] | None = {"online": {}} if args.online else None
    config = load_config(TrainRunConfig, args.config, flags, args.set, defaults=defaults)
    if args.dry_run:
        print(config.to_toml(), end="")
        if (command := own_server_command(config)) is not None:
            print(f"\n# The run's own vLLM starts as:\n# {shlex.join(command)}")
        return 0
    console = Console(soft_wrap=True)  # a step's line is one line, in a log file too
    console.print(
        f"libra train: {config.steps} steps of {config.prompts_per_step} prompts x "
        f"{config.samples_per_prompt} samples ({_players(config)}, {config.mode}) "
        f"into {config.run_dir}"
    )
    progress = _progress(enabled=not args.no_progress and config.rollout.progress)
    try:
        anyio.run(_train, config, console, progress, args.resume, view_options(args))
    except (NothingToResume, AttachError, GatewaySyncError) as error:
        print(f"libra: error: {error}", file=sys.stderr)
        return 1
    except TrainerError as error:  # before the loop's task groups started
        print(f"libra: error: {error}\n{resume_hint(config.run_dir)}", file=sys.stderr)
        return 1
    except BaseExceptionGroup as group:  # the loop's task groups wrap the trainer's failure
        failed = group.subgroup(TrainerError)
        if failed is not None:
            hint = resume_hint(config.run_dir)
            print(f"libra: error: {_leaf(failed)}\n{hint}", file=sys.stderr)
            return 1
        sync = group.subgroup(GatewaySyncError)  # the gateway's fleet did not load them
        if sync is None:
            raise
        print(f"libra: error: {_leaf(sync)}", file=sys.stderr)
        return 1
    plot = plot_run(config.run_dir)
    console.print(f"metrics in {config.run_dir / METRICS_FILE}; plot in {plot}")
    return 0


def resume_hint(run_dir: Path) -> str:
    """What a stopped run keeps, and how to go on: the newest checkpoint, the steps
    after it that will run again, and the trajectories the log gives back."""
    latest = find_latest(run_dir)
    if latest is None:
        return "libra: no checkpoint to resume from: run it again (in a new --run-dir)"
    logged = len(list(iter_metrics(run_dir))) if (run_dir / METRICS_FILE).exists() else 0
    first, last = latest.run.step, logged - 1
    past = f"step {first}" if first == last else f"steps {first}-{last}"
    again = f"; {past} ran past it and will run again" if last >= first else ""
    return (
        f"libra: `libra train --resume` (same config and --run-dir) goes on from step "
        f"{latest.run.step} (its checkpoint){again}; the finished trajectories of step "
        f"{latest.run.step} and later that weights v{latest.run.weight_version} or older "
        f"sampled are taken back from {run_dir / 'rollouts'}, the rest sampled again"
    )


def _leaf(group: BaseExceptionGroup[BaseException]) -> BaseException:
    first = group.exceptions[0]
    return _leaf(first) if isinstance(first, BaseExceptionGroup) else first


async def _train(
    config: TrainRunConfig,
    console: Console,
    progress: Callable[[int, RolloutStats], Any],
    resume: bool,
    view: ViewOptions | None,
) -> None:
    try:
        await train(
            config,
            resume=resume,
            on_step=lambda record: console.print(step_line(record)),
            progress=progress,
            view=view,
        )
    except BaseExceptionGroup as group:
        # One failure, wrapped by the task groups it crossed (the event stream's, the
        # run's): raised as itself, so a user's error stays one line.
        only = single_failure(group)
        if only is not None:
            raise only from None
        raise


def step_line(record: StepRecord) -> str:
    """The console's line for one step."""
    reward = "-" if record.reward_mean is None else f"{record.reward_mean:.3f}"
    loss = record.loss.get("policy_loss")
    reruns = f" · {record.reused} taken from the log" if record.reused else ""
    reruns += f" · {record.retried} failures run again" if record.retried else ""
    corrected = ""
    if (weight := record.loss.get("is_weight_mean", 1.0)) != 1.0:  # [grpo] correction on
        corrected = (
            f" · mismatch {record.loss['approx_kl']:.1e}, IS weight {weight:.3f}, "
            f"cut {record.loss['is_cut_fraction']:.1%}"
        )
    return (
        f"[bold]step {record.step}[/] reward {reward} · response {record.response_tokens_mean:.0f} "
        f"tok · trained {record.samples_trained} samples / {record.tokens_trained} tok "
        f"({record.groups_used}/{record.groups} groups) · loss "
        f"{'-' if loss is None else f'{loss:.4f}'} · gap {record.logprob_gap_mean:.1e}"
        f"{corrected} · "
        f"rollout {record.rollout_s:.1f} s, "
        f"train {record.train_s:.1f} s, "
        f"sync {record.export_s + record.sync_s:.1f} s → v{record.weight_version}{reruns}"
    )


def _progress(*, enabled: bool) -> Callable[[int, RolloutStats], Any]:
    @contextmanager
    def bar(step: int, stats: RolloutStats) -> Iterator[Callable[[], None]]:
        progress = Progress(
            TextColumn(f"[bold]rollout {step}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[counters]}"),
            console=Console(stderr=True),
            disable=not enabled,
            transient=True,
        )
        task = progress.add_task("rollout", total=stats.total, counters="")
        with progress:
            yield lambda: progress.update(task, completed=stats.done, counters=counters(stats))

    return bar


# ------------------------------------------------------------------------- plot

_SMOOTHING = 5  # steps in the reward's running mean

_PANELS = (
    ("reward", (("reward_mean", "mean reward"),)),
    ("response tokens", (("response_tokens_mean", "mean response length"),)),
    (
        "seconds",
        (
            ("rollout_s", "rollout"),
            ("train_s", "train"),
            ("export_s", "export"),
            ("sync_s", "sync"),
        ),
    ),
)


def _players(config: TrainRunConfig) -> str:
    """Who plays the run's episodes, in a few words."""
    rollout = config.rollout
    if rollout.envs is not None:
        return " + ".join(f"{share.env} x{share.weight:g}" for share in rollout.envs)
    return rollout.agent or rollout.env or "online: agents elsewhere"


def run_eval(args: argparse.Namespace) -> int:
    """The run folder's config (``config.toml``), with ``--set`` on top."""
    config = load_config(
        TrainRunConfig, args.run_dir / "config.toml", {"run_dir": args.run_dir}, args.set
    )
    line = anyio.run(evaluate, config, args.checkpoint)
    print(json.dumps(line))
    print(f"written to {args.run_dir / 'eval' / 'checkpoints.jsonl'}")
    return 0


def run_plot(args: argparse.Namespace) -> int:
    print(f"plotted {plot_run(args.run_dir)}")
    print(reward_trend(list(iter_metrics(args.run_dir))))
    return 0


def reward_trend(lines: list[dict[str, object]], window: int = _SMOOTHING) -> str:
    """The mean reward of the first and of the last ``window`` steps, in one line."""

    if not lines:
        return "no steps yet"
    first, last = lines[:window], lines[-window:]
    return (
        f"mean reward over steps {first[0]['step']}-{first[-1]['step']}: {_mean_reward(first)}, "
        f"over steps {last[0]['step']}-{last[-1]['step']}: {_mean_reward(last)}"
    )


def _mean_reward(lines: list[dict[str, object]]) -> str:
    values = [v for v in (_number(line.get("reward_mean")) for line in lines) if not math.isnan(v)]
    return f"{sum(values) / len(values):.3f}" if values else "-"


def plot_run(run_dir: Path) -> Path:
    """``RUN_DIR/plot.png``: reward, response length and stage times over steps, and
    the evaluations' pass@k per env where the run has them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    lines = list(iter_metrics(run_dir))
    steps = [line["step"] for line in lines]
    evaluations = _evaluations(run_dir)
    panels = len(_PANELS) + bool(evaluations)
    figure, axes = plt.subplots(panels, 1, figsize=(7, 8 + 2 * bool(evaluations)), sharex=True)
    if evaluations:
        for label, points in evaluations.items():
            axes[-1].plot(*zip(*points, strict=True), marker="o", label=label)
        axes[-1].set_ylabel("eval (after N steps)")
        axes[-1].grid(alpha=0.3)
        axes[-1].legend(loc="upper left", fontsize="small")
    for axis, (title, series) in zip(axes, _PANELS, strict=False):
        for key, label in series:
            values = [_number(line.get(key)) for line in lines]
            axis.plot(steps, values, marker="o", label=label)
            if key == "reward_mean" and len(values) >= 2 * _SMOOTHING:
                # A step's mean is over a few samples: the trend is in the running mean.
                axis.plot(steps, _running_mean(values), label=f"over {_SMOOTHING} steps")
        axis.set_ylabel(title)
        axis.grid(alpha=0.3)
        if len(axis.get_lines()) > 1:
            axis.legend(loc="upper left", fontsize="small")
    axes[-1].set_xlabel("step")
    axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True))
    figure.suptitle(f"libra train: {run_dir}")
    figure.tight_layout()
    target = run_dir / "plot.png"
    figure.savefig(target, dpi=100)
    plt.close(figure)
    return target


def _evaluations(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """``eval.jsonl``'s pass@k figures, ``env pass@k`` -> (steps trained, value)."""
    path = run_dir / EVAL_FILE
    series: dict[str, list[tuple[int, float]]] = {}
    for text in path.read_text().splitlines() if path.exists() else []:
        line = json.loads(text)
        for env, figures in line["envs"].items():
            for key, value in figures.items():
                if key.startswith("pass@") and value is not None:
                    series.setdefault(f"{env} {key}", []).append((line["step"], value))
    return series


def _running_mean(values: list[float]) -> list[float]:
    """Each value's mean with the ones before it, ``_SMOOTHING`` in all (fewer at first)."""
    means = []
    for end in range(1, len(values) + 1):
        window = [v for v in values[max(0, end - _SMOOTHING) : end] if not math.isnan(v)]
        means.append(sum(window) / len(window) if window else math.nan)
    return means


def _number(value: object) -> float:
    return float(value) if isinstance(value, int | float) else math.nan
