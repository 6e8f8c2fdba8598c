"""``/blocks``: the viz layer's offline HTML page, fed live from the engine's events.

``LiveBlocks`` records the engine's steps with ``EngineRecorder`` (every block's owners, ref
count and tokens after each step) into a log bounded to the last ``history`` steps, and
renders the same page ``paged-jax viz`` writes, opened on the newest step and reloading itself
while it shows it. The page fetches nothing: its data is inline and its Content Security
Policy forbids every other request.
"""

from __future__ import annotations

from paged_jax.viz.engine_events import EngineRecorder
from paged_jax.viz.html import render_html
from paged_jax.viz.log import RunLog
from paged_jax.viz.recorder import Recorder

__all__ = ["LiveBlocks"]


class LiveBlocks:
    """Subscribes to ``engine`` at construction. ``flush`` records what changed outside a
    step (aborts); ``window`` copies the log (call both between steps: the recorder runs
    inside ``engine.step``); ``render`` makes the page from a copy, anywhere."""

    def __init__(self, engine, history: int = 256, refresh_s: float = 2.0):
        if not refresh_s > 0:
            raise ValueError(f"refresh_s must be > 0. Got {refresh_s!r}.")
        self.refresh_s = refresh_s
        self.recorder = EngineRecorder(engine, Recorder("serve", keep_last=history))

    def flush(self) -> None:
        self.recorder.flush("requests aborted")

    def window(self) -> RunLog:
        log = self.recorder.log
        return RunLog(config=log.config, snapshots=list(log.snapshots), events=list(log.events),
                      scenario=log.scenario)

    def render(self, log: RunLog) -> str:
        return render_html(log, refresh=self.refresh_s)
