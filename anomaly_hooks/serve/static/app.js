// Operator page of the anomaly_hooks inspection service. Plain JavaScript, no dependencies,
// nothing loaded from elsewhere (works air-gapped). Client-given text is only ever inserted
// with textContent, never parsed as HTML.
"use strict";

const $ = (id) => document.getElementById(id);
const fmt = (x, digits = 4) => (x === null || x === undefined) ? "–" : Number(x).toPrecision(digits);

async function api(path, options = {}) {
  const response = await fetch(path, { credentials: "same-origin", ...options });
  const type = response.headers.get("content-type") || "";
  const body = type.includes("json") ? await response.json() : await response.text();
  if (!response.ok) {
    const message = (body && body.message) ? `${body.code}: ${body.message}` : `HTTP ${response.status}`;
    const err = new Error(message);
    err.code = body && body.code;
    err.detail = body && body.message;
    throw err;
  }
  return body;
}

function setStatus(text, isError = false) {
  const el = $("status");
  el.textContent = text;
  el.classList.toggle("error", isError);
}

function localTime(iso) {
  const d = new Date(iso);
  return isNaN(d) ? iso : d.toLocaleString();
}

// ---- which model: a server may serve several (GET /v1/models); the page works on one ----
let currentModel = null;  // the selected model's name; null: the server has one model

function modelUrl(suffix, single) {
  return currentModel === null ? single : `/v1/models/${encodeURIComponent(currentModel)}${suffix}`;
}

async function loadModels() {
  const select = $("model-select");
  try {
    const listed = await api("/v1/models");
    if (listed.count < 2) { currentModel = null; return listed; }
    const names = listed.models.map((m) => m.name);
    if (!names.includes(currentModel)) currentModel = listed.default;
    if (select.options.length !== names.length ||
        [...select.options].some((o, i) => o.value !== names[i])) {
      select.replaceChildren(...names.map((name) => {
        const option = document.createElement("option");
        option.value = name; option.textContent = name;
        return option;
      }));
    }
    select.value = currentModel;
    select.hidden = false; $("model-select-label").hidden = false;
    return listed;
  } catch (err) {
    return null;
  }
}

function selectModel() {
  currentModel = $("model-select").value;
  refreshModel(); refreshResults(); refreshDrift(); refreshOperatingPoint();
}

// ---- model state --------------------------------------------------------------------
async function refreshModel() {
  const listed = await loadModels();
  const mine = listed && currentModel !== null ? listed.models.find((m) => m.name === currentModel) : null;
  if (mine) {  // several models: the selected one's state
    $("model-id").textContent = mine.ready ? mine.model_id : (mine.error || "loading…");
    $("ready-dot").className = mine.ready ? "dot ok" : "dot bad";
    return;
  }
  try {
    const ready = await api("/readyz");
    $("model-id").textContent = ready.model_id;
    $("ready-dot").className = "dot ok";
  } catch (err) {
    $("model-id").textContent = err.message;
    $("ready-dot").className = "dot bad";
  }
}

// ---- operating point: the threshold, what it was chosen for and what it will do ---------
const pct = (x) => (x === null || x === undefined) ? "–" : `${(100 * x).toPrecision(3)} %`;
const interval = (iv) => Array.isArray(iv) && iv.length === 2 ? ` [${pct(iv[0])}, ${pct(iv[1])}]` : "";

function operatingRows(t) {
  const rows = [["threshold", fmt(t.value)], ["objective", t.objective || "far"]];
  rows.push(["expected false alarms", pct(t.expected_far ?? t.false_alarm_rate) + interval(t.far_interval)]);
  if (t.recall !== null && t.recall !== undefined) {
    rows.push(["recall on labelled defects", pct(t.recall) + interval(t.recall_interval) +
               (t.n_defects ? ` (${t.n_defects} defects)` : "")]);
  }
  if (t.target_recall) rows.push(["target recall", pct(t.target_recall)]);
  if (t.scores) rows.push(["good images scored out of sample", String(t.scores.length)]);
  const prov = t.provenance || {};
  const shown = new Set(rows.map(([k]) => k));
  for (const [key, value] of Object.entries(prov)) {
    const name = key.replaceAll("_", " ");
    if (value === null || typeof value === "object" || shown.has(name)) continue;
    rows.push([name, String(value)]);
  }
  return rows;
}

// ---- the serving model: its version of the models folder and its lineage -------------
const short = (checksum) => checksum ? String(checksum).slice(0, 12) : "–";

function modelRows(info) {
  const rows = [["model", info.model_id + (currentModel !== null ? ` (${info.name})` : "")],
                ["method", info.method],
                ["file", String(info.path || "").split("/").pop()], ["checksum", short(info.file_sha256)]];
  const v = info.version;
  if (v) {
    rows.push(["version", v.name + (v.since ? ` (since ${localTime(v.since)})` : "")]);
    rows.push(["rollback to", v.previous ? `${v.previous.name} (${short(v.previous.checksum)})` : "– (none)"]);
  }
  const l = info.lineage;
  if (l) {
    rows.push(["lineage", `${l.updates} update(s), ${l.images_added} image(s) added`]);
    if (l.last_update) rows.push(["last update", localTime(l.last_update)]);
    if (l.parent_checksum) rows.push(["parent", short(l.parent_checksum)]);
    if (l.labels_used !== null && l.labels_used !== undefined) rows.push(["labels used", String(l.labels_used)]);
    const s = l.source;
    if (s && s.kind === "results") {
      const since = s.since ? `, since ${localTime(s.since)}` : "";
      const skipped = s.skipped ? `, ${s.skipped} skipped` : "";
      rows.push(["learned from", `${s.good ?? 0} result(s) labelled good, ${s.defect ?? 0} defect${since}${skipped}`]);
    }
  } else {
    rows.push(["lineage", "– (as fitted, no updates)"]);
  }
  return rows;
}

function kvRows(rows) {
  return rows.map(([k, v]) => {
    const tr = document.createElement("tr");
    const th = document.createElement("th"); th.textContent = k;
    const td = document.createElement("td"); td.textContent = v;
    tr.append(th, td);
    return tr;
  });
}

async function refreshOperatingPoint() {
  const summary = $("operating-summary"), table = $("operating-table");
  try {
    const info = await api(modelUrl("", "/v1/model"));
    servingChecksum = info.file_sha256 || null;
    $("model-table").replaceChildren(...kvRows(modelRows(info)));
    const t = info.threshold || {};
    summary.textContent = `score > ${fmt(t.value)} is anomalous`;
    table.replaceChildren(...kvRows(operatingRows(t)));
  } catch (err) {
    summary.textContent = err.message;
    $("model-table").replaceChildren(...kvRows([["model", err.message]]));
  }
}

// ---- inspect ------------------------------------------------------------------------
function showResult(res, originalUrl) {
  $("result").hidden = false;
  const verdict = $("verdict");
  verdict.textContent = res.is_anomalous ? "ANOMALOUS" : "OK";
  verdict.className = "verdict " + (res.is_anomalous ? "anomalous" : "normal");
  verdict.dataset.state = res.is_anomalous ? "anomalous" : "normal";
  $("r-score").textContent = fmt(res.score);
  $("r-threshold").textContent = fmt(res.threshold);
  $("r-norm").textContent = fmt(res.normalized_score, 3);
  $("r-pixels").textContent = res.anomalous_pixels ?? "–";
  const w = res.image ? res.image.width : res.width;
  const h = res.image ? res.image.height : res.height;
  $("r-size").textContent = (w && h) ? `${w} × ${h}` + (res.image ? ` ${res.image.format}` : "") : "–";
  $("r-time").textContent = localTime(res.time || res.time_iso);
  $("r-source").textContent = [res.part_id, res.source].filter(Boolean).join(" · ") || "–";
  const overlay = res.overlay_png ? "data:image/png;base64," + res.overlay_png : res.overlay_url;
  const mask = res.mask_png ? "data:image/png;base64," + res.mask_png : res.mask_url;
  setPicture("original", originalUrl);
  setPicture("overlay", overlay);
  setPicture("mask", mask);
}

function setPicture(id, url) {
  const img = $(id);
  if (url) { img.src = url; img.parentElement.hidden = false; }
  else { img.removeAttribute("src"); img.parentElement.hidden = true; }
}

let lastObjectUrl = null;
async function inspect(file) {
  if (!file) return;
  const form = new FormData();
  form.append("file", file, file.name);
  const partId = $("part-id").value.trim();
  if (partId) form.append("part_id", partId);
  setStatus(`inspecting ${file.name}…`);
  const started = performance.now();
  try {
    const res = await api(modelUrl("/predict", "/v1/predict") + "?heatmap=png", { method: "POST", body: form });
    if (lastObjectUrl) URL.revokeObjectURL(lastObjectUrl);
    lastObjectUrl = URL.createObjectURL(file);
    showResult(res, lastObjectUrl);
    setStatus(`${file.name}: done in ${((performance.now() - started) / 1000).toFixed(2)} s ` +
              `(batch of ${res.timing_ms.batch_size})`);
    refreshResults();
  } catch (err) {
    setStatus(`${file.name}: ${err.message}`, true);
  }
}

function setupUpload() {
  const drop = $("drop");
  $("file").addEventListener("change", (e) => { inspect(e.target.files[0]); e.target.value = ""; });
  ["dragenter", "dragover"].forEach((t) => drop.addEventListener(t, (e) => {
    e.preventDefault(); drop.classList.add("over");
  }));
  ["dragleave", "drop"].forEach((t) => drop.addEventListener(t, (e) => {
    e.preventDefault(); drop.classList.remove("over");
  }));
  drop.addEventListener("drop", (e) => inspect(e.dataTransfer.files[0]));
}

// ---- recent inspections and the score chart -----------------------------------------
function renderRecent(rows) {
  const body = $("recent");
  body.replaceChildren();
  $("recent-empty").hidden = rows.length > 0;
  for (const r of rows) {
    const tr = document.createElement("tr");
    tr.dataset.id = r.id;
    const thumb = document.createElement("td");
    if (r.thumb_url) {
      const img = document.createElement("img");
      img.loading = "lazy"; img.alt = ""; img.src = r.thumb_url;
      thumb.append(img);
    }
    const time = document.createElement("td"); time.textContent = localTime(r.time_iso);
    const who = document.createElement("td");
    who.textContent = [r.part_id, r.source].filter(Boolean).join(" · ") || "–";
    const score = document.createElement("td"); score.textContent = fmt(r.score);
    const verdict = document.createElement("td");
    const tag = document.createElement("span");
    tag.className = "tag " + (r.is_anomalous ? "anomalous" : "normal");
    tag.textContent = r.is_anomalous ? "anomalous" : "ok";
    verdict.append(tag);
    tr.append(thumb, time, who, score, verdict, labelCell(r));
    tr.addEventListener("click", () => showResult(r, null));
    body.append(tr);
  }
}

function drawChart(rows) {
  const canvas = $("chart");
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth || 600, height = canvas.clientHeight || 200;
  canvas.width = width * ratio; canvas.height = height * ratio;
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.clearRect(0, 0, width, height);
  const points = rows.slice().reverse();  // oldest first
  ctx.fillStyle = "#6b7385"; ctx.font = "11px system-ui, sans-serif";
  if (!points.length) { ctx.fillText("no scores yet", 10, 20); return; }
  const values = points.flatMap((p) => [p.score, p.threshold]);
  let lo = Math.min(...values), hi = Math.max(...values);
  if (hi - lo < 1e-9) { hi += 1; lo -= 1; }
  const pad = (hi - lo) * 0.08; lo -= pad; hi += pad;
  const left = 48, right = 8, top = 8, bottom = 18;
  const x = (i) => left + (points.length === 1 ? 0.5 : i / (points.length - 1)) * (width - left - right);
  const y = (v) => top + (1 - (v - lo) / (hi - lo)) * (height - top - bottom);
  ctx.strokeStyle = "#dde2ea"; ctx.lineWidth = 1;
  for (let k = 0; k <= 4; k++) {
    const v = lo + (hi - lo) * k / 4;
    ctx.beginPath(); ctx.moveTo(left, y(v)); ctx.lineTo(width - right, y(v)); ctx.stroke();
    ctx.fillText(Number(v).toPrecision(3), 2, y(v) + 4);
  }
  ctx.fillText(`last ${points.length} inspections`, left, height - 4);
  ctx.strokeStyle = "#e5484d"; ctx.setLineDash([5, 4]); ctx.lineWidth = 1.5;  // threshold
  ctx.beginPath();
  points.forEach((p, i) => { const px = x(i), py = y(p.threshold); i ? ctx.lineTo(px, py) : ctx.moveTo(px, py); });
  ctx.stroke(); ctx.setLineDash([]);
  points.forEach((p, i) => {
    ctx.fillStyle = p.is_anomalous ? "#e5484d" : "#2fbf71";
    ctx.beginPath(); ctx.arc(x(i), y(p.score), 3, 0, 2 * Math.PI); ctx.fill();
  });
}

// the operator's word on a verdict: good or defect (an admin route: the page's token)
const LABEL_TEXT = {
  good: (r) => r.is_anomalous ? "false alarm" : "confirmed good",
  defect: (r) => r.is_anomalous ? "confirmed defect" : "missed defect",
};

function labelCell(r) {
  const td = document.createElement("td");
  if (r.label) {
    const tag = document.createElement("span");
    tag.className = "tag labelled-" + r.label;
    tag.textContent = LABEL_TEXT[r.label] ? LABEL_TEXT[r.label](r) : r.label;
    if (r.label_note) tag.title = r.label_note;
    td.append(tag);
  }
  for (const label of ["good", "defect"]) {
    if (r.label === label) continue;
    const b = document.createElement("button");
    b.type = "button"; b.className = "label"; b.dataset.label = label;
    b.textContent = LABEL_TEXT[label](r);
    b.addEventListener("click", (e) => { e.stopPropagation(); setLabel(r.id, label); });
    td.append(b);
  }
  return td;
}

async function setLabel(id, label) {
  try {
    await api(`/v1/results/${id}/label`, {
      method: "POST", headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ label }),
    });
    setStatus(`result ${id} labelled ${label}`);
  } catch (err) {
    setStatus(`label of result ${id}: ${err.message}`, true);
  }
  refreshResults();
}

let servingChecksum = null;  // the serving model's file_sha256 (from /v1/model)

async function countFalseAlarms() {
  if (!servingChecksum) return;
  let n = 0, before = null;
  for (let page = 0; page < 20; page++) {  // at most 20 pages of 1000
    const q = "/v1/results?label=good&anomalous=true&limit=1000" + (before ? `&before_id=${before}` : "");
    const rows = (await api(q)).results;
    n += rows.filter((r) => r.model_checksum === servingChecksum).length;
    if (rows.length < 1000) break;
    before = rows[rows.length - 1].id;
  }
  $("false-alarms").textContent = `labelled false alarms of the serving model: ${n}`;
}

async function refreshResults() {
  try {
    const onlyAnomalous = $("only-anomalous").checked;
    const label = $("label-filter").value;
    const model = currentModel === null ? "" : `&model=${encodeURIComponent(currentModel)}`;
    const recent = await api("/v1/results?limit=50" + (onlyAnomalous ? "&anomalous=true" : "") +
                             (label ? `&label=${label}` : "") + model);
    renderRecent(recent.results);
    await countFalseAlarms();
    drawChart((await api("/v1/results?limit=200" + model)).results);
  } catch (err) {
    $("recent-empty").hidden = false;
    $("recent-empty").textContent = err.message;
  }
}

// ---- drift --------------------------------------------------------------------------
function leaves(obj, prefix = "", out = []) {
  for (const [k, v] of Object.entries(obj || {})) {
    const key = prefix ? `${prefix}.${k}` : k;
    if (v !== null && typeof v === "object") leaves(v, key, out);
    else if (typeof v === "number" || typeof v === "boolean") out.push([key, v]);
  }
  return out;
}

async function refreshDrift() {
  const state = $("drift-state"), table = $("drift-table");
  try {
    const status = await api(modelUrl("/drift", "/v1/drift"));
    table.replaceChildren();
    if (!status.enabled) {
      state.textContent = "not enabled";
      state.className = "drift-state off";
      $("drift-message").textContent = "This server runs without a drift monitor (start it with --monitor).";
      return;
    }
    const s = String(status.state || (status.drift ? "drift" : "ok"));
    state.textContent = s;
    state.className = "drift-state " + s.toLowerCase();
    $("drift-message").textContent = status.message || "";
    const rest = Object.fromEntries(Object.entries(status).filter(([k]) => !["enabled", "state", "message"].includes(k)));
    for (const [key, value] of leaves(rest).slice(0, 40)) {
      const tr = document.createElement("tr");
      const a = document.createElement("td"); a.textContent = key;
      const b = document.createElement("td");
      b.textContent = typeof value === "number" ? fmt(value, 4) : String(value);
      tr.append(a, b); table.append(tr);
    }
  } catch (err) {
    if (err.code === "drift_unavailable") {  // the model cannot feed a monitor: say why
      table.replaceChildren();
      state.textContent = "not available"; state.className = "drift-state off";
      $("drift-message").textContent = err.detail;
      return;
    }
    state.textContent = "unavailable"; state.className = "drift-state error";
    $("drift-message").textContent = err.message;
  }
}

setupUpload();
$("only-anomalous").addEventListener("change", refreshResults);
$("label-filter").addEventListener("change", refreshResults);
$("model-select").addEventListener("change", selectModel);
// the model list first: on a server of several models, every panel shows the selected one
loadModels().finally(() => {
  refreshModel(); refreshResults(); refreshDrift(); refreshOperatingPoint();
});
setInterval(refreshModel, 10000);
setInterval(refreshOperatingPoint, 10000);  // the operating point and the model card
setInterval(refreshResults, 3000);
setInterval(refreshDrift, 5000);
