"""``libra train --online``: the step's groups are sessions that agents elsewhere played.

The run serves the gateway (``libra serve``'s OpenAI surface) in front of its fleet and
has no task source of its own. Any program, in any language, plays episodes against it
with the documented session protocol: a session named by ``X-Libra-Session``, its
reward and end reported with ``POST /v1/libra/report``. Each session that ends comes
here (:meth:`OnlineGroups.add`):

- ended by its client (``done``) with a reward: it joins the group of its prompt (the
  messages before its first reply: sessions that start alike are samples of one task);
- ended because its client rewrote an earlier message (``history_edited``: the gateway
  went on in a new session under the same key, and never trains on tokens the model
  did not sample): it waits for the key's next session to end, and the two are one
  episode's pieces (``libra.engine.join_pieces``), one sample of several exact
  sequences, in the group of the prompt it started from;
- anything else is logged with its reason and not trained, counted in the step's
  ``dropped``: ``idle_ttl`` (it never reported an end: it has no reward), ``unscored``
  (done without a reward), and the gateway's own ends (``evicted``, ``shutdown``, a
  failure); an unkeyed session's ``history_edited`` too (nothing names its next one).

A group is complete at ``samples_per_prompt`` sessions; later ones of the same prompt
start its next group. One that has waited ``group_wait_s`` since its first session
ended goes into a step as it is if it has two sessions or more, and is dropped
(``lone sample``) otherwise. A step takes the first ``prompts_per_step`` complete
groups; its records are then written to ``rollouts/step-K.jsonl`` under the step's
group ids (those no step took when the run ends, under the next step's number).
Clients keep playing while a step trains, so groups may wait: with ``grpo.stale =
"drop"``, one sampled on weights older than ``grpo.max_staleness`` allows leaves before
the step takes it (counted ``stale``); with ``reweight`` the batch builder weighs it, as
in every run.
"""

from __future__ import annotations

import sys
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import msgspec
from pydantic import Field, PositiveFloat

from libra._clock import now
from libra.config import Section
from libra.engine import Group, TrajectoryRecord, join_pieces
from libra.envs import GroupId, TaskId
from libra.train._rollout_log import RolloutLog, step_file
from libra.train._settings import RunSettings

_POLL_S = 0.5  # how often a waiting step looks for groups past their wait


class OnlineConfig(Section):
    """``[online]``: the gateway a ``libra train --online`` run serves its agents on."""

    host: str = Field("127.0.0.1", description="the address the gateway listens on")
    port: int = Field(8080, ge=0, le=65535, description="its port (0: any free one)")
    no_auth: bool = Field(False, description="no API key (only on a loopback address)")
    api_key_file: Path | None = Field(
        None, description="user keys, one a line (else $LIBRA_API_KEY)"
    )
    admin_key_file: Path | None = Field(
        None, description="admin keys, one a line (else $LIBRA_ADMIN_KEY)"
    )
    session_ttl_s: PositiveFloat = Field(
        600.0, description="a session idle this long ends (idle_ttl): recorded, not trained"
    )
    group_wait_s: PositiveFloat = Field(
        300.0,
        description="a group not full this long after its first session ended trains as "
        "it is with two sessions or more, else is dropped (lone sample)",
    )


@dataclass
class OnlineGroups:
    """The groups of the run's steps, made of the sessions the gateway ends (see the
    module); what :class:`libra.train.TrainRun` reads them from in an online run."""

    config: RunSettings
    online: OnlineConfig
    log: RolloutLog
    groups: dict[int, list[Group]] = field(default_factory=lambda: defaultdict(list))
    dropped: defaultdict[int, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))
    reused: dict[int, int] = field(default_factory=dict)  # (a resume takes nothing back)
    retried: dict[int, int] = field(default_factory=dict)
    reusable: dict[int, list[TrajectoryRecord]] = field(default_factory=dict)
    _gathering: dict[str, list[TrajectoryRecord]] = field(default_factory=dict)  # by task
    _pieces: dict[str, list[TrajectoryRecord]] = field(default_factory=dict)  # by client key
    _first_at: dict[str, float] = field(default_factory=dict)
    _made: Counter[str] = field(default_factory=Counter)  # groups made of each task
    _ready: list[list[TrajectoryRecord]] = field(default_factory=list)
    _window: int = 0  # the step the sessions ending now go to
    _changed: anyio.Event = field(default_factory=anyio.Event)

    jobs_left = 0  # no job is ever submitted: what the allocation tail reads

    def submit(self, step: int) -> None:
        """Nothing to submit: agents elsewhere play. The sessions that end from now
        on count toward step ``step`` (its drops are its line's)."""
        self._window = max(self._window, step)

    def add(self, client_key: str | None, record: TrajectoryRecord) -> None:
        """A session the gateway ended (``Sessions.on_end``)."""
        if client_key is not None:
            if record.stop_reason == "history_edited":  # its episode goes on: keep the piece
                self._pieces.setdefault(client_key, []).append(record)
                return
            if earlier := self._pieces.pop(client_key, None):
                record = join_pieces([*earlier, record])
        reason = _untrainable(record)
        if reason is not None:
            self.dropped[self._window][reason] += 1
            self.log.append(msgspec.structs.replace(record, step=self._window))
            return
        members = self._gathering.setdefault(record.task_id, [])
        self._first_at.setdefault(record.task_id, now())
        members.append(record)
        if len(members) == self.config.samples_per_prompt:
            self._complete(record.task_id)

    async def of_step(self, step: int, tick: Callable[[], None]) -> list[Group]:
        """Step ``step``'s groups: the first ``prompts_per_step`` complete ones."""
        self._window = max(self._window, step)
        self._drop_stale(step)
        while len(self._ready) < self.config.prompts_per_step:
            self._close_waited()
            self._drop_stale(step)
            seen = len(self._ready)
            with anyio.move_on_after(_POLL_S):
                await self._changed.wait()
            for _ in range(len(self._ready) - seen):
                tick()
        taken = self._ready[: self.config.prompts_per_step]
        del self._ready[: self.config.prompts_per_step]
        self._window = step + 1
        return [self._as_group(step, members) for members in taken]

    def close(self) -> None:
        """The run is over: the sessions that ended and no step took are written to the
        log under the next step (never trained), said in one line on stderr."""
        left = [r for members in (*self._ready, *self._gathering.values()) for r in members]
        left += [r for pieces in self._pieces.values() for r in pieces]
        for record in left:
            self.log.append(msgspec.structs.replace(record, step=self._window))
        if left:
            print(
                f"libra train --online: {len(left)} sessions ended that no step took: "
                f"written to {step_file(self.log.run_dir, self._window)}, not trained",
                file=sys.stderr,
            )

    async def read_records(self) -> None:
        """The gateway hands the sessions over (:meth:`add`): nothing to read."""
        await anyio.sleep_forever()

    # ------------------------------------------------------------------ internals

    def _complete(self, task: str) -> None:
        self._ready.append(self._gathering.pop(task))
        del self._first_at[task]
        self._changed.set()
        self._changed = anyio.Event()

    def _close_waited(self) -> None:
        """Groups past ``group_wait_s``: ready with two sessions or more, else dropped."""
        deadline = now() - self.online.group_wait_s
        for task in [task for task, at in self._first_at.items() if at <= deadline]:
            if len(self._gathering[task]) >= 2:
                self._complete(task)
                continue
            (lone,) = self._gathering.pop(task)
            del self._first_at[task]
            self.dropped[self._window]["lone sample"] += 1
            self.log.append(msgspec.structs.replace(lone, step=self._window))

    def _drop_stale(self, step: int) -> None:
        """With ``grpo.stale = "drop"``: the ready groups sampled on weights older than
        ``grpo.max_staleness`` allows at step ``step`` (whose weights are ``v{step}``)
        leave, counted, and fresher ones are waited for; ``reweight`` keeps them for the
        batch builder to weigh."""
        grpo = self.config.grpo
        if grpo.max_staleness is None or grpo.stale != "drop":
            return
        oldest = step - grpo.max_staleness
        stale = [members for members in self._ready if _oldest_version(members) < oldest]
        for members in stale:
            self._ready.remove(members)
            self.dropped[step]["stale"] += len(members)
            for record in members:
                self.log.append(msgspec.structs.replace(record, step=step))

    def _as_group(self, step: int, members: list[TrajectoryRecord]) -> Group:
        """``members`` as a group of step ``step``: its own task id (a prompt's n-th
        group), written to the step's log."""
        task, env = members[0].task_id, members[0].env
        key = task.removeprefix(f"{env}/")  # str(TaskId(env, key)): the env from its field
        self._made[task] += 1
        group = GroupId(step, TaskId(env, f"{key}.{self._made[task]}"))
        records = []
        for sample, record in enumerate(members):
            record = msgspec.structs.replace(
                record, step=step, sample=sample, task_id=str(group.task), group_id=str(group)
            )
            self.log.append(record)
            records.append(record)
        return Group(group, tuple(records))


def _untrainable(record: TrajectoryRecord) -> str | None:
    """Why a session the gateway ended does not train (None: it may)."""
    if record.status == "failed":
        return "failed"
    if record.stop_reason not in ("done", "max_context_tokens"):
        return record.stop_reason  # idle_ttl, history_edited, evicted, shutdown
    if record.reward is None:
        return "unscored"
    return None


def _oldest_version(members: list[TrajectoryRecord]) -> int:
    """The oldest weight version that sampled a token of ``members``."""
    versions = [
        span.version for r in members for span in r.weight_versions if span.end > span.start
    ]
    return min(versions, default=0)
