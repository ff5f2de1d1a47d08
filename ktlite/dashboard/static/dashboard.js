// ktlite dashboard: polls the dashboard's JSON API (same origin) and draws what it answers.
// Every value from a deployment (names, log lines, tracebacks) is shown as text, never as HTML.
"use strict";

const LIST_MS = 3000, DETAIL_MS = 2000, LOGS_MS = 1000, KEEP_LINES = 5000;
const state = {
  token: null, chosen: null, detail: null, call: null,
  logs: [], logAfter: 0, follower: 0, logsBusy: false, detailBusy: false, listBusy: false,
};

function $(id) { return document.getElementById(id); }

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") node.className = v;
    else if (k === "text") node.textContent = v;
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v);
  }
  for (const c of children) node.append(c instanceof Node ? c : String(c));
  return node;
}

function readToken() {
  const m = /(?:^|[#&])token=([^&]+)/.exec(location.hash);
  if (m) {
    sessionStorage.setItem("ktlite-dashboard-token", decodeURIComponent(m[1]));
    history.replaceState(null, "", location.pathname);  // the secret leaves the address bar
  }
  return sessionStorage.getItem("ktlite-dashboard-token");
}

async function api(path, method) {
  const resp = await fetch(path, {
    method: method || "GET",
    headers: { "x-ktlite-dashboard": state.token },
    cache: "no-store",
  });
  const body = await resp.json().catch(() => ({ detail: `HTTP ${resp.status}` }));
  if (!resp.ok) throw new Error(body.detail || `HTTP ${resp.status}`);
  return body;
}

function problem(node, text) {
  node.hidden = !text;
  node.textContent = text || "";
}

function bytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}

function num(v, suffix) { return v === null || v === undefined ? "–" : `${v}${suffix || ""}`; }
// a Ray node or Monarch host, as its pod server reports it (the head adds its cluster's view)
function engineLine(name, e) {
  const parts = [`${e.kind || "engine"} ${e.head ? "head" : "worker"}`, e.alive ? "alive" : "NOT RUNNING"];
  if (e.pid) parts.push(`pid ${e.pid}`);
  if (e.started_at) parts.push(`up ${secs(Date.now() / 1000 - e.started_at)}`);
  if (Array.isArray(e.nodes)) parts.push(`${e.nodes.length} Ray node(s) in the cluster`);
  if (Array.isArray(e.hosts)) {
    parts.push(`${e.hosts.filter((h) => h.reachable).length}/${e.hosts.length} hosts reachable`);
  }
  if (Array.isArray(e.lost) && e.lost.length) parts.push(`LOST: ${e.lost.join(", ")}`);
  if (e.error) parts.push(`error: ${e.error}`);
  return `${name}: ${parts.join(" · ")}`;
}

function secs(s) { return s >= 1 ? `${s.toFixed(2)} s` : `${(s * 1000).toFixed(1)} ms`; }
function key(b, n) { return `${b}/${n}`; }

// ---- deployments ---------------------------------------------------------------------------

async function refreshList() {
  if (state.listBusy) return;
  state.listBusy = true;
  try {
    const body = await api("/api/deployments");
    drawList(body.backends);
    problem($("problem"), "");
    $("refreshed").textContent = `updated ${new Date().toLocaleTimeString()}`;
  } catch (e) {
    problem($("problem"), `the dashboard's server did not answer: ${e.message}`);
  } finally {
    state.listBusy = false;
  }
}

function drawList(backends) {
  const nav = $("deployments");
  nav.replaceChildren();
  for (const b of backends) {
    nav.append(el("h4", { text: b.backend }));
    if (b.error) {
      nav.append(b.set_up
        ? el("p", { class: "unreachable", text: `not reachable: ${b.error}` })
        : el("p", { class: "muted small", text: `not set up here: ${b.error}` }));
      continue;
    }
    if (!b.deployments.length) nav.append(el("p", { class: "muted", text: "no deployments" }));
    const ul = el("ul");
    for (const d of b.deployments) {
      const k = key(b.backend, d.name);
      const button = el("button", {
        type: "button",
        class: state.chosen === k ? "chosen" : "",
        "data-deployment": k,
        onclick: () => choose(b.backend, d.name),
      }, `${d.name} `, el("span", { class: "muted", text: `${d.ready}/${d.pods} pods` }));
      ul.append(el("li", {}, button));
    }
    nav.append(ul);
  }
}

function choose(backend, name) {
  state.chosen = key(backend, name);
  state.detail = null;
  state.call = null;
  state.logs = [];
  state.logAfter = 0;
  state.follower = 0;
  $("logs").replaceChildren();
  $("detail").hidden = false;
  $("dep-name").textContent = name;
  $("dep-where").textContent = backend;
  for (const b of document.querySelectorAll("nav button"))
    b.classList.toggle("chosen", b.dataset.deployment === state.chosen);
  refreshDetail();
  refreshLogs();
}

function chosenPath() {
  const [backend, ...rest] = state.chosen.split("/");
  return `/api/deployments/${encodeURIComponent(backend)}/${encodeURIComponent(rest.join("/"))}`;
}

// ---- one deployment --------------------------------------------------------------------------

async function refreshDetail() {
  if (!state.chosen || state.detailBusy) return;
  state.detailBusy = true;
  const asked = state.chosen;
  try {
    const stuck = Number($("stuck-after").value);
    const query = stuck > 0 ? `?stuck_after=${stuck}` : "";
    const body = await api(chosenPath() + query);
    if (asked !== state.chosen) return;
    state.detail = body;
    drawDetail(body);
    problem($("dep-problem"), "");
  } catch (e) {
    if (asked === state.chosen) problem($("dep-problem"), e.message);
  } finally {
    state.detailBusy = false;
  }
}

function drawDetail(d) {
  $("dep-where").textContent = d.where;
  const tbody = $("ranks").querySelector("tbody");
  tbody.replaceChildren();
  const ranks = new Set();
  const engines = [];
  for (const pod of d.pods) {
    if (pod.error) {
      tbody.append(el("tr", {}, el("td", { text: pod.pod }),
        el("td", { colspan: "8", class: "bad", text: `not answering: ${pod.error}` })));
      continue;
    }
    if (pod.engine) engines.push(engineLine(pod.pod, pod.engine));
    for (const r of pod.ranks) {
      ranks.add(r.rank);
      const calls = (r.calls || []).map((c) => `${c.id.slice(0, 8)} ${secs(c.running_s)}`).join(", ");
      const gpuMem = r.gpu_memory_used_bytes === null || r.gpu_memory_used_bytes === undefined
        ? "–" : `${bytes(r.gpu_memory_used_bytes)} / ${bytes(r.gpu_memory_total_bytes)}`;
      tbody.append(el("tr", { class: r.stuck ? "stuck" : "", "data-rank": r.rank },
        el("td", { text: pod.pod }), el("td", { text: r.rank }),
        el("td", { text: r.stuck ? `${r.state} (stuck)` : r.state }),
        el("td", { text: num(r.cpu_percent) }), el("td", { text: bytes(r.rss_bytes) }),
        el("td", { text: gpuMem }), el("td", { text: num(r.gpu_utilization_percent, " %") }),
        el("td", { text: r.restarts }), el("td", { text: calls || "–" })));
    }
  }
  $("engine").hidden = !engines.length;
  $("engine-text").textContent = engines.join("\n");
  $("serving").hidden = !d.serving;
  $("serving-text").textContent = d.serving || "";
  const stuck = d.pods.flatMap((p) => (p.ranks || []).filter((r) => r.stuck).map((r) => r.rank));
  $("stuck").textContent = stuck.length ? `stuck: rank ${stuck.join(", ")}` : "";
  drawRankChoices([...ranks].sort((a, b) => a - b));
  drawCalls(d.calls);
}

function drawRankChoices(ranks) {
  const select = $("log-rank");
  const have = new Set([...select.options].map((o) => o.value));
  for (const r of ranks) {
    if (!have.has(String(r))) select.append(el("option", { value: String(r), text: `rank ${r}` }));
  }
}

function drawCalls(calls) {
  const tbody = $("calls").querySelector("tbody");
  tbody.replaceChildren();
  if (!calls.length) {
    tbody.append(el("tr", {}, el("td", { colspan: "4", class: "muted", text: "no calls yet" })));
  }
  if (!calls.some((c) => c.id === state.call)) state.call = calls.length ? calls[0].id : null;
  for (const c of calls) {
    const outcome = c.status === "ok" ? "ok" : `failed on rank ${c.failed_ranks.join(", ")}`;
    tbody.append(el("tr", {
      "data-call": c.id, "data-status": c.status,
      class: c.id === state.call ? "chosen" : "",
      onclick: () => { state.call = c.id; drawCalls(state.detail.calls); },
    }, el("td", { text: c.id.slice(0, 12) }),
      el("td", { text: new Date(c.start * 1000).toLocaleTimeString() }),
      el("td", { text: secs(c.duration_s) }),
      el("td", { class: c.status === "ok" ? "ok" : "failed", text: outcome })));
  }
  drawTimeline(calls.find((c) => c.id === state.call));
}

function drawTimeline(call) {
  $("timeline").hidden = !call;
  if (!call) return;
  $("timeline").dataset.call = call.id;
  $("timeline-id").textContent = `${call.id.slice(0, 12)} (${secs(call.duration_s)})`;
  const rows = $("timeline-rows");
  rows.replaceChildren();
  const span = Math.max(call.duration_s, 1e-6);
  const pct = (s) => `${Math.min(100, Math.max(0, (s / span) * 100))}%`;
  for (const r of call.ranks) {
    const track = el("div", { class: "track" });
    const segs = [
      ["reach", 0, r.reach_s, "reaching the pod"],
      [r.status === "ok" ? "run" : "failed", r.reach_s, r.run_s, r.status],
      ["wait", r.reach_s + r.run_s, r.wait_s, "waiting for the slowest rank"],
    ];
    for (const [cls, at, len, what] of segs) {
      const seg = el("div", { class: `seg ${cls}`, title: `${what}: ${secs(len)}` });
      seg.style.left = pct(at);
      seg.style.width = pct(len);
      track.append(seg);
    }
    rows.append(el("div", { class: "trow", "data-rank": r.rank, "data-status": r.status },
      el("span", { class: "label", text: `rank ${r.rank} ${r.pod}` }), track,
      el("span", { class: "numbers", text: `${r.status} · ran ${secs(r.run_s)} · waited ${secs(r.wait_s)}` })));
  }
  const errors = $("errors");
  errors.replaceChildren();
  for (const r of call.ranks) {
    if (r.status === "ok" || (!r.error && !r.message && !r.error_dropped)) continue;
    const box = el("div", { class: "error", "data-rank": r.rank });
    const head = r.error ? `${r.error.type}: ${r.error.message}` : r.message || r.status;
    box.append(el("strong", { text: `rank ${r.rank} (${r.pod}) ${r.status}: ${head}` }));
    if (r.error && r.error.traceback) box.append(el("pre", { class: "traceback", text: r.error.traceback }));
    if (r.error_dropped) box.append(el("p", { class: "muted", text: "its exception was too large to keep here" }));
    errors.append(box);
  }
}

// ---- logs ----------------------------------------------------------------------------------

async function refreshLogs() {
  if (!state.chosen || state.logsBusy) return;
  state.logsBusy = true;
  const asked = state.chosen;
  try {
    const body = await api(`${chosenPath()}/logs?after=${state.logAfter}&follower=${state.follower}`);
    if (asked !== state.chosen) return;
    if (body.follower !== state.follower) { state.logs = []; state.follower = body.follower; }
    state.logs.push(...body.lines);
    if (state.logs.length > KEEP_LINES) state.logs.splice(0, state.logs.length - KEEP_LINES);
    if (body.lines.length) state.logAfter = body.lines[body.lines.length - 1].n;
    $("log-state").textContent = body.error ? `logs stopped: ${body.error}` : body.ended ? "logs ended" : "";
    if (body.lines.length) drawLogs();
  } catch (e) {
    if (asked === state.chosen) $("log-state").textContent = `logs: ${e.message}`;
  } finally {
    state.logsBusy = false;
  }
}

function shownLine(line) {
  const rank = $("log-rank").value;
  if (rank === "server" && line.rank !== null) return false;
  if (rank !== "" && rank !== "server" && line.rank !== Number(rank)) return false;
  const q = $("log-search").value.toLowerCase();
  return !q || line.text.toLowerCase().includes(q);
}

function drawLogs() {
  const pre = $("logs");
  const lines = state.logs.filter(shownLine);
  pre.replaceChildren(...lines.map((l) => el("span", { class: "line", "data-rank": l.rank === null ? "" : l.rank },
    el("span", { class: "pod", text: l.pod ? `[${l.pod}] ` : "" }),
    el("span", { class: "rank", text: l.rank === null ? "" : `[rank ${l.rank}] ` }), l.text)));
  if ($("log-follow").checked) pre.scrollTop = pre.scrollHeight;
}

// ---- teardown ------------------------------------------------------------------------------

async function teardown() {
  if (!state.chosen) return;
  const name = state.chosen;
  if (!window.confirm(`Tear down ${name}? Its pods stop and what it created is deleted.`)) return;
  try {
    await api(`${chosenPath()}/teardown`, "POST");
    state.chosen = null;
    $("detail").hidden = true;
    refreshList();
  } catch (e) {
    problem($("dep-problem"), `teardown of ${name} failed: ${e.message}`);
  }
}

function start() {
  state.token = readToken();
  if (!state.token) {
    problem($("problem"), "this page needs the dashboard's secret: open the address that `ktlite dashboard` printed (it ends with #token=...)");
    $("refreshed").textContent = "";
    return;
  }
  $("teardown").addEventListener("click", teardown);
  $("log-rank").addEventListener("change", drawLogs);
  $("log-search").addEventListener("input", drawLogs);
  $("stuck-after").addEventListener("change", refreshDetail);
  refreshList();
  setInterval(refreshList, LIST_MS);
  setInterval(refreshDetail, DETAIL_MS);
  setInterval(refreshLogs, LOGS_MS);
}

document.addEventListener("DOMContentLoaded", start);
