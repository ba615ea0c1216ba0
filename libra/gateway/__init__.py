"""``libra serve``: one OpenAI-compatible endpoint for a whole fleet, C-MLFQ behind it.

The HTTP surface speaks the OpenAI API; the core (:class:`Sessions`) keeps sessions,
feeds the scheduler the tool results that arrive in clients' requests and records
sessions as trajectories. The surface sees the core only through :class:`GatewayCore`
(``_protocol.py``).
"""

from libra.gateway._app import DEFAULT_MAX_BODY_BYTES, GatewayApp, create_gateway
from libra.gateway._auth import AuthError, Keys, gateway_keys
from libra.gateway._config import GatewayConfig
from libra.gateway._metrics import GatewayMetrics, Totals
from libra.gateway._protocol import ChatReply, ChatTurn, FinishReason, FleetStatus, GatewayCore
from libra.gateway._server import GatewayServer, serving, uvicorn_config
from libra.gateway._sessions import Sessions
from libra.openai import ADMIN_HEADER, SESSION_HEADER  # the surface's own headers

__all__ = [
    "ADMIN_HEADER",
    "DEFAULT_MAX_BODY_BYTES",
    "SESSION_HEADER",
    "AuthError",
    "ChatReply",
    "ChatTurn",
    "FinishReason",
    "FleetStatus",
    "GatewayApp",
    "GatewayConfig",
    "GatewayCore",
    "GatewayMetrics",
    "GatewayServer",
    "Keys",
    "Sessions",
    "Totals",
    "create_gateway",
    "gateway_keys",
    "serving",
    "uvicorn_config",
]
