// Live comparison dashboard: polls /admin/compare and /admin/backends every 2 s and draws
// hand-written SVG line charts from the server's 5-minute history (no libraries, no CDN).
// `body[data-updates]` counts successful refreshes, for tests and for the eye.
"use strict";

const POLL_MS = 2000;
const HISTORY_S = 300;
const RUNTIME_COLORS = { vllm: "#58a6ff", sglang: "#f0883e", trtllm: "#3fb950", triton: "#bc8cff" };
const PALETTE = ["#58a6ff", "#f0883e", "#3fb950", "#bc8cff", "#ff7b72", "#d29922", "#39c5cf", "#db61a2"];
const SVG_NS = "http://www.w3.org/2000/svg";

// Each chart reads one series of the server's `history` block (completed 10-s steps, last 5 min).
const CHARTS = [
  { key: "output_tokens_per_s", title: "Output tokens/s", scale: 1, fmt: (v) => v.toFixed(0) },
  { key: "ttft_p50_s", title: "TTFT p50 (ms)", scale: 1000, fmt: (v) => v.toFixed(0) },
  { key: "itl_p50_s", title: "ITL p50 (ms)", scale: 1000, fmt: (v) => v.toFixed(0) },
  { key: "usd_per_million_output_tokens", title: "$ per 1M output tokens", scale: 1, fmt: (v) => "$" + v.toFixed(0) },
];

let updates = 0;

function ms(x) { return x == null ? null : x * 1000; }
function el(tag, attrs, text) {
  const e = tag.startsWith("svg:") ? document.createElementNS(SVG_NS, tag.slice(4)) : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text != null) e.textContent = text;
  return e;
}
function fmt(x, digits = 1, unit = "") {
  return x == null ? "–" : Number(x).toLocaleString(undefined, { maximumFractionDigits: digits }) + unit;
}
function pct(x) { return x == null ? "–" : (x * 100).toFixed(1) + "%"; }
function colorFor(scope, name, i) { return (scope === "runtime" && RUNTIME_COLORS[name]) || PALETTE[i % PALETTE.length]; }

// A "nice" tick step (1, 2, 2.5 or 5 times a power of ten) so that four steps cover `v`.
function niceStep(v) {
  if (!(v > 0)) return 0.25;
  const raw = v / 4, p = Math.pow(10, Math.floor(Math.log10(raw)));
  for (const m of [1, 2, 2.5, 5, 10]) if (raw <= m * p) return m * p;
  return 10 * p;
}
function tick(v, step) { return step >= 1 ? v.toFixed(0) : v.toFixed(step >= 0.1 ? 1 : 2); }

function drawChart(container, scope, chart, hist) {
  const W = 300, H = 130, L = 38, R = 6, T = 6, B = 16;
  const names = Object.keys(hist[scope]);
  const offsets = hist.end_offsets_s;
  const span = HISTORY_S;
  const val = (n, i) => { const v = hist[scope][n][chart.key][i]; return v == null ? null : v * chart.scale; };
  let ymax = 0;
  for (const n of names) offsets.forEach((_, i) => { const v = val(n, i); if (v != null && v > ymax) ymax = v; });
  const step = niceStep(ymax * 1.02);
  ymax = step * 4;
  const x = (off) => L + ((off + span) / span) * (W - L - R);
  const y = (v) => T + (1 - v / ymax) * (H - T - B);

  const box = el("div", { class: "chart", "data-chart": scope + "-" + chart.key });
  const title = el("div", { class: "title" });
  const any = names.some((n) => offsets.some((_, i) => val(n, i) != null));
  title.append(el("span", {}, chart.title), el("span", {}, any ? "10 s steps" : "no data yet"));
  box.append(title);
  const svg = el("svg:svg", { viewBox: `0 0 ${W} ${H}`, preserveAspectRatio: "none", role: "img" });
  for (let i = 0; i <= 4; i++) {
    const v = (ymax * i) / 4;
    svg.append(el("svg:line", { class: "axis", x1: L, x2: W - R, y1: y(v), y2: y(v), "stroke-dasharray": i ? "2 3" : "" }));
    svg.append(el("svg:text", { class: "tick", x: L - 4, y: y(v) + 3, "text-anchor": "end" },
                  (chart.key.startsWith("usd") ? "$" : "") + tick(v, step)));
  }
  svg.append(el("svg:text", { class: "tick", x: L, y: H - 3 }, "-5 min"));
  svg.append(el("svg:text", { class: "tick", x: W - R, y: H - 3, "text-anchor": "end" }, "now"));
  names.forEach((n, si) => {
    let d = "", pen = false, last = null;
    offsets.forEach((off, i) => {
      const v = val(n, i);
      if (v == null) { pen = false; return; }
      d += (pen ? "L" : "M") + x(off).toFixed(1) + " " + y(v).toFixed(1) + " ";
      pen = true; last = [off, v];
    });
    const color = colorFor(scope, n, si);
    if (d) svg.append(el("svg:path", { d: d.trim(), fill: "none", stroke: color, "stroke-width": 1.8,
                                       "data-series": n, "vector-effect": "non-scaling-stroke" }));
    if (last) svg.append(el("svg:circle", { cx: x(last[0]), cy: y(last[1]), r: 2.5, fill: color,
                                            "data-series": n, "data-value": last[1] }));
  });
  box.append(svg);
  const legend = el("div", { class: "legend" });
  names.forEach((n, si) => {
    let lastV = null;
    offsets.forEach((_, i) => { const v = val(n, i); if (v != null) lastV = v; });
    const item = el("span", {});
    item.append(el("i", { style: "background:" + colorFor(scope, n, si) }),
                document.createTextNode(n + " " + (lastV == null ? "–" : chart.fmt(lastV))));
    legend.append(item);
  });
  box.append(legend);
  container.append(box);
}

function drawCharts(scope, hist) {
  const container = document.getElementById("charts-" + scope);
  container.replaceChildren();
  for (const c of CHARTS) drawChart(container, scope, c, hist);
}

function drawTotals(doc) {
  const t = doc.total;
  const cards = [
    ["requests/s", fmt(t.requests_per_s, 2)], ["output tokens/s", fmt(t.output_tokens_per_s)],
    ["TTFT p50", fmt(ms(t.ttft_s.p50), 1, " ms")], ["ITL p50", fmt(ms(t.itl_s.p50), 1, " ms")],
    ["error rate", pct(t.error_rate)],
    ["$ / 1M output, sustained", usd(t.cost.usd_per_million_output_tokens_at_best, 2)],
    ["utilisation", pct(t.cost.utilisation)],
    ["$ / 1M output, at this load", usd(t.cost.usd_per_million_output_tokens, 2)],
  ];
  const box = document.getElementById("totals");
  box.replaceChildren(...cards.map(([k, v]) => {
    const c = el("div", { class: "card" });
    c.append(el("div", { class: "k" }, k), el("div", { class: "v", "data-total": k }, v));
    return c;
  }));
}

function table(id, head, rows) {
  const tbl = document.getElementById(id);
  tbl.replaceChildren();
  const tr = el("tr");
  for (const h of head) tr.append(el("th", {}, h));
  tbl.append(tr);
  for (const r of rows) {
    const row = el("tr");
    for (const cell of r) {
      const td = el("td");
      if (cell instanceof Node) td.append(cell); else td.textContent = cell;
      row.append(td);
    }
    tbl.append(row);
  }
}

function drawBackends(backends, compare) {
  const byName = Object.fromEntries(compare.backends.map((b) => [b.name, b]));
  table("backends", ["backend", "runtime", "in flight", "running", "waiting", "KV cache", "out tok/s", "$/h"],
    backends.map((b) => {
      const name = el("span");
      name.append(el("span", { class: "dot", style: "background:" + (b.healthy ? "var(--ok)" : "var(--bad)"),
                               title: b.healthy ? "healthy" : (b.last_error || "unhealthy") }),
                  document.createTextNode(b.name));
      const kv = el("span");
      const u = b.load.kv_usage;
      kv.append(document.createTextNode(pct(u)));
      const boxEl = el("span", { class: "barbox" });
      boxEl.append(el("span", { class: "bar", style: `width:${Math.round((u || 0) * 100)}%` }));
      kv.append(boxEl);
      const c = byName[b.name];
      return [name, b.runtime, String(b.in_flight), fmt(b.load.running, 0), fmt(b.load.waiting, 0), kv,
              fmt(c && c.output_tokens_per_s), b.usd_per_hour == null ? "–" : "$" + fmt(b.usd_per_hour, 2)];
    }));
}

function usd(v, digits) {
  return v == null ? "–" : "$" + fmt(v, digits);
}

// Cost columns lead with the cost at sustained throughput (what the runtime costs when it is used),
// then the utilisation, then the cost at the observed load, where idle hours are paid for.
function drawRuntimes(rows) {
  table("runtimes", ["runtime", "req/s", "out tok/s", "in tok/s", "TTFT p50/p95/p99 ms", "ITL p50/p95/p99 ms",
                     "errors", "cached", "SLA", "$/1M sustained", "utilisation", "$/1M at this load", "n"],
    rows.map((r) => [r.name, fmt(r.requests_per_s, 2), fmt(r.output_tokens_per_s), fmt(r.prompt_tokens_per_s),
      ["p50", "p95", "p99"].map((k) => fmt(ms(r.ttft_s[k]))).join(" / "),
      ["p50", "p95", "p99"].map((k) => fmt(ms(r.itl_s[k]))).join(" / "),
      pct(r.error_rate), pct(r.cached_token_share), pct(r.sla.attainment),
      usd(r.cost.usd_per_million_output_tokens_at_best, 2), pct(r.cost.utilisation),
      usd(r.cost.usd_per_million_output_tokens, 2), fmt(r.requests, 0)]));
}

// A wide server's data-parallel ranks, each a routing unit of its own (shown when a backend has them).
function drawRanks(rows) {
  document.getElementById("ranks-section").hidden = !rows.length;
  table("ranks", ["backend", "rank", "runtime", "req/s", "out tok/s", "TTFT p50/p99 ms", "cached", "errors", "n"],
    rows.map((r) => [r.backend, String(r.rank), r.runtime, fmt(r.requests_per_s, 2), fmt(r.output_tokens_per_s),
      ["p50", "p99"].map((k) => fmt(ms(r.ttft_s[k]))).join(" / "), pct(r.cached_token_share),
      pct(r.error_rate), fmt(r.requests, 0)]));
}

function drawAb(ab) {
  const box = document.getElementById("ab");
  if (!ab.length) {
    box.replaceChildren(el("div", { class: "empty" }, "No split routes configured (routes.*.split)."));
    return;
  }
  box.replaceChildren(...ab.map((a) => {
    const v = el("div", { class: "verdict" + (a.srm.flagged ? " srm" : ""), "data-route": a.route });
    v.append(el("div", { class: "route" }, a.route), el("div", { class: "text" }, a.verdict));
    const arms = a.arms.map((r) => `${r.arm}: weight ${r.weight}, n=${r.requests}, TTFT p50 ` +
      fmt(ms(r.ttft_p50_s.value)) + " ms").join(" · ");
    v.append(el("div", { class: "arms" }, arms + ` · SRM p=${a.srm.p_value.toPrecision(3)}`));
    return v;
  }));
}

async function getJson(url) {
  const r = await fetch(url, { cache: "no-store" });
  if (!r.ok) throw new Error(url + ": " + r.status);
  return r.json();
}

async function poll() {
  const windowS = document.getElementById("window").value;
  const scope = document.getElementById("scope").value;
  const status = document.getElementById("status");
  try {
    const [doc, be] = await Promise.all([
      getJson("/admin/compare?window=" + windowS + "&scope=" + scope), getJson("/admin/backends")]);
    drawTotals(doc);
    const hist = { ...doc.history, runtime: doc.history.runtimes, backend: doc.history.backends };
    drawCharts("runtime", hist);
    drawCharts("backend", hist);
    drawBackends(be.backends, doc);
    drawRuntimes(doc.runtimes);
    drawRanks(doc.ranks || []);
    drawAb(doc.ab);
    document.getElementById("assumptions").textContent = "Cost assumptions: " + doc.assumptions.join("; ") + ".";
    updates += 1;
    document.body.dataset.updates = String(updates);
    document.body.dataset.totalRequests = String(doc.total.requests);
    const where = doc.scope === "fleet" ? `fleet of ${(doc.replicas || []).length} replicas`
      : `${doc.workers || 1} worker${(doc.workers || 1) > 1 ? "s" : ""}`;
    document.body.dataset.scope = doc.scope || "replica";
    status.textContent = `live · ${where} · window ${windowS} s · update ${updates}`;
    status.className = "status ok";
  } catch (err) {
    status.textContent = "error: " + err.message;
    status.className = "status bad";
  }
  setTimeout(poll, POLL_MS);
}

// A new window or scope takes effect at the next poll (at most POLL_MS later). `?scope=fleet` in the
// page's address starts on the fleet view (a link or bookmark to it).
const wantedScope = new URLSearchParams(location.search).get("scope");
if (wantedScope === "fleet" || wantedScope === "replica") document.getElementById("scope").value = wantedScope;
poll();
