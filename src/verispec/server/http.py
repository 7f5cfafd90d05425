"""uvicorn, configured for clients that misbehave: the HTTP protocol and the server class that
``verispec serve`` runs (tests build their servers from them too).

  * A connection must deliver a complete request head within --header-timeout seconds of
    opening (or of its previous response): a client that sends half its headers and stalls
    (slowloris) is disconnected instead of holding a file descriptor forever. uvicorn closes
    idle keep-alive connections, but stops timing one as soon as any byte arrives.
  * Beyond --max-connections open connections a new one is closed at once.
  * On SIGTERM or Ctrl-C the app is told to drain (GenerationService.drain) before uvicorn
    starts its graceful shutdown, which waits a little longer than --drain-timeout.

Not here: request checks (app.py) and the body timeout (app._read_json).
"""

from __future__ import annotations

import asyncio

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from .settings import ServerSettings


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a request-head deadline and a connection cap."""

    header_timeout = 10.0  # set per server by guarded_protocol()
    max_connections = 256

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_deadline: asyncio.TimerHandle | None = None
        if len(self.connections) > self.max_connections:
            self.transport.close()  # connection_lost removes it from the set
            return
        self._arm_head_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_deadline()
        super().connection_lost(exc)

    def handle_events(self) -> None:
        super().handle_events()
        if self.conn.their_state is not h11.IDLE:  # a request head has arrived
            self._disarm_head_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_head_deadline()  # the next request on this connection gets the same

    def _arm_head_deadline(self) -> None:
        self._disarm_head_deadline()
        self._head_deadline = self.loop.call_later(self.header_timeout, self._head_too_slow)

    def _disarm_head_deadline(self) -> None:
        deadline = getattr(self, "_head_deadline", None)
        if deadline is not None:
            deadline.cancel()
            self._head_deadline = None

    def _head_too_slow(self) -> None:
        self._head_deadline = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


def guarded_protocol(settings: ServerSettings) -> type[GuardedH11Protocol]:
    """A protocol class with this server's limits (uvicorn instantiates it per connection)."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,),
                {"header_timeout": settings.header_timeout,
                 "max_connections": settings.max_connections})


def uvicorn_config(app, settings: ServerSettings, log_level: str = "info") -> uvicorn.Config:
    return uvicorn.Config(app, http=guarded_protocol(settings), log_level=log_level,
                          timeout_keep_alive=max(1, round(settings.keep_alive_timeout)),
                          timeout_graceful_shutdown=round(settings.drain_timeout) + 2)


class VerispecServer(uvicorn.Server):
    """uvicorn's server, telling the app to drain when a shutdown signal arrives (from the
    signal handler, or from another thread: the drain is scheduled on the server's loop)."""

    _loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)

    def handle_exit(self, sig: int, frame) -> None:
        drain = getattr(getattr(self.config.app, "state", None), "drain", None)
        if drain is not None and self._loop is not None and not self.should_exit:
            self._loop.call_soon_threadsafe(drain)
        super().handle_exit(sig, frame)
