// One worker's page: polls /api/worker/<id> every 5 s (the monitor samples every 5 s) and
// redraws. Plain DOM and inline SVG; every text a peer wrote goes in through textContent.
"use strict";

const POLL_MS = 5000;
const WORKER = decodeURIComponent(location.pathname.split("/").pop());

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
  const none = "no sample in this range (a live worker holding a slice is sampled every 5 s)";
  charts.replaceChildren(...Object.entries(w.charts).map(([name, c]) => chart(name, c.unit, c.series, w.range, { empty: none })));
  showKept(w.range.kept_s);
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

let timer = null;

async function poll(now) {
  if (now && timer) clearTimeout(timer);
  const status = document.getElementById("status");
  try {
    const resp = await fetch(`/api/worker/${encodeURIComponent(WORKER)}?range=${chartRange()}`, { cache: "no-store" });
    if (!resp.ok) throw new Error(resp.status === 404 ? `no worker ${WORKER}` : `HTTP ${resp.status}`);
    draw(await resp.json());
    status.dataset.state = "live";
    status.textContent = `live · ${new Date().toLocaleTimeString()}`;
  } catch (err) {
    status.dataset.state = "error";
    status.textContent = `${err.message}; retrying`;
  }
  timer = setTimeout(poll, POLL_MS);
}

document.getElementById("range-pick").append(rangePicker(() => poll(true)));
poll();
