"""A real uvicorn server on 127.0.0.1 in a background thread, for the server's tests."""

from __future__ import annotations

import socket
import threading
import time

import uvicorn


class ServerThread:
    """``with ServerThread(app) as s: s.url``: uvicorn serving ``app`` on a free port of
    127.0.0.1 (the socket is bound before the thread starts, so no other process can take
    the port in between)."""

    def __init__(self, app, start_timeout: float = 120.0):
        self.app, self.start_timeout = app, start_timeout

    def __enter__(self) -> ServerThread:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning",
                                                    timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True)
        self.thread.start()
        deadline = time.monotonic() + self.start_timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()
        assert not self.thread.is_alive(), "uvicorn did not stop"
