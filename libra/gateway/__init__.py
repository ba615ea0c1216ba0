"""``libra serve``: one OpenAI-compatible endpoint for a whole fleet, C-MLFQ behind it.

The HTTP surface speaks the OpenAI API; the core (:class:`Sessions`) keeps sessions,
feeds the scheduler the tool results that arrive in clients' requests and records
sessions as trajectories. The surface sees the core only through :class:`GatewayCore`
(``_protocol.py``).
"""

from libra.gateway._config import GatewayConfig
from libra.gateway._protocol import ChatReply, ChatTurn, FinishReason, FleetStatus, GatewayCore
from libra.gateway._sessions import Sessions

__all__ = [
    "ChatReply",
    "ChatTurn",
    "FinishReason",
    "FleetStatus",
    "GatewayConfig",
    "GatewayCore",
    "Sessions",
]
