"""``logged_compiles()``: the jit compilations jax logs inside a ``with`` block."""

from __future__ import annotations

import contextlib
import logging

import jax


@contextlib.contextmanager
def logged_compiles():
    """Yields a list that fills with jax's "Compiling jit(...) ..." log messages while the
    block runs (``jax.log_compiles``)."""
    seen: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record):
            if "Compiling" in record.getMessage():
                seen.append(record.getMessage())

    handler, log = Collect(), logging.getLogger("jax")
    log.addHandler(handler)
    try:
        with jax.log_compiles(True):
            yield seen
    finally:
        log.removeHandler(handler)
