// One worker's page: polls /api/worker/<id> every 5 s (the monitor samples every 5 s) and
// redraws. Plain DOM and inline SVG; every text a peer wrote goes in through textContent.
"use strict";

const POLL_MS = 5000;
const SVG = "http://www.w3.org/2000/svg";
const COLOURS = ["#1971c2", "#e8590c", "#2f9e44", "#9c36b5", "#c92a2a", "#495057"];
const WORKER = decodeURIComponent(location.pathname.split("/").pop());

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

function when(ms) {
  return ms ? new Date(ms).toISOString().replace("T", " ").slice(0, 19) + " UTC" : "–";
}

function mib(n) {
  return `${(n / (1 << 20)).toFixed(1)} MiB`;
}

function drawKv(id, rows) {
  const body = document.querySelector(`#${id} tbody`);
  body.replaceChildren();
  for (const [k, v] of rows) body.append(el("tr", { "data-key": k }, el("th", {}, k), el("td", {}, v)));
}

function niceMax(v) {
  if (v <= 0) return 1;
  const p = 10 ** Math.floor(Math.log10(v));
  return [1, 2, 5, 10].map((m) => m * p).find((x) => x >= v);
}

// a line chart with a time axis (clock time, UTC), a y axis in `unit` and a legend per model
function chart(name, unit, series) {
  const w = 560, h = 180, left = 56, right = 30, top = 12, bottom = 34;
  const box = svg("svg", { class: "chart", width: w, height: h + 22, "data-chart": name });
  const lines = Object.entries(series);
  const pts = lines.flatMap(([, p]) => p);
  const t0 = pts.length ? Math.min(...pts.map((p) => p[0])) : Date.now() / 1000 - 600;
  const t1 = pts.length ? Math.max(...pts.map((p) => p[0])) : Date.now() / 1000;
  const span = Math.max(t1 - t0, 1);
  const ymax = niceMax(Math.max(0, ...pts.map((p) => p[1])));
  const x = (t) => left + ((t - t0) / span) * (w - left - right);
  const y = (v) => top + (1 - v / ymax) * (h - top - bottom);
  box.append(svg("line", { x1: left, y1: y(0), x2: w - right, y2: y(0), class: "axis-line" }));
  box.append(svg("line", { x1: left, y1: top, x2: left, y2: y(0), class: "axis-line" }));
  for (let i = 0; i <= 4; i++) {  // y ticks
    const v = (ymax * i) / 4;
    box.append(svg("text", { x: left - 4, y: y(v) + 3, class: "tick", "text-anchor": "end" }, String(Math.round(v * 1000) / 1000)));
  }
  for (let i = 0; i <= 4; i++) {  // time ticks
    const t = t0 + (span * i) / 4;
    const label = new Date(t * 1000).toISOString().slice(11, 19);
    box.append(svg("text", { x: x(t), y: h - bottom + 14, class: "tick x-tick", "text-anchor": "middle" }, label));
  }
  box.append(svg("text", { x: left + (w - left - right) / 2, y: h - 4, class: "axis-label", "text-anchor": "middle" }, "time (UTC)"));
  box.append(svg("text", { x: 12, y: top + (h - top - bottom) / 2, class: "axis-label", "text-anchor": "middle",
    transform: `rotate(-90 12 ${top + (h - top - bottom) / 2})` }, unit));
  lines.forEach(([model, p], i) => {
    const d = p.map((q, j) => `${j ? "L" : "M"}${x(q[0]).toFixed(1)},${y(q[1]).toFixed(1)}`).join(" ");
    box.append(svg("path", { d: d || `M${left},${y(0)}`, fill: "none", stroke: COLOURS[i % COLOURS.length], "stroke-width": 1.8, "data-model": model }));
  });
  const legend = el("div", { class: "legend" });
  lines.forEach(([model, p], i) => {
    const last = p.length ? p[p.length - 1][1] : 0;
    legend.append(el("span", { class: "key", "data-model": model },
      el("i", { style: `background:${COLOURS[i % COLOURS.length]}` }), `${model}: ${Math.round(last * 1000) / 1000} ${unit} now`));
  });
  if (!lines.length) legend.append(el("span", { class: "key none" }, "no sample yet (a live worker holding a slice is sampled every 5 s)"));
  return el("div", { class: "chart-box", "data-chart": name }, el("div", { class: "name" }, name.replace(/_/g, " ")), box, legend);
}

function draw(w) {
  document.getElementById("worker-id").textContent = w.worker;
  document.title = `kvq worker ${w.worker}`;
  const held = Object.entries(w.held).map(([m, s]) => `${m}: ${s.length} slices`).join("; ") || "nothing";
  drawKv("summary", [
    ["state", w.alive ? `alive (last beat ${w.heartbeat_age_s.toFixed(1)} s ago)` : "no heartbeat"],
    ["kernels", w.kernels],
    ["memory", `${mib(w.held_bytes)} of expert slices (${held})`],
    ["jobs served", String(w.served)],
    ["device", w.info ? w.info.device : "–"],
    ["last departed", w.departed ? `${w.departed.why} at ${when(w.departed.ts_ms)}` : "–"],
  ]);
  const charts = document.getElementById("charts");
  charts.replaceChildren(...Object.entries(w.charts).map(([name, c]) => chart(name, c.unit, c.series)));
  const body = document.querySelector("#trust tbody");
  body.replaceChildren();
  for (const t of w.trust) {
    const now = t.drain ? "draining" : t.banned ? "banned" : t.active ? "quarantined" : "trusted";
    body.append(el("tr", { "data-model": t.model },
      el("td", {}, t.model), el("td", { class: `trust-${now}` }, now), el("td", {}, String(t.mismatches)),
      el("td", {}, t.banned ? "yes" : "no"), el("td", {}, t.until_ms ? when(t.until_ms) : "–"),
      el("td", {}, t.operator ? `operator ${t.operator}` : t.coord || "–"), el("td", {}, t.reason || "–"), el("td", {}, when(t.ts_ms))));
  }
  if (!w.trust.length) body.append(el("tr", { class: "none" }, el("td", { colspan: 8 }, "trusted: never caught, no operator's word")));
  const hist = document.querySelector("#history tbody");
  hist.replaceChildren();
  for (const v of w.history) {
    hist.append(el("tr", { "data-model": v.model },
      el("td", {}, when(v.ts_ms)), el("td", {}, v.model), el("td", {}, v.operator ? `operator ${v.operator}` : v.coord || "–"),
      el("td", {}, v.reason || "–"), el("td", {}, String(v.mismatches)), el("td", {}, v.banned ? "yes" : "no"),
      el("td", {}, v.until_ms ? when(v.until_ms) : "–")));
  }
  if (!w.history.length) hist.append(el("tr", { class: "none" }, el("td", { colspan: 7 }, "no verdict")));
  drawKv("info", w.info ? Object.entries(w.info).map(([k, v]) => [k, String(v)]) : [["info", "none (its record expired)"]]);
}

async function poll() {
  const status = document.getElementById("status");
  try {
    const resp = await fetch(`/api/worker/${encodeURIComponent(WORKER)}`, { cache: "no-store" });
    if (!resp.ok) throw new Error(resp.status === 404 ? `no worker ${WORKER}` : `HTTP ${resp.status}`);
    draw(await resp.json());
    status.dataset.state = "live";
    status.textContent = `live · ${new Date().toLocaleTimeString()}`;
  } catch (err) {
    status.dataset.state = "error";
    status.textContent = `${err.message}; retrying`;
  }
  setTimeout(poll, POLL_MS);
}

poll();
