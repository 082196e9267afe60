"""Run the app on a free local port in a background thread (tests, benchmarks, notebooks)."""

from __future__ import annotations

import threading
import time


class BackgroundServer:
    """A uvicorn server for `app` on 127.0.0.1, started on construction; `stop()` ends it
    with the same graceful shutdown as `specscope serve` (server/serve.py)."""

    def __init__(self, app, start_timeout: float = 20.0, shutdown_timeout: float = 5.0) -> None:
        import uvicorn

        from specscope.server.serve import Server, bind_sockets

        # A TCP socket on a free port (bind_sockets says why the proto must be TCP).
        (sock,) = bind_sockets("127.0.0.1", 0)
        self.app = app
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = Server(uvicorn.Config(app, log_level="warning", lifespan="on"),
                             shutdown_timeout)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]},
                                       daemon=True)
        self.thread.start()
        deadline = time.time() + start_timeout
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("the server thread died while starting")
            if time.time() > deadline:
                raise RuntimeError(f"the server did not start within {start_timeout} s")
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
