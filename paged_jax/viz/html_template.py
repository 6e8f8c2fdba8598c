"""The HTML page's markup, style and script (``html.py`` fills in ``__TITLE__`` and
``__DATA__``). The script rebuilds every step's blocks from the per-step changes once at load,
then draws a step as the slider moves: SVG boxes for a small pool, one canvas for a grid."""

TEMPLATE = r"""<!DOCTYPE html>
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
#title { font-family: monospace; color: #333; white-space: nowrap; overflow: hidden;
         text-overflow: ellipsis; max-width: 1100px; }
svg text { font: 11px sans-serif; pointer-events: none; }
svg text.small { font-size: 9px; }
.block .bg, .block .fill { stroke: none; }
.block .edge { fill: none; stroke: #555; stroke-width: 0.8; }
.block.dim { opacity: 0.2; }
.block.sel .edge { stroke: #000; stroke-width: 3; }
.block .changed { fill: none; stroke-width: 2.5; }
#grid { cursor: crosshair; }
#tip { position: fixed; display: none; background: #fff; border: 1px solid #888;
       padding: 4px 8px; box-shadow: 2px 2px 6px rgba(0,0,0,.2); pointer-events: none;
       white-space: pre; font: 12px monospace; }
#tables { max-height: 520px; overflow-y: auto; contain: content; }
#tables .req { display: flex; gap: 4px; align-items: center; margin: 3px 0; cursor: pointer;
               padding: 2px 4px; border-radius: 4px; }
#tables .req.sel { background: #fff3b0; outline: 2px solid #000; }
#tables .name { width: 110px; flex: none; font-weight: bold; white-space: nowrap; }
#tables .cell { min-width: 26px; text-align: center; border: 1px solid; font: 11px monospace;
                padding: 1px 2px; }
#tables .cells { font: 11px monospace; white-space: nowrap; overflow: hidden;
                 text-overflow: ellipsis; max-width: 560px; border-left: 6px solid;
                 padding-left: 4px; }
#free { max-width: 700px; overflow-wrap: anywhere; }
#events { max-height: 300px; overflow-y: auto; contain: content; margin: 0; }
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
<canvas id="grid" role="img" aria-label="physical blocks"></canvas>
<div id="legend">Colour: owner (stripes: several; white hatching: more than 64 requests at
once); the solid part is tokens / block size. Black band (and xN): ref count N &gt; 1. Grey:
held outside any table. Magenta outline: changed in this step. * after a request: its table is
kept outside the state. Hover a block for its owners.</div>
<div class="row">
  <div><h3>Block tables <small>(click a request)</small></h3><div id="tables"></div>
       <div id="free"></div></div>
  <div><h3>Curves <small>(click to jump)</small></h3><svg id="curves"></svg></div>
</div>
<h3>Events of this step</h3><pre id="events"></pre>
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
const n = D.steps.length;
let current = 0, selected = null;

// ---- every step's blocks, [ref, tokens, holders, held] per block, from the changes
const FREE_INFO = [0, 0, [], 0];
const STATES = [];
{
  let cur = new Array(D.numBlocks).fill(FREE_INFO);
  for (const s of D.steps) {
    cur = cur.slice();
    for (const [b, ref, tok, holders, held] of s.delta) cur[b] = [ref, tok, holders, held];
    STATES.push(cur);
  }
}

function el(tag, attrs, parent) {
  const node = document.createElementNS(NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  if (parent) parent.appendChild(node);
  return node;
}
function owners(info) { return [...new Set(info[2].map((h) => h[0]))]; }
// Owners joined by "+", cut with an ellipsis to fit (the hover lists them all).
function fitLabel(own, max) {
  const s = own.join("+");
  return s.length <= max ? s : s.slice(0, max - 1) + "\u2026";
}

function showTip(b, ev) {
  const [ref, tokens, holders, held] = STATES[current][b];
  let who = holders.map((h) => `${h[0]} (logical ${h[1]})`).join(", ") || "none";
  if (held > 0) who += `${holders.length ? " + " : ""}${held} held outside any table`;
  tip.textContent = `block ${b}\nowners: ${ref > 0 ? who : "free"}\nref count: ${ref}\n` +
                    `tokens: ${tokens}/${D.blockSize}`;
  tip.style.display = "block";
  tip.style.left = (ev.clientX + 14) + "px";
  tip.style.top = (ev.clientY + 14) + "px";
}
function hideTip() { tip.style.display = "none"; }

// ---- a small pool: SVG boxes, built once and updated per step
const svg = document.getElementById("blocks");
const blocks = [];
function buildBoxes() {
  const rows = Math.ceil(D.numBlocks / D.perRow);
  svg.setAttribute("width", D.perRow * (CELL + GAP) + 20);
  svg.setAttribute("height", rows * ROWH + 10);
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
      label: el("text", {class: "label", x: x + CELL / 2, y: y + BAND + 14,
                         "text-anchor": "middle"}, g),
      ref: el("text", {x: x + CELL / 2, y: y - 5, "text-anchor": "middle"}, g),
    };
    el("text", {x: x + CELL / 2, y: y + CELL + 13, "text-anchor": "middle"}, g).textContent = b;
    g.addEventListener("mousemove", (ev) => showTip(b, ev));
    g.addEventListener("mouseleave", hideTip);
    blocks.push(parts);
  }
}

function drawBox(b, info, changed) {
  const p = blocks[b], [ref, tokens] = info, own = owners(info);
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
    if (D.hatches[name]) {
      const id = {"/": 1, "\\": 2, "x": 3}[D.hatches[name]];
      el("rect", {x: p.x + i * w, y: p.y, width: w, height: CELL, fill: `url(#hatch${id})`},
         p.stripes);
    }
  });
  p.band.style.display = ref > 1 ? "" : "none";
  p.ref.textContent = ref > 1 ? "x" + ref : "";
  // 11px fits 5 characters across a 40px block, 9px fits 6.
  const small = own.join("+").length > 5;
  p.label.setAttribute("class", small ? "label small" : "label");
  p.label.textContent = fitLabel(own, small ? 6 : 5);
  p.changed.style.display = changed ? "" : "none";
  p.g.classList.toggle("sel", selected !== null && own.includes(selected));
  p.g.classList.toggle("dim", selected !== null && !own.includes(selected));
}

function svgHatches() {
  const defs = el("defs", {}, svg), P = D.hatchPitch;
  [["1", "M0," + P + " L" + P + ",0"], ["2", "M0,0 L" + P + "," + P],
   ["3", "M0," + P + " L" + P + ",0 M0,0 L" + P + "," + P]].forEach(([k, d]) => {
    const pat = el("pattern", {id: "hatch" + k, width: P, height: P,
                               patternUnits: "userSpaceOnUse"}, defs);
    el("path", {d, stroke: "#fff", "stroke-width": 1}, pat);
  });
}

// ---- a large pool: one canvas, repainted per step
const canvas = document.getElementById("grid");
const C = D.cell, P = C + 2, LBL = 40, PAD = 4;
let ctx = null;
const patterns = {};
function cellXY(b) { return [LBL + (b % D.perRow) * P, PAD + Math.floor(b / D.perRow) * P]; }
function buildGrid() {
  const rows = Math.ceil(D.numBlocks / D.perRow);
  canvas.width = LBL + D.perRow * P + PAD;
  canvas.height = rows * P + 2 * PAD;
  ctx = canvas.getContext("2d", {alpha: false});
  for (const h of ["/", "\\", "x"]) {  // white lines every hatchPitch px, as in the PNG
    const k = D.hatchPitch, tile = document.createElement("canvas");
    tile.width = tile.height = k;
    const t = tile.getContext("2d"), img = t.createImageData(k, k);
    for (let y = 0; y < k; y++) for (let x = 0; x < k; x++) {
      const on = ((h !== "\\") && (x + y) % k === 0) || ((h !== "/") && (x - y + k) % k === 0);
      img.data.set(on ? [255, 255, 255, 255] : [0, 0, 0, 0], 4 * (y * k + x));
    }
    t.putImageData(img, 0, 0);
    patterns[h] = ctx.createPattern(tile, "repeat");
  }
  const at = (ev) => {
    const r = canvas.getBoundingClientRect();
    const cx = ev.clientX - r.left - LBL, cy = ev.clientY - r.top - PAD;
    const col = Math.floor(cx / P), row = Math.floor(cy / P), b = row * D.perRow + col;
    return cx < 0 || cy < 0 || col >= D.perRow || cx % P >= C || cy % P >= C ||
      b >= D.numBlocks ? -1 : b;
  };
  canvas.addEventListener("mousemove", (ev) => {
    const b = at(ev);
    if (b < 0) hideTip(); else showTip(b, ev);
  });
  canvas.addEventListener("mouseleave", hideTip);
  canvas.addEventListener("click", (ev) => {
    const b = at(ev), own = b < 0 ? [] : owners(STATES[current][b]);
    selected = own.length && selected !== own[0] ? own[0] : null;
    show(current);
  });
}

function paintGrid(state, changed) {
  ctx.fillStyle = "#fff";
  ctx.fillRect(0, 0, canvas.width, canvas.height);
  ctx.fillStyle = "#333";
  ctx.font = "9px sans-serif";
  ctx.textAlign = "right";
  ctx.textBaseline = "middle";
  for (let b = 0; b < D.numBlocks; b += D.perRow) {
    const [, y] = cellXY(b);
    ctx.fillText(String(b), LBL - 4, y + C / 2);
  }
  for (let b = 0; b < D.numBlocks; b++) {
    const info = state[b], [ref, tokens] = info, [x, y] = cellXY(b);
    const own = info[2].length ? owners(info) : [];
    if (own.length === 0) {
      ctx.fillStyle = ref > 0 ? D.style.held : D.style.free;
      ctx.fillRect(x, y, C, C);
    } else {
      const h = Math.round(C * tokens / D.blockSize);
      own.forEach((name, i) => {
        const x0 = x + Math.round(i * C / own.length);
        const x1 = x + Math.round((i + 1) * C / own.length);
        ctx.fillStyle = D.tints[name];
        ctx.fillRect(x0, y, x1 - x0, C - h);
        ctx.fillStyle = D.colors[name];
        ctx.fillRect(x0, y + C - h, x1 - x0, h);
        if (D.hatches[name]) {
          ctx.fillStyle = patterns[D.hatches[name]];
          ctx.fillRect(x0, y, x1 - x0, C);
        }
      });
    }
    if (ref > 1) { ctx.fillStyle = D.style.shared; ctx.fillRect(x, y, C, 3); }
    if (selected !== null) {
      if (own.includes(selected)) {
        ctx.strokeStyle = "#000"; ctx.lineWidth = 2; ctx.strokeRect(x + 1, y + 1, C - 2, C - 2);
      } else {
        ctx.fillStyle = "rgba(255,255,255,0.75)"; ctx.fillRect(x, y, C, C);
      }
    }
    if (changed.has(b)) {
      ctx.strokeStyle = D.style.changed; ctx.lineWidth = 1;
      ctx.strokeRect(x - 0.5, y - 0.5, C + 1, C + 1);
    }
  }
}

// ---- block tables, rebuilt from the blocks' holders
function tablesOf(state) {
  const out = {};
  state.forEach((info, b) => {
    for (const [name, i] of info[2]) (out[name] = out[name] || [])[i] = b;
  });
  return out;
}
function drawTables(step, state) {
  const box = document.getElementById("tables");
  const tables = tablesOf(state);
  box.replaceChildren();
  for (const [name, tokens, outside] of step.requests) {
    const table = tables[name] || [];
    const row = document.createElement("div");
    row.className = "req" + (name === selected ? " sel" : "");
    row.dataset.request = name;
    const label = document.createElement("span");
    label.className = "name";
    label.style.color = D.colors[name];
    label.textContent = `${name}: ${tokens} tok` + (outside ? "*" : "");
    row.appendChild(label);
    if (D.grid) {  // one line of block numbers; the whole table in its hover
      const cells = document.createElement("span");
      cells.className = "cells";
      cells.style.borderColor = D.colors[name];
      cells.textContent = cells.title = table.join(" ");
      row.appendChild(cells);
    } else {
      table.forEach((b, i) => {
        const cell = document.createElement("span");
        cell.className = "cell";
        cell.title = `logical ${i} -> physical ${b}`;
        cell.style.borderColor = D.colors[name];
        cell.style.background = D.tints[name];
        cell.textContent = b;
        row.appendChild(cell);
      });
    }
    row.addEventListener("click", () => {
      selected = selected === name ? null : name;
      show(current);
    });
    box.appendChild(row);
  }
  const more = step.numFree > step.free.length ? ", \u2026" : "";
  document.getElementById("free").textContent =
    `Free list (next first, ${step.numFree} blocks): [` + step.free.join(", ") + more + "]";
}

// ---- curves, drawn as steps: a value holds from its step to the next
const CHARTS = [
  ["utilization", ["block_util", "token_util"], 1],
  ["blocks", ["free_blocks", "used_blocks", "saved_blocks"], D.numBlocks],
  ["events (cumulative)", ["cow_copies", "preemptions", "prefix_hits", "evictions"], null],
];
const LINE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728"];
const CW = 560, CH = 110, CL = 40;
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
    const yOf = (v) => y0 + CH - CH * v / max, vals = D.metrics[k], pts = [];
    vals.forEach((v, t) => {
      if (t > 0) pts.push(`${xOf(t)},${yOf(vals[t - 1])}`);
      pts.push(`${xOf(t)},${yOf(v)}`);
    });
    el("polyline", {points: pts.join(" "), fill: "none", stroke: LINE[j], "stroke-width": 1.6,
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
  const step = D.steps[t], state = STATES[t];
  if (selected !== null && !step.requests.some((r) => r[0] === selected)) selected = null;
  slider.value = t;
  document.getElementById("label").textContent = `step ${t} / ${n - 1}`;
  document.getElementById("title").textContent = step.title;
  document.getElementById("title").title = step.title;
  const changed = new Set(step.changed);
  if (D.grid) paintGrid(state, changed);
  else state.forEach((info, b) => drawBox(b, info, changed.has(b)));
  drawTables(step, state);
  for (const c of cursors) { c.setAttribute("x1", xOf(t)); c.setAttribute("x2", xOf(t)); }
  document.getElementById("events").textContent = step.events.join("\n") || "(none)";
  document.getElementById("picture").textContent = step.picture === null ?
    `(${D.numBlocks} blocks: the terminal picture is in layout.txt)` : step.picture;
}

if (D.grid) { svg.style.display = "none"; buildGrid(); }
else { canvas.style.display = "none"; buildBoxes(); svgHatches(); }
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
window.pagedJax = {show, cellXY, cell: C};  // for tests: draw a step, where block b's cell is
show(D.start);
// A live page (paged-jax serve's /blocks) reloads itself, from its own address, while the
// last step is shown; a reader who stepped back keeps the step they chose.
if (D.refresh) setInterval(() => { if (current === n - 1) location.reload(); },
                           D.refresh * 1000);
</script>
</body>
</html>
"""
