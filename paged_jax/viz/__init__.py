"""Pictures of the block layout, over time.

Record a run (``Recorder`` for any ``BlockState``, ``RecordingPool`` for the pure ops by
name, ``EngineRecorder`` for an ``LLMEngine`` from its events), save its ``RunLog`` as JSON,
and draw it: ``terminal`` (text, ``rich`` live view), ``png`` (one step), ``timeline``
(heatmap, GIF), ``curves``, ``html`` (offline page) and ``perfetto`` (trace). The picture
modules import matplotlib/Pillow/rich lazily: install the ``images`` extra for them.
"""

from paged_jax.viz.ascii import render_layout
from paged_jax.viz.engine_events import EngineRecorder
from paged_jax.viz.log import Event, RunLog, Snapshot
from paged_jax.viz.pool import RecordingPool
from paged_jax.viz.recorder import Recorder
from paged_jax.viz.terminal import render_step

__all__ = ["EngineRecorder", "Event", "Recorder", "RecordingPool", "RunLog", "Snapshot",
           "render_layout", "render_step"]
