"""Run the app under uvicorn, with a graceful shutdown that includes the engine.

The listening sockets are bound by `bind_sockets` before the model loads (the CLI does so),
so a taken port or a bad host fails at once; uvicorn starts listening on them when it
starts.

On SIGTERM or SIGINT uvicorn stops accepting connections, closes idle ones and waits for
open responses to end; it knows nothing of the engine thread, whose streams could run for
minutes. So `Server.shutdown` first tells the worker: requests running or queued go on
for `shutdown_timeout` seconds, then the running one is stopped at its next cycle (its
stream ends with a `server_shutting_down` error event and `data: [DONE]`) and the queued
ones get 503. While requests still run within that grace, the listener stays open, so a
new client gets that 503 (`server_shutting_down`, Retry-After) instead of a refused
connection; once none runs, or the grace is over, uvicorn's own shutdown follows. uvicorn
cancels whatever is still open `_SEND_SLACK` seconds after the rest of the grace (a client
that stopped reading), then the app's lifespan ends and stops the worker thread.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import signal
import socket
import time

import uvicorn
from fastapi import FastAPI

_SEND_SLACK = 5.0  # seconds for streams to flush their last events after the engine stops
_DRAIN_POLL = 0.05  # seconds between looks at the worker while it drains
STARTUP_FAILURE = 3  # uvicorn's exit code when the server cannot start (port taken, ...)

log = logging.getLogger("uvicorn.error")  # where uvicorn itself says it is running


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _resolve(host: str, port: int) -> list[tuple[socket.AddressFamily, tuple]]:
    """The distinct (family, address) pairs to bind for `host` ("" or 0.0.0.0: all IPv4)."""
    if host and all(c.isdigit() or c == "." for c in host):
        try:  # dotted digits are an IPv4 address or nothing: never a name to look up
            socket.inet_aton(host)
        except OSError:
            raise OSError(f"cannot listen on {_address(host, port)}: {host} is not an IPv4 "
                          f"address (give --host an IP address or a host name)") from None
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                   proto=socket.IPPROTO_TCP, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise OSError(f"cannot listen on {_address(host, port)}: {e.strerror} (give --host "
                      f"an IP address or a host name this machine resolves)") from None
    addrs = list(dict.fromkeys((family, addr) for family, _, _, _, addr in infos))
    return addrs[:1] if port == 0 else addrs  # port 0: one socket, so one port, to report


def bind_sockets(host: str, port: int) -> list[socket.socket]:
    """TCP sockets bound to every address `host` resolves to, not yet listening (uvicorn
    listens when it starts). Raises OSError("cannot listen on HOST:PORT: why")."""
    addrs = _resolve(host, port)
    socks: list[socket.socket] = []
    try:
        for family, addr in addrs:
            # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on connections of a socket
            # whose proto says TCP; without it Nagle holds the first body chunk after the
            # headers until the client's delayed ACK (about 40 ms per request on a
            # kept-alive connection).
            sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
            socks.append(sock)
            # A restart can reuse the port while the old process's connections linger.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6 and len(addrs) > 1:  # as asyncio: one family each
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(addr)
    except OSError as e:
        for sock in socks:
            sock.close()
        hint = " (another server holds it: stop that one or choose another --port)" \
            if e.errno == errno.EADDRINUSE else ""
        raise OSError(f"cannot listen on {_address(host, port)}: {e.strerror or e}{hint}") \
            from None
    return socks


class Server(uvicorn.Server):
    """uvicorn's server whose shutdown first drains the engine worker (module doc)."""

    def __init__(self, config: uvicorn.Config, shutdown_timeout: float) -> None:
        self._auto_timeout = config.timeout_graceful_shutdown is None
        if self._auto_timeout:
            config.timeout_graceful_shutdown = shutdown_timeout + _SEND_SLACK
        super().__init__(config)
        self.shutdown_timeout = shutdown_timeout

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started and sockets:  # uvicorn says where it runs only for its own sockets
            for sock in sockets:
                host, port = sock.getsockname()[:2]
                log.info("Uvicorn running on http://%s (Press CTRL+C to quit)",
                         _address(host, port))

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        app = self.config.app
        worker = getattr(getattr(app, "state", None), "worker", None)
        if worker is not None:
            worker.begin_shutdown(self.shutdown_timeout)
            deadline = time.monotonic() + self.shutdown_timeout
            # Keep listening while requests run: new ones get the worker's 503.
            while worker.inflight > 0 and time.monotonic() < deadline and not self.force_exit:
                await asyncio.sleep(_DRAIN_POLL)
            if self._auto_timeout:  # what is left of the grace, then the flush
                left = max(deadline - time.monotonic(), 0.0)
                self.config.timeout_graceful_shutdown = left + _SEND_SLACK
        await super().shutdown(sockets)


def serve(app: FastAPI, *, host: str = "127.0.0.1", port: int = 8000,
          sockets: list[socket.socket] | None = None, log_level: str = "info",
          shutdown_timeout: float = 5.0) -> int:
    """Serve `app` until SIGTERM/SIGINT, then shut down gracefully; the exit code.

    sockets: bound sockets from `bind_sockets` (host and port are then unused); without
    them, `host` and `port` are bound here.
    """
    if sockets is None:
        sockets = bind_sockets(host, port)
    server = Server(uvicorn.Config(app, log_level=log_level, lifespan="on"), shutdown_timeout)

    # uvicorn answers SIGTERM/SIGINT with its graceful shutdown, then re-raises the signal
    # to the handler it found, so that the default one ends the process: killed by
    # SIGTERM (exit 143), or a KeyboardInterrupt traceback. The shutdown already answered
    # the signal, so the handler it finds only asks for exit (which also covers a signal
    # arriving before uvicorn installs its own) and the process exits 0.
    def handled(sig: int, frame: object) -> None:
        server.should_exit = True

    previous = {s: signal.signal(s, handled) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run(sockets=sockets)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    return 0 if server.started else STARTUP_FAILURE
