// The run inspector's pages. No dependencies: the server embeds the first data in
// <script id="initial">, the page renders it, then server-sent events keep it current.
"use strict";

const SVG_NS = "http://www.w3.org/2000/svg";

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") node.className = v;
    else node.setAttribute(k, v === true ? "" : String(v));
  }
  for (const child of children.flat(Infinity)) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function svg(tag, attrs, ...children) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v !== null && v !== undefined) node.setAttribute(k, String(v));
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function setChildren(node, ...children) {
  // Like replaceChildren, but nested arrays are flattened and null/undefined skipped.
  node.replaceChildren(...children.flat(Infinity).filter((c) => c !== null && c !== undefined && c !== false));
}

function utc(iso) {
  if (!iso) return "";
  return new Date(iso).toISOString().replace("T", " ").slice(0, 19);
}

function seconds(value) {
  if (value === null || value === undefined) return "";
  return value < 1 ? `${Math.round(value * 1000)} ms` : `${value.toFixed(2)} s`;
}

function count(value) {
  return value === null || value === undefined ? "" : Number(value).toLocaleString("en-US");
}

function statusBadge(status) {
  return el("span", { class: `status status-${status}` }, status);
}

function initial() {
  return JSON.parse(document.getElementById("initial").textContent);
}

function follow(url, handlers) {
  // EventSource reconnects by itself after a dropped connection; "end" closes it for good.
  const source = new EventSource(url);
  const live = document.getElementById("live");
  for (const [name, handler] of Object.entries(handlers)) {
    source.addEventListener(name, (event) => handler(JSON.parse(event.data)));
  }
  source.addEventListener("end", () => { source.close(); live.hidden = true; });
  source.onopen = () => { live.hidden = false; };
  source.onerror = () => { live.hidden = true; };
  return source;
}

// ------------------------------------------------------------------ run list

const openTrees = new Set();  // root runs whose child rows are shown; kept across live updates
let listData = null;

function runLink(runId) {
  return el("a", { href: `/runs/${encodeURIComponent(runId)}` }, runId);
}

function treeRows(runs, depth) {
  // [depth, run] for each run and, below it, its child runs (already nested by the server).
  return runs.flatMap((r) => [[depth, r], ...treeRows(r.children || [], depth + 1)]);
}

function runCells(r) {
  // Figures of the run with every run below it (the server's totals): a root run of an agent
  // or subflow flow costs what its child runs cost.
  const t = r.totals || { elapsed_s: r.duration_s, prompt_tokens: r.prompt_tokens, cached_tokens: r.cached_tokens, generated_tokens: r.generated_tokens, busy: false };
  return [
    el("td", {}, statusBadge(r.status)),
    el("td", {}, r.workflow_id),
    el("td", {}, utc(r.created_at)),
    el("td", { class: "num duration", "data-elapsed": t.elapsed_s, "data-busy": t.busy ? "1" : null }, seconds(t.elapsed_s)),
    el("td", { class: "num" }, r.node_count),
    el("td", { class: "num tokens-in" }, count(t.prompt_tokens)),
    el("td", { class: "num tokens-cached" }, count(t.cached_tokens)),
    el("td", { class: "num tokens-out" }, count(t.generated_tokens)),
    el("td", { class: "num" }, r.progress_count),
  ];
}

let listReceivedAt = 0;

function tickList() {
  // A run that is still going (or whose child runs are) counts up between updates.
  const extra = (performance.now() - listReceivedAt) / 1000;
  for (const cell of document.querySelectorAll("#runs td.duration[data-busy]")) {
    cell.textContent = seconds(Number(cell.dataset.elapsed) + extra);
  }
}

function rootRows(root) {
  const below = treeRows(root.children || [], 1);
  const open = openTrees.has(root.run_id);
  const toggle = below.length
    ? el("button", { type: "button", class: "toggle", "aria-expanded": String(open) },
        `${open ? "▾" : "▸"} ${below.length} child run${below.length === 1 ? "" : "s"}`)
    : null;
  if (toggle) {
    toggle.addEventListener("click", () => {
      if (openTrees.has(root.run_id)) openTrees.delete(root.run_id);
      else openTrees.add(root.run_id);
      renderList(listData);
    });
  }
  return [
    el("tr", { class: "root", "data-run-id": root.run_id, "data-status": root.status },
      el("td", { class: "mono" }, runLink(root.run_id), toggle), ...runCells(root)),
    ...below.map(([depth, r]) => el("tr", { class: "child", hidden: !open, "data-run-id": r.run_id, "data-status": r.status, "data-root": root.run_id },
      el("td", { class: "mono", style: `padding-left: ${0.6 + 1.2 * depth}em` }, "└ ", runLink(r.run_id)), ...runCells(r))),
  ];
}

function renderList(data) {
  listData = data;
  listReceivedAt = performance.now();
  document.getElementById("ledger").textContent = data.ledger;
  const statusSelect = document.getElementById("status");
  const workflowSelect = document.getElementById("workflow");
  fillSelect(statusSelect, data.statuses, data.filters.status);
  fillSelect(workflowSelect, data.workflows, data.filters.workflow);
  document.querySelector("#runs tbody").replaceChildren(...data.runs.flatMap(rootRows));
  document.getElementById("empty").hidden = data.runs.length > 0;
}

function fillSelect(select, values, chosen) {
  const keep = select.options[0];
  select.replaceChildren(keep, ...values.map((v) => el("option", { value: v, selected: v === chosen }, v)));
}

function listPage() {
  const data = initial();
  renderList(data);
  const query = new URLSearchParams();
  if (data.filters.status) query.set("status", data.filters.status);
  if (data.filters.workflow) query.set("workflow", data.filters.workflow);
  query.set("limit", data.filters.limit);
  follow(`/api/runs/stream?${query}`, { runs: renderList });
  setInterval(tickList, 500);
  for (const id of ["status", "workflow"]) {
    document.getElementById(id).addEventListener("change", () => document.getElementById("filters").submit());
  }
}

// ------------------------------------------------------------------ run page

let selectedKey = null;   // the call shown in the panel: "RUN_ID CALL_KEY" (callId)
let selectedNode = null;  // or the graph node shown there (one of the two is set)
let current = null;
let receivedAt = 0;       // when the page got `current` (performance.now())

function callName(call) {
  // The server names calls: label (+ short id where the flow repeats it), #n per loop visit.
  return call.name || call.label || call.node_id;
}

function callId(runId, call) {
  return `${runId} ${call.key}`;
}

function allCalls(data) {
  // Every call of the run and of its child runs: {call, runId, span, turn}. An agent's calls
  // are its turns, numbered in order.
  const out = data.calls.map((call) => ({ call, runId: data.run.run_id, span: null, turn: null }));
  for (const span of data.spans || []) {
    span.calls.forEach((call, i) => out.push({ call, runId: span.run.run_id, span, turn: span.kind === "agent" ? i + 1 : null }));
  }
  return out;
}

function entryName(entry) {
  const name = callName(entry.call);
  return entry.turn ? `turn ${entry.turn} · ${name}` : name;
}

function elapsedNow(data) {
  // The run's time, its child runs' included, counts up between updates while any of them runs.
  const totals = data.totals || {};
  const base = totals.elapsed_s ?? data.elapsed_s ?? data.run.duration_s;
  return totals.busy || data.live ? base + (performance.now() - receivedAt) / 1000 : base;
}

function tickDuration() {
  const node = document.getElementById("duration");
  if (node && current) node.textContent = seconds(elapsedNow(current));
}

function renderRun(data) {
  current = data;
  receivedAt = performance.now();
  const run = data.run;
  document.getElementById("crumb").textContent = `${run.workflow_id} / ${run.run_id}`;
  const fact = (label, value, id) => el("span", { class: "fact" }, `${label} `, el("b", { id }, value));
  const childCalls = (data.spans || []).reduce((n, s) => n + s.calls.length, 0);
  const totals = data.totals || { prompt_tokens: run.prompt_tokens, cached_tokens: run.cached_tokens, generated_tokens: run.generated_tokens, runs: 1 };
  const tree = totals.runs > 1 ? ` (this run and ${totals.runs - 1} child run${totals.runs === 2 ? "" : "s"})` : "";
  setChildren(document.getElementById("summary"),
    el("h1", { class: "mono" }, run.run_id),
    statusBadge(run.status),
    fact("workflow", run.workflow_id),
    fact("started", `${utc(run.created_at)} UTC`),
    fact("duration", seconds(elapsedNow(data)), "duration"),
    fact("steps", data.steps.length),
    fact("LLM calls", childCalls ? `${data.calls.length} + ${childCalls} in child runs` : data.calls.length),
    fact("tokens", `${count(totals.prompt_tokens)} in / ${count(totals.cached_tokens)} from cache / ${count(totals.generated_tokens)} out${tree}`, "tokens"),
    fact("phase events", run.progress_count),
    run.parent_run_id ? fact("parent run", runLink(run.parent_run_id)) : null,
    run.wait_reason ? fact("waiting for", run.wait_reason) : null,
  );
  const error = document.getElementById("run-error");
  error.hidden = !data.error;
  error.textContent = data.error ? `error: ${data.error}` : "";
  renderOutput(data);
  if (selectedNode && !(data.graph && data.graph.nodes.some((n) => n.node_id === selectedNode))) selectedNode = null;
  const entries = allCalls(data);
  if (!selectedNode && !entries.some((e) => callId(e.runId, e.call) === selectedKey)) selectedKey = entries.length ? callId(entries[0].runId, entries[0].call) : null;
  renderGraph(data);
  renderChildren(data);
  renderTimeline(data);
  renderCharts(data);
  renderPanel(data);
  renderSteps(data);
}

// ------------------------------------------------------------------ graph

const NODE_W = 170, NODE_H = 50;

function renderGraph(data) {
  const box = document.getElementById("graph");
  const graph = data.graph;
  document.getElementById("graph-section").hidden = !graph;
  if (!graph) { box.replaceChildren(); return; }
  const xs = graph.nodes.map((n) => n.x), ys = graph.nodes.map((n) => n.y);
  const minX = Math.min(...xs, 0), minY = Math.min(...ys, 0);
  const pad = 16;
  const at = new Map(graph.nodes.map((n) => [n.node_id, { x: n.x - minX + pad, y: n.y - minY + pad }]));
  const width = Math.max(...graph.nodes.map((n) => at.get(n.node_id).x), 0) + NODE_W + pad;
  const height = Math.max(...graph.nodes.map((n) => at.get(n.node_id).y), 0) + NODE_H + pad;
  const root = svg("svg", { viewBox: `0 0 ${width} ${height}`, width: "100%", style: `max-width: ${width}px`, role: "img", "aria-label": "flow graph" });
  for (const e of graph.edges) {
    const a = at.get(e.source), b = at.get(e.target);
    if (!a || !b) continue;
    const x1 = a.x + NODE_W, y1 = a.y + NODE_H / 2, x2 = b.x, y2 = b.y + NODE_H / 2;
    const bend = Math.max(40, Math.abs(x2 - x1) / 2);
    root.append(svg("path", { class: `edge ${e.execution ? "edge-exec" : "edge-data"}`, "data-source": e.source, "data-target": e.target,
      d: `M${x1},${y1} C${x1 + bend},${y1} ${x2 - bend},${y2} ${x2},${y2}` },
      svg("title", {}, `${e.source}.${e.source_handle ?? ""} → ${e.target}.${e.target_handle ?? ""}`)));
  }
  for (const n of graph.nodes) {
    const p = at.get(n.node_id);
    const facts = [n.visits > 1 ? `×${n.visits}` : null, n.attempts > 1 ? `${n.attempts} attempts` : null,
      n.time_s != null ? seconds(n.time_s) : null, n.call_keys.length ? `${n.call_keys.length} call${n.call_keys.length === 1 ? "" : "s"}` : null,
      n.child_run_ids.length ? `${n.child_run_ids.length} child run${n.child_run_ids.length === 1 ? "" : "s"}` : null].filter(Boolean).join(" · ");
    const g = svg("g", { class: `gnode state-${n.state}${n.node_id === selectedNode ? " selected" : ""}`, "data-node": n.node_id, "data-state": n.state,
      "data-visits": n.visits, transform: `translate(${p.x},${p.y})` },
      svg("rect", { width: NODE_W, height: NODE_H, rx: 6 }),
      svg("text", { class: "glabel", x: 8, y: 19 }, truncate(n.label, 24)),
      svg("text", { class: "gfacts", x: 8, y: 38 }, truncate(facts || n.type, 28)),
      svg("title", {}, `${n.label} (${n.node_id}, ${n.type}): ${n.state}${facts ? " · " + facts : ""}${n.error ? "\n" + n.error : ""}`));
    g.addEventListener("click", () => selectNode(n.node_id));
    root.append(g);
  }
  box.replaceChildren(root);
}

function selectNode(nodeId) {
  selectedNode = nodeId;
  renderGraph(current);
  renderPanel(current);
  document.getElementById("panel").scrollIntoView({ block: "nearest" });
}

function renderChildren(data) {
  const rows = [];
  const walk = (runs, depth) => {
    for (const r of runs) {
      const span = (data.spans || []).find((s) => s.run.run_id === r.run_id);
      rows.push(el("tr", { "data-run-id": r.run_id, "data-status": r.status },
        el("td", { class: "mono", style: `padding-left: ${0.6 + 1.2 * (depth - 1)}em` }, depth > 1 ? "└ " : "", runLink(r.run_id)),
        el("td", {}, r.workflow_id), el("td", {}, statusBadge(r.status)), el("td", { class: "num" }, seconds(r.duration_s)),
        el("td", { class: "num" }, span ? span.calls.length : ""), el("td", { class: "num" }, count(r.prompt_tokens)),
        el("td", { class: "num" }, count(r.cached_tokens)), el("td", { class: "num" }, count(r.generated_tokens))));
      walk(r.children || [], depth + 1);
    }
  };
  walk(data.children || [], 1);
  document.getElementById("children-section").hidden = rows.length === 0;
  document.querySelector("#children tbody").replaceChildren(...rows);
}

function renderOutput(data) {
  const section = document.getElementById("output-section");
  if (!section) return;
  const has = data.output !== null && data.output !== undefined;
  section.hidden = !has;
  setChildren(document.getElementById("output"), has ? outputBlocks(data.output) : null);
}

function outputBlocks(output) {
  // The flow's final output: each field on its own, text as text, the rest as JSON.
  if (output === null || typeof output !== "object" || Array.isArray(output)) return foldable(output, "output-value");
  return Object.entries(output).map(([k, v]) => el("div", { class: "output-field", "data-field": k }, el("h3", {}, k), foldable(v, "output-value")));
}

function spanTitle(span) {
  // "agent writer" / "subflow summarize": the node of the parent run that started it.
  return `${span.kind} ${span.node_label || span.node_id || span.run.workflow_id}`;
}

function timelineRows(data) {
  // This run's calls, then each child run (a span bar) followed by its calls, indented.
  const rows = [];
  for (const entry of allCalls(data)) {
    if (entry.span && !rows.some((r) => r.kind === "span" && r.span === entry.span)) rows.push({ kind: "span", span: entry.span, depth: entry.span.depth });
    rows.push({ kind: "call", entry, call: entry.call, depth: entry.span ? entry.span.depth : 0, runId: entry.span ? entry.runId : null });
  }
  for (const span of data.spans || []) {
    if (!span.calls.length) rows.push({ kind: "span", span, depth: span.depth });  // a child run without calls
  }
  return rows;
}

function renderTimeline(data) {
  const box = document.getElementById("timeline");
  const rows = timelineRows(data);
  if (!rows.length) {
    box.replaceChildren(el("p", { class: "message" }, "no LLM calls recorded yet"));
    return;
  }
  const width = Math.max(box.clientWidth || 900, 500);
  const labelWidth = 190, right = 190, rowHeight = 24, top = 22;
  const plot = width - labelWidth - right;
  const horizon = Math.max(data.horizon_s, 1e-3);
  const x = (t) => labelWidth + (Math.max(0, t) / horizon) * plot;
  const height = top + rows.length * rowHeight + 6;
  const root = svg("svg", { viewBox: `0 0 ${width} ${height}`, height, role: "img", "aria-label": "timeline" });
  const axis = svg("g", { class: "axis" });
  for (let i = 0; i <= 5; i++) {
    const t = (horizon * i) / 5;
    axis.append(svg("line", { x1: x(t), x2: x(t), y1: top - 4, y2: height }),
      svg("text", { x: x(t), y: 12, "text-anchor": "middle" }, `${t.toFixed(2)}s`));
  }
  root.append(axis);
  rows.forEach((row, i) => {
    const y = top + i * rowHeight;
    const indent = 6 + 12 * row.depth;
    if (row.kind === "span") {
      const s = row.span;
      const bar = svg("g", { class: "span", "data-run-id": s.run.run_id, "data-status": s.run.status });
      const link = svg("a", { href: `/runs/${encodeURIComponent(s.run.run_id)}` },
        svg("text", { class: "label span-label", x: indent, y: y + 16 }, truncate(`▸ ${spanTitle(s)}`, 28)),
        svg("title", {}, `${spanTitle(s)}: child run ${s.run.run_id} (${s.run.workflow_id})`));
      const x0 = x(s.start_s), x1 = Math.max(x(s.end_s), x0 + 1.5);
      bar.append(link, svg("rect", { class: `span-bar status-${s.run.status}`, x: x0, y: y + 9, width: x1 - x0, height: rowHeight - 18, rx: 2 },
        svg("title", {}, `child run ${s.run.run_id} (${s.run.workflow_id}) ${s.run.status}: ${s.start_s.toFixed(3)}s → ${s.end_s.toFixed(3)}s`)));
      bar.append(svg("text", { x: labelWidth + plot + 8, y: y + 16, class: "facts" }, `${s.run.status} · ${s.calls.length} call${s.calls.length === 1 ? "" : "s"}`));
      root.append(bar);
      return;
    }
    const call = row.call;
    const own = !row.runId;
    const id = callId(row.entry.runId, call);
    const bar = svg("g", { class: `bar${id === selectedKey && !selectedNode ? " selected" : ""}${own ? "" : " child-call"}`,
      "data-call": call.key, "data-node": call.node_id, "data-run-id": row.entry.runId, "data-turn": row.entry.turn });
    bar.append(svg("rect", { class: "track", x: 0, y, width, height: rowHeight, fill: "transparent" }));
    bar.append(svg("text", { class: "label", x: indent, y: y + 16 }, truncate(entryName(row.entry), 28 - row.depth * 2)));
    for (const seg of call.segments) {
      const x0 = x(seg.start_s), x1 = Math.max(x(seg.end_s), x0 + 1.5);
      bar.append(svg("rect", { class: `seg seg-${seg.phase}`, "data-phase": seg.phase, x: x0, y: y + 5, width: x1 - x0, height: rowHeight - 10, rx: 2 },
        svg("title", {}, `${call.node_id} ${seg.phase}: ${seg.start_s.toFixed(3)}s → ${seg.end_s.toFixed(3)}s`)));
    }
    const facts = [call.phase === "load" ? `loading ${truncate(String(call.load.model || ""), 18)}` : call.lane || call.phase, call.generated_tokens != null ? `${call.generated_tokens} tok` : null,
      call.tokens_per_second != null ? `${Math.round(call.tokens_per_second)} tok/s` : null].filter(Boolean).join(" · ");
    bar.append(svg("text", { x: labelWidth + plot + 8, y: y + 16, class: "facts" }, facts));
    bar.addEventListener("click", () => select(id));
    root.append(bar);
  });
  box.replaceChildren(root);
}

function truncate(text, width) {
  return text.length <= width ? text : `${text.slice(0, width - 1)}…`;
}

function renderCharts(data) {
  const box = document.getElementById("charts");
  box.replaceChildren(...allCalls(data).map((entry) => {
    const call = entry.call, id = callId(entry.runId, call);
    const card = el("div", { class: `chart${id === selectedKey ? " selected" : ""}`, "data-call": call.key, "data-run-id": entry.runId },
      el("h3", {}, entryName(entry), el("span", { class: "muted" }, `  ${call.phase}${call.lane ? " · " + call.lane : ""}`)),
      chart(call));
    card.addEventListener("click", () => select(id));
    return card;
  }));
}

function chart(call) {
  const width = 420, height = 90, left = 34, rightPad = 34, top = 6, bottom = 16;
  const samples = call.samples;
  const root = svg("svg", { viewBox: `0 0 ${width} ${height}`, preserveAspectRatio: "none" });
  if (!samples.length) {
    root.append(svg("text", { x: left, y: 40 }, "no phase events"));
    return root;
  }
  const t0 = call.start_s ?? samples[0].t;
  const t1 = Math.max(...samples.map((s) => s.t), t0 + 1e-3);
  const x = (t) => left + ((t - t0) / (t1 - t0)) * (width - left - rightPad);
  const tpsPoints = samples.filter((s) => s.tokens_per_second != null).map((s) => [s.t, s.tokens_per_second]);
  const maxTps = Math.max(1, ...tpsPoints.map((p) => p[1]));
  const yTps = (v) => top + (1 - v / maxTps) * (height - top - bottom);
  const prefillPoints = [];
  for (const s of samples) {
    const total = s.prompt_tokens;
    if (!total) continue;
    let done = s.prefill_processed_tokens;
    if (s.phase !== "prefill") done = total;  // a token exists: the prompt is in the cache
    if (done == null) done = 0;
    prefillPoints.push([s.t, Math.min(1, done / total)]);
  }
  if (call.start_s != null && call.prompt_tokens) prefillPoints.unshift([call.start_s, 0]);
  const yPct = (v) => top + (1 - v) * (height - top - bottom);
  root.append(svg("g", { class: "axis" },
    svg("line", { x1: left, x2: width - rightPad, y1: height - bottom, y2: height - bottom }),
    svg("text", { x: left - 4, y: top + 8, "text-anchor": "end" }, Math.round(maxTps)),
    svg("text", { x: left - 4, y: height - bottom, "text-anchor": "end" }, "0"),
    svg("text", { x: width - rightPad + 4, y: top + 8 }, "100%"),
    svg("text", { x: left, y: height - 3 }, `${t0.toFixed(2)}s`),
    svg("text", { x: width - rightPad, y: height - 3, "text-anchor": "end" }, `${t1.toFixed(2)}s`)));
  const line = (points, cls, y) => {
    if (!points.length) return;
    root.append(svg("polyline", { class: cls, points: points.map(([t, v]) => `${x(t).toFixed(1)},${y(v).toFixed(1)}`).join(" ") }));
    for (const [t, v] of points) root.append(svg("circle", { class: cls.replace("line", "dot"), cx: x(t), cy: y(v), r: 2.2 }));
  };
  line(prefillPoints, "line-prefill", yPct);
  line(tpsPoints, "line-tps", yTps);
  root.append(svg("title", {}, `${call.node_id}: tokens/s (blue, left axis) and prefill progress (amber, right axis)`));
  return root;
}

function select(key) {
  selectedKey = key;
  selectedNode = null;
  renderGraph(current);
  renderTimeline(current);
  renderCharts(current);
  renderPanel(current);
}

function table(rows) {
  const shown = rows.filter(([, v]) => v !== null && v !== undefined && v !== "");
  if (!shown.length) return el("p", { class: "message" }, "none recorded");
  return el("table", {}, shown.map(([k, v]) => el("tr", {}, el("th", {}, k), el("td", {}, v))));
}

function jsonBlock(value, cls) {
  if (value === null || value === undefined) return el("p", { class: "message" }, "none recorded");
  return el("pre", { class: cls }, typeof value === "string" ? value : JSON.stringify(value, null, 2));
}

function renderNodePanel(panel, data, node) {
  const calls = data.calls.filter((c) => node.call_keys.includes(c.key));
  setChildren(panel,
    el("h2", {}, node.label, el("span", { class: "muted" }, ` ${node.node_id} · ${node.type} · `), statusBadge(node.state)),
    table([["runs", node.visits], ["attempts", node.attempts || null], ["time", seconds(node.time_s)]]),
    node.error ? [el("h3", {}, "error"), el("pre", { class: "error" }, node.error)] : null,
    calls.length ? [el("h3", {}, "LLM calls"), el("ul", { class: "node-calls" }, calls.map((c) => {
      const link = el("a", { href: `#call=${encodeURIComponent(c.key)}`, "data-call": c.key }, callName(c));
      link.addEventListener("click", (event) => { event.preventDefault(); select(callId(data.run.run_id, c)); });
      return el("li", {}, link, " ", statusBadge(c.status), c.generated_tokens != null ? ` ${c.generated_tokens} tok` : "");
    }))] : null,
    node.child_run_ids.length ? [el("h3", {}, "child runs"), el("ul", { class: "node-children" },
      node.child_run_ids.map((id) => el("li", {}, runLink(id))))] : null,
    el("h3", {}, "inputs"), jsonBlock(node.inputs, "node-inputs"),
    el("h3", {}, "outputs"), jsonBlock(node.outputs, "node-outputs"),
  );
}

const FOLD_CHARS = 600, FOLD_LINES = 12;

function foldable(value, cls) {
  // Long content folds behind its first line; opening it shows all of it (nothing is cut).
  if (value === null || value === undefined) return el("p", { class: "message" }, "none");
  const text = typeof value === "string" ? value : JSON.stringify(value, null, 2);
  const lines = text.split("\n");
  if (text.length <= FOLD_CHARS && lines.length <= FOLD_LINES) return el("pre", { class: cls }, text);
  const head = truncate(lines[0], 90);
  return el("details", { class: `fold ${cls || ""}` },
    el("summary", {}, head, el("span", { class: "muted" }, `  (${count(text.length)} characters, ${lines.length} lines)`)),
    el("pre", { class: cls }, text));
}

function messageBlock(message, index, isNew) {
  const role = message.role || "?";
  const extra = [message.name ? `name ${message.name}` : null, message.tool_call_id ? `tool call ${message.tool_call_id}` : null].filter(Boolean).join(" · ");
  const content = message.content;
  const text = content === null || content === undefined ? "" : typeof content === "string" ? content : JSON.stringify(content, null, 2);
  return el("div", { class: `message-item role-${role}${isNew ? " new" : ""}`, "data-role": role, "data-index": index },
    el("div", { class: "message-head" }, el("b", {}, role), extra ? el("span", { class: "muted" }, `  ${extra}`) : null,
      isNew ? el("span", { class: "badge-new" }, "new in this turn") : null),
    text ? foldable(text, "message-content") : null,
    message.tool_calls ? [el("div", { class: "muted" }, "tool calls"), foldable(message.tool_calls, "tool-calls")] : null);
}

function inputSection(call, entry) {
  // The conversation as the model got it. In a later turn of the same run the messages the
  // previous turn had fold together, so what this turn added reads first.
  const messages = call.messages || [];
  const shared = call.new_from || 0;
  const earlier = messages.slice(0, shared).map((m, i) => messageBlock(m, i, false));
  const fresh = messages.slice(shared).map((m, i) => messageBlock(m, shared + i, shared > 0));
  return [
    el("h3", {}, "input", el("span", { class: "muted" }, `  ${messages.length} message${messages.length === 1 ? "" : "s"} · ${count(call.prompt_tokens) || "?"} prompt tokens as rendered`)),
    call.input_note ? el("p", { class: "message" }, call.input_note) : null,
    el("div", { class: "messages", id: "messages" },
      shared ? el("details", { class: "earlier" }, el("summary", {}, `${shared} earlier message${shared === 1 ? "" : "s"} (as in the previous turn)`), earlier) : null,
      fresh.length ? fresh : el("p", { class: "message" }, messages.length ? "" : "no input recorded")),
    call.tools && call.tools.length
      ? el("details", { class: "tools" }, el("summary", {}, `${call.tools.length} tool${call.tools.length === 1 ? "" : "s"} offered: ${call.tools.map((t) => t.name || (t.function && t.function.name) || "?").join(", ")}`),
          foldable(call.tools, "tool-schemas"))
      : el("p", { class: "message" }, "no tools offered"),
  ];
}

function loadText(load) {
  if (!load || !load.state) return null;
  const size = load.size_bytes ? ` (${bytesText(load.size_bytes)})` : "";
  return load.state === "loading" ? `loading${size}…` : `${load.state} in ${seconds(load.seconds)}${size}`;
}

function bytesText(n) {
  // As the terminal says it (load_progress.human_bytes).
  const units = ["B", "KiB", "MiB", "GiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
  return `${i ? n.toFixed(1) : n} ${units[i]}`;
}

function renderPanel(data) {
  const panel = document.getElementById("panel");
  const node = selectedNode && data.graph ? data.graph.nodes.find((n) => n.node_id === selectedNode) : null;
  if (node) { renderNodePanel(panel, data, node); return; }
  const entry = allCalls(data).find((e) => callId(e.runId, e.call) === selectedKey);
  if (!entry) {
    panel.replaceChildren(el("p", { class: "message" }, "select a call on the timeline"));
    return;
  }
  const call = entry.call;
  const ex = call.execution, spec = call.speculation, route = call.route || {};
  const asked = route.asked || {}, served = route.served || {};
  const cached = call.cached_tokens ?? call.prompt_cache.cached_tokens;
  setChildren(panel,
    el("h2", {}, entryName(entry), el("span", { class: "muted" }, ` ${call.node_id} · attempt ${call.attempt} · `), statusBadge(call.status)),
    entry.span ? el("p", { class: "muted" }, `in ${spanTitle(entry.span)}: `, runLink(entry.runId)) : null,
    el("h3", {}, "model"),
    table([["served by", el("span", { class: "mono", id: "served-model" }, call.model || served.model || "")],
      ["provider", served.provider], ["the node asked for", asked.model ? `${asked.provider || ""} ${asked.model}` : asked.provider],
      ["route", route.rule ? (typeof route.rule === "object" ? JSON.stringify(route.rule) : String(route.rule)) : null],
      ["server", served.base_url], ["model load", loadText(call.load)]]),
    inputSection(call, entry),
    el("h3", {}, "controls"),
    call.controls.length
      ? el("table", { class: "controls" }, el("tr", {}, el("th", {}, "control"), el("th", {}, "value"), el("th", {}, "decided by")),
          call.controls.map((c) => el("tr", { "data-control": c.name }, el("td", {}, c.name), el("td", { class: "mono" }, c.value), el("td", { class: "source" }, c.source))))
      : el("p", { class: "message" }, "none recorded"),
    el("h3", {}, "execution"),
    table([["lane", call.lane], ["peak batch", ex.peak_batch_size], ["queue", seconds(ex.queue_s)], ["TTFT", seconds(call.ttft_s)],
      ["prompt tokens", count(call.prompt_tokens)], ["generated tokens", count(call.generated_tokens)],
      ["tokens/s", call.tokens_per_second != null ? call.tokens_per_second.toFixed(1) : null],
      ["prefill tokens/s", call.prefill_tokens_per_second != null ? call.prefill_tokens_per_second.toFixed(1) : null],
      ["finish", call.finish_reason], ["client", call.client.kind], ["phase events", call.samples.length]]),
    el("h3", {}, "speculation"),
    table([["used", spec.used === undefined ? null : String(spec.used)], ["mode", spec.mode], ["draft depth", spec.num_draft_tokens],
      ["rounds", spec.rounds], ["accepted tokens", spec.accepted_tokens], ["drafted tokens", spec.drafted_tokens],
      ["acceptance", call.acceptance != null ? `${(100 * call.acceptance).toFixed(1)}%` : null], ["reason", spec.reason]]),
    el("h3", {}, "prompt cache"),
    call.prefix_break ? el("p", { class: "warning", id: "prefix-break" }, call.prefix_break) : null,
    table([["cached tokens", count(cached)], ...Object.entries(call.prompt_cache).filter(([k]) => k !== "cached_tokens").map(([k, v]) => [k.replaceAll("_", " "), typeof v === "object" ? JSON.stringify(v) : String(v)])]),
    call.sibling_batch.role || call.sibling_batch.launched
      ? [el("h3", {}, "sibling batch"), table(Object.entries(call.sibling_batch).map(([k, v]) => [k.replaceAll("_", " "), typeof v === "object" ? JSON.stringify(v) : String(v)]))]
      : null,
    call.error ? [el("h3", {}, "error"), el("pre", { class: "error" }, call.error)] : null,
    el("h3", {}, "response"), foldable(call.response ?? (call.status === "running" ? "(generating…)" : ""), "response"),
    call.tool_calls && call.tool_calls.length ? [el("h3", {}, "tool calls answered"), foldable(call.tool_calls, "answer-tool-calls")] : null,
  );
}

function renderSteps(data) {
  document.querySelector("#steps tbody").replaceChildren(...data.steps.map((s) => el("tr", {},
    el("td", { class: "num" }, s.seq), el("td", {}, s.node_id), el("td", {}, s.status), el("td", {}, s.effect || ""),
    el("td", { class: "num" }, s.attempt), el("td", { class: "num" }, seconds(s.duration_s)), el("td", { class: "error" }, s.error || ""))));
}

function runPage() {
  const data = initial();
  const wanted = new URLSearchParams(window.location.hash.slice(1)).get("call");
  if (wanted && data.calls.some((c) => c.key === wanted)) selectedKey = callId(data.run.run_id, { key: wanted });
  renderRun(data);
  if (data.unfinished) {
    follow(`/api/runs/${encodeURIComponent(data.run.run_id)}/stream`, { run: renderRun });
    setInterval(tickDuration, 500);
  }
  window.addEventListener("resize", () => current && renderTimeline(current));
}

if (document.body.dataset.page === "list") listPage();
else if (document.body.dataset.page === "run") runPage();
