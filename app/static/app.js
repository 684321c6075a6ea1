// The jobs page: polls GET /v1/jobs every second, renders a live table, and a job view (#job=<id>)
// with its plan, throughput and the preview heatmap. The job view follows its job by Server-Sent Events
// (GET /v1/jobs/{id}/events, EventSource); where that fails (an API key is set, which EventSource cannot
// send; a proxy; 503 too many streams) it polls the job as before. Vanilla JavaScript, no build step.
"use strict";

const POLL_MS = 1000;
const LIST_LIMIT = 50;
const TERMINAL = new Set(["succeeded", "failed", "canceled"]);
const $ = (id) => document.getElementById(id);

const state = { selected: null, record: null, previewFor: null, previewUrl: null, timer: null,
  events: null, eventsFor: null, noEvents: new Set() };

function apiKey() { return localStorage.getItem("jacobian.apiKey") || ""; }

async function api(path, options = {}) {
  const headers = Object.assign({}, options.headers || {});
  const key = apiKey();
  if (key) headers["Authorization"] = "Bearer " + key;
  const response = await fetch(path, Object.assign({}, options, { headers }));
  if (!response.ok) {
    let message = response.status + " " + response.statusText;
    try {
      const body = await response.json();
      if (body && body.error) message = body.error.type + ": " + body.error.message;
    } catch (_) { /* not JSON */ }
    const err = new Error(message);
    err.status = response.status;
    throw err;
  }
  return response;
}

// -- formatting ----------------------------------------------------------------------------------

function fmtNum(n, digits = 1) {
  return typeof n === "number" && isFinite(n) ? n.toLocaleString("en-US", { maximumFractionDigits: digits }) : "–";
}
function fmtInt(n) { return typeof n === "number" ? n.toLocaleString("en-US") : "?"; }
function fmtDuration(s) {
  if (typeof s !== "number" || !isFinite(s) || s < 0) return "–";
  if (s < 60) return s.toFixed(1) + " s";
  const m = Math.floor(s / 60), sec = Math.round(s % 60);
  if (m < 60) return m + " min " + sec + " s";
  return Math.floor(m / 60) + " h " + (m % 60) + " min";
}
function fmtBytes(b) {
  if (typeof b !== "number" || !isFinite(b)) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (Math.abs(b) >= 1024 && i < units.length - 1) { b /= 1024; i++; }
  return (i === 0 ? b.toFixed(0) : b.toFixed(1)) + " " + units[i];
}
function fmtTime(iso) {
  if (!iso) return "–";
  const d = new Date(iso);
  return isNaN(d) ? iso : d.toLocaleTimeString("en-GB");
}
function seconds(iso) { return iso ? Date.parse(iso) / 1000 : null; }
function fraction(job) {
  const p = job.progress || {};
  if (typeof p.fraction === "number") return Math.max(0, Math.min(1, p.fraction));
  return p.rows_total ? (p.rows_done || 0) / p.rows_total : 0;
}
function el(tag, attrs = {}, text) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}
function baseName(path) { return (path || "").replace(/\/+$/, "").split("/").pop(); }

// -- job list ------------------------------------------------------------------------------------

function rowFor(job) {
  const tr = el("tr", { id: "job-" + job.id, class: "job", "data-job-id": job.id });
  tr.innerHTML = '<td><code class="jid"></code></td><td><span class="badge"></span></td><td class="kind"></td>' +
    '<td class="model"></td><td><div class="prog"><div class="bar"><div class="fill"></div></div><span></span></div></td>' +
    '<td class="num rate"></td><td class="num eta"></td><td class="created"></td>';
  tr.addEventListener("click", () => { location.hash = "job=" + job.id; });
  return tr;
}

function updateRow(tr, job) {
  const p = job.progress || {};
  const f = fraction(job);
  tr.dataset.status = job.status;
  tr.classList.toggle("selected", job.id === state.selected);
  tr.querySelector(".jid").textContent = job.id.slice(0, 12);
  tr.querySelector(".jid").title = job.id;
  const badge = tr.querySelector(".badge");
  badge.textContent = job.status;
  badge.dataset.status = job.status;
  tr.querySelector(".kind").textContent = job.kind || "";
  const model = (job.model || {}).path || "";
  tr.querySelector(".model").textContent = baseName(model);
  tr.querySelector(".model").title = model;
  const fill = tr.querySelector(".fill");
  fill.style.width = (100 * f).toFixed(1) + "%";
  fill.dataset.status = job.status;
  tr.querySelector(".prog span").textContent =
    p.rows_total ? fmtInt(p.rows_done || 0) + "/" + fmtInt(p.rows_total) : (100 * f).toFixed(0) + "%";
  tr.querySelector(".rate").textContent = fmtNum(p.rows_per_second);
  tr.querySelector(".eta").textContent = TERMINAL.has(job.status) ? "–" : fmtDuration(p.eta_seconds);
  tr.querySelector(".created").textContent = fmtTime(job.created_at);
}

function renderList(jobs) {
  const body = $("jobs-body");
  const existing = new Map([...body.children].map((tr) => [tr.dataset.jobId, tr]));
  jobs.forEach((job, i) => {
    let tr = existing.get(job.id);
    if (!tr) tr = rowFor(job);
    existing.delete(job.id);
    updateRow(tr, job);
    if (body.children[i] !== tr) body.insertBefore(tr, body.children[i] || null);
  });
  for (const tr of existing.values()) tr.remove();
  $("empty").hidden = jobs.length > 0;
  $("job-count").textContent = jobs.length ? "(" + jobs.length + (jobs.length >= LIST_LIMIT ? "+" : "") + ")" : "";
}

// -- job view ------------------------------------------------------------------------------------

function fillDl(dl, pairs) {
  dl.replaceChildren();
  for (const [k, v] of pairs) {
    if (v === undefined) continue;
    dl.append(el("dt", {}, k), el("dd", {}, v === null || v === "" ? "–" : String(v)));
  }
}

function renderJob(job) {
  $("job-placeholder").hidden = true;
  $("job-view").hidden = false;
  const p = job.progress || {};
  const plan = job.plan || {};
  const result = job.result || {};
  const f = fraction(job);
  $("jv-id").textContent = job.id;
  $("job-view").dataset.jobId = job.id;
  $("job-view").dataset.status = job.status;
  $("jv-status").textContent = job.status;
  $("jv-status").dataset.status = job.status;
  $("jv-cancel").hidden = TERMINAL.has(job.status);
  $("jv-fill").style.width = (100 * f).toFixed(1) + "%";
  $("jv-fill").dataset.status = job.status;
  $("jv-progress").textContent = "rows " + fmtInt(p.rows_done || 0) + " / " + fmtInt(p.rows_total) +
    " (" + (100 * f).toFixed(1) + "%)" + (TERMINAL.has(job.status) ? "" : ", ETA " + fmtDuration(p.eta_seconds));
  const err = job.error;
  $("jv-error").hidden = !err;
  $("jv-error").textContent = err ? err.type + ": " + err.message : "";

  const model = job.model || {};
  fillDl($("jv-job"), [["kind", job.kind], ["model", model.path], ["signature", model.signature],
    ["created", fmtTime(job.created_at)], ["started", fmtTime(job.started_at)], ["finished", fmtTime(job.finished_at)]]);

  const created = seconds(job.created_at), started = seconds(job.started_at), finished = seconds(job.finished_at);
  const end = finished || Date.now() / 1000;
  const elapsed = started ? end - started : null;
  const average = elapsed && p.rows_done ? p.rows_done / elapsed : null;
  fillDl($("jv-throughput"), [
    ["rows/s (now)", fmtNum(p.rows_per_second)],
    ["rows/s (mean)", fmtNum(average)],
    ["elapsed", fmtDuration(elapsed)],
    ["queue wait", fmtDuration(started && created ? started - created : null)],
    ["ETA", TERMINAL.has(job.status) ? "–" : fmtDuration(p.eta_seconds)],
  ]);

  const planPairs = [["chunk rows", plan.chunk_rows], ["strategy", plan.strategy], ["mode", plan.mode],
    ["free at start", plan.free_bytes_at_start !== undefined ? fmtBytes(plan.free_bytes_at_start) : undefined],
    ["bytes / row", plan.bytes_per_row !== undefined ? fmtBytes(plan.bytes_per_row) : undefined],
    ["OOM retries", plan.oom_retries], ["shards", plan.shards]];
  const known = new Set(["chunk_rows", "strategy", "mode", "free_bytes_at_start", "bytes_per_row", "oom_retries", "shards"]);
  // Other scalar keys as they come; an object one level down (plan.sparsity, plan.trial) as "sparsity nnz".
  for (const [k, v] of Object.entries(plan)) {
    if (known.has(k)) continue;
    const name = k.replace(/_/g, " ");
    if (v === null || typeof v !== "object") planPairs.push([name, v]);
    else if (!Array.isArray(v)) {
      for (const [k2, v2] of Object.entries(v)) {
        if (v2 === null || typeof v2 !== "object") planPairs.push([name + " " + k2.replace(/_/g, " "), v2]);
      }
    }
  }
  fillDl($("jv-plan"), Object.keys(plan).length ? planPairs : [["plan", "not chosen yet"]]);

  fillDl($("jv-result"), [["shape", result.shape ? "(" + result.shape.join(", ") + ")" : null],
    ["dtype", result.dtype], ["uri", result.uri],
    ["rows", job.status === "succeeded" ? "jacobian fetch " + job.id + " --rows 0:10 -o rows.npy" : null]]);

  if (job.status === "succeeded") loadPreview(job.id);
  else $("jv-preview").hidden = true;
}

async function loadPreview(id) {
  if (state.previewFor === id) return;
  state.previewFor = id;
  const path = "/v1/jobs/" + encodeURIComponent(id) + "/preview.png";
  $("jv-preview-link").href = path;
  try {
    const blob = await (await api(path)).blob();
    if (state.selected !== id) return;
    if (state.previewUrl) URL.revokeObjectURL(state.previewUrl);
    state.previewUrl = URL.createObjectURL(blob);
    const img = $("jv-preview-img");
    img.src = state.previewUrl;
    img.dataset.jobId = id;
    $("jv-preview").hidden = false;
  } catch (e) {
    state.previewFor = null;
    $("jv-preview").hidden = true;
  }
}

// -- events --------------------------------------------------------------------------------------

function stopEvents() {
  if (state.events) state.events.close();
  state.events = null;
  state.eventsFor = null;
}

// Follow the selected job by EventSource unless it has ended, EventSource is missing, an API key is set
// (EventSource sends no Authorization header) or its stream failed before: then poll() reads it instead.
function followSelected() {
  const id = state.selected;
  if (!id || state.eventsFor === id) return;
  stopEvents();
  if (typeof EventSource === "undefined" || apiKey() || state.noEvents.has(id)) return;
  if (state.record && TERMINAL.has(state.record.status)) return;
  const source = new EventSource("/v1/jobs/" + encodeURIComponent(id) + "/events");
  const onEvent = (e) => {
    if (state.selected !== id) return;
    state.record = JSON.parse(e.data);
    renderJob(state.record);
    if (e.type === "end") stopEvents();
  };
  for (const kind of ["status", "progress", "end"]) source.addEventListener(kind, onEvent);
  source.onerror = () => {
    // CONNECTING: the browser reconnects by itself with Last-Event-ID. CLOSED: an error answer; poll.
    if (source.readyState === EventSource.CLOSED && state.events === source) {
      state.noEvents.add(id);
      stopEvents();
    }
  };
  state.events = source;
  state.eventsFor = id;
}

function isFollowed(id) {
  return state.events !== null && state.eventsFor === id && state.events.readyState !== EventSource.CLOSED;
}

// -- polling -------------------------------------------------------------------------------------

function setConn(stateName, text) {
  $("conn").dataset.state = stateName;
  $("conn").textContent = text;
}

async function poll() {
  try {
    const status = $("status-filter").value;
    const q = "?limit=" + LIST_LIMIT + (status ? "&status=" + encodeURIComponent(status) : "");
    const page = await (await api("/v1/jobs" + q)).json();
    renderList(page.jobs || []);
    if (state.selected && isFollowed(state.selected)) {
      if (state.record) renderJob(state.record);
    } else if (state.selected) {
      const inList = (page.jobs || []).find((j) => j.id === state.selected);
      if (!state.record || !TERMINAL.has(state.record.status) || (inList && inList.status !== state.record.status)) {
        state.record = await (await api("/v1/jobs/" + encodeURIComponent(state.selected))).json();
      }
      renderJob(state.record);
      followSelected();
    }
    setConn("live", "live · " + new Date().toLocaleTimeString("en-GB"));
  } catch (e) {
    setConn("error", e.status === 401 ? "API key needed (401)" : String(e.message || e));
  }
}

function selectFromHash() {
  const m = /^#job=([A-Za-z0-9_-]+)$/.exec(location.hash);
  const id = m ? m[1] : null;
  if (id !== state.selected) {
    stopEvents();
    state.selected = id;
    state.record = null;
    state.previewFor = null;
    $("jv-preview").hidden = true;
    if (!id) { $("job-view").hidden = true; $("job-placeholder").hidden = false; }
  }
}

function schedule() {
  clearTimeout(state.timer);
  poll().finally(() => { state.timer = setTimeout(schedule, POLL_MS); });
}

$("apikey").value = apiKey();
$("apikey").addEventListener("change", (e) => {
  localStorage.setItem("jacobian.apiKey", e.target.value.trim());
  stopEvents();
  state.noEvents.clear();
  schedule();
});
$("status-filter").addEventListener("change", schedule);
$("jv-cancel").addEventListener("click", async () => {
  if (!state.selected) return;
  try { await api("/v1/jobs/" + encodeURIComponent(state.selected) + "/cancel", { method: "POST" }); } catch (e) { alert(e.message); }
  state.record = null;
  schedule();
});
window.addEventListener("hashchange", () => { selectFromHash(); schedule(); });
selectFromHash();
schedule();
