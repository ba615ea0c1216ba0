// Libra's live view: reads the run's events (/events, server-sent), keeps the run's state
// here, and redraws at most twice a second. No library, no CDN: it must work offline.
"use strict";

const KEY = new URLSearchParams(location.search).get("key");
const withKey = (path) => (KEY ? `${path}?key=${encodeURIComponent(KEY)}` : path);
const COLORS = ["#1e88e5", "#e53935", "#43a047", "#fb8c00", "#8e24aa", "#00897b", "#6d4c41", "#546e7a"];
const SHOWN_ROWS = 300;
const esc = (text) => String(text).replace(/[&<>"]/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" })[c]);

const run = {
  now: 0,
  trajectories: new Map(), // id -> its state
  fleet: [],
  buckets: [], // {t, counts: {bucket: running trajectories}}
  moves: [],
  steps: [],
  evals: [],
};
let sortKey = "seconds";
let sortDescending = true;
let selected = null;
let dirty = true;

function trajectory(id) {
  let t = run.trajectories.get(id);
  if (!t) {
    t = { id, env: "", step: 0, status: "running", turns: 0, tokens: 0, reward: null,
          started: run.now, ended: null, bucket: "", calls: [], tools: [], moves: [] };
    run.trajectories.set(id, t);
  }
  return t;
}

function apply(e) {
  run.now = Math.max(run.now, e.t);
  switch (e.kind) {
    case "start": Object.assign(trajectory(e.id), { env: e.env, step: e.step, started: e.t }); break;
    case "call": {
      const t = trajectory(e.id);
      t.calls.push(e);
      t.bucket = e.bucket;
      if (e.outcome === "ok") t.tokens += e.new_tokens;
      t.turns = Math.max(t.turns, e.turn + 1);
      break;
    }
    case "tool": trajectory(e.id).tools.push(e); break;
    case "move": trajectory(e.id).moves.push(e); run.moves.push(e); break;
    case "end":
      Object.assign(trajectory(e.id), { status: e.status, turns: e.turns, tokens: e.tokens,
                                        reward: e.reward, ended: e.t });
      break;
    case "fleet": {
      run.fleet = e.instances;
      const counts = {};
      for (const i of e.instances) counts[i.bucket] = counts[i.bucket] || 0;
      for (const t of run.trajectories.values()) {
        if (t.ended === null && t.bucket) counts[t.bucket] = (counts[t.bucket] || 0) + 1;
      }
      run.buckets.push({ t: e.t, counts });
      break;
    }
    case "step": run.steps.push(e.line); break;
    case "eval": run.evals.push(e.line); break;
  }
}

function seconds(t) {
  return (t.ended === null ? run.now : t.ended) - t.started;
}

// ------------------------------------------------------------------------- drawing

function lineChart(canvas, series, xLabel) {
  canvas.dataset.points = series.map((s) => s.points.length).join(","); // what a test reads
  const ctx = canvas.getContext("2d");
  const w = canvas.width, h = canvas.height, pad = 34;
  ctx.clearRect(0, 0, w, h);
  const points = series.flatMap((s) => s.points);
  const figure = canvas.closest("figure");
  if (figure) figure.hidden = !points.length; // a chart of nothing is not shown
  if (!points.length) return;
  const xs = points.map((p) => p[0]), ys = points.map((p) => p[1]);
  const x0 = Math.min(...xs), x1 = Math.max(...xs, x0 + 1e-9);
  const y0 = Math.min(0, ...ys), y1 = Math.max(...ys, y0 + 1e-9);
  const X = (x) => pad + ((x - x0) / (x1 - x0)) * (w - pad - 8);
  const Y = (y) => h - pad + 8 - ((y - y0) / (y1 - y0)) * (h - pad - 8);
  ctx.strokeStyle = "#999"; ctx.fillStyle = "#555"; ctx.font = "10px sans-serif";
  ctx.beginPath(); ctx.moveTo(pad, 4); ctx.lineTo(pad, h - pad + 8); ctx.lineTo(w - 4, h - pad + 8); ctx.stroke();
  ctx.fillText(y1.toPrecision(3), 2, 12); ctx.fillText(y0.toPrecision(3), 2, h - pad + 8);
  ctx.fillText(`${x0.toPrecision(3)} .. ${x1.toPrecision(3)} ${xLabel}`, pad, h - 4);
  series.forEach((s, index) => {
    ctx.strokeStyle = COLORS[index % COLORS.length]; ctx.fillStyle = ctx.strokeStyle;
    ctx.beginPath();
    s.points.forEach(([x, y], i) => (i ? ctx.lineTo(X(x), Y(y)) : ctx.moveTo(X(x), Y(y))));
    ctx.stroke();
    if (s.points.length === 1) ctx.fillRect(X(s.points[0][0]) - 2, Y(s.points[0][1]) - 2, 4, 4);
    ctx.fillText(s.name, w - 110, 12 + 11 * index);
  });
}

function cells(row, values) {
  row.replaceChildren(...values.map((v) => {
    const td = document.createElement("td");
    td.textContent = v === null || v === undefined ? "" : v;
    return td;
  }));
  return row;
}

function table(id, rows) {
  const body = document.querySelector(`#${id} tbody`);
  body.replaceChildren(...rows.map((values) => cells(document.createElement("tr"), values)));
  return body;
}

const fixed = (x, digits = 2) => (x === null || x === undefined ? "" : Number(x).toFixed(digits));

function drawFleet() {
  table("fleet", run.fleet.map((i) => [i.name, i.bucket, i.state, i.in_flight,
    i.waiting ?? "", i.kv_usage === undefined ? "" : `${(100 * i.kv_usage).toFixed(0)}%`, `v${i.weight_version}`]));
  const names = [...new Set(run.buckets.flatMap((b) => Object.keys(b.counts)))];
  lineChart(document.getElementById("buckets-chart"),
    names.map((name) => ({ name, points: run.buckets.map((b) => [b.t, b.counts[name] || 0]) })), "s");
  table("moves", run.moves.slice(-200).reverse().map((m) =>
    [fixed(m.t, 1), m.id, m.source, m.target, m.tool ? `${m.tool}: ${m.status}` : ""]));
}

function drawTrajectories() {
  const needle = document.getElementById("filter").value.trim().toLowerCase();
  let rows = [...run.trajectories.values()];
  if (needle) rows = rows.filter((t) => [t.id, t.env, t.status, t.bucket].some((v) => v.toLowerCase().includes(needle)));
  const key = (t) => (sortKey === "seconds" ? seconds(t) : t[sortKey]);
  rows.sort((a, b) => {
    const x = key(a), y = key(b);
    const order = x === y ? 0 : x === null ? -1 : y === null ? 1 : x < y ? -1 : 1;
    return sortDescending ? -order : order;
  });
  const body = table("trajectories", rows.slice(0, SHOWN_ROWS).map((t) =>
    [t.id, t.env, t.status, t.turns, t.tokens, fixed(t.reward), fixed(seconds(t), 1), t.bucket]));
  [...body.children].forEach((tr, i) => {
    const t = rows[i];
    tr.dataset.id = t.id;
    tr.children[2].className = `status-${t.status}`;
    if (t.id === selected) tr.classList.add("selected");
  });
  const running = rows.filter((t) => t.ended === null).length;
  document.getElementById("shown").textContent =
    `${Math.min(rows.length, SHOWN_ROWS)} of ${rows.length} shown (${running} running)`;
}

function drawDetail() {
  const section = document.getElementById("detail-section");
  const t = selected && run.trajectories.get(selected);
  section.hidden = !t;
  if (!t) return;
  document.getElementById("detail-id").textContent = `${t.id} (${t.status})`;
  const lanes = [...new Set(t.calls.map((c) => c.instance)), "tools"];
  const svg = document.getElementById("timeline");
  const w = 560, lane = 22, left = 90;
  svg.setAttribute("height", lanes.length * lane + 20);
  const end = t.ended === null ? run.now : t.ended;
  const X = (x) => left + ((x - t.started) / Math.max(1e-9, end - t.started)) * (w - left - 4);
  const parts = lanes.map((name, i) => `<text x="2" y="${i * lane + 15}" font-size="10">${esc(name)}</text>`);
  const bar = (row, from, to, color, title) =>
    `<rect x="${X(from)}" y="${row * lane + 4}" width="${Math.max(1, X(to) - X(from))}" height="${lane - 8}" fill="${color}"><title>${esc(title)}</title></rect>`;
  for (const c of t.calls) {
    parts.push(bar(lanes.indexOf(c.instance), c.t - c.seconds, c.t, c.outcome === "ok" ? "#1e88e5" : "#e53935",
      `turn ${c.turn}: ${c.new_tokens} tokens in ${c.seconds.toFixed(2)} s (${c.outcome}), bucket ${c.bucket}`));
  }
  for (const tool of t.tools) {
    parts.push(bar(lanes.length - 1, tool.t - tool.seconds, tool.t, tool.status === "success" ? "#43a047" : "#fb8c00",
      `${tool.tool}: ${tool.status} in ${tool.seconds.toFixed(2)} s`));
  }
  for (const m of t.moves) {
    parts.push(`<line x1="${X(m.t)}" x2="${X(m.t)}" y1="0" y2="${lanes.length * lane}" stroke="#8e24aa"><title>${esc(m.source)} to ${esc(m.target)}</title></line>`);
  }
  parts.push(`<text x="${left}" y="${lanes.length * lane + 14}" font-size="10">${(end - t.started).toFixed(1)} s</text>`);
  svg.innerHTML = parts.join("");
  const steps = [
    ...t.calls.map((c) => [c.t, `call, turn ${c.turn}`, `${c.instance} (${c.bucket})`, c.seconds, `${c.outcome}, ${c.new_tokens} tokens`]),
    ...t.tools.map((x) => [x.t, `tool ${x.tool}`, "", x.seconds, x.status]),
    ...t.moves.map((m) => [m.t, "move", `${m.source} to ${m.target}`, null, m.tool ? `after ${m.tool}: ${m.status}` : ""]),
  ].sort((a, b) => a[0] - b[0]);
  table("steps", steps.map(([at, what, where, s, outcome]) => [fixed(at, 2), what, where, fixed(s, 2), outcome]));
}

async function showConversation(id) {
  const box = document.getElementById("conversation");
  box.textContent = "";
  let answer = await fetch(withKey(`record/${encodeURIComponent(id)}`));
  // Its end is published a moment before its record is written: ask again while it
  // stays selected (and ended).
  while (!answer.ok && selected === id) {
    box.textContent = "the conversation shows once the trajectory has ended and is recorded";
    await new Promise((resolve) => setTimeout(resolve, 1000));
    if (run.trajectories.get(id)?.ended !== null) {
      answer = await fetch(withKey(`record/${encodeURIComponent(id)}`));
    }
  }
  if (!answer.ok || selected !== id) return;
  box.textContent = "";
  const record = await answer.json();
  box.replaceChildren(...record.messages.map((m) => {
    const div = document.createElement("div");
    div.className = `message ${m.role}`;
    const role = document.createElement("span");
    role.className = "role";
    role.textContent = `${m.role}: `;
    const calls = (m.tool_calls || []).map((c) => `\n[calls ${c.function.name}(${c.function.arguments})]`).join("");
    div.append(role, (m.content || "") + calls);
    return div;
  }));
}

function drawTraining() {
  const section = document.getElementById("training-section");
  section.hidden = !run.steps.length && !run.evals.length;
  if (section.hidden) return;
  const last = run.steps[run.steps.length - 1];
  const live = document.getElementById("state").textContent === "live";
  document.getElementById("step-now").textContent = last
    ? `${run.steps.length} steps done, weights v${last.weight_version}` +
      (live ? `; step ${last.step + 1} under way` : "") : "";
  const per = (field) => run.steps.filter((s) => s[field] !== null && s[field] !== undefined).map((s) => [s.step, s[field]]);
  lineChart(document.getElementById("reward-chart"), [{ name: "reward", points: per("reward_mean") }], "step");
  lineChart(document.getElementById("length-chart"), [{ name: "tokens", points: per("response_tokens_mean") }], "step");
  lineChart(document.getElementById("times-chart"),
    ["rollout_s", "train_s", "export_s", "sync_s"].map((f) => ({ name: f, points: per(f) })), "step");
  const envs = [...new Set(run.evals.flatMap((e) => Object.keys(e.envs || {})))];
  lineChart(document.getElementById("eval-chart"), envs.map((env) => ({
    name: env, points: run.evals.filter((e) => e.envs[env] && e.envs[env]["pass@1"] !== null)
      .map((e) => [e.step, e.envs[env]["pass@1"]]) })), "steps done");
  const allocated = run.steps.filter((s) => s.alloc);
  const numbers = [...new Set(allocated.flatMap((s) => Object.keys(s.alloc).filter((k) => typeof s.alloc[k] === "number")))];
  lineChart(document.getElementById("alloc-chart"),
    numbers.map((k) => ({ name: k, points: allocated.map((s) => [s.step, s.alloc[k] ?? 0]) })), "step");
  table("alloc", allocated.map((s) => [s.step, JSON.stringify(s.alloc)]));
  document.getElementById("alloc-moves").hidden = !allocated.length;
}

function draw() {
  if (!dirty) return;
  dirty = false;
  const ended = [...run.trajectories.values()].filter((t) => t.ended !== null).length;
  document.getElementById("summary").textContent =
    `${run.now.toFixed(1)} s, ${run.trajectories.size} trajectories (${ended} ended), ${run.moves.length} moves`;
  drawFleet();
  drawTrajectories();
  drawDetail();
  drawTraining();
}

// --------------------------------------------------------------------------- wiring

document.querySelectorAll("#trajectories th[data-key]").forEach((th) => th.addEventListener("click", () => {
  sortDescending = sortKey === th.dataset.key ? !sortDescending : true;
  sortKey = th.dataset.key;
  dirty = true;
}));
document.getElementById("filter").addEventListener("input", () => { dirty = true; });
document.querySelector("#trajectories tbody").addEventListener("click", (event) => {
  const row = event.target.closest("tr");
  if (!row) return;
  selected = row.dataset.id;
  dirty = true;
  showConversation(selected);
});

const source = new EventSource(withKey("events"));
const state = document.getElementById("state");
source.onopen = () => { state.textContent = "live"; state.className = "badge live"; };
source.onmessage = (message) => {
  for (const e of JSON.parse(message.data)) apply(e);
  dirty = true;
};
source.addEventListener("state", () => {
  state.textContent = "finished"; state.className = "badge";
  source.close();
  dirty = true;
});
source.onerror = () => { if (state.textContent === "live") { state.textContent = "disconnected"; state.className = "badge"; } };
setInterval(draw, 500);
