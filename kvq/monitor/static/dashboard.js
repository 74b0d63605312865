// The monitor's live dashboard: polls /api/dashboard every 2 s and redraws. Plain DOM and
// inline SVG, no library. Every text a peer wrote (worker ids, reasons) goes in through
// textContent, never as HTML.
"use strict";

const POLL_MS = 2000;
const SVG = "http://www.w3.org/2000/svg";

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, String(v));
  for (const c of children) e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return e;
}

function fmt(v, digits = 2) {
  if (v === null || v === undefined) return "–";
  return typeof v === "number" ? String(Math.round(v * 10 ** digits) / 10 ** digits) : String(v);
}

function cellState(c) {
  if (c.live === 0) return "none";
  return c.live < c.target ? "under" : "ok";
}

function drawModels(models) {
  const box = document.getElementById("models");
  box.replaceChildren();
  for (const m of models) {
    const layerStarts = [...new Set(m.cells.map((c) => c.layers[0]))].sort((a, b) => a - b);
    const expertStarts = [...new Set(m.cells.map((c) => c.experts[0]))].sort((a, b) => a - b);
    const grid = el("div", { class: "grid", "data-model": m.model });
    grid.style.gridTemplateColumns = `auto repeat(${expertStarts.length}, 132px)`;
    grid.append(el("span", { class: "axis" }, "layers \u2193 experts \u2192"));
    for (const e of expertStarts) {
      const c = m.cells.find((x) => x.experts[0] === e);
      grid.append(el("span", { class: "axis" }, `experts ${c.experts[0]}-${c.experts[1] - 1}`));
    }
    for (const l of layerStarts) {
      const row = m.cells.filter((x) => x.layers[0] === l);
      grid.append(el("span", { class: "axis" }, `layers ${row[0].layers[0]}-${row[0].layers[1] - 1}`));
      for (const e of expertStarts) {
        const c = row.find((x) => x.experts[0] === e);
        if (!c) { grid.append(el("span", {})); continue; }
        const holders = c.holders.map((h) => `${h.worker}${h.alive ? "" : " (dead)"}${h.quarantined ? " (quarantined)" : ""}`);
        const cell = el("div", {
          class: "cell", "data-slice": c.slice, "data-state": cellState(c), "data-live": c.live,
          "data-quarantined": c.quarantined, title: `${c.slice}: ${holders.join(", ") || "no holder"}`,
        }, el("b", {}, `${c.live}/${c.target}`), el("span", {}, c.slice));
        grid.append(cell);
      }
    }
    box.append(el("h3", {}, m.model), grid);
  }
}

function drawTable(id, rows, cols) {
  const body = document.querySelector(`#${id} tbody`);
  body.replaceChildren();
  for (const r of rows) {
    const tr = el("tr", { [`data-${id.slice(0, -1)}`]: r[cols[0][0]] });
    for (const [key, show] of cols) {
      const td = el("td", {}, show ? show(r[key], r) : fmt(r[key]));
      if (key === "trust") td.className = `trust-${r.trust}`;
      tr.append(td);
    }
    body.append(tr);
  }
}

function spark(points, label) {
  const w = 180, h = 36;
  const svg = document.createElementNS(SVG, "svg");
  svg.setAttribute("class", "spark");
  svg.setAttribute("width", w);
  svg.setAttribute("height", h + 12);
  const vals = points.map((p) => p[1]);
  const max = Math.max(1, ...vals);
  const t0 = points.length ? points[0][0] : 0;
  const span = points.length > 1 ? points[points.length - 1][0] - t0 : 1;
  const d = points.map((p, i) => `${i ? "L" : "M"}${((p[0] - t0) / (span || 1)) * w},${h - (p[1] / max) * (h - 2)}`).join(" ");
  const path = document.createElementNS(SVG, "path");
  path.setAttribute("d", d || `M0,${h}`);
  path.setAttribute("fill", "none");
  path.setAttribute("stroke", "#1971c2");
  path.setAttribute("stroke-width", "1.5");
  const text = document.createElementNS(SVG, "text");
  text.setAttribute("x", 0);
  text.setAttribute("y", h + 11);
  text.textContent = `${label} ${fmt(vals[vals.length - 1] ?? 0)} (max ${fmt(max)})`;
  svg.append(path, text);
  return svg;
}

function drawStreams(streams) {
  const box = document.getElementById("streams");
  box.replaceChildren();
  for (const s of streams) {
    box.append(el("div", { class: "stream", "data-stream": s.stream },
      el("div", { class: "name" }, s.stream),
      spark(s.series.stream_length || [], "depth"),
      spark(s.series.group_lag || [], "lag"),
      spark(s.series.group_oldest_pending_age_seconds || [], "pending age s")));
  }
}

function drawAlerts(alerts) {
  const ul = document.getElementById("alerts");
  ul.replaceChildren();
  if (!alerts.length) ul.append(el("li", { class: "none" }, "none hold now"));
  for (const a of alerts) ul.append(el("li", { "data-alert": a.alert }, `${a.alert}: ${a.summary}`));
}

function drawDead(dead) {
  document.getElementById("dead-count").textContent = `(${dead.length})`;
  const ul = document.getElementById("deadletters");
  ul.replaceChildren();
  for (const d of dead.newest) {
    ul.append(el("li", {}, `${new Date(d.ts_ms).toISOString()} ${d.source}: ${d.reason}`));
  }
}

function draw(snap) {
  drawAlerts(snap.alerts);
  drawModels(snap.models);
  drawTable("workers", snap.workers, [
    ["worker"], ["slices", (v) => v.join(", ")], ["trust", (v) => v],
    ["ms_per_row"], ["queued_rows"], ["load"], ["heartbeat_age_s", (v) => (v === null ? "gone" : `${fmt(v, 1)} s`)],
  ]);
  drawTable("coordinators", snap.coordinators, [
    ["coordinator"], ["model", (v) => v], ["busy", (v, r) => `${r.busy} / ${r.slots}${r.alive ? "" : " (stale)"}`],
    ["tokens_per_s"], ["remote_share", (v) => `${fmt(100 * v, 1)} %`],
  ]);
  drawStreams(snap.streams);
  drawDead(snap.deadletters);
}

async function poll() {
  const status = document.getElementById("status");
  try {
    const resp = await fetch("/api/dashboard", { cache: "no-store" });
    if (!resp.ok) throw new Error(`HTTP ${resp.status}`);
    draw(await resp.json());
    status.dataset.state = "live";
    status.textContent = `live · ${new Date().toLocaleTimeString()}`;
  } catch (err) {
    status.dataset.state = "error";
    status.textContent = `cannot reach the monitor (${err.message}); retrying`;
  }
  setTimeout(poll, POLL_MS);
}

poll();
