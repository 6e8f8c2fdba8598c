"""The colours every view shares: the swatches for block states, and one style per request.

A request's style is a colour from ``PALETTE`` plus a hatch. The 64 colours are at least
``MIN_DELTA_E`` apart in CIELAB (CIE76), and at least ``MIN_SWATCH_DELTA_E`` from every
swatch (free, held, shared, several owners, changed), so no request ever looks like a block
state. They were picked greedily, farthest point first, from an sRGB grid (lightness 35..80,
chroma >= 30), starting from Tableau 10 without its grey, which the small scenarios keep.

``assign_styles`` hands styles out so that requests alive at the same time never share one:

* the first 64 requests get the 64 colours in order, unhatched;
* a later request takes the unhatched colour whose last holder ended longest ago (so a colour
  comes back only after its previous request is gone, as late as possible);
* only while more than 64 requests are alive at once does a request get a hatched style
  (``HATCHES``, the same colours again with stripes). That gives 256 styles; beyond 256
  requests alive at once styles repeat, and ``assign_styles`` warns.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence

import numpy as np

FREE_COLOR = "#eeeeee"  # a free block
HELD_COLOR = "#9e9e9e"  # in use, but by no table (a loose or cached reference)
SHARED_MARK = "#111111"  # band on a block with ref count > 1
SHARED_OWNERS_COLOR = "#4d4d4d"  # a block in several tables at once (where stripes don't fit)
CHANGED_COLOR = "#ff00aa"  # outline of a block touched in this step
SWATCHES = {"free": FREE_COLOR, "held": HELD_COLOR, "shared": SHARED_MARK,
            "several owners": SHARED_OWNERS_COLOR, "changed": CHANGED_COLOR}

PALETTE = (
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#bcbd22",
    "#17becf", "#5800f8", "#f800e8", "#206040", "#b0d098", "#0058f0", "#f80078", "#f8b078",
    "#686000", "#00e000", "#00e0a8", "#8818b0", "#f88088", "#984800", "#c0b8f0", "#a02858",
    "#c08800", "#4088f8", "#b00088", "#88d000", "#e870f8", "#206000", "#784870", "#80a040",
    "#48a888", "#b030f8", "#f0a8c8", "#10e060", "#60c0f8", "#f07850", "#a03030", "#a89860",
    "#f80000", "#3848b0", "#80d880", "#9868f0", "#f0c000", "#d8c060", "#008848", "#b86880",
    "#008080", "#5030e0", "#505090", "#e03858", "#d8a0f8", "#f86098", "#00d8c8", "#a87040",
    "#a880b0", "#c84800", "#883080", "#709060", "#a0d050", "#e09888", "#3090b0", "#8890e0",
)  # fmt: skip
MIN_DELTA_E = 20.0  # between any two palette colours
MIN_SWATCH_DELTA_E = 25.0  # between a palette colour and a swatch
# Hatches by level: none, then stripes ("/", "\\", both). The PNG and the HTML page draw
# them as white lines every HATCH_PITCH pixels; the timeline (one pixel per block) cannot.
HATCHES = ("", "/", "\\", "x")
HATCH_PITCH = 5
NUM_STYLES = len(PALETTE) * len(HATCHES)


@dataclasses.dataclass(frozen=True)
class OwnerStyle:
    color: str  # "#rrggbb"
    hatch: str  # one of HATCHES


def hex_to_rgb(color: str) -> tuple[int, int, int]:
    color = color.lstrip("#")
    return tuple(int(color[i : i + 2], 16) for i in (0, 2, 4))  # type: ignore[return-value]


def srgb_to_lab(rgb: np.ndarray) -> np.ndarray:
    """[..., 3] sRGB in 0..255 -> [..., 3] CIELAB (D65)."""
    c = np.asarray(rgb, np.float64) / 255
    c = np.where(c > 0.04045, ((c + 0.055) / 1.055) ** 2.4, c / 12.92)
    m = np.array([[0.4124, 0.3576, 0.1805], [0.2126, 0.7152, 0.0722], [0.0193, 0.1192, 0.9505]])
    xyz = c @ m.T / np.array([0.95047, 1.0, 1.08883])
    f = np.where(xyz > (6 / 29) ** 3, np.cbrt(xyz), xyz / (3 * (6 / 29) ** 2) + 4 / 29)
    return np.stack([116 * f[..., 1] - 16, 500 * (f[..., 0] - f[..., 1]),
                     200 * (f[..., 1] - f[..., 2])], axis=-1)


def delta_e(a: str, b: str) -> float:
    """CIE76 colour difference of two ``#rrggbb`` colours."""
    la, lb = srgb_to_lab(np.array([hex_to_rgb(a), hex_to_rgb(b)]))
    return float(np.linalg.norm(la - lb))


def assign_styles(lifetimes: Sequence[tuple[str, int, int]]) -> dict[str, OwnerStyle]:
    """``(name, first step, last step)`` per request, in order of first appearance -> style.

    Two requests whose step ranges overlap never get the same style (up to ``NUM_STYLES``
    alive at once); see the module docstring for the order styles are handed out in.
    """
    n = len(PALETTE)
    released = [-1] * NUM_STYLES  # step after which each style's last holder ended
    busy_until = [-1] * NUM_STYLES  # last step of each style's current holder
    out: dict[str, OwnerStyle] = {}
    for name, first, last in lifetimes:
        if last < first:
            raise ValueError(f"Request {name!r} ends (step {last}) before it starts ({first}).")
        free = [k for k in range(NUM_STYLES) if busy_until[k] < first]
        if not free:
            warnings.warn(f"More than {NUM_STYLES} requests are alive at step {first}; "
                          f"request {name!r} shares a style with a live request.", stacklevel=2)
            free = list(range(NUM_STYLES))
        level = min(k // n for k in free)
        # Least recently released first; never-used styles (-1) in palette order.
        k = min((k for k in free if k // n == level), key=lambda k: (released[k], k))
        busy_until[k] = released[k] = last
        out[name] = OwnerStyle(PALETTE[k % n], HATCHES[k // n])
    return out


def hatch_mask(hatch: str, height: int, width: int, x0: int = 0, y0: int = 0) -> np.ndarray:
    """[height, width] bool: the pixels a hatch paints white, for a box whose top left pixel
    is (x0, y0) (the pattern is anchored to the image, so neighbouring boxes line up)."""
    y, x = np.mgrid[y0 : y0 + height, x0 : x0 + width]
    mask = np.zeros((height, width), bool)
    if hatch in ("/", "x"):
        mask |= (x + y) % HATCH_PITCH == 0
    if hatch in ("\\", "x"):
        mask |= (x - y) % HATCH_PITCH == 0
    return mask
