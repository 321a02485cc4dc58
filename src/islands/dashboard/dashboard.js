// The islands dashboard page: polls /api/state and redraws. Text goes in with textContent only.
"use strict";

const POLL_MS = 2000;
const CONFIG = { displaylogo: false, responsive: true };
const EVENT_SYMBOLS = { failure: "x", join: "triangle-up", entered: "triangle-right", resumed: "diamond" };
const ISLAND_COLORS = ["#4c78a8", "#f58518", "#54a24b", "#e45756", "#72b7b2", "#eeca3b", "#b279a2", "#9d755d"];
let lastRev = null;

// ---- formatting (tests compare these strings with run.json) -----------------------------------------
function isNum(v) { return typeof v === "number" && isFinite(v); }
function fmtLoss(v) { return isNum(v) ? v.toFixed(4) : "\u2013"; }
function fmtMB(v) { return isNum(v) ? v.toFixed(3) : "\u2013"; }
function fmtPct(v) { return isNum(v) ? (100 * v).toFixed(1) + " %" : "\u2013"; }
function fmtInt(v) { return isNum(v) ? String(Math.round(v)) : "\u2013"; }
function fmtRate(v) { return isNum(v) ? v.toPrecision(3) : "\u2013"; }
function fmtSeconds(v) {
  if (!isNum(v)) return "\u2013";
  if (v < 60) return v.toFixed(1) + " s";
  if (v < 3600) return Math.floor(v / 60) + " min " + Math.round(v % 60) + " s";
  return Math.floor(v / 3600) + " h " + Math.round((v % 3600) / 60) + " min";
}
function fmtClock(t) { return isNum(t) ? new Date(t * 1000).toLocaleTimeString() : "\u2013"; }

function setText(id, text) { const el = document.getElementById(id); if (el) el.textContent = text; }

function fillTable(id, rows) {
  const body = document.querySelector("#" + id + " tbody");
  body.replaceChildren();
  for (const cells of rows) {
    const tr = document.createElement("tr");
    for (const c of cells) { const td = document.createElement("td"); td.textContent = c; tr.appendChild(td); }
    body.appendChild(tr);
  }
}

// ---- text -----------------------------------------------------------------------------------------
function renderText(s) {
  const badge = document.getElementById("status");
  badge.textContent = s.status;
  badge.className = "badge " + s.status;
  setText("status-text", s.status_text || "");
  setText("run-dir", s.run_dir);
  document.title = "islands: " + s.run_dir.split("/").filter(Boolean).pop() + " (" + s.status + ")";
  const j = s.job;
  const parts = [];
  if (j.task) parts.push("task " + j.task);
  if (j.strategy) parts.push("strategy " + j.strategy);
  if (isNum(j.workers)) parts.push(j.workers + " worker(s)");
  if (isNum(j.islands)) parts.push(j.islands + " island(s)");
  setText("job", parts.join(" \u00b7 "));
  setText("interconnect", j.interconnect || "\u2013");
  setText("baseline", j.baseline || "\u2013");
  setText("step", (isNum(s.step) ? String(s.step) : "\u2013") + (isNum(j.steps_total) ? " / " + j.steps_total : ""));

  const n = s.numbers;
  setText("val-loss", fmtLoss(n.val_loss));
  setText("val-step", fmtInt(n.val_step));
  setText("val-accuracy", fmtPct(n.val_accuracy));
  setText("train-loss", fmtLoss(n.train_loss));
  setText("mb-sent", fmtMB(n.mb_sent_per_worker));
  setText("utilisation", fmtPct(n.utilisation));
  setText("utilisation-of", n.utilisation_of || "");
  setText("tokens-per-s", fmtInt(n.tokens_per_s));
  setText("wall", fmtSeconds(n.wall_s));
  setText("source", n.from === "run.json" ? "run.json (the run finished)" : "the live streams");

  const c = s.checkpoint;
  const saves = Object.entries(c.saves || {}).map(([k, v]) => k + " " + v).join(", ");
  const levels = Object.entries(c.levels || {}).map(([k, v]) => k + (v === "policy" ? " (policy)" : " every " + v));
  setText("ckpt-levels", c.configured ? levels.join(", ") : "none configured");
  setText("ckpt-saves", saves || (c.configured ? "none yet" : "\u2013"));
  setText("ckpt-step", c.last_saved_step === null || c.last_saved_step === undefined ? "\u2013" : String(c.last_saved_step));
  setText("ckpt-stall", fmtSeconds(c.stall_s));
  setText("ckpt-resumed", c.resumed_from ? JSON.stringify(c.resumed_from) : "\u2013");
  setText("ckpt-last-step", c.configured ? (c.last_saved_step === null || c.last_saved_step === undefined
    ? "none yet" : "step " + c.last_saved_step) : "off");
  setText("ckpt-summary", saves ? "saves: " + saves : "");

  fillTable("ranks", s.ranks.map((r) => [r.name, r.rank ?? "\u2013", r.island ?? "\u2013", r.step ?? "\u2013",
    fmtMB(r.latest.sent_mb), fmtPct(r.latest.utilisation), fmtRate(r.latest.link_gbit_s), fmtClock(r.last_t)]));
  fillTable("events", s.membership.events.map((e) => [isNum(e.t_s) ? "+" + fmtSeconds(e.t_s) : "\u2013",
    e.step ?? "\u2013", e.text, e.stream]));
}

// ---- charts ---------------------------------------------------------------------------------------
function layout(xTitle, yTitle, empty, extra) {
  const l = {
    margin: { l: 60, r: 16, t: 28, b: 50 }, xaxis: { title: { text: xTitle }, zeroline: false },
    yaxis: { title: { text: yTitle }, zeroline: false }, legend: { orientation: "h", y: -0.3 },
    uirevision: "keep", paper_bgcolor: "#ffffff", plot_bgcolor: "#ffffff", font: { size: 12 },
    annotations: empty ? [{ text: "no data yet", showarrow: false, xref: "paper", yref: "paper", x: 0.5, y: 0.5,
      font: { size: 14, color: "#5d6778" } }] : [],
  };
  return Object.assign(l, extra || {});
}

function draw(id, traces, lay) { Plotly.react(document.getElementById(id), traces, lay, CONFIG); }

// one point draws no line: show it as a marker until a second point arrives
function line(x, y, name, extra) {
  return Object.assign({ type: "scatter", mode: x.length > 1 ? "lines" : "markers", x: x, y: y, name: name }, extra || {});
}

function renderCharts(s) {
  const ranks = s.ranks;
  const val = s.val;
  const many = ranks.length > 8;  // many ranks: one legend entry for the group

  // loss against steps: each rank's training loss, the global model's validation loss
  const lossTraces = ranks.filter((r) => r.train_loss.step.length).map((r, i) =>
    line(r.train_loss.step, r.train_loss.value, "train " + r.name,
         { opacity: 0.75, legendgroup: many ? "train" : r.name, showlegend: !many || i === 0 }));
  if (val.step.length) {
    lossTraces.push(line(val.step, val.loss, "validation", { mode: "lines+markers", line: { width: 3, color: "#111" } }));
  }
  draw("chart-loss-step", lossTraces, layout("step", "loss", !lossTraces.length));

  // validation loss against MB sent
  const mb = val.sent_mb.map((v, i) => [v, val.loss[i], val.step[i]]).filter((p) => isNum(p[0]));
  draw("chart-loss-mb", mb.length ? [line(mb.map((p) => p[0]), mb.map((p) => p[1]), "validation",
    { mode: "lines+markers", text: mb.map((p) => "step " + p[2]), line: { width: 3, color: "#111" } })] : [],
  layout("MB sent (" + (val.source === "run.json" ? "rank 0" : val.source || "rank 0") + ")", "validation loss", !mb.length));

  // utilisation per rank
  const util = ranks.filter((r) => r.utilisation.step.length).map((r, i) =>
    line(r.utilisation.step, r.utilisation.value, r.name, { legendgroup: many ? "u" : r.name, showlegend: !many || i === 0 }));
  draw("chart-utilisation", util, layout("step", "utilisation", !util.length,
    { yaxis: { title: { text: "utilisation" }, tickformat: ".0%", range: [0, 1.05] } }));

  // link rates per rank, with the interconnect probe's rates for reference
  const link = ranks.filter((r) => r.link_gbit_s.step.length).map((r, i) =>
    line(r.link_gbit_s.step, r.link_gbit_s.value, r.name,
         { mode: r.link_gbit_s.step.length > 1 ? "lines" : "markers", legendgroup: many ? "l" : r.name,
           showlegend: !many || i === 0 }));
  const shapes = [], notes = [];
  if (link.length) {  // the interconnect probe's rates: what the links could carry
    const ref = s.link_reference;
    for (const [v, label, dash] of [[ref.p2p_gbit_s, "probe p2p", "dash"],
                                     [ref.all_reduce_busbw_gbit_s, "probe all-reduce busbw", "dot"]]) {
      if (!isNum(v) || v <= 0) continue;
      shapes.push({ type: "line", xref: "paper", x0: 0, x1: 1, yref: "y", y0: v, y1: v, line: { dash: dash, color: "#888", width: 1.5 } });
      notes.push({ xref: "paper", x: 0.01, xanchor: "left", yref: "y", y: Math.log10(v), yanchor: "bottom", showarrow: false,
        text: label + " " + fmtRate(v), font: { size: 11, color: "#5d6778" } });
    }
  }
  const linkLayout = layout("step", "Gbit/s", !link.length, { yaxis: { title: { text: "Gbit/s" }, type: "log" }, shapes: shapes });
  linkLayout.annotations = linkLayout.annotations.concat(notes);
  draw("chart-link", link, linkLayout);

  // membership timeline
  const rows = s.membership.rows.filter((r) => isNum(r.start) && isNum(r.end));
  const traces = [];
  if (rows.length) {
    traces.push({ type: "bar", orientation: "h", y: rows.map((r) => r.label), base: rows.map((r) => r.start),
      x: rows.map((r) => Math.max(r.end - r.start, 0.05)), name: "active", width: 0.6,
      marker: { color: rows.map((r) => ISLAND_COLORS[(isNum(r.island) ? r.island : 0) % ISLAND_COLORS.length]) },
      hovertemplate: "%{y}<br>from +%{base:.1f} s to +%{x:.1f} s later<extra></extra>" });
    const byName = new Map(rows.map((r) => [r.name, r.label]));
    const evs = s.membership.events.filter((e) => isNum(e.t_s) && byName.has(e.stream));
    for (const type of [...new Set(evs.map((e) => e.type))]) {
      const these = evs.filter((e) => e.type === type);
      traces.push({ type: "scatter", mode: "markers", name: type, x: these.map((e) => e.t_s),
        y: these.map((e) => byName.get(e.stream)), text: these.map((e) => e.text),
        marker: { symbol: EVENT_SYMBOLS[type] || "circle", size: 12, color: type === "failure" ? "#b3261e" : "#111" },
        hovertemplate: "%{text}<extra></extra>" });
    }
  }
  draw("chart-membership", traces, layout("seconds since the run started", "", !rows.length,
    { barmode: "overlay", yaxis: { automargin: true, autorange: "reversed" }, showlegend: traces.length > 1 }));
}

// ---- polling --------------------------------------------------------------------------------------
async function tick() {
  let s = null;
  try {
    const r = await fetch("api/state", { cache: "no-store" });
    s = await r.json();
    if (!r.ok) throw new Error(s.error || ("HTTP " + r.status));
  } catch (e) {
    const badge = document.getElementById("status");
    badge.textContent = "unreachable";
    badge.className = "badge unreachable";
    setText("status-text", "the dashboard server does not answer (the job may have ended); the last state is shown");
    setText("error", String(e));
    s = null;
  }
  if (s !== null) {
    try {
      setText("error", "");
      renderText(s);
      if (s.rev !== lastRev) { renderCharts(s); lastRev = s.rev; }
    } catch (e) {
      setText("error", "could not draw the state: " + e);
    }
  }
  setTimeout(tick, POLL_MS);
}

tick();
