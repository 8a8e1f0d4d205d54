// tokenmill dashboard: polls dashboard/data (the same server) and draws it with plain DOM and
// SVG. No library, no request anywhere else. Text from the server (request ids, prompts) goes
// in through textContent only, never as HTML.
"use strict";

(() => {
  const POLL_MS = Number(new URLSearchParams(location.search).get("interval_ms")) || 1000;
  const KEY_STORE = "tokenmill-dashboard-key";
  const COLORS = ["#4e9cf5", "#f5a54e", "#5cc98a", "#e0607e", "#b18cf2", "#d6cd5a"];
  const $ = (id) => document.getElementById(id);
  let key = takeKey();
  let timer = null;

  // ----- the API key -------------------------------------------------------------------------

  function takeKey() {
    // #key=... never reaches a server: read it, keep it for this tab, drop it from the URL
    const match = location.hash.match(/(?:^#|&)key=([^&]*)/);
    if (match) {
      sessionStorage.setItem(KEY_STORE, decodeURIComponent(match[1]));
      history.replaceState(null, "", location.pathname + location.search);
    }
    return sessionStorage.getItem(KEY_STORE) || "";
  }

  function askForKey(refused) {
    $("main").hidden = true;
    $("auth").hidden = false;
    $("auth-error").textContent = refused ? "That key was refused." : "";
    setStatus("locked", "API key required");
  }

  $("auth-form").addEventListener("submit", (event) => {
    event.preventDefault();
    key = $("auth-key").value.trim();
    sessionStorage.setItem(KEY_STORE, key);
    $("auth").hidden = true;
    schedule(0);
  });

  // ----- polling -----------------------------------------------------------------------------

  function schedule(ms) {
    clearTimeout(timer);
    timer = setTimeout(poll, ms);
  }

  async function poll() {
    let next = POLL_MS;
    try {
      const headers = key ? { Authorization: "Bearer " + key } : {};
      const response = await fetch("dashboard/data", { headers, cache: "no-store" });
      if (response.status === 401) {
        askForKey(Boolean(key));
        return; // until a key is given
      }
      if (!response.ok) throw new Error("HTTP " + response.status);
      const data = await response.json();
      $("auth").hidden = true;
      $("main").hidden = false;
      (data.kind === "router" ? renderRouter : renderServer)(data);
      setStatus("live", "live · " + new Date(data.time * 1000).toLocaleTimeString());
    } catch (error) {
      setStatus("error", "no answer: " + error.message);
      next = POLL_MS * 3;
    }
    schedule(next);
  }

  function setStatus(state, text) {
    const el = $("status");
    el.dataset.state = state;
    el.textContent = text;
  }

  // ----- formatting --------------------------------------------------------------------------

  const missing = (x) => x === null || x === undefined;
  function num(x, digits = 1) {
    if (missing(x)) return "–";
    if (Math.abs(x) >= 1e6) return (x / 1e6).toFixed(2) + " M";
    if (Number.isInteger(x)) return x.toLocaleString("en-US");
    return x.toFixed(digits);
  }
  const pct = (x) => (missing(x) ? "–" : (100 * x).toFixed(1) + " %");
  function ms(seconds) {
    if (missing(seconds)) return "–";
    return seconds < 1 ? (seconds * 1000).toFixed(1) + " ms" : seconds.toFixed(2) + " s";
  }
  function duration(seconds) {
    const two = (big, bigUnit, small, smallUnit) =>
      big + " " + bigUnit + (small ? " " + small + " " + smallUnit : "");
    if (seconds < 60) return seconds.toFixed(1) + " s";
    if (seconds < 3600) return two(Math.floor(seconds / 60), "min", Math.floor(seconds % 60), "s");
    return two(Math.floor(seconds / 3600), "h", Math.floor((seconds % 3600) / 60), "min");
  }

  // ----- DOM helpers -------------------------------------------------------------------------

  function el(tag, attrs = {}, ...children) {
    const node = document.createElement(tag);
    for (const [name, value] of Object.entries(attrs)) {
      if (!missing(value)) node.setAttribute(name, value);
    }
    for (const child of children) {
      node.append(child instanceof Node ? child : String(child));
    }
    return node;
  }

  // A figure: its text for people, its raw number in data-value for scripts (and the tests).
  function tile(name, label, text, value, sub = "") {
    return el("div", { class: "tile", "data-figure": name },
      el("div", { class: "label" }, label),
      el("div", { class: "value", "data-value": missing(value) ? "" : value }, text),
      el("div", { class: "sub" }, sub));
  }

  function table(id, head, rows) {
    const t = $(id);
    t.replaceChildren(el("thead", {}, el("tr", {}, ...head.map((h) => el("th", {}, h)))),
      el("tbody", {}, ...rows));
  }

  const cell = (text, value, name) => el("td", { "data-value": value, "data-figure": name }, text);

  function rowsOf(items) { // [{label, value, why}] -> label / value / why rows
    return items.map((r) => el("tr", {}, el("th", {}, r.label), el("td", {}, r.value),
      el("td", { class: "why" }, r.why || "")));
  }

  // ----- charts (SVG) ------------------------------------------------------------------------

  const SVG = "http://www.w3.org/2000/svg";
  function svg(tag, attrs, text) {
    const node = document.createElementNS(SVG, tag);
    for (const [name, value] of Object.entries(attrs)) node.setAttribute(name, value);
    if (text !== undefined) node.textContent = text;
    return node;
  }

  function niceMax(x) {
    if (!(x > 0)) return 1;
    const step = Math.pow(10, Math.floor(Math.log10(x)));
    for (const m of [1, 2, 2.5, 5, 10]) if (x <= m * step) return m * step;
    return 10 * step;
  }

  // series: [{name, values, color}] over times t (Unix s); opts.max fixes the y range
  function chart(id, t, series, opts = {}) {
    const node = $(id);
    const W = Math.max(node.clientWidth || 480, 240), H = 170;
    const pad = { l: 50, r: 10, t: 10, b: 34 };
    node.setAttribute("viewBox", `0 0 ${W} ${H}`);
    const all = series.flatMap((s) => s.values).filter((v) => !missing(v));
    const top = opts.max || niceMax(Math.max(0, ...all));
    const end = t.length ? t[t.length - 1] : 0, span = Math.max(60, end - (t[0] ?? end));
    const x = (ti) => pad.l + (W - pad.l - pad.r) * (1 - (end - ti) / span);
    const y = (v) => pad.t + (H - pad.t - pad.b) * (1 - v / top);
    const parts = [svg("rect", { class: "plot", x: pad.l, y: pad.t, width: W - pad.l - pad.r,
      height: H - pad.t - pad.b })];
    for (const frac of [0, 0.5, 1]) {
      parts.push(svg("line", { class: "gridline", x1: pad.l, x2: W - pad.r, y1: y(top * frac),
        y2: y(top * frac) }));
      const label = opts.percent ? Math.round(100 * top * frac) + " %" : num(top * frac);
      parts.push(svg("text", { class: "axis", x: pad.l - 4, y: y(top * frac) + 4,
        "text-anchor": "end" }, label));
    }
    parts.push(svg("text", { class: "axis", x: pad.l, y: H - pad.b + 14 },
      "−" + duration(span)));
    parts.push(svg("text", { class: "axis", x: W - pad.r, y: H - pad.b + 14,
      "text-anchor": "end" }, "now"));
    let at = pad.l + 8; // legends side by side, each as wide as its text
    for (const s of series) {
      const label = legend(s, at, H, opts);
      parts.push(...line(s, t, x, y), label);
      at += label.textContent.length * 7 + 16;
    }
    node.replaceChildren(...parts);
  }

  // A gap in the polls (nobody watched) breaks the line rather than drawing across it.
  const GAP_S = Math.max(5, (3 * POLL_MS) / 1000);
  function line(s, t, x, y) {
    const runs = [];
    let points = [];
    s.values.forEach((v, i) => {
      if (points.length && (missing(v) || t[i] - t[i - 1] > GAP_S)) {
        runs.push(points);
        points = [];
      }
      if (!missing(v)) points.push(`${x(t[i]).toFixed(1)},${y(v).toFixed(1)}`);
    });
    if (points.length) runs.push(points);
    return runs.map((p) => svg("polyline", { class: "series", stroke: s.color,
      points: (p.length === 1 ? [p[0], p[0]] : p).join(" ") }));
  }

  function legend(s, at, H, opts) {
    const last = [...s.values].reverse().find((v) => !missing(v));
    const text = `${s.name} ${opts.percent ? pct(last) : num(last)}`;
    return svg("text", { class: "legend", x: at, y: H - 4, fill: s.color }, "● " + text);
  }

  // ----- one server --------------------------------------------------------------------------

  function renderServer(d) {
    $("title").textContent = "tokenmill";
    $("model").textContent = d.model;
    const prefix = d.prefix !== "tokenmill" ? ` · metrics ${d.prefix}:` : "";
    $("version").textContent = "v" + d.version + prefix;
    $("uptime").textContent = "up " + duration(d.uptime_s);
    $("workers-panel").hidden = true;
    $("tiles").replaceChildren(...serverTiles(d));
    const h = d.history;
    chart("chart-requests", h.t, [
      { name: "running", values: h.num_requests_running, color: COLORS[0] },
      { name: "waiting", values: h.num_requests_waiting, color: COLORS[1] }]);
    chart("chart-tokens", h.t, [
      { name: "prompt", values: h.prompt_tokens_computed_total, color: COLORS[2] },
      { name: "generation", values: h.generation_tokens_total, color: COLORS[0] }]);
    chart("chart-kv", h.t, [{ name: "used", values: h.kv_cache_usage_perc, color: COLORS[3] }],
      { max: 1, percent: true });
    latencyTable(d);
    requestsTable(d.requests, d.show_prompts, null);
    table("totals", ["counter", "value"], Object.entries(d.totals).map(([name, v]) =>
      el("tr", {}, el("th", {}, name), cell(num(v, 3), v, "total-" + name))));
    table("plan", [], rowsOf(d.plan));
    table("machine", [], rowsOf(d.machine));
    $("totals-panel").hidden = $("plan-panel").hidden = false;
  }

  function ratio(r) {
    if (!r) return ["off", null, "not running"];
    return [pct(r.value), r.value, r.over === "window" ? "last minutes" : "since start"];
  }

  function serverTiles(d) {
    const n = d.now, r = d.rates, t = d.totals;
    const [hit, hitV, hitSub] = ratio(d.ratios.prefix_hit_rate);
    const [acc, accV, accSub] = ratio(d.ratios.spec_acceptance);
    const [st, stV, stSub] = ratio(d.ratios.structured_share);
    const used = n.kv_blocks - n.kv_free_blocks;
    return [
      tile("running", "Running", num(n.running), n.running),
      tile("waiting", "Waiting", num(n.waiting), n.waiting),
      tile("swapped", "Swapped / loading KV", num(n.loading_kv), n.loading_kv,
        "preemption recomputes; KV from a tier"),
      tile("kv_usage", "KV cache", pct(n.kv_usage), n.kv_usage,
        `${num(used)} of ${num(n.kv_blocks)} blocks`),
      tile("prefix_hit_rate", "Prefix-cache hits", hit, hitV, hitSub),
      tile("prompt_tps", "Prompt tok/s", num(r.prompt_tps), r.prompt_tps, "computed (prefill)"),
      tile("generation_tps", "Generation tok/s", num(r.generation_tps), r.generation_tps,
        `${num(t.generation_tokens_total)} in all`),
      tile("preemptions", "Preemptions", num(t.num_preemptions_total),
        t.num_preemptions_total, `${num(r.preemptions_per_s, 2)} /s`),
      tile("spec_acceptance", "Spec-decode acceptance", acc, accV, accSub),
      tile("structured_share", "Structured output", st, stV, stSub),
    ];
  }

  function latencyTable(d) {
    $("latency-window").textContent = `(finished requests, last ${duration(d.window_s)})`;
    const names = { ttft: "TTFT", itl: "ITL", e2e: "E2E", queue: "queue" };
    table("latency", ["", "p50", "p99", "max", "n"], Object.entries(names).map(([k, label]) => {
      const s = d.latency[k];
      return el("tr", { "data-figure": k }, el("th", {}, label),
        cell(ms(s.p50), s.p50, k + "-p50"), cell(ms(s.p99), s.p99, k + "-p99"),
        cell(ms(s.max), s.max, k + "-max"), cell(num(s.n), s.n, k + "-n"));
    }));
  }

  // requests: {count, rows}; worker: the column's value in router mode (null: no column)
  function requestsTable(requests, showPrompts, workerOf) {
    $("requests-count").textContent = `(${requests.count})`;
    const head = ["id", "state", "prompt", "cached", "generated", "age"];
    if (workerOf) head.unshift("worker");
    if (showPrompts) head.push("prompt text");
    table("requests", head, requests.rows.map((r) => {
      const cells = [el("td", { class: "id" }, r.id),
        el("td", { class: "state-" + r.state }, r.state),
        cell(num(r.prompt_tokens), r.prompt_tokens), cell(num(r.cached_tokens), r.cached_tokens),
        cell(num(r.output_tokens), r.output_tokens), cell(duration(r.age_s), r.age_s)];
      if (workerOf) cells.unshift(el("td", {}, workerOf(r)));
      if (showPrompts) cells.push(el("td", { class: "prompt" }, r.prompt ?? ""));
      return el("tr", {}, ...cells);
    }));
  }

  // ----- the router: one row per worker ------------------------------------------------------

  function renderRouter(d) {
    $("title").textContent = "tokenmill router";
    $("model").textContent = `${d.workers.length} workers`;
    $("version").textContent = "";
    $("uptime").textContent = "";
    $("policy").textContent = `(policy ${d.policy})`;
    $("workers-panel").hidden = false;
    const live = d.workers.filter((w) => w.data);
    const sum = (f) => live.reduce((a, w) => a + (f(w.data) || 0), 0);
    const healthy = d.workers.filter((w) => w.healthy).length;
    const inFlight = d.workers.reduce((a, w) => a + w.in_flight, 0);
    const summed = (name, label, f) => tile(name, label, num(sum(f)), sum(f));
    $("tiles").replaceChildren(
      tile("healthy_workers", "Healthy workers", `${healthy} / ${d.workers.length}`, healthy),
      tile("router_in_flight", "Router in flight", num(inFlight), inFlight),
      summed("running", "Running", (x) => x.now.running),
      summed("waiting", "Waiting", (x) => x.now.waiting),
      summed("prompt_tps", "Prompt tok/s", (x) => x.rates.prompt_tps),
      summed("generation_tps", "Generation tok/s", (x) => x.rates.generation_tps));
    workersTable(d.workers);
    routerCharts(live);
    $("latency-panel").hidden = true; // per worker, in the table above
    const rows = live.flatMap((w) => w.data.requests.rows.map((r) => ({ ...r, worker: w.url })));
    requestsTable({ count: sum((x) => x.requests.count), rows },
      live.some((w) => w.data.show_prompts), (r) => r.worker);
    $("totals-panel").hidden = $("plan-panel").hidden = true;
  }

  function workersTable(workers) {
    const head = ["worker", "healthy", "in flight", "routed", "running", "waiting", "KV",
      "prefix hits", "prompt tok/s", "gen tok/s", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99",
      "note"];
    table("workers", head, workers.map((w) => {
      const x = w.data;
      const f = (get, fmt = num) => (x ? cell(fmt(get(x)), get(x)) : el("td", {}, "–"));
      return el("tr", { "data-worker": w.url },
        el("td", { class: "id" }, w.url), el("td", {}, w.healthy ? "yes" : "no"),
        cell(num(w.in_flight), w.in_flight), cell(num(w.routed), w.routed),
        f((v) => v.now.running), f((v) => v.now.waiting), f((v) => v.now.kv_usage, pct),
        f((v) => v.ratios.prefix_hit_rate && v.ratios.prefix_hit_rate.value, pct),
        f((v) => v.rates.prompt_tps), f((v) => v.rates.generation_tps),
        f((v) => v.latency.ttft.p50, ms), f((v) => v.latency.ttft.p99, ms),
        f((v) => v.latency.itl.p50, ms), f((v) => v.latency.itl.p99, ms),
        el("td", { class: "error" }, w.error || ""));
    }));
  }

  function routerCharts(live) {
    // each worker's own times; the newest worker's axis (they are polled together)
    const t = live.length ? live[0].data.history.t : [];
    const per = (key) => live.map((w, i) => ({
      name: w.url.replace(/^https?:\/\//, ""),
      values: alignTo(t, w.data.history.t, w.data.history[key]),
      color: COLORS[i % COLORS.length] }));
    $("chart-requests-title").textContent = "Running requests per worker";
    $("chart-tokens-title").textContent = "Generation tok/s per worker";
    $("chart-kv-title").textContent = "KV cache usage per worker";
    chart("chart-requests", t, per("num_requests_running"));
    chart("chart-tokens", t, per("generation_tokens_total"));
    chart("chart-kv", t, per("kv_cache_usage_perc"), { max: 1, percent: true });
  }

  // a worker's values at the times of another's samples (the nearest not later)
  function alignTo(t, own, values) {
    let j = 0;
    return t.map((ti) => {
      while (j + 1 < own.length && own[j + 1] <= ti) j += 1;
      return own.length && own[j] <= ti ? values[j] : null;
    });
  }

  schedule(0);
})();
