// dmsc dashboard: polls /ui/api/state and draws the page it is loaded in (body[data-page]).
// Every value goes into the page as text (textContent), never as markup.
"use strict";

const POLL_MS = 2000;
const charts = {};

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v !== undefined && v !== null) node.setAttribute(k, v);
  }
  for (const c of children) {
    if (c === undefined || c === null) continue;
    node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return node;
}

function fmt(x, digits) {
  if (x === null || x === undefined) return "-";
  if (typeof x !== "number") return String(x);
  return x.toLocaleString(undefined, { maximumFractionDigits: digits ?? 3 });
}

// a time as the database keeps it (ISO text, or seconds since the epoch) in the reader's clock
function when(t) {
  if (t === null || t === undefined) return "";
  const d = typeof t === "number" ? new Date(t * 1000) : new Date(t.endsWith("Z") || t.includes("+") ? t : `${t}Z`);
  return isNaN(d) ? String(t) : d.toLocaleString();
}

function bytes(n) {
  if (n === null || n === undefined) return "-";
  const units = ["B", "KB", "MB", "GB"];
  let i = 0;
  while (n >= 1000 && i < units.length - 1) { n /= 1000; i++; }
  return `${n.toFixed(i ? 2 : 0)} ${units[i]}`;
}

// columns: [header, row => value, className?]; a value may be a Node
function table(columns, rows, empty) {
  if (!rows.length) return el("p", { class: "empty" }, empty || "none");
  const head = el("tr", {}, ...columns.map(([h]) => el("th", {}, h)));
  const body = rows.map((r) => el("tr", {}, ...columns.map(([, f, cls]) => el("td", { class: cls }, f(r)))));
  return el("table", {}, el("thead", {}, head), el("tbody", {}, ...body));
}

function put(id, node) {
  const box = document.getElementById(id);
  if (box) box.replaceChildren(node);
}

function health(s) {
  const cls = s.health === "ok" ? "ok" : "bad";
  return el("span", { class: cls }, s.health);
}

function state(t) {
  const cls = { done: "ok", failed: "bad", running: "warn", cancelled: "warn" }[t.state] || "";
  return el("span", { class: cls }, t.state);
}

function drawOverview(s) {
  const byKey = {};
  for (const sv of s.services) byKey[`${sv.stage}/${sv.replica}`] = sv;
  // the plan's stages, then the elastic serving replicas' stages, by datacenter
  const items = {};
  for (const dc of s.topology.datacenters) {
    items[dc.name] = dc.placed.map((p) => {
      const sv = byKey[`${p.stage}/${p.replica}`];
      return el("li", {}, `stage ${p.stage} / replica ${p.replica}: ${p.layers} on ${p.device} `,
        sv ? health(sv) : el("span", { class: "bad" }, "no service"));
    });
  }
  for (const r of s.serving) {
    for (const [st, dc, , device] of r.placement) {
      (items[dc] = items[dc] || []).push(el("li", {}, `stage ${st} of ${r.name} on ${device} `,
        el("span", { class: r.draining ? "warn" : "ok" }, r.draining ? "draining" : "serving")));
    }
  }
  const cards = Object.keys(items).sort().map((name) => el("div", { class: "card", "data-dc": name },
    el("h4", {}, name), el("ul", {}, ...items[name])));
  put("datacenters", el("div", { class: "cards" }, ...cards));
  put("paths", table([
    ["after stage", (p) => p.after_stage, "num"],
    ["from", (p) => p.source], ["to", (p) => p.target],
    ["links", (p) => p.links.join(", ")], ["km", (p) => fmt(p.km, 0), "num"],
    ["reserved", (p) => p.reserved], ["Gbit/s", (p) => fmt(p.gbit_s), "num"],
  ], s.topology.paths, "no inter-datacenter path: every boundary stays inside a datacenter"));
  put("services", table([
    ["SID", (v) => v.sid], ["stage", (v) => v.stage, "num"], ["replica", (v) => v.replica, "num"],
    ["datacenter", (v) => v.datacenter], ["device", (v) => v.device],
    ["health", health], ["heartbeat age (s)", (v) => fmt(v.heartbeat_age_s, 1), "num"],
    ["epoch", (v) => v.epoch, "num"], ["address", (v) => v.address], ["pid", (v) => v.pid, "num"],
    ["CPU %", (v) => fmt(v.cpu_percent, 0), "num"], ["memory", (v) => bytes(v.rss_bytes), "num"],
    ...(s.services.some((v) => v.gpu_memory_bytes !== null && v.gpu_memory_bytes !== undefined)
      ? [["GPU memory", (v) => bytes(v.gpu_memory_bytes), "num"], ["GPU %", (v) => fmt(v.gpu_utilization_percent, 0), "num"]]
      : []),
  ], s.services, "no services"));
  put("nodes", table([
    ["node", (n) => n.node], ["host", (n) => n.host ?? "-"], ["cores", (n) => fmt(n.cpus, 0), "num"],
    ["busy %", (n) => fmt(n.cpu_percent, 0), "num"],
    ["memory used", (n) => bytes(n.memory_used_bytes), "num"], ["of", (n) => bytes(n.memory_total_bytes), "num"],
    ["sent /s", (n) => bytes(n.net_sent_bytes_s), "num"], ["received /s", (n) => bytes(n.net_recv_bytes_s), "num"],
    ["workers", (n) => n.workers, "num"], ["their CPU %", (n) => fmt(n.workers_cpu_percent, 0), "num"],
    ["their memory", (n) => bytes(n.workers_rss_bytes), "num"],
  ], s.nodes || [], "no nodes"));
  put("serving", table([
    ["name", (r) => r.name],
    ["placement", (r) => r.placement.map(([st, dc, devs]) => `stage ${st}: ${dc} ${devs.join("+")}`).join("; ")],
    ["in flight", (r) => r.in_flight, "num"],
    ["state", (r) => (r.draining ? el("span", { class: "warn" }, "draining") : el("span", { class: "ok" }, "serving"))],
    ["since", (r) => when(r.started_at)],
  ], s.serving, "none: the plan's replicas serve alone (dmsc up --autoscale adds more with the load)"));
  put("scale-events", table([
    ["at", (e) => when(e.at)], ["action", (e) => e.action], ["replica", (e) => e.replica],
    ["replicas after", (e) => e.replicas_after, "num"], ["in flight", (e) => fmt(e.in_flight, 1), "num"],
    ["reason", (e) => e.reason.slice(0, 120)],
  ], s.scale_events, "no scale events"));
}

function drawTasks(s) {
  const q = s.queues;
  put("queues", el("div", { class: "cards" },
    el("div", { class: "card" }, el("h4", {}, "queued"), el("div", { class: "big" }, q.queued)),
    el("div", { class: "card" }, el("h4", {}, "sync lane"), el("div", { class: "big" }, q.lanes.sync)),
    el("div", { class: "card" }, el("h4", {}, "async lane"), el("div", { class: "big" }, q.lanes.async)),
    el("div", { class: "card", id: "exception-queue" }, el("h4", {}, "exception queue"),
      el("div", { class: q.exceptions ? "big bad" : "big" }, q.exceptions))));
  put("tasks", table([
    ["id", (t) => t.id, "num"], ["kind", (t) => t.kind], ["state", state],
    ["lane", (t) => t.lane], ["priority", (t) => t.priority, "num"], ["tenant", (t) => t.tenant],
    ["attempts", (t) => t.attempts, "num"], ["queue wait (s)", (t) => fmt(t.queue_wait_s, 2), "num"],
    ["exception", (t) => t.exception_type || ""], ["error", (t) => (t.error || "").slice(0, 80)],
  ], s.tasks, "no tasks yet"));
  put("versions", table([
    ["id", (v) => v.id, "num"], ["run", (v) => v.run, "num"], ["step", (v) => v.step, "num"],
    ["status", (v) => v.status],
    ["canary share", (v) => (v.status === "canary" ? `${v.canary_percent}%` : ""), "num"],
    ["task", (v) => v.task ?? "", "num"], ["created", (v) => when(v.created_at)],
  ], s.versions, "no model version yet: a training task makes one"));
  put("faults", table([
    ["id", (f) => f.id, "num"], ["kind", (f) => f.kind], ["services", (f) => f.services],
    ["reason", (f) => (f.reason || "").slice(0, 100)], ["detected", (f) => when(f.detected_at)],
    ["recovered", (f) => (f.recovered_at ? when(f.recovered_at) : el("span", { class: "bad" }, "not yet"))],
    ["steps lost", (f) => f.steps_lost ?? "", "num"], ["epoch", (f) => f.epoch ?? "", "num"],
  ], s.faults, "no faults"));
}

function chart(id, config) {
  const canvas = document.getElementById(id);
  if (!canvas || typeof Chart === "undefined") return;
  if (charts[id]) {
    charts[id].data = config.data;
    charts[id].update("none");
  } else {
    config.options = Object.assign({ animation: false, responsive: true, maintainAspectRatio: false }, config.options);
    charts[id] = new Chart(canvas, config);
  }
}

const linear = (title) => ({ type: "linear", title: { display: true, text: title } });

function drawCharts(s) {
  const tr = s.training;
  const xy = (ys) => tr.steps.map((x, i) => ({ x, y: ys[i] }));
  const span = tr.steps.length ? [tr.steps[0], tr.steps[tr.steps.length - 1]] : [0, 1];
  // a task whose dp changed while it ran: each segment's prediction over its own steps
  const segs = tr.segments || [];
  const predicted = segs.length
    ? segs.filter((g) => g.predicted_step_s !== null).map((g) => ({
      label: `predicted at dp ${g.dp}`,
      data: [g.first_step, g.last_step].map((x) => ({ x, y: g.predicted_step_s })),
      borderColor: "#c0392b", borderDash: [6, 4], pointRadius: 0 }))
    : tr.predicted_step_s === null ? [] : [
      { label: "predicted", data: span.map((x) => ({ x, y: tr.predicted_step_s })),
        borderColor: "#c0392b", borderDash: [6, 4], pointRadius: 0 },
    ];
  chart("chart-step", {
    type: "line",
    // the prediction for the job the task ran; none where it is not comparable (the reason
    // is the chart's title)
    data: { datasets: [
      { label: "measured", data: xy(tr.step_s), borderColor: "#2563eb", pointRadius: 0 },
    ].concat(predicted) },
    options: {
      scales: { x: linear("step"), y: { beginAtZero: true } },
      plugins: { title: { display: !!tr.prediction, text: "prediction: " + (tr.prediction || "") } },
    },
  });
  chart("chart-loss", {
    type: "line",
    data: { datasets: [{ label: "loss", data: xy(tr.loss), borderColor: "#7c3aed", pointRadius: 0 }] },
    options: { scales: { x: linear("step") } },
  });
  chart("chart-tput", {
    type: "line",
    data: { datasets: [{ label: "tokens/s", data: xy(tr.tokens_per_s), borderColor: "#059669", pointRadius: 0 }] },
    options: { scales: { x: linear("step"), y: { beginAtZero: true } } },
  });
  const links = s.links;
  chart("chart-links", {
    type: "bar",
    data: {
      labels: links.map((l) => `${l.from} → ${l.to} (${l.from_dc}→${l.to_dc})`),
      datasets: [{ label: "bytes per step", data: links.map((l) => l.bytes_per_step),
        backgroundColor: links.map((l) => (l.kind === "pipeline" ? "#2563eb" : "#f59e0b")) }],
    },
    options: { indexAxis: "y", plugins: { legend: { display: false } } },
  });
  const rows = [...new Set(s.gantt.map((g) => `stage ${g.stage} / replica ${g.replica}`))].sort();
  const bars = (op, color) => ({
    label: op === "F" ? "forward" : "backward",
    data: s.gantt.filter((g) => g.op === op)
      .map((g) => ({ x: [g.t0_ms, g.t1_ms], y: `stage ${g.stage} / replica ${g.replica}`, mb: g.mb, step: g.step })),
    backgroundColor: color, grouped: false, barPercentage: 0.7,
  });
  chart("chart-gantt", {
    type: "bar",
    data: { labels: rows, datasets: [bars("F", "#2563eb"), bars("B", "#f59e0b")] },
    options: {
      indexAxis: "y",
      scales: { x: linear("ms since the first op shown"), y: { stacked: false } },
      plugins: { tooltip: { callbacks: { label: (c) => `step ${c.raw.step}, micro-batch ${c.raw.mb}: ${fmt(c.raw.x[1] - c.raw.x[0], 1)} ms` } } },
    },
  });
  put("links", table([
    ["from", (l) => `${l.from} (${l.from_dc})`], ["to", (l) => `${l.to} (${l.to_dc})`],
    ["kind", (l) => l.kind], ["per step", (l) => bytes(l.bytes_per_step), "num"],
    ["Mbit/s", (l) => fmt(l.mbit_s, 1), "num"],
  ], links, "no traffic measured yet: a training task reports it"));
  const ms = (x) => (x === null || x === undefined ? "-" : fmt(x * 1e3, 1));
  put("segments", table([
    ["steps", (g) => `${g.first_step} .. ${g.last_step}`], ["dp", (g) => g.dp, "num"],
    ["steps run", (g) => g.steps, "num"], ["measured median ms", (g) => ms(g.median_step_s), "num"],
    ["predicted ms", (g) => ms(g.predicted_step_s), "num"],
    ["prediction", (g) => g.not_comparable || g.prediction || ""],
  ], segs, "the newest training task ran at one dp (its prediction is the chart's)"));
  put("modes", table([
    ["mode", (m) => m.mode], ["predicted ms", (m) => ms(m.predicted_s), "num"],
    ["measured ms", (m) => ms(m.measured_s), "num"], ["ratio", (m) => fmt(m.ratio, 2), "num"],
    ["slowest worker ms", (m) => ms(m.slowest_s), "num"],
    ["bytes sent", (m) => bytes(m.measured_bytes), "num"],
    ["steps", (m) => m.steps, "num"],
  ], tr.modes || [], "no communication measured yet: a training task reports it"));
  const routing = document.getElementById("routing");
  if (routing) {  // expert parallelism: the routing measured beside the one the plan priced
    const r = tr.routing;
    routing.textContent = r ? `expert routing: the busiest expert-parallel rank received ` +
      `${fmt(r.measured, 2)} of an even share of the tokens (the plan priced ${fmt(r.planned, 2)})` : "";
  }
}

// the control loop's open alerts, on every page (the document has no "control" part when
// dmsc up ran with --control-interval 0)
function banner(s) {
  const box = document.getElementById("alert-banner");
  if (!box) return;
  const open = ((s.control || {}).alerts || []).filter((a) => !a.resolved_at);
  box.hidden = !open.length;
  box.textContent = open.length
    ? `${open.length} objective${open.length > 1 ? "s" : ""} broken: ` +
      open.map((a) => `${a.slo} ${fmt(a.value)} > ${fmt(a.objective)}`).join("; ")
    : "";
}

function effect(d) {
  if (d.step_before_s === null || d.step_before_s === undefined) return "";
  if (d.step_after_s === null || d.step_after_s === undefined) return `${fmt(d.step_before_s)} s -> (measuring)`;
  return `${fmt(d.step_before_s)} s -> ${fmt(d.step_after_s)} s (task ${d.task_after})`;
}

function drawControl(s) {
  const c = s.control;
  if (!c) {
    put("control-loop", document.createTextNode("off (dmsc up --control-interval 0)"));
    return;
  }
  const slos = Object.entries(c.slos).map(([k, v]) => `${k} <= ${v.max} (${v.action})`).join(", ");
  put("control-loop", document.createTextNode(
    `every ${c.interval_s} s, ${c.mode} mode · objectives: ${slos || "none"} · ` +
    `${c.cost.ticks} ticks, ${fmt(c.cost.mean_wall_ms, 2)} ms and ${fmt(c.cost.mean_cpu_ms, 2)} ms CPU each`));
  put("alerts", table([
    ["id", (a) => a.id, "num"], ["at", (a) => when(a.at)], ["objective", (a) => a.slo],
    ["measured", (a) => fmt(a.value), "num"], ["limit", (a) => fmt(a.objective), "num"],
    ["why", (a) => a.reason, "why"], ["task", (a) => a.task ?? "", "num"],
    ["action", (a) => `${a.action}${a.action_outcome ? ": " + a.action_outcome : ""}`],
    ["webhook", (a) => a.webhook],
    ["state", (a) => (a.resolved_at ? el("span", { class: "ok" }, "resolved") : el("span", { class: "bad" }, "open"))],
  ], c.alerts, "no alerts"));
  put("decisions", table([
    ["id", (d) => d.id, "num"], ["at", (d) => when(d.at)], ["module", (d) => d.module],
    ["kind", (d) => d.kind], ["target", (d) => d.target], ["verdict", (d) => d.verdict],
    ["why", (d) => d.reason, "why"], ["outcome", (d) => d.outcome],
    ["step before -> after", effect],
  ], c.decisions, "no decisions yet"));
}

const DRAW = { overview: drawOverview, tasks: (s) => { drawTasks(s); drawControl(s); }, charts: drawCharts };

function live(on, s) {
  const badge = document.getElementById("live");
  if (!badge) return;
  badge.className = on ? "live on" : "live off";
  badge.textContent = on ? `live · ${new Date(s.generated_at * 1000).toLocaleTimeString()}` : "no answer";
  if (on) {
    const down = s.replicas_down.length ? ` · replicas out of routing: ${s.replicas_down.join(", ")}` : "";
    document.getElementById("summary").textContent =
      `run ${s.run} · ${s.model} on ${s.topology.cluster} · epoch ${s.epoch} · ${s.steps_done} steps trained · ` +
      `${s.services.length} services, ${s.services.filter((v) => v.health === "ok").length} healthy${down}`;
  }
}

async function poll() {
  const draw = DRAW[document.body.dataset.page];
  try {
    const r = await fetch("/ui/api/state", { credentials: "same-origin", cache: "no-store" });
    if (r.status === 401) { window.location.assign("/ui"); return; }
    if (!r.ok) throw new Error(`HTTP ${r.status}`);
    const s = await r.json();
    draw(s);
    banner(s);
    live(true, s);
  } catch (e) {
    live(false);
  }
  setTimeout(poll, POLL_MS);
}

if (DRAW[document.body.dataset.page]) poll();
