// meshnet dashboard: polls GET /admin/dashboard with the admin token about every second
// and draws the mesh; it follows GET /admin/events (server-sent state changes), lists
// them as they come and redraws at once on each. The token comes from the login form or a URL fragment
// (#token=...; browsers never send fragments, so it is never in a server's log); it is
// kept in this tab's sessionStorage only and the fragment is wiped at once.
// Every value from the server goes in as text (textContent), never as markup.
"use strict";

const POLL_MS = 1000;
const KEY = "meshnet-admin-token";
const $ = (id) => document.getElementById(id);

function takeToken() {
  const m = location.hash.match(/(?:^#|&)token=([^&]+)/);
  if (m) {
    sessionStorage.setItem(KEY, decodeURIComponent(m[1]));
    history.replaceState(null, "", location.pathname + location.search);
  }
  return sessionStorage.getItem(KEY);
}

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") e.className = v;
    else if (k.startsWith("data-")) e.setAttribute(k, v);
    else e[k] = v;
  }
  for (const c of children) e.append(c instanceof Node ? c : String(c ?? ""));
  return e;
}

function bytes(n) {
  if (!n) return "0";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}

function ago(seconds) {
  if (seconds < 1) return "now";
  if (seconds < 120) return `${Math.round(seconds)} s ago`;
  return `${Math.round(seconds / 60)} min ago`;
}

function replace(node, ...children) {
  node.replaceChildren(...children);
}

function drawHeader(s) {
  // Every served model; the badge is green while each has a complete route.
  $("model").textContent = s.models.map((m) => `${m.name} · ${m.n_layers} layers`).join(" | ");
  const complete = s.models.every((m) => m.route);
  const route = $("route");
  route.textContent = complete ? "route complete" : "no route";
  route.className = "badge " + (complete ? "ok" : "bad");
  route.title = s.models.map((m) =>
    `${m.name}: ${m.reason || m.route.map((h) => h.node_id).join(" > ")}`).join("\n");
}

function drawTotals(s) {
  const t = s.totals;
  const up = s.nodes.filter((n) => n.state === "up").length;
  const cards = [
    ["nodes up", `${up} / ${s.nodes.length}`],
    ["in flight", s.generations_in_flight],
    ["waiting", s.waiting],
    ["generations", t.generations],
    ["prompt tokens", t.prompt_tokens],
    ["generated tokens", t.generated_tokens],
    ["refused", t.refusals],
    ["failovers", t.failovers],
    ["nodes marked down", t.nodes_marked_down],
  ];
  replace($("totals"), ...cards.map(([k, v]) => el("div", { class: "card" }, el("b", {}, v), k)));
}

function drawTopology(s) {
  replace($("topology"), ...s.nodes.map((n) => {
    // A node's span is drawn against its own model's layers (the first model's if empty).
    const model = s.models.find((m) => m.fingerprint === n.fingerprint) || s.models[0];
    const layers = model.n_layers;
    const state = n.layers ? n.state : (n.state === "up" ? "empty" : "down");
    const [start, end] = n.layers || [0, layers];
    const span = el("div", { class: `span ${state}` },
      n.layers ? `${start}–${end}` : "empty");
    span.style.left = `${(100 * start) / layers}%`;
    span.style.width = `${(100 * (end - start)) / layers}%`;
    return el("div", { class: "lane", "data-node": n.node_id, "data-state": n.state },
      el("span", { class: "name", title: n.node_id }, n.node_id),
      el("div", { class: "track" }, span));
  }));
}

function drawCoverage(s) {
  const model = s.models[0];
  replace($("coverage"), ...model.replicas.map((count, layer) =>
    el("div", { class: count ? "layer" : "layer gap", title: `layer ${layer}: ${count}`,
      "data-layer": layer, "data-replicas": count }, count)));
}

function fetching(f) {
  if (!f) return "";
  const share = f.total_bytes ? Math.floor((100 * f.done_bytes) / f.total_bytes) : 0;
  const left = f.bytes_per_s > 0 ? Math.round((f.total_bytes - f.done_bytes) / f.bytes_per_s) : "?";
  return ` (fetching ${f.layer_start}:${f.layer_end}: ${share}%, ${bytes(f.bytes_per_s)}/s, ${left} s left)`;
}

function drawNodes(s) {
  const rows = s.nodes.map((n) => {
    const l = n.load;
    const kv = n.kv_budget_bytes ? `${bytes(l.kv_bytes)} / ${bytes(n.kv_budget_bytes)}`
      : bytes(l.kv_bytes);
    const state = el("span", { class: `state-${n.state}` }, n.state);
    if (n.down_reason) state.title = n.down_reason;
    const cells = [
      el("td", {}, n.node_id),
      el("td", {}, n.address),
      el("td", {}, n.layers ? `${n.layers[0]}:${n.layers[1]}` : "empty", fetching(n.fetching)),
      el("td", {}, state, n.down_reason ? ` (${n.down_reason})` : ""),
      el("td", {}, ago(n.heartbeat_age_s)),
      el("td", { class: "num" }, l.sessions),
      el("td", { class: "num" }, kv),
      el("td", { class: "num" }, l.queue_depth),
      el("td", { class: "num" }, l.tokens_per_s.toFixed(1)),
      el("td", { class: "num" }, `${s.streams_reserved[n.node_id] || 0} / ${l.max_streams || "?"}`),
      el("td", { class: "num" }, `${l.last_batch} (max ${l.max_batch})`),
    ];
    return el("tr", { "data-node": n.node_id, "data-state": n.state }, ...cells);
  });
  replace($("nodes").tBodies[0], ...rows);
}

function drawSessions(s) {
  const body = $("sessions").tBodies[0];
  if (!s.sessions) {
    replace(body, el("tr", {}, el("td", { class: "error" }, "database unavailable")));
    return;
  }
  replace(body, ...Object.entries(s.sessions).map(([state, count]) =>
    el("tr", { "data-session-state": state }, el("td", {}, state),
      el("td", { class: "num" }, count))));
}

function drawEvents(s) {
  const rows = s.events.map((e) => el("tr", { "data-event": e.what },
    el("td", {}, new Date(e.at * 1000).toLocaleTimeString()),
    el("td", {}, e.what),
    el("td", {}, e.node_id),
    el("td", {}, e.kind),
    el("td", {}, e.detail)));
  if (!rows.length) rows.push(el("tr", {}, el("td", { class: "muted" }, "none yet")));
  replace($("events").tBodies[0], ...rows);
}

function draw(s) {
  drawHeader(s);
  drawTotals(s);
  drawTopology(s);
  drawCoverage(s);
  drawNodes(s);
  drawSessions(s);
  drawEvents(s);
  $("status").textContent = `updated ${new Date(s.now * 1000).toLocaleTimeString()}`;
  document.body.dataset.updated = String(s.now);
}

function showLogin(message) {
  $("board").hidden = true;
  $("logout").hidden = true;
  $("login").hidden = false;
  $("login-error").textContent = message || "";
  $("status").textContent = "not connected";
}

const MAX_CHANGES = 30;
let lastEvent = null; // the id of the last state change seen: a resumed stream goes on from it
let following = null; // the AbortController of the stream being read
let pollTimer = null;

function showChange(e) {
  const when = new Date(e.at * 1000).toLocaleTimeString();
  const row = el("tr", { "data-kind": e.kind, "data-state": e.state },
    el("td", { class: "num" }, e.id), el("td", {}, when), el("td", {}, e.kind),
    el("td", {}, e.subject), el("td", {}, e.previous || "(new)"), el("td", {}, e.state || "(gone)"));
  const body = $("changes").tBodies[0];
  body.prepend(row);
  while (body.rows.length > MAX_CHANGES) body.deleteRow(-1);
}

// Reads the event stream with fetch (an EventSource cannot send the token); on its end
// or failure, follows again from the last id after a pause.
async function follow() {
  const token = sessionStorage.getItem(KEY);
  if (!token || following) return;
  following = new AbortController();
  const headers = { Authorization: `Bearer ${token}` };
  if (lastEvent !== null) headers["Last-Event-ID"] = String(lastEvent);
  try {
    const r = await fetch("/admin/events", { headers, cache: "no-store", signal: following.signal });
    if (!r.ok || !r.body) throw new Error(`the tracker answered ${r.status}`);
    $("changes-status").textContent = "live";
    const reader = r.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += value;
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const frame = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        const data = frame.split("\n").find((l) => l.startsWith("data: "));
        const name = frame.split("\n").find((l) => l.startsWith("event: "));
        if (!data || name === "event: reset") continue;
        const e = JSON.parse(data.slice(6));
        lastEvent = e.id;
        showChange(e);
        clearTimeout(pollTimer);
        poll(); // the picture follows the change at once
      }
    }
  } catch (e) {
    $("changes-status").textContent = `reconnecting (${e.message})`;
  }
  const stopped = following.signal.aborted;
  following = null;
  if (!stopped) setTimeout(follow, 2000);
}

async function poll() {
  const token = sessionStorage.getItem(KEY);
  if (!token) { showLogin(); return; }
  try {
    const r = await fetch("/admin/dashboard", {
      headers: { Authorization: `Bearer ${token}` }, cache: "no-store",
    });
    if (r.status === 401) {
      sessionStorage.removeItem(KEY);
      showLogin("the tracker refused that token");
      return;
    }
    if (!r.ok) throw new Error(`the tracker answered ${r.status}`);
    const state = await r.json();
    $("login").hidden = true;
    $("board").hidden = false;
    $("logout").hidden = false;
    draw(state);
    follow();
  } catch (e) {
    $("status").textContent = `tracker unreachable (${e.message}); retrying`;
  }
  clearTimeout(pollTimer);
  pollTimer = setTimeout(poll, POLL_MS);
}

$("login").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const token = $("token").value.trim();
  $("token").value = "";
  if (token) {
    sessionStorage.setItem(KEY, token);
    poll();
  }
});

$("logout").addEventListener("click", () => {
  sessionStorage.removeItem(KEY);
  if (following) following.abort();
  showLogin();
});

takeToken();
poll();
