// The monitor's live dashboard: polls /api/dashboard every 2 s and redraws. Plain DOM and
// inline SVG, no library. Every text a peer wrote (worker ids, reasons) goes in through
// textContent, never as HTML.
"use strict";

const POLL_MS = 2000;

function fmt(v, digits = 2) {
  if (v === null || v === undefined) return "–";
  return typeof v === "number" ? String(Math.round(v * 10 ** digits) / 10 ** digits) : String(v);
}

// the spans whose cells are shown ("model:first layer"), asked for in each poll; a model of
// few slices has every span open anyway
const openSpans = new Set();
let showAllWorkers = false;
const WORKERS_SHOWN = 20;

function spanLabel(l) {
  return l[1] - l[0] > 1 ? `L${l[0]}-${l[1] - 1}` : `L${l[0]}`;
}

function drawModels(models) {
  const box = document.getElementById("models");
  box.replaceChildren();
  for (const m of models) {
    const t = m.totals;
    const summary = `${m.slices} slices: ${t.ok + t.idle} covered, ${t.under} under target, ${t.none} without a live worker` +
      (m.serving ? "" : " · no live coordinator: nothing is served (grey)");
    const head = el("h3", {}, m.model, " ", el("small", { class: "summary" }, summary));
    const strip = el("div", { class: "spans", "data-model": m.model, "data-serving": m.serving });
    for (const sp of m.spans) {
      const key = `${m.model}:${sp.layers[0]}`;
      const bad = sp.none + sp.under;
      const b = el("button", {
        class: "span", "data-layers": sp.layers[0], "data-state": sp.state, "data-open": sp.open,
        title: `layers ${sp.layers[0]}-${sp.layers[1] - 1}: ${sp.slices} slices, ${sp.ok + sp.idle} covered, ` +
          `${sp.under} under target, ${sp.none} without a live worker${sp.quarantined ? `, ${sp.quarantined} with a quarantined holder` : ""}`,
      }, spanLabel(sp.layers), bad ? el("sup", {}, String(bad)) : "");
      b.addEventListener("click", () => {
        if (openSpans.has(key)) openSpans.delete(key); else openSpans.add(key);
        poll(true);
      });
      strip.append(b);
    }
    box.append(el("div", { class: "model", "data-model": m.model, "data-serving": m.serving }, head, strip, drawGrid(m)));
  }
}

function drawGrid(m) {
  const rows = m.spans.filter((sp) => sp.open && sp.cells.length);
  const grid = el("div", { class: "grid", "data-model": m.model });
  if (!rows.length) return grid;
  const cells = rows.flatMap((sp) => sp.cells);
  const expertStarts = [...new Set(cells.map((c) => c.experts[0]))].sort((a, b) => a - b);
  const mini = expertStarts.length > 16;
  grid.style.gridTemplateColumns = `auto repeat(${expertStarts.length}, ${mini ? "14px" : "132px"})`;
  grid.append(el("span", { class: "axis" }, "layers \u2193 experts \u2192"));
  for (const e of expertStarts) {
    const c = cells.find((x) => x.experts[0] === e);
    grid.append(el("span", { class: "axis" }, mini ? "" : `experts ${c.experts[0]}-${c.experts[1] - 1}`));
  }
  for (const sp of rows) {
    grid.append(el("span", { class: "axis" }, `layers ${sp.layers[0]}-${sp.layers[1] - 1}`));
    for (const e of expertStarts) {
      const c = sp.cells.find((x) => x.experts[0] === e);
      if (!c) { grid.append(el("span", {})); continue; }
      const holders = c.holders.map((h) => `${h.worker}${h.alive ? "" : " (lost)"}${h.quarantined ? " (quarantined)" : ""}`);
      grid.append(el("div", {
        class: mini ? "cell mini" : "cell", "data-slice": c.slice, "data-state": c.state, "data-live": c.live,
        "data-quarantined": c.quarantined, title: `${c.slice}: ${c.live}/${c.target}; ${holders.join(", ") || "no holder"}`,
      }, ...(mini ? [] : [el("b", {}, `${c.live}/${c.target}`), el("span", {}, c.slice)])));
    }
  }
  return grid;
}

function drawTable(id, rows, cols, most) {
  const body = document.querySelector(`#${id} tbody`);
  body.replaceChildren();
  for (const r of most ? rows.slice(0, most) : rows) {
    const tr = el("tr", { [`data-${id.slice(0, -1)}`]: r[cols[0][0]] });
    if (r.state) tr.dataset.state = r.state;
    if (r.spans && r.spans.length) {  // a worker: its row opens the spans it holds
      tr.classList.add("opens");
      tr.title = "show the slices of the layer spans it holds";
      tr.addEventListener("click", () => { openSpans.clear(); r.spans.forEach((k) => openSpans.add(k)); poll(true); });
    }
    for (const [key, show] of cols) {
      const td = el("td", {}, show ? show(r[key], r) : fmt(r[key]));
      if (key === "trust") td.className = `trust-${r.trust}`;
      if (key === "_act") td.className = "act";
      tr.append(td);
    }
    body.append(tr);
  }
  if (!rows.length && id === "requests") body.append(el("tr", { class: "none" }, el("td", { colspan: cols.length }, "none now")));
  if (most && rows.length > most) {
    const more = el("button", { class: "more" }, `show ${rows.length - most} more`);
    more.addEventListener("click", () => { showAllWorkers = true; poll(true); });
    body.append(el("tr", {}, el("td", { colspan: cols.length }, more)));
  }
}

// the streams' charts: one per measure, one line per stream (its legend), over the range
// chosen; three side by side on a 1280-pixel screen
const STREAM_CHARTS = [
  ["stream_length", "depth", "entries"],
  ["group_lag", "lag", "entries"],
  ["group_oldest_pending_age_seconds", "oldest pending age", "seconds"],
];

function drawStreams(streams, range) {
  const box = document.getElementById("streams");
  box.replaceChildren(...STREAM_CHARTS.map(([key, name, unit]) => {
    const series = Object.fromEntries(streams.map((s) => [s.stream, s.series[key] || []]));
    return chart(name, unit, series, range, { empty: "no stream yet", width: 380, height: 150 });
  }));
  showKept(range.kept_s);
}

function drawAlerts(alerts) {
  const ul = document.getElementById("alerts");
  ul.replaceChildren();
  if (!alerts.length) ul.append(el("li", { class: "none" }, "none hold now"));
  for (const a of alerts) ul.append(el("li", { "data-alert": a.alert }, `${a.alert}: ${a.summary}`));
}

function drawDeparted(rows) {
  const ul = document.getElementById("departed");
  ul.replaceChildren();
  if (!rows.length) ul.append(el("li", { class: "none" }, "none in the last hour"));
  for (const d of rows) {
    ul.append(el("li", { "data-departed": d.worker },
      `${d.worker}: ${d.why} ${fmt(d.ago_s, 0)} s ago (${new Date(d.when_ms).toISOString()}); held ${d.held || "nothing"} `,
      buttons([["release", "release", { worker: d.worker }, `release worker ${d.worker}`]])));
  }
}

function slicesText(n, r) {
  const shown = r.ranges.slice(0, 3).join("; ");
  return `${n}: ${shown}${r.ranges.length > 3 ? ` (+${r.ranges.length - 3} ranges)` : ""}`;
}

function drawDead(dead) {
  document.getElementById("dead-count").textContent = `(${dead.length})`;
  const ul = document.getElementById("deadletters");
  ul.replaceChildren();
  for (const d of dead.newest) {
    ul.append(el("li", { "data-dead": d.id }, `${new Date(d.ts_ms).toISOString()} ${d.source}: ${d.reason} `,
      buttons([
        ["requeue", "deadletter-requeue", { ids: [d.id] }, `requeue dead letter ${d.id}`],
        ["drop", "deadletter-drop", { ids: [d.id] }, `drop dead letter ${d.id}`],
      ])));
  }
}

// -- an operator's actions (KVQ_MONITOR_TOKENS): the token is kept in this tab's
// sessionStorage and sent as a bearer token; without one the page is read-only
const TOKEN_KEY = "kvq-operator-token";
let operatorName = null;

function buttons(specs) {
  const span = el("span", { class: "act" });
  for (const [label, action, body, what] of specs) {
    const b = el("button", { type: "button", class: "act-btn", "data-action": action }, label);
    b.addEventListener("click", (ev) => { ev.stopPropagation(); act(action, body, what); });
    span.append(b);
  }
  return span;
}

function say(text, state) {
  const box = document.getElementById("action-status");
  box.dataset.state = state;
  box.textContent = text;
}

async function act(action, body, what) {
  const token = sessionStorage.getItem(TOKEN_KEY);
  try {
    const resp = await fetch(`/api/actions/${action}`, {
      method: "POST",
      headers: { "Content-Type": "application/json", Authorization: `Bearer ${token}` },
      body: JSON.stringify(body),
    });
    const got = await resp.json();
    if (!resp.ok) throw new Error(got.message || `HTTP ${resp.status}`);
    say(`${what}: done by ${got.by}`, "ok");
  } catch (err) {
    say(`${what}: failed (${err.message})`, "error");
  }
  poll(true);
}

async function checkOperator() {
  const box = document.getElementById("operator");
  const who = document.getElementById("who");
  const form = document.getElementById("signin");
  const out = document.getElementById("signout");
  operatorName = null;
  const token = sessionStorage.getItem(TOKEN_KEY);
  try {
    const open = await (await fetch("/api/operator", { cache: "no-store" })).json();
    if (!open.actions) {
      box.dataset.state = "off";
      who.textContent = "read-only (the monitor has no KVQ_MONITOR_TOKENS)";
    } else if (token) {
      const resp = await fetch("/api/operator", { cache: "no-store", headers: { Authorization: `Bearer ${token}` } });
      if (resp.ok) operatorName = (await resp.json()).who;
      if (!operatorName) { sessionStorage.removeItem(TOKEN_KEY); who.textContent = "wrong token; read-only"; }
    } else {
      who.textContent = "read-only";
    }
  } catch (err) {
    who.textContent = `read-only (${err.message})`;
  }
  if (operatorName) { box.dataset.state = "signed-in"; who.textContent = `operator: ${operatorName}`; }
  else if (box.dataset.state !== "off") box.dataset.state = "signed-out";
  form.hidden = box.dataset.state !== "signed-out";
  out.hidden = !operatorName;
  document.body.classList.toggle("signed-in", Boolean(operatorName));
}

document.getElementById("signin").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const input = document.getElementById("token");
  sessionStorage.setItem(TOKEN_KEY, input.value.trim());
  input.value = "";
  checkOperator();
});
document.getElementById("signout").addEventListener("click", () => {
  sessionStorage.removeItem(TOKEN_KEY);
  checkOperator();
});

function workerButtons(r) {
  const w = r.worker;
  const drain = ["drain", "drain", { worker: w }, `drain worker ${w}`];
  const quarantine = ["quarantine", "quarantine", { worker: w }, `quarantine worker ${w}`];
  const release = ["release", "release", { worker: w }, `release worker ${w}`];
  if (r.trust === "trusted") return buttons([drain, quarantine]);
  if (r.trust === "draining") return buttons([release, quarantine]);
  return buttons([release]);
}

function draw(snap) {
  drawAlerts(snap.alerts);
  drawModels(snap.models);
  drawTable("workers", snap.workers, [
    ["worker", (v) => el("a", { href: `/worker/${encodeURIComponent(v)}`, class: "worker-link", title: "its page" }, v)], ["state", (v) => v], ["slices", slicesText], ["trust", (v) => v],
    ["ms_per_row"], ["queued_rows"], ["load"], ["kernels"], ["heartbeat_age_s", (v) => (v === null ? "gone" : `${fmt(v, 1)} s`)],
    ["_act", (v, r) => workerButtons(r)],
  ], showAllWorkers ? 0 : WORKERS_SHOWN);
  drawTable("requests", snap.requests, [
    ["request", (v) => v], ["model", (v) => v], ["age_s", (v) => `${fmt(v, 1)} s`], ["prompt_tokens"],
    ["generated", (v, r) => `${v} / ${r.max_tokens}`], ["coordinator", (v) => v || "–"], ["grain", (v) => v],
    ["state", (v, r) => (r.attempt > 1 ? `${v} (attempt ${r.attempt})` : v)],
    ["_act", (v, r) => buttons([["cancel", "cancel", { model: r.model, request: r.request }, `cancel request ${r.request}`]])],
  ]);
  drawDeparted(snap.departed);
  drawTable("coordinators", snap.coordinators, [
    ["coordinator"], ["model", (v) => v], ["busy", (v, r) => `${r.busy} / ${r.slots}${r.alive ? "" : " (stale)"}`],
    ["tokens_per_s"], ["remote_share", (v) => `${fmt(100 * v, 1)} %`],
  ]);
  drawStreams(snap.streams, snap.range);
  drawDead(snap.deadletters);
}

let timer = null;

async function poll(now) {
  if (now && timer) clearTimeout(timer);
  const status = document.getElementById("status");
  try {
    const open = encodeURIComponent([...openSpans].join(","));
    const resp = await fetch(`/api/dashboard?open=${open}&range=${chartRange()}`, { cache: "no-store" });
    if (!resp.ok) throw new Error(`HTTP ${resp.status}`);
    draw(await resp.json());
    status.dataset.state = "live";
    status.textContent = `live · ${new Date().toLocaleTimeString()}`;
  } catch (err) {
    status.dataset.state = "error";
    status.textContent = `cannot reach the monitor (${err.message}); retrying`;
  }
  timer = setTimeout(poll, POLL_MS);
}

document.getElementById("range-pick").append(rangePicker(() => poll(true)));
checkOperator();
poll();
