"""Agents as rollouts: the user's own program plays an episode through an OpenAI client.

An agent is an ``async def agent(task, client)``: ``task`` a :class:`libra.envs.Task`,
``client`` an ``openai.AsyncOpenAI`` bound to a session of its own, whose calls the
run's scheduler routes and the gateway's core (``libra.gateway.Sessions``) records with
exact token ids. It returns the episode's reward, or None to let the run's env score the
final conversation. :class:`AgentRunner` plays a :class:`libra.engine.TrajectoryJob`
with it, so a :class:`libra.engine.RolloutSession` runs agents as it runs envs.
"""

from libra.agents._agent import Agent, AgentFunction, load_agent
from libra.agents._runner import AgentRunner

__all__ = ["Agent", "AgentFunction", "AgentRunner", "load_agent"]
