"""``running(app)``: uvicorn serving an app in a background thread, for benchmarks, tests
and notebooks that drive the server from the same process."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

__all__ = ["running"]

START_TIMEOUT_S = 60.0


@contextlib.contextmanager
def running(app, host: str = "127.0.0.1") -> Iterator[str]:
    """Serve ``app`` with uvicorn in a background thread on a free port of ``host``; yields
    the base URL (``http://host:port``) once the server accepts connections, and shuts it
    down (lifespan included) on exit."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))  # bound here and handed over: no other process can take the port
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                           lifespan="on", access_log=False))
    failed: list[BaseException] = []

    def run():
        try:
            server.run(sockets=[sock])
        except BaseException as e:  # reported by the caller's thread below
            failed.append(e)

    thread = threading.Thread(target=run, name="paged_jax bench uvicorn", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"uvicorn did not start on {host}:{port}"
                                   + (f": {failed[0]!r}" if failed else "."))
            time.sleep(0.01)
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(START_TIMEOUT_S)
        sock.close()
        if thread.is_alive():
            raise RuntimeError(f"uvicorn on {host}:{port} did not shut down within "
                               f"{START_TIMEOUT_S:.0f} s.")
    if failed:
        raise RuntimeError(f"uvicorn on {host}:{port} failed: {failed[0]!r}") from failed[0]
