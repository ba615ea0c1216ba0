"""What plays a run's episodes: an env's trajectories, or an agent's (``rollout.agent``).
Both front ends that roll out (``libra rollout``, ``libra train``) open their session
here, so an agent runs wherever an env does."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from libra.agents import Agent, AgentRunner, load_agent
from libra.config import UsageError
from libra.engine import Engine, RolloutSession, TrajectoryRunner, run_trajectory
from libra.envs import Env, env_name, load_env
from libra.launch._gateway import open_gateway
from libra.launch._rollout import RolloutConfig


@dataclass(frozen=True)
class Player:
    """The rollout's env class (None: an agent with no env to score it), its agent, and
    the name its records carry."""

    env_cls: type[Env] | None
    agent: Agent | None
    name: str


@dataclass(frozen=True)
class Share:
    """One player of a run's mixture: how often a step's prompt is its, and its task
    file (None: seeded tasks)."""

    player: Player
    weight: float = 1.0
    tasks: Path | None = None


def load_mixture(config: RolloutConfig) -> list[Share]:
    """``rollout.envs``, loaded; else the one env or agent ``config`` names."""
    if config.envs is None:
        return [Share(load_player(config), 1.0, config.tasks)]
    shares = []
    for entry in config.envs:
        env_cls = load_env(entry.env)
        player = Player(env_cls, None, env_name(entry.env, env_cls))
        shares.append(Share(player, entry.weight, entry.tasks))
    names = [share.player.name for share in shares]
    if len(set(names)) < len(names):
        raise UsageError(f"rollout.envs: two envs go by one name ({', '.join(names)})")
    return shares


def load_player(config: RolloutConfig) -> Player:
    """The env and the agent ``config`` names, loaded (a bad name is one clear error)."""
    if config.envs is not None:
        raise UsageError("rollout.envs is libra train's mixture: name one env (rollout.env)")
    env_cls = load_env(config.env) if config.env is not None else None
    if config.agent is not None:
        agent = load_agent(config.agent)
        return Player(env_cls, agent, agent.name)
    if config.env is None or env_cls is None:
        raise UsageError("name an env (rollout.env, --env) or an agent (rollout.agent, --agent)")
    return Player(env_cls, None, env_name(config.env, env_cls))


@asynccontextmanager
async def open_agent(
    engine: Engine, agent: Agent, *, scorer: type[Env] | None = None, timeout_s: float = 600.0
) -> AsyncIterator[AgentRunner]:
    """A runner of ``agent``'s episodes on ``engine``, through a gateway of its own on a
    free loopback port (``libra.agents``)."""
    runner = AgentRunner(engine, agent, scorer=scorer, timeout_s=timeout_s)
    config, keys = runner.gateway_config(), runner.keys()
    async with (
        open_gateway(
            engine, config, keys, on_end=runner.ended, episode_of=runner.episode_of
        ) as gateway,
        runner.through(gateway.url, gateway.sessions),
    ):
        yield runner


@asynccontextmanager
async def open_session(
    engine: Engine, config: RolloutConfig, player: Player
) -> AsyncIterator[RolloutSession]:
    """A rollout session over ``engine`` whose jobs ``player`` plays."""
    async with AsyncExitStack() as stack:
        runner: TrajectoryRunner = run_trajectory
        if player.agent is not None:
            runner = await stack.enter_async_context(
                open_agent(
                    engine, player.agent, scorer=player.env_cls, timeout_s=config.agent_timeout_s
                )
            )
        yield await stack.enter_async_context(RolloutSession(engine, runner=runner))
