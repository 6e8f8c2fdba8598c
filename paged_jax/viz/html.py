"""One self-contained, offline HTML page of a recorded run.

Everything is inline (data as JSON, JS, CSS, SVG built by the script) and a Content Security
Policy forbids every network fetch, so the file works from disk with no connection:

* a step slider (arrow keys step it, Home/End jump);
* hovering a block shows its owners, logical indices, ref count and tokens;
* clicking a request highlights its table and its blocks (click again to clear);
* curves of utilization, blocks and events, with a cursor on the current step; clicking a
  curve jumps to that step;
* the terminal picture and the events of the current step.

Every block is an SVG ``<g class="block" data-block="k">`` whose ``rect.bg`` carries
``data-owner`` (owners joined by ``+``; empty when free) so tests can read what is shown.
"""

from __future__ import annotations

import html
import json
import os

from paged_jax.viz.layout import (
    CHANGED_COLOR,
    FREE_COLOR,
    HELD_COLOR,
    SHARED_MARK,
    block_views,
    changed_blocks,
    owner_colors,
    tint,
)
from paged_jax.viz.log import RunLog
from paged_jax.viz.metrics import CURVES, step_metrics
from paged_jax.viz.terminal import render_picture


def page_data(log: RunLog) -> dict:
    """Everything the page's script needs, JSON-ready."""
    colors = owner_colors(log)
    steps = []
    for t, snap in enumerate(log.snapshots):
        steps.append({
            "title": snap.title,
            "blocks": [[v.ref_count, v.tokens, [list(h) for h in v.holders], v.held]
                       for v in block_views(snap)],
            "requests": [[name, list(r.table), r.num_tokens, r.slot is None]
                         for name, r in snap.requests().items()],
            "free": list(snap.free_order),
            "changed": sorted(changed_blocks(log, t)),
            "events": [e.describe() for e in log.events_at(t)],
            "picture": render_picture(log, t),
        })
    metrics = step_metrics(log)
    return {
        "scenario": log.scenario,
        "numBlocks": log.config.num_blocks,
        "blockSize": log.config.block_size,
        "perRow": log.config.num_blocks if log.config.num_blocks <= 24 else 16,
        "colors": colors,
        "tints": {name: tint(c) for name, c in colors.items()},
        "style": {"free": FREE_COLOR, "held": HELD_COLOR, "shared": SHARED_MARK,
                  "changed": CHANGED_COLOR},
        "steps": steps,
        "metrics": {k: [float(x) for x in v] for k, v in metrics.items()},
        "curveLabels": CURVES,
    }


def render_html(log: RunLog) -> str:
    data = json.dumps(page_data(log), separators=(",", ":")).replace("</", "<\\/")
    title = html.escape(f"paged_jax block layout: {log.scenario or 'run'}")
    return _TEMPLATE.replace("__TITLE__", title).replace("__DATA__", data)


def save_html(log: RunLog, path: str | os.PathLike) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(render_html(log))


_TEMPLATE = r"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="default-src 'none';
  script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data:">
<link rel="icon" href="data:,">
<title>__TITLE__</title>
<style>
body { font: 14px/1.4 system-ui, sans-serif; margin: 16px; color: #222; }
h1 { font-size: 18px; margin: 0 0 8px; }
#controls { display: flex; gap: 10px; align-items: center; margin: 8px 0; }
#step { width: 420px; }
#title { font-family: monospace; color: #333; }
svg text { font: 11px sans-serif; pointer-events: none; }
.block .bg, .block .fill { stroke: none; }
.block .edge { fill: none; stroke: #555; stroke-width: 0.8; }
.block.dim { opacity: 0.2; }
.block.sel .edge { stroke: #000; stroke-width: 3; }
.block .changed { fill: none; stroke-width: 2.5; }
#tip { position: fixed; display: none; background: #fff; border: 1px solid #888;
       padding: 4px 8px; box-shadow: 2px 2px 6px rgba(0,0,0,.2); pointer-events: none;
       white-space: pre; font: 12px monospace; }
#tables .req { display: flex; gap: 4px; align-items: center; margin: 3px 0; cursor: pointer;
               padding: 2px 4px; border-radius: 4px; }
#tables .req.sel { background: #fff3b0; outline: 2px solid #000; }
#tables .name { width: 90px; font-weight: bold; }
#tables .cell { min-width: 26px; text-align: center; border: 1px solid; font: 11px monospace;
                padding: 1px 2px; }
#curves .chart { cursor: pointer; }
#curves .cursor { stroke: #d00; stroke-width: 1.5; }
#legend { font-size: 12px; color: #555; max-width: 900px; }
pre { background: #f6f6f6; padding: 8px; overflow-x: auto; }
.row { display: flex; gap: 24px; flex-wrap: wrap; }
</style>
</head>
<body>
<h1>__TITLE__</h1>
<div id="controls">
  <button id="prev" title="previous step (Left arrow)">&#9664;</button>
  <input id="step" type="range" min="0" value="0" step="1" aria-label="step">
  <button id="next" title="next step (Right arrow)">&#9654;</button>
  <span id="label"></span>
</div>
<div id="title"></div>
<svg id="blocks" role="img" aria-label="physical blocks"></svg>
<div id="legend">Colour: owner (stripes: several); the solid part is tokens / block size.
Black band and xN: ref count N &gt; 1. Grey: held outside any table. Magenta outline: changed
in this step. * after a request: its table is kept outside the state.</div>
<div class="row">
  <div><h3>Block tables <small>(click a request)</small></h3><div id="tables"></div>
       <div id="free"></div></div>
  <div><h3>Curves <small>(click to jump)</small></h3><svg id="curves"></svg></div>
</div>
<h3>Events of this step</h3><ul id="events"></ul>
<h3>Terminal picture</h3><pre id="picture"></pre>
<div id="tip"></div>
<script id="data" type="application/json">__DATA__</script>
<script>
"use strict";
const D = JSON.parse(document.getElementById("data").textContent);
const NS = "http://www.w3.org/2000/svg";
const CELL = 40, GAP = 8, BAND = 8, TOP = 18, ROWH = CELL + 34;
const slider = document.getElementById("step");
const tip = document.getElementById("tip");
let current = 0, selected = null;

function el(tag, attrs, parent) {
  const node = document.createElementNS(NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  if (parent) parent.appendChild(node);
  return node;
}

// ---- physical blocks, built once and updated per step
const svg = document.getElementById("blocks");
const rows = Math.ceil(D.numBlocks / D.perRow);
svg.setAttribute("width", D.perRow * (CELL + GAP) + 20);
svg.setAttribute("height", rows * ROWH + 10);
const blocks = [];
for (let b = 0; b < D.numBlocks; b++) {
  const x = 10 + (b % D.perRow) * (CELL + GAP), y = TOP + Math.floor(b / D.perRow) * ROWH;
  const g = el("g", {class: "block", "data-block": b}, svg);
  const parts = {
    g, x, y,
    bg: el("rect", {class: "bg", x, y, width: CELL, height: CELL}, g),
    stripes: el("g", {}, g),
    band: el("rect", {class: "band", x, y, width: CELL, height: BAND, fill: D.style.shared}, g),
    edge: el("rect", {class: "edge", x, y, width: CELL, height: CELL}, g),
    changed: el("rect", {class: "changed", x: x - 3, y: y - 3, width: CELL + 6,
                         height: CELL + 6, stroke: D.style.changed}, g),
    label: el("text", {x: x + CELL / 2, y: y + BAND + 14, "text-anchor": "middle"}, g),
    ref: el("text", {x: x + CELL / 2, y: y - 5, "text-anchor": "middle"}, g),
  };
  el("text", {x: x + CELL / 2, y: y + CELL + 13, "text-anchor": "middle"}, g).textContent = b;
  g.addEventListener("mousemove", (ev) => showTip(b, ev));
  g.addEventListener("mouseleave", () => { tip.style.display = "none"; });
  blocks.push(parts);
}

function owners(info) { return [...new Set(info[2].map((h) => h[0]))]; }

function drawBlock(b, info, changed) {
  const p = blocks[b], [ref, tokens, holders, held] = info, own = owners(info);
  p.stripes.replaceChildren();
  let color = D.style.free;
  if (ref > 0 && own.length === 0) color = D.style.held;
  if (own.length === 1) color = D.tints[own[0]];
  p.bg.setAttribute("fill", color);
  p.bg.setAttribute("data-owner", own.join("+") || (ref > 0 ? "(held)" : ""));
  p.bg.setAttribute("data-ref", ref);
  p.bg.setAttribute("data-tokens", tokens);
  const w = CELL / Math.max(1, own.length), h = CELL * tokens / D.blockSize;
  own.forEach((name, i) => {
    el("rect", {x: p.x + i * w, y: p.y, width: w, height: CELL, fill: D.tints[name]}, p.stripes);
    el("rect", {class: "fill", x: p.x + i * w, y: p.y + CELL - h, width: w, height: h,
                fill: D.colors[name]}, p.stripes);
  });
  p.band.style.display = ref > 1 ? "" : "none";
  p.ref.textContent = ref > 1 ? "x" + ref : "";
  p.label.textContent = own.join("+");
  p.changed.style.display = changed ? "" : "none";
  p.g.classList.toggle("sel", selected !== null && own.includes(selected));
  p.g.classList.toggle("dim", selected !== null && !own.includes(selected));
}

function showTip(b, ev) {
  const [ref, tokens, holders, held] = D.steps[current].blocks[b];
  let who = holders.map((h) => `${h[0]} (logical ${h[1]})`).join(", ") || "none";
  if (held > 0) who += `${holders.length ? " + " : ""}${held} held outside any table`;
  tip.textContent = `block ${b}\nowners: ${ref > 0 ? who : "free"}\nref count: ${ref}\n` +
                    `tokens: ${tokens}/${D.blockSize}`;
  tip.style.display = "block";
  tip.style.left = (ev.clientX + 14) + "px";
  tip.style.top = (ev.clientY + 14) + "px";
}

// ---- block tables
function drawTables(step) {
  const box = document.getElementById("tables");
  box.replaceChildren();
  for (const [name, table, tokens, outside] of step.requests) {
    const row = document.createElement("div");
    row.className = "req" + (name === selected ? " sel" : "");
    row.dataset.request = name;
    const label = document.createElement("span");
    label.className = "name";
    label.style.color = D.colors[name];
    label.textContent = `${name}: ${tokens} tok` + (outside ? "*" : "");
    row.appendChild(label);
    table.forEach((b, i) => {
      const cell = document.createElement("span");
      cell.className = "cell";
      cell.title = `logical ${i} -> physical ${b}`;
      cell.style.borderColor = D.colors[name];
      cell.style.background = D.tints[name];
      cell.textContent = b;
      row.appendChild(cell);
    });
    row.addEventListener("click", () => {
      selected = selected === name ? null : name;
      show(current);
    });
    box.appendChild(row);
  }
  document.getElementById("free").textContent =
    "Free list (next first): [" + step.free.join(", ") + "]";
}

// ---- curves
const CHARTS = [
  ["utilization", ["block_util", "token_util"], 1],
  ["blocks", ["free_blocks", "used_blocks", "saved_blocks"], D.numBlocks],
  ["events (cumulative)", ["cow_copies", "preemptions", "prefix_hits", "evictions"], null],
];
const LINE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728"];
const CW = 560, CH = 110, CL = 40, n = D.steps.length;
const curves = document.getElementById("curves");
curves.setAttribute("width", CW + 190);
curves.setAttribute("height", CHARTS.length * (CH + 24));
const cursors = [];
const xOf = (t) => CL + (n > 1 ? t * (CW - CL) / (n - 1) : 0);
CHARTS.forEach(([title, keys, top], i) => {
  const y0 = i * (CH + 24) + 16;
  const g = el("g", {class: "chart", "data-chart": title}, curves);
  el("rect", {x: CL, y: y0, width: CW - CL, height: CH, fill: "#fafafa", stroke: "#ccc"}, g);
  el("text", {x: CL, y: y0 - 4}, g).textContent = title;
  const max = top || Math.max(1, ...keys.flatMap((k) => D.metrics[k]));
  el("text", {x: CL - 4, y: y0 + 10, "text-anchor": "end"}, g).textContent = +max.toFixed(2);
  el("text", {x: CL - 4, y: y0 + CH, "text-anchor": "end"}, g).textContent = 0;
  keys.forEach((k, j) => {
    const pts = D.metrics[k].map((v, t) => `${xOf(t)},${y0 + CH - CH * v / max}`).join(" ");
    el("polyline", {points: pts, fill: "none", stroke: LINE[j], "stroke-width": 1.6,
                    "data-metric": k}, g);
    const ty = y0 + 12 + 14 * j;
    el("rect", {x: CW + 8, y: ty - 8, width: 10, height: 3, fill: LINE[j]}, g);
    el("text", {x: CW + 22, y: ty - 3}, g).textContent = k.replace(/_/g, " ");
  });
  cursors.push(el("line", {class: "cursor", y1: y0, y2: y0 + CH}, g));
  g.addEventListener("click", (ev) => {
    const r = curves.getBoundingClientRect();
    const t = Math.round((ev.clientX - r.left - CL) * (n - 1) / (CW - CL));
    show(Math.min(n - 1, Math.max(0, t)));
  });
});

// ---- stepping
function show(t) {
  current = t;
  const step = D.steps[t];
  if (selected !== null && !step.requests.some((r) => r[0] === selected)) selected = null;
  slider.value = t;
  document.getElementById("label").textContent = `step ${t} / ${n - 1}`;
  document.getElementById("title").textContent = step.title;
  const changed = new Set(step.changed);
  step.blocks.forEach((info, b) => drawBlock(b, info, changed.has(b)));
  drawTables(step);
  for (const c of cursors) { c.setAttribute("x1", xOf(t)); c.setAttribute("x2", xOf(t)); }
  const list = document.getElementById("events");
  list.replaceChildren(...step.events.map((e) => {
    const li = document.createElement("li"); li.textContent = e; return li;
  }));
  document.getElementById("picture").textContent = step.picture;
}

slider.max = n - 1;
slider.addEventListener("input", () => show(+slider.value));
document.getElementById("prev").addEventListener("click", () => show(Math.max(0, current - 1)));
document.getElementById("next").addEventListener("click", () => show(Math.min(n - 1, current + 1)));
document.addEventListener("keydown", (ev) => {
  if (ev.target === slider) return;  // the slider steps itself
  const to = {ArrowLeft: current - 1, ArrowRight: current + 1, Home: 0, End: n - 1}[ev.key];
  if (to === undefined) return;
  ev.preventDefault();
  show(Math.min(n - 1, Math.max(0, to)));
});
show(0);
</script>
</body>
</html>
"""
