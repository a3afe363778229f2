// Atoll dashboard: plain JavaScript, SVG and canvas; no library, no build step.
// The server pushes one snapshot of the job at a time over server-sent events (/api/stream); the loss history,
// one island's nodes and one node's page are fetched when shown.
"use strict";

const $ = (id) => document.getElementById(id);
let doc = null;
let view = "map";
let openIsland = null;
let nodeShown = null;
let historyKey = null;
let history = null;
let zoom = null; // [first step, last step] shown, null: the whole job
let eventKinds = new Set();
const hiddenKinds = new Set();

// --- formatting ---------------------------------------------------------------------------------------------
function esc(s) {
  return String(s ?? "").replace(/[&<>"']/g, (c) => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;",
    "'": "&#39;"}[c]));
}
function num(x, d = 0) { return x == null ? "-" : Number(x).toLocaleString(undefined, {maximumFractionDigits: d,
  minimumFractionDigits: d}); }
function secs(x) {
  if (x == null || !(x > 0)) return "-";
  if (x < 1) return `${(x * 1000).toFixed(x < 0.01 ? 2 : 0)} ms`;
  if (x < 90) return `${x.toFixed(x < 10 ? 2 : 1)} s`;
  if (x < 5400) return `${Math.round(x / 60)} min`;
  if (x < 172800) return `${(x / 3600).toFixed(1)} h`;
  return `${(x / 86400).toFixed(1)} d`;
}
function rate(bps) {
  if (!(bps > 0)) return "-";
  for (const [u, s] of [["GB/s", 1e9], ["MB/s", 1e6], ["kB/s", 1e3]]) if (bps >= s) return `${(bps / s).toFixed(2)} ${u}`;
  return `${bps.toFixed(0)} B/s`;
}
function bytes(n) {
  if (!(n > 0)) return "-";
  for (const [u, s] of [["GiB", 2 ** 30], ["MiB", 2 ** 20], ["KiB", 2 ** 10]]) if (n >= s) return `${(n / s).toFixed(1)} ${u}`;
  return `${n.toFixed(0)} B`;
}
function clock(t) { return new Date(t * 1000).toLocaleTimeString(); }
// bandwidth -> colour: red at 1 MB/s and below, through yellow, to green at 10 GB/s and above (log scale)
function bwColour(bps) {
  if (!(bps > 0)) return "#555";
  const f = Math.max(0, Math.min(1, (Math.log10(bps) - 6) / 4));
  return `hsl(${Math.round(f * 130)}, 75%, 50%)`;
}
const stateColour = {alive: "#3fb950", gone: "#f85149", left: "#6e7681", quarantined: "#d29922"};

// --- live updates -------------------------------------------------------------------------------------------
function connect() {
  const source = new EventSource("/api/stream");
  source.addEventListener("snapshot", (e) => {
    $("live").textContent = "live";
    $("live").classList.remove("off");
    doc = JSON.parse(e.data);
    render();
  });
  source.onerror = () => { $("live").textContent = "reconnecting"; $("live").classList.add("off"); };
}

async function getJSON(path) {
  const r = await fetch(path, {credentials: "same-origin"});
  if (!r.ok) throw new Error(`${path}: ${r.status}`);
  return r.json();
}

// --- routing ------------------------------------------------------------------------------------------------
function route() {
  const h = location.hash.replace(/^#\/?/, "") || "map";
  if (h.startsWith("node/")) { view = "node"; nodeShown = decodeURIComponent(h.slice(5)); }
  else { view = ["map", "plan", "training", "outer", "events"].includes(h) ? h : "map"; nodeShown = null; }
  for (const s of document.querySelectorAll(".view")) s.hidden = s.id !== `view-${view}`;
  for (const a of document.querySelectorAll("nav a")) a.classList.toggle("active", a.dataset.view === view);
  render();
}

function render() {
  if (!doc) return;
  renderHeader();
  if (view === "map") renderMap();
  else if (view === "plan") renderPlan();
  else if (view === "training") renderTraining();
  else if (view === "outer") renderOuter();
  else if (view === "events") renderEvents();
  else if (view === "node") renderNode();
  $("updated").textContent = `Snapshot of ${clock(doc.time)}.`;
}

function renderHeader() {
  const j = doc.job;
  $("job-name").textContent = j.name;
  $("job-state").textContent = j.waiting ? "waiting" : j.state;
  $("job-state").className = `badge ${j.state}`;
  $("step").textContent = j.target_steps ? `${num(j.step)} / ${num(j.target_steps)}` : num(j.step);
  $("loss").textContent = j.loss == null ? "-" : j.loss.toFixed(4);
  $("tps").textContent = num(j.tokens_per_second);
  $("eta").textContent = j.state === "finished" ? "done" : secs(j.eta_seconds);
  $("epoch").textContent = j.epoch;
  const m = doc.map;
  $("alive-headline").textContent = `${num(m.states.alive || 0)} / ${num(m.members)}`;
  document.title = `${j.name}: step ${j.step} - Atoll`;
}

// --- cluster map --------------------------------------------------------------------------------------------
const SVGNS = "http://www.w3.org/2000/svg";
function el(name, attrs, parent) {
  const e = document.createElementNS(SVGNS, name);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  if (parent) parent.appendChild(e);
  return e;
}

function renderMap() {
  const m = doc.map;
  $("count-members").textContent = num(m.members);
  for (const s of ["alive", "gone", "left", "quarantined"]) $(`count-${s}`).textContent = num(m.states[s] || 0);
  $("count-regions").textContent = num(m.regions.length);
  $("count-islands").textContent = num(m.islands);
  $("count-devices").textContent = num(m.devices);
  $("bw-legend").innerHTML = 'link bandwidth <span>1 MB/s</span><span class="ramp" style="background:linear-gradient(' +
    'to right, hsl(0,75%,50%), hsl(65,75%,50%), hsl(130,75%,50%))"></span><span>10 GB/s</span>';
  drawMap(m);
  $("region-table").tBodies[0].innerHTML = m.regions.map((r) => `<tr><td>${esc(r.name)}</td><td>${r.islands.length}` +
    `</td><td>${num(r.members)}</td><td>${num(r.alive)}</td><td>${num(r.devices)}</td></tr>`).join("");
  if (openIsland) loadIsland(openIsland);
}

function regionCells(n, W, H) {
  // one or two regions side by side; more on an ellipse, so the links between any two are chords apart
  if (n <= 2) return Array.from({length: n}, (_, k) => ({x: k * W / n + 8, y: 8, w: W / n - 16, h: H - 16}));
  if (n > 12) {
    const cols = Math.ceil(Math.sqrt(n * W / H)), rows = Math.ceil(n / cols);
    return Array.from({length: n}, (_, k) => ({x: (k % cols) * W / cols + 6, y: Math.floor(k / cols) * H / rows + 6,
      w: W / cols - 12, h: H / rows - 12}));
  }
  const w = Math.min(300, W * 0.85 / Math.ceil(n / 2)), h = Math.min(190, H * 0.4);
  const rx = W / 2 - w / 2 - 8, ry = H / 2 - h / 2 - 8;
  return Array.from({length: n}, (_, k) => {
    const a = 2 * Math.PI * k / n - Math.PI / 2;
    return {x: W / 2 + rx * Math.cos(a) - w / 2, y: H / 2 + ry * Math.sin(a) - h / 2, w, h};
  });
}

function drawMap(m) {
  const svg = $("map-svg");
  const W = svg.clientWidth || 1200, H = svg.clientHeight || 460;
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  svg.replaceChildren();
  const regions = m.regions;
  if (!regions.length) {
    el("text", {x: W / 2, y: H / 2, "text-anchor": "middle"}, svg).textContent = doc.job.waiting || "no members yet";
    return;
  }
  const cells = regionCells(regions.length, W, H);
  const maxMembers = Math.max(1, ...regions.flatMap((r) => r.islands.map((i) => i.members)));
  const centre = {}, islandAt = {};
  const regionLayer = el("g", {}, svg), linkLayer = el("g", {}, svg), islandLayer = el("g", {}, svg);
  const labelLayer = el("g", {}, svg);
  regions.forEach((r, k) => {
    const c = cells[k];
    el("rect", {x: c.x, y: c.y, width: c.w, height: c.h, rx: 10, class: "region"}, regionLayer);
    el("text", {x: c.x + 10, y: c.y + 18, "font-weight": 600}, regionLayer).textContent =
      `${r.name}: ${num(r.members)} members, ${r.islands.length} island${r.islands.length === 1 ? "" : "s"}`;
    centre[r.name] = [c.x + c.w / 2, c.y + c.h / 2 + 8];
    const n = r.islands.length;
    const ic = Math.max(1, Math.ceil(Math.sqrt(n * c.w / Math.max(1, c.h - 30))));
    const ir = Math.ceil(n / ic);
    const iw = (c.w - 16) / ic, ih = (c.h - 34) / ir;
    const rmax = Math.max(4, Math.min(60, Math.min(iw, ih) / 2 - 12));
    r.islands.forEach((isl, j) => {
      const cx = c.x + 8 + (j % ic + 0.5) * iw, cy = c.y + 26 + (Math.floor(j / ic) + 0.5) * ih;
      const rad = Math.max(5, rmax * Math.sqrt(isl.members / maxMembers));
      islandAt[isl.id] = [cx, cy];
      const g = el("g", {class: "island", "data-island": isl.id, tabindex: 0}, islandLayer);
      g.addEventListener("click", () => { openIsland = isl.id; loadIsland(isl.id); });
      const alive = (isl.states.alive || 0) / Math.max(1, isl.members);
      el("circle", {cx, cy, r: rad, class: "body", fill: isl.unformed ? "#2a2f36" : "#1f3b57", stroke: "#2a3441"}, g);
      // ring: the share alive (green) against the rest (red)
      const circ = 2 * Math.PI * (rad + 3);
      el("circle", {cx, cy, r: rad + 3, fill: "none", stroke: "#f85149", "stroke-width": 3}, g);
      el("circle", {cx, cy, r: rad + 3, fill: "none", stroke: "#3fb950", "stroke-width": 3,
        "stroke-dasharray": `${alive * circ} ${circ}`, transform: `rotate(-90 ${cx} ${cy})`}, g);
      if (rad >= 12) el("text", {x: cx, y: cy + 4, "text-anchor": "middle"}, g).textContent = `${isl.members}`;
      if (iw > 90) {
        const sub = el("text", {x: cx, y: cy + rad + 17, "text-anchor": "middle", "font-size": 11}, g);
        const dev = Object.keys(isl.devices)[0] || "";
        sub.textContent = `${isl.id.length > 22 ? isl.id.slice(0, 21) + "…" : isl.id} ${dev ? "· " + dev : ""}`;
      }
      const title = el("title", {}, g);
      title.textContent = `${isl.id}\n${isl.members} members (${Object.entries(isl.states).map(([s, c]) =>
        `${c} ${s}`).join(", ")})\n${Object.entries(isl.devices).map(([d, c]) => `${c} x ${d}`).join("\n")}` +
        `\ninner ${rate(isl.inner_bandwidth)}, outer ${rate(isl.outer_bandwidth)}\n${isl.planned} in the plan`;
    });
  });
  for (const l of m.region_links) {
    const a = centre[l.a], b = centre[l.b];
    if (!a || !b) continue;
    const line = el("line", {x1: a[0], y1: a[1], x2: b[0], y2: b[1], stroke: bwColour(l.bandwidth),
      "stroke-width": 6, "stroke-opacity": 0.55, "stroke-linecap": "round"}, linkLayer);
    el("title", {}, line).textContent = `${l.a} - ${l.b}: ${rate(l.bandwidth)} (median of ${l.links} links)`;
    // the label two fifths along from the first region: links that cross at their middles keep theirs apart
    const x = a[0] + (b[0] - a[0]) * 0.4, y = a[1] + (b[1] - a[1]) * 0.4, text = rate(l.bandwidth);
    el("rect", {x: x - 3.4 * text.length, y: y - 9, width: 6.8 * text.length, height: 16, rx: 4, fill: "#0b0f14",
      stroke: bwColour(l.bandwidth)}, labelLayer);
    el("text", {x, y: y + 3, "text-anchor": "middle", "font-size": 11}, labelLayer).textContent = text;
  }
  const islandLinks = m.island_links.length > 400 ? [] : m.island_links;
  for (const l of islandLinks) {
    const a = islandAt[l.a], b = islandAt[l.b];
    if (!a || !b) continue;
    const line = el("line", {x1: a[0], y1: a[1], x2: b[0], y2: b[1], stroke: bwColour(l.bandwidth),
      "stroke-width": 2, "stroke-opacity": 0.8}, linkLayer);
    el("title", {}, line).textContent = `${l.a} - ${l.b}: ${rate(l.bandwidth)}`;
  }
}

async function loadIsland(id) {
  let rows;
  try { rows = await getJSON(`/api/island/${encodeURIComponent(id)}`); }
  catch (e) { $("island-panel").hidden = true; openIsland = null; return; }
  if (openIsland !== id) return;
  $("island-panel").hidden = false;
  $("island-title").textContent = `Island ${id}: ${rows.length} nodes`;
  $("island-dots").innerHTML = rows.map((r) => `<a href="#node/${encodeURIComponent(r.id)}" title="${esc(r.id)}: ` +
    `${esc(r.state)}" style="background:${stateColour[r.state] || "#888"}"></a>`).join("");
  const shown = rows.slice(0, 500);
  $("island-table").tBodies[0].innerHTML = shown.map((r) => `<tr><td><a href="#node/${encodeURIComponent(r.id)}">` +
    `${esc(r.id)}</a></td><td class="state-${esc(r.state)}">${esc(r.state)}</td><td>${esc(r.device)} x${r.devices}` +
    `</td><td>${r.block_ms ? r.block_ms.toFixed(2) + " ms" : "-"}</td><td>${r.speed_factor.toFixed(2)}x</td>` +
    `<td>${esc(r.stage || "-")}</td><td>${num(r.step)}</td><td>${r.heartbeat_age.toFixed(1)} s ago</td></tr>`).join("") +
    (rows.length > shown.length ? `<tr><td colspan="8" class="muted">and ${rows.length - shown.length} more ` +
    `(every node is a square above)</td></tr>` : "");
}

// --- plan ---------------------------------------------------------------------------------------------------
function renderPlan() {
  const p = doc.plan;
  if (!p) {
    $("plan-epoch").textContent = "-";
    $("plan-summary").textContent = doc.job.waiting || "no plan yet";
    $("pipelines").innerHTML = "";
    return;
  }
  $("plan-epoch").textContent = p.epoch;
  const dp = p.pipelines.length;
  $("plan-summary").textContent = `${p.model}, ${p.mode} mode, ${dp} pipeline${dp === 1 ? "" : "s"}, global batch ` +
    `${p.global_batch} x ${p.seq_len}; predicted ${secs(p.predicted_step_seconds)} a step, ` +
    `${num(p.predicted_tokens_per_second)} tokens/s` + (p.bottleneck ? `; bottleneck: ${p.bottleneck}` : "");
  $("plan-reason").textContent = p.mode_reason || "";
  const visible = p.pipelines.slice(0, 64);
  $("pipelines").innerHTML = visible.map((pl) => {
    const stages = pl.stages.map((s, k) => {
      const pred = s.predicted_compute_seconds, meas = s.measured_compute_seconds;
      const scale = Math.max(pred, meas, 1e-9);
      const ratio = pred > 0 && meas > 0 ? `${(meas / pred).toFixed(2)}x` : "-";
      const box = `<div class="stage" data-stage="${pl.index}-${s.index}"><h3>stage ${s.index} · ${esc(s.island)}</h3>` +
        `<div class="row"><span>layers</span><span>[${s.layers[0]}, ${s.layers[1]})</span></div>` +
        `<div class="row"><span>dp x tp</span><span>${s.dp} x ${s.tp}${s.lanes > 1 ? ` (${s.lanes} lanes)` : ""}</span></div>` +
        `<div class="row"><span>nodes</span><span>${s.nodes}</span></div>` +
        `<div class="row"><span>memory / device</span><span>${s.memory_gb_per_device.toFixed(2)} GB</span></div>` +
        `<div class="row"><span>compute predicted</span><span>${secs(pred)}</span></div>` +
        `<div class="bar"><i style="width:${100 * pred / scale}%;background:#58a6ff"></i></div>` +
        `<div class="row"><span>compute measured</span><span>${secs(meas)} (${ratio})</span></div>` +
        `<div class="bar"><i style="width:${100 * meas / scale}%;background:${meas > 1.25 * pred && pred > 0 ?
          "#f85149" : "#3fb950"}"></i></div>` +
        `<div class="row"><span>wait · utilisation</span><span>${secs(s.wait_seconds)} · ` +
        `${(100 * s.utilisation).toFixed(0)}%</span></div></div>`;
      // the codec the plan chose for the boundary, and what its links send now (adaptive compression measures)
      const now = p.links.filter((x) => x.pipeline === pl.index && x.stage === s.index && x.direction === "forward");
      const sent = [...new Set(now.map((x) => x.codec))].join(", ");
      const achieved = now.length ? rate(Math.min(...now.map((x) => x.achieved_bytes_per_s))) : "";
      const arrow = k < pl.stages.length - 1 ? `<div class="arrow"><span>planned ${esc(s.codec || "-")}</span>` +
        `<div class="line"></div><span>${sent ? `now ${esc(sent)}` : secs(s.send_seconds)}</span>` +
        `<span>${achieved}</span></div>` : "";
      return box + arrow;
    }).join("");
    return `<div class="pipe-label">pipeline ${pl.index}${pl.group ? ` · group ${esc(pl.group)}` : ""} · micro-batch ` +
      `${pl.micro_batch} x ${pl.micro_batches}</div><div class="pipeline">${stages}</div>`;
  }).join("") + (p.pipelines.length > visible.length ? `<p class="muted">and ${p.pipelines.length - visible.length} ` +
    `more pipelines</p>` : "");
  $("idle-table").tBodies[0].innerHTML = p.idle.length ? p.idle.map((i) => `<tr><td>${esc(i.island)}</td><td>${i.gpus}` +
    `</td><td>${i.nodes.map((n) => `<a href="#node/${encodeURIComponent(n)}">${esc(n)}</a>`).join(", ")}</td>` +
    `<td>${esc(i.reason)}</td></tr>`).join("") : `<tr><td colspan="4" class="muted">every device has work</td></tr>`;
  $("link-table").tBodies[0].innerHTML = p.links.length ? p.links.map((x) => `<tr><td>${x.pipeline}</td>` +
    `<td>${x.stage}</td><td>${esc(x.src)}</td><td>${esc(x.dst)}</td><td>${esc(x.direction)}</td><td>${esc(x.codec)}</td>` +
    `<td>${bytes(x.bytes_raw)}</td><td>${bytes(x.bytes_wire)}</td><td>${x.bytes_wire > 0 ?
      (x.bytes_raw / x.bytes_wire).toFixed(2) + "x" : "-"}</td><td>${rate(x.achieved_bytes_per_s)}</td></tr>`).join("")
    : `<tr><td colspan="10" class="muted">no traffic between stages in the recent steps (one-stage pipelines send ` +
      `none; else no step reported yet)</td></tr>`;
}

// --- training -----------------------------------------------------------------------------------------------
async function renderTraining() {
  const j = doc.job;
  $("t-step").textContent = num(j.step);
  $("t-target").textContent = num(j.target_steps);
  $("t-tps").textContent = num(j.tokens_per_second);
  $("t-eta").textContent = j.state === "finished" ? "done" : secs(j.eta_seconds);
  $("t-measured").textContent = secs(j.measured_step_seconds);
  $("t-predicted").textContent = secs(j.predicted_step_seconds);
  $("t-ckpt").textContent = j.last_checkpoint_step ? `step-${j.last_checkpoint_step}` : "-";
  if (doc.history_key !== historyKey) {
    const key = doc.history_key;
    try { history = await getJSON("/api/history"); historyKey = key; } catch (e) { return; }
  }
  drawChart();
}

function drawChart() {
  const canvas = $("loss-chart");
  const dpr = window.devicePixelRatio || 1;
  const W = canvas.clientWidth, H = canvas.clientHeight;
  canvas.width = W * dpr; canvas.height = H * dpr;
  const g = canvas.getContext("2d");
  g.scale(dpr, dpr);
  g.clearRect(0, 0, W, H);
  const h = history;
  const n = h ? h.step.length : 0;
  canvas.dataset.points = String(h ? h.loss.filter((x) => x != null).length : 0);
  canvas.dataset.valPoints = String(h ? h.val_loss.filter((x) => x != null).length : 0);
  g.fillStyle = "#8a97a6"; g.font = "12px system-ui";
  if (!n) { g.fillText("no loss reported yet", W / 2 - 50, H / 2); return; }
  const L = 56, R = 16, T = 14, B = 30;
  const x0 = zoom ? zoom[0] : h.step[0], x1 = zoom ? zoom[1] : h.step[n - 1];
  const idx = [];
  for (let i = 0; i < n; i++) if (h.step[i] >= x0 && h.step[i] <= x1) idx.push(i);
  let lo = Infinity, hi = -Infinity;
  for (const i of idx) for (const v of [h.loss[i], h.loss_min[i], h.loss_max[i], h.val_loss[i]])
    if (v != null) { lo = Math.min(lo, v); hi = Math.max(hi, v); }
  if (!isFinite(lo)) { lo = 0; hi = 1; }
  if (hi - lo < 1e-9) { hi += 0.5; lo -= 0.5; }
  const pad = (hi - lo) * 0.05; lo -= pad; hi += pad;
  const sx = (s) => L + (W - L - R) * (x1 > x0 ? (s - x0) / (x1 - x0) : 0.5);
  const sy = (v) => T + (H - T - B) * (1 - (v - lo) / (hi - lo));
  canvas._scale = {L, R, W, x0, x1};
  g.strokeStyle = "#2a3441"; g.lineWidth = 1;
  for (let k = 0; k <= 4; k++) {
    const v = lo + (hi - lo) * k / 4, y = sy(v);
    g.beginPath(); g.moveTo(L, y); g.lineTo(W - R, y); g.stroke();
    g.fillText(v.toFixed(3), 4, y + 4);
  }
  for (let k = 0; k <= 5; k++) {
    const s = x0 + (x1 - x0) * k / 5;
    g.fillText(Math.round(s).toLocaleString(), sx(s) - 12, H - 10);
  }
  // min-max band of bucketed rows
  g.fillStyle = "rgba(88,166,255,0.18)";
  g.beginPath();
  let started = false;
  for (const i of idx) if (h.loss_max[i] != null) { const x = sx(h.step[i]), y = sy(h.loss_max[i]);
    if (!started) { g.moveTo(x, y); started = true; } else g.lineTo(x, y); }
  for (const i of idx.slice().reverse()) if (h.loss_min[i] != null) g.lineTo(sx(h.step[i]), sy(h.loss_min[i]));
  if (started) g.fill();
  const line = (key, colour, width) => {
    g.strokeStyle = colour; g.lineWidth = width; g.beginPath();
    let first = true;
    for (const i of idx) { const v = h[key][i]; if (v == null) continue;
      const x = sx(h.step[i]), y = sy(v); if (first) { g.moveTo(x, y); first = false; } else g.lineTo(x, y); }
    g.stroke();
    if (key === "val_loss") for (const i of idx) if (h.val_loss[i] != null) {
      g.fillStyle = colour; g.beginPath(); g.arc(sx(h.step[i]), sy(h.val_loss[i]), 3, 0, 7); g.fill(); }
  };
  line("loss", "#58a6ff", 1.5);
  line("val_loss", "#f0883e", 2);
  g.fillStyle = "#58a6ff"; g.fillText("loss", W - 130, T + 10);
  g.fillStyle = "#f0883e"; g.fillText("validation loss", W - 95, T + 10);
  if (canvas._drag) {
    g.fillStyle = "rgba(255,255,255,0.08)";
    g.fillRect(Math.min(canvas._drag[0], canvas._drag[1]), T, Math.abs(canvas._drag[1] - canvas._drag[0]), H - T - B);
  }
}

function setupChart() {
  const c = $("loss-chart");
  const stepAt = (px) => { const s = c._scale; return s.x0 + (s.x1 - s.x0) * (px - s.L) / (s.W - s.L - s.R); };
  c.addEventListener("mousedown", (e) => { c._drag = [e.offsetX, e.offsetX]; });
  c.addEventListener("mousemove", (e) => { if (c._drag) { c._drag[1] = e.offsetX; drawChart(); } });
  c.addEventListener("mouseup", () => {
    const d = c._drag; c._drag = null;
    if (d && Math.abs(d[1] - d[0]) > 4 && c._scale) {
      const a = stepAt(Math.min(d[0], d[1])), b = stepAt(Math.max(d[0], d[1]));
      zoom = [a, b];
    }
    drawChart();
  });
  c.addEventListener("wheel", (e) => {
    if (!history || !c._scale) return;
    e.preventDefault();
    const s = c._scale, at = stepAt(e.offsetX), f = e.deltaY > 0 ? 1.25 : 0.8;
    const first = history.step[0], last = history.step[history.step.length - 1];
    let a = at - (at - s.x0) * f, b = at + (s.x1 - at) * f;
    if (b - a >= last - first) { zoom = null; } else { zoom = [Math.max(first, a), Math.min(last, b)]; }
    drawChart();
  }, {passive: false});
  $("zoom-reset").onclick = () => { zoom = null; drawChart(); };
  $("zoom-recent").onclick = () => {
    if (!history || !history.step.length) return;
    const first = history.step[0], last = history.step[history.step.length - 1];
    zoom = [last - (last - first) * 0.1, last]; drawChart();
  };
}

// --- outer mode ---------------------------------------------------------------------------------------------
function renderOuter() {
  const o = doc.outer;
  const body = $("group-table").tBodies[0], rounds = $("round-table").tBodies[0];
  if (!o) {
    $("outer-summary").textContent = "This plan trains synchronously: no outer rounds.";
    body.innerHTML = ""; rounds.innerHTML = ""; $("group-rounds").innerHTML = "";
    return;
  }
  $("outer-summary").textContent = `H = ${o.inner_steps} inner steps, ${o.codec} pseudo-gradients, deadline ` +
    `${secs(o.deadline_seconds)}; predicted sync ${secs(o.sync_seconds)} a round against ${secs(o.round_seconds)} ` +
    `of compute; ${o.exclusions} contribution(s) left out as outliers${o.last_exclusion ? ` (newest: ${o.last_exclusion})` : ""}`;
  body.innerHTML = o.groups.map((g) => `<tr><td>${esc(g.name)}${g.planned ? "" : " (no longer planned)"}</td>` +
    `<td>${num(g.inner_step)}</td><td>${num(g.round)}</td><td>${g.steps_per_round ? g.steps_per_round.toFixed(1) : "-"}` +
    `</td><td>${secs(g.wait_per_round)}</td><td>${bytes(g.sync_bytes)}</td><td>${secs(g.sync_seconds)}</td>` +
    `<td>${num(g.rounds_in)} / ${num(g.rounds_missed)}</td><td>${num(g.tokens)}</td></tr>`).join("");
  rounds.innerHTML = o.decisions.slice().reverse().map((d) => `<tr><td>${d.round}</td><td>${esc(d.groups_in.join(", "))}` +
    `</td><td>${d.left_out.length ? `<span class="state-gone">${esc(d.left_out.join(", "))}</span>` : "-"}</td>` +
    `<td>${secs(d.wait_seconds)}</td><td class="muted">${esc(d.reason)}</td></tr>`).join("") ||
    `<tr><td colspan="5" class="muted">no round decided yet</td></tr>`;
  $("group-rounds").innerHTML = o.groups.filter((g) => g.rounds && g.rounds.length).map((g) =>
    `<h2>${esc(g.name)}: its newest rounds</h2><table class="grid"><thead><tr><th>round</th><th>inner steps</th>` +
    `<th>waited before it</th></tr></thead><tbody>${g.rounds.slice().reverse().map((r) => `<tr><td>${r.round}</td>` +
    `<td>${r.inner_steps.toFixed(1)}</td><td>${secs(r.wait_seconds)}</td></tr>`).join("")}</tbody></table>`).join("");
}

// --- events -------------------------------------------------------------------------------------------------
function eventRows(events) {
  return events.slice().reverse().map((e) => `<li data-kind="${esc(e.kind)}"><time>${clock(e.time)}</time>` +
    `<span class="kind kind-${esc(e.kind)}">${esc(e.kind)}</span><span>${linkNodes(esc(e.text))}</span></li>`).join("");
}
function linkNodes(text) {
  return text.replace(/\bnode ([A-Za-z0-9_.:-]+)/g, (all, id) => `node <a href="#node/${encodeURIComponent(id)}">${id}</a>`);
}
function renderEvents() {
  for (const e of doc.events) eventKinds.add(e.kind);
  $("event-filter").innerHTML = [...eventKinds].sort().map((k) => `<label><input type="checkbox" data-kind="${esc(k)}"` +
    `${hiddenKinds.has(k) ? "" : " checked"}> ${esc(k)}</label>`).join("");
  for (const box of $("event-filter").querySelectorAll("input")) box.onchange = () => {
    if (box.checked) hiddenKinds.delete(box.dataset.kind); else hiddenKinds.add(box.dataset.kind);
    renderEvents();
  };
  $("event-list").innerHTML = eventRows(doc.events.filter((e) => !hiddenKinds.has(e.kind)));
}

// --- node page ----------------------------------------------------------------------------------------------
async function renderNode() {
  const id = nodeShown;
  let n;
  try { n = await getJSON(`/api/node/${encodeURIComponent(id)}`); }
  catch (e) { $("node-id").textContent = `${id} (not a member of this job)`; $("node-facts").innerHTML = ""; return; }
  if (nodeShown !== id) return;
  $("node-id").textContent = id;
  const u = n.usage;
  const facts = [["state", `<span class="state-${esc(n.state)}">${esc(n.state)}</span>${n.reason ? ` (${esc(n.reason)})` : ""}`],
    ["region · island", `${esc(n.region)} · ${esc(n.island || "-")}`],
    ["device", `${esc(n.device)} x${n.devices} (${esc(n.device_kind)}), ${bytes(n.memory_total_bytes)}`],
    ["speed", `one block forward+backward ${n.block_ms ? n.block_ms.toFixed(2) + " ms" : "-"} (its smallest ` +
      `micro-batch profiled); plan's calibration ` +
      `${n.speed_factor.toFixed(2)}x`],
    ["in the plan", esc(n.stage || "not in the running plan")],
    ["step · epoch", `${num(n.step)} · ${n.plan_epoch}`],
    ["measured", u ? `step ${secs(u.step_seconds)}, compute ${secs(u.compute_seconds)}, wait ${secs(u.wait_seconds)}, ` +
      `utilisation ${(100 * u.utilisation).toFixed(0)}%, peak memory ${bytes(u.peak_memory_bytes)}` : "no step reports"],
    ["last heartbeat", `${n.heartbeat_age.toFixed(1)} s ago`], ["joined", clock(n.joined_unix)],
    ["host", `${esc(n.hostname)} · ${esc(n.peer_address)}${n.unreachable ? " (dials out)" : ""} · ${n.cpu_count} CPUs`],
    ["versions", `atoll ${esc(n.atoll_version)}, torch ${esc(n.torch_version)}`]];
  $("node-facts").innerHTML = facts.map(([k, v]) => `<dt>${k}</dt><dd>${v}</dd>`).join("");
  $("node-layers").tBodies[0].innerHTML = n.layer_timings.map((t) => `<tr><td>${esc(t.kind)}</td><td>${t.micro_batch} x ` +
    `${t.seq_len}</td><td>${secs(t.forward_seconds)}</td><td>${secs(t.backward_seconds)}</td></tr>`).join("");
  const maxBw = Math.max(1, ...n.links.map((l) => l.bandwidth));
  $("node-links").innerHTML = n.links.length ? n.links.map((l) => `<div class="row"><a href="#node/` +
    `${encodeURIComponent(l.peer)}">${esc(l.peer)}</a> ${rate(l.bandwidth)}<div class="bar"><i style="width:` +
    `${100 * l.bandwidth / maxBw}%;background:${bwColour(l.bandwidth)}"></i></div></div>`).join("")
    : `<p class="muted">no links measured yet</p>`;
  $("node-events").innerHTML = eventRows(n.events);
}

window.addEventListener("hashchange", route);
window.addEventListener("resize", () => render());
$("island-close").onclick = () => { openIsland = null; $("island-panel").hidden = true; };
setupChart();
route();
connect();
