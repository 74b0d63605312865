// What both pages draw with (loaded before dashboard.js and worker.js): el and svg build DOM
// nodes (every text a peer wrote goes in through textContent), chart draws a line chart with a
// UTC time axis, units and a legend, rangePicker is the charts' time range choice.
"use strict";

const SVG = "http://www.w3.org/2000/svg";
const COLOURS = ["#1971c2", "#e8590c", "#2f9e44", "#9c36b5", "#c92a2a", "#495057"];

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, String(v));
  for (const c of children) e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return e;
}

function svg(tag, attrs, text) {
  const e = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, String(v));
  if (text !== undefined) e.textContent = text;
  return e;
}

function niceMax(v) {
  if (v <= 0) return 1;
  const p = 10 ** Math.floor(Math.log10(v));
  return [1, 2, 5, 10].map((m) => m * p).find((x) => x >= v);
}

// a line chart with a time axis (clock time, UTC), a y axis in `unit` and a legend per line
// (a model, a stream); `range` ({from, to} in seconds, the snapshot's): the span of the time
// axis, else the points' own; `opts`: `empty`, the legend's words when there is no line, and
// the chart's `width` and `height` in pixels (560 x 180 by default)
function chart(name, unit, series, range, opts = {}) {
  const w = opts.width || 560, h = opts.height || 180, left = 56, right = 30, top = 12, bottom = 34;
  const empty = opts.empty;
  const box = svg("svg", { class: "chart", width: w, height: h + 22, "data-chart": name });
  const dash = (i) => (i < COLOURS.length ? "" : "5 3");  // more lines than colours: dashed
  const lines = Object.entries(series);
  const pts = lines.flatMap(([, p]) => p);
  const t0 = range ? range.from : pts.length ? Math.min(...pts.map((p) => p[0])) : Date.now() / 1000 - 600;
  const t1 = range ? range.to : pts.length ? Math.max(...pts.map((p) => p[0])) : Date.now() / 1000;
  const span = Math.max(t1 - t0, 1);
  const ymax = niceMax(Math.max(0, ...pts.map((p) => p[1])));
  box.dataset.t0 = t0;
  box.dataset.t1 = t1;
  const x = (t) => left + ((t - t0) / span) * (w - left - right);
  const y = (v) => top + (1 - v / ymax) * (h - top - bottom);
  box.append(svg("line", { x1: left, y1: y(0), x2: w - right, y2: y(0), class: "axis-line" }));
  box.append(svg("line", { x1: left, y1: top, x2: left, y2: y(0), class: "axis-line" }));
  for (let i = 0; i <= 4; i++) {  // y ticks
    const v = (ymax * i) / 4;
    box.append(svg("text", { x: left - 4, y: y(v) + 3, class: "tick", "text-anchor": "end" }, String(Math.round(v * 1000) / 1000)));
  }
  for (let i = 0; i <= 4; i++) {  // time ticks (a day or more: with the date)
    const t = t0 + (span * i) / 4;
    const iso = new Date(t * 1000).toISOString();
    const label = span >= 86400 ? `${iso.slice(5, 10)} ${iso.slice(11, 16)}` : iso.slice(11, 19);
    box.append(svg("text", { x: x(t), y: h - bottom + 14, class: "tick x-tick", "text-anchor": "middle" }, label));
  }
  box.append(svg("text", { x: left + (w - left - right) / 2, y: h - 4, class: "axis-label", "text-anchor": "middle" }, "time (UTC)"));
  box.append(svg("text", { x: 12, y: top + (h - top - bottom) / 2, class: "axis-label", "text-anchor": "middle",
    transform: `rotate(-90 12 ${top + (h - top - bottom) / 2})` }, unit));
  lines.forEach(([model, p], i) => {
    const d = p.filter((q) => q[0] >= t0).map((q, j) => `${j ? "L" : "M"}${x(q[0]).toFixed(1)},${y(q[1]).toFixed(1)}`).join(" ");
    box.append(svg("path", { d: d || `M${left},${y(0)}`, fill: "none", stroke: COLOURS[i % COLOURS.length],
      "stroke-dasharray": dash(i), "stroke-width": 1.8, "data-model": model }));
  });
  const legend = el("div", { class: "legend", style: `max-width:${w}px` });
  lines.forEach(([model, p], i) => {
    const last = p.length ? p[p.length - 1][1] : 0;
    legend.append(el("span", { class: "key", "data-model": model },
      el("i", { style: `background:${COLOURS[i % COLOURS.length]}`, class: dash(i) ? "dashed" : "" }),
      `${model}: ${Math.round(last * 1000) / 1000} ${unit} now`));
  });
  if (!lines.length) legend.append(el("span", { class: "key none" }, empty || "no sample yet"));
  return el("div", { class: "chart-box", "data-chart": name }, el("div", { class: "name" }, name.replace(/_/g, " ")), box, legend);
}

// the charts' time range, kept in this tab (both pages share it): seconds, or "all" (as much as
// the monitor keeps, KVQ_MONITOR_HISTORY_S); `changed` is called after a choice
const RANGE_KEY = "kvq-chart-range";
const RANGES = [["600", "10 min"], ["3600", "1 h"], ["all", "all kept"]];

function chartRange() {
  const got = sessionStorage.getItem(RANGE_KEY);
  return RANGES.some(([v]) => v === got) ? got : "600";
}

function rangePicker(changed) {
  const box = el("span", { class: "range", role: "group", "aria-label": "charts' time range" }, "range: ");
  for (const [value, label] of RANGES) {
    const b = el("button", { type: "button", class: "range-btn", "data-range": value, "aria-pressed": value === chartRange() }, label);
    b.addEventListener("click", () => {
      sessionStorage.setItem(RANGE_KEY, value);
      box.querySelectorAll("button").forEach((x) => x.setAttribute("aria-pressed", x === b));
      changed();
    });
    box.append(b);
  }
  return box;
}

// "all kept (1 h)": the label of the all button once the monitor said how much it keeps
function showKept(keptS) {
  const b = document.querySelector('.range-btn[data-range="all"]');
  if (!b) return;
  const h = keptS / 3600;
  b.textContent = `all kept (${h >= 1 ? `${Math.round(h * 10) / 10} h` : `${Math.round(keptS / 60)} min`})`;
}
