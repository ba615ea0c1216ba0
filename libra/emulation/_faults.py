"""The faults the emulated server injects: one seeded draw per generation request picks at
most one of them, at the rates its config gives, so a run's faults repeat with its seed; and
how each strikes a request (an HTTP 500, a stall, a death, a cut reply, a garbled body)."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Literal, NoReturn

from libra._asgi import ClientDisconnected, Receive
from libra.emulation._http import HTTPError
from libra.emulation._reply import Generation

Fault = Literal["error", "stall", "abort", "garbage", "die"]


class EmulatedServerDied(ConnectionError):
    """The in-process emulated server died (``die_rate``/``die_after``): every request
    fails as a connection to a server that is not there."""


class Faults:
    """What goes wrong with the next generation request, drawn from a seeded RNG.

    ``rates`` are tried in order against one uniform draw. ``die_after`` kills the server on
    the request after that many; ``on_death`` runs when it dies (a served process exits).
    """

    def __init__(
        self,
        rates: dict[Fault, float],
        seed: int,
        die_after: int | None = None,
        on_death: Callable[[], None] | None = None,
    ) -> None:
        self.rates = rates
        self.die_after = die_after
        self.on_death = on_death
        self.dead = False
        self._rng = random.Random(f"failures:{seed}")
        self._requests = 0

    def draw(self) -> Fault | None:
        """This request's fault, if any; a death raises :class:`EmulatedServerDied`."""
        self._requests += 1
        if self.die_after is not None and self._requests > self.die_after:
            self.die()
        draw = self._rng.random()
        for fault, rate in self.rates.items():
            if draw < rate:
                if fault == "die":
                    self.die()
                return fault
            draw -= rate
        return None

    def die(self) -> NoReturn:
        self.dead = True
        if self.on_death is not None:
            self.on_death()
        raise EmulatedServerDied("the emulated server died (injected)")

    def check_alive(self) -> None:
        if self.dead:
            raise EmulatedServerDied("the emulated server died (injected)")

    def cut(self, tokens: int) -> int:
        """An injected abort: how many of a reply's ``tokens`` were produced."""
        return self._rng.randrange(max(1, tokens))

    def garble(self, body: bytes) -> bytes:
        """Injected garbage: the answer cut short (invalid JSON), or JSON that is no
        OpenAI response."""
        if self._rng.random() < 0.5:
            return body[: self._rng.randrange(1, len(body))]
        return b'{"object": "garbage", "choices": "none"}'

    async def strike(self, receive: Receive) -> Fault | None:
        """The fault injected into this generation request, if any. An HTTP 500, a stall
        (an answer never comes) and a death happen here; an abort and garbage are applied
        to the reply later (:meth:`cut_if_aborted`, :meth:`answer_body`)."""
        fault = self.draw()
        if fault == "error":
            rate = self.rates["error"]
            raise HTTPError(500, f"Injected failure (error_rate={rate}).", "InternalServerError")
        if fault == "stall":
            await _wait_for_disconnect(receive)
        return fault

    def cut_if_aborted(self, reply: Generation, fault: Fault | None) -> Generation:
        if fault != "abort":
            return reply
        return Generation(reply.tokens[: self.cut(len(reply.tokens))], "abort")

    def answer_body(self, body: bytes, fault: Fault | None) -> bytes:
        return self.garble(body) if fault == "garbage" else body


async def _wait_for_disconnect(receive: Receive) -> None:
    """A stalled request: nothing is answered; it ends when the client gives up."""
    while (await receive())["type"] != "http.disconnect":
        pass
    raise ClientDisconnected
