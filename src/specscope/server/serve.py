"""Run the app under uvicorn, with a graceful shutdown that includes the engine.

On SIGTERM or SIGINT uvicorn stops accepting connections, closes idle ones and waits for
open responses to end; it knows nothing of the engine thread, whose streams could run for
minutes. So `Server.shutdown` first tells the worker: requests running or queued go on
for `shutdown_timeout` seconds, then the running one is stopped at its next cycle (its
stream ends with a `server_shutting_down` error event and `data: [DONE]`) and the queued
ones get 503. uvicorn cancels whatever is still open `_SEND_SLACK` seconds after that (a
client that stopped reading), then the app's lifespan ends and stops the worker thread.
"""

from __future__ import annotations

import signal

import uvicorn
from fastapi import FastAPI

_SEND_SLACK = 5.0  # seconds for streams to flush their last events after the engine stops
STARTUP_FAILURE = 3  # uvicorn's exit code when the server cannot start (port taken, ...)


class Server(uvicorn.Server):
    """uvicorn's server whose shutdown first starts the engine worker's (module doc)."""

    def __init__(self, config: uvicorn.Config, shutdown_timeout: float) -> None:
        if config.timeout_graceful_shutdown is None:
            config.timeout_graceful_shutdown = shutdown_timeout + _SEND_SLACK
        super().__init__(config)
        self.shutdown_timeout = shutdown_timeout

    async def shutdown(self, sockets=None) -> None:
        app = self.config.app
        worker = getattr(getattr(app, "state", None), "worker", None)
        if worker is not None:
            worker.begin_shutdown(self.shutdown_timeout)
        await super().shutdown(sockets)


def serve(app: FastAPI, *, host: str, port: int, log_level: str = "info",
          shutdown_timeout: float = 5.0) -> int:
    """Serve `app` until SIGTERM/SIGINT, then shut down gracefully; the exit code."""
    server = Server(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                   lifespan="on"), shutdown_timeout)

    # uvicorn answers SIGTERM/SIGINT with its graceful shutdown, then re-raises the signal
    # to the handler it found, so that the default one ends the process: killed by
    # SIGTERM (exit 143), or a KeyboardInterrupt traceback. The shutdown already answered
    # the signal, so the handler it finds only asks for exit (which also covers a signal
    # arriving before uvicorn installs its own) and the process exits 0.
    def handled(sig: int, frame: object) -> None:
        server.should_exit = True

    previous = {s: signal.signal(s, handled) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run()
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    return 0 if server.started else STARTUP_FAILURE
