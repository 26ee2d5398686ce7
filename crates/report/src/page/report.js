"use strict";
// Draws the report from the JSON in #data. Nothing is fetched: every chart is SVG built here.
// When done, <body> carries data-charts-expected, data-charts-drawn, data-errors and
// data-ready, which the browser test reads.
(function () {
  const body = document.body;
  let errors = 0;
  window.addEventListener("error", function () {
    errors += 1;
    body.dataset.errors = String(errors);
  });
  const data = JSON.parse(document.getElementById("data").textContent);
  const main = document.getElementById("main");
  const NS = "http://www.w3.org/2000/svg";
  const PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b",
    "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"];
  const color = (i) => PALETTE[i % PALETTE.length];
  let drawn = 0;
  let expected = 0;

  function svgEl(tag, attrs, parent) {
    const e = document.createElementNS(NS, tag);
    for (const k in attrs) e.setAttribute(k, attrs[k]);
    if (parent) parent.appendChild(e);
    return e;
  }
  function node(tag, attrs, parent, text) {
    const e = document.createElement(tag);
    for (const k in attrs || {}) e.setAttribute(k, attrs[k]);
    if (text !== undefined) e.textContent = text;
    if (parent) parent.appendChild(e);
    return e;
  }
  function fmt(v) {
    if (v === null || v === undefined || !isFinite(v)) return "";
    const a = Math.abs(v);
    if (a !== 0 && (a >= 1e6 || a < 1e-3)) return v.toExponential(2);
    if (a >= 100) return v.toFixed(0);
    return String(Number(v.toPrecision(4)));
  }
  function ticks(lo, hi, n) {
    if (!(hi > lo)) { hi = lo + 1; }
    const raw = (hi - lo) / n;
    const mag = Math.pow(10, Math.floor(Math.log10(raw)));
    const step = [1, 2, 5, 10].map((m) => m * mag).find((s) => s >= raw);
    const out = [];
    for (let t = Math.ceil(lo / step) * step; t <= hi + step * 1e-9; t += step) out.push(t);
    return out;
  }
  function section(title, wide) {
    const s = node("section", wide ? { class: "wide" } : {}, main);
    node("h2", {}, s, title);
    return s;
  }
  function legend(host, names) {
    const l = node("div", { class: "legend" }, host);
    names.forEach((n, i) => node("span", { style: "--c:" + color(i) }, l, n));
  }

  // A line chart of `series` ([{points: [[x, y]], raw?: [[x, y]]}]) into `host`, replacing
  // the chart it drew before.
  function lineChart(host, series, ylabel) {
    const old = host.querySelector("svg.chart");
    if (old) old.remove(); else drawn += 1;
    const W = 640, H = 300, m = { l: 64, r: 16, t: 12, b: 40 };
    const svg = svgEl("svg", { viewBox: "0 0 " + W + " " + H, class: "chart", role: "img" });
    host.insertBefore(svg, host.querySelector(".legend"));
    const pts = [];
    series.forEach((s) => (s.raw || s.points).concat(s.points).forEach((p) => {
      if (isFinite(p[0]) && isFinite(p[1])) pts.push(p);
    }));
    if (pts.length === 0) {
      svgEl("text", { x: W / 2, y: H / 2, "text-anchor": "middle" }, svg).textContent =
        "no " + ylabel + " recorded";
      return;
    }
    const xs = pts.map((p) => p[0]), ys = pts.map((p) => p[1]);
    let [x0, x1, y0, y1] = [Math.min(...xs), Math.max(...xs), Math.min(...ys), Math.max(...ys)];
    if (x1 === x0) x1 = x0 + 1;
    if (y1 === y0) { y0 -= Math.abs(y0) * 0.1 + 1e-12; y1 += Math.abs(y1) * 0.1 + 1e-12; }
    const X = (x) => m.l + (x - x0) / (x1 - x0) * (W - m.l - m.r);
    const Y = (y) => H - m.b - (y - y0) / (y1 - y0) * (H - m.t - m.b);
    ticks(y0, y1, 5).forEach((t) => {
      svgEl("line", { x1: m.l, x2: W - m.r, y1: Y(t), y2: Y(t), class: "grid" }, svg);
      svgEl("text", { x: m.l - 6, y: Y(t) + 4, "text-anchor": "end" }, svg).textContent = fmt(t);
    });
    ticks(x0, x1, 6).forEach((t) => {
      svgEl("text", { x: X(t), y: H - m.b + 16, "text-anchor": "middle" }, svg).textContent = fmt(t);
    });
    svgEl("line", { x1: m.l, x2: m.l, y1: m.t, y2: H - m.b, class: "axis" }, svg);
    svgEl("line", { x1: m.l, x2: W - m.r, y1: H - m.b, y2: H - m.b, class: "axis" }, svg);
    svgEl("text", { x: (W + m.l) / 2, y: H - 6, "text-anchor": "middle" }, svg).textContent = "step";
    svgEl("text", { x: 14, y: (H - m.b) / 2, transform: "rotate(-90 14 " + (H - m.b) / 2 + ")",
      "text-anchor": "middle" }, svg).textContent = ylabel;
    const line = (p) => p.filter((q) => isFinite(q[1])).map((q) => X(q[0]).toFixed(1) + "," + Y(q[1]).toFixed(1)).join(" ");
    series.forEach((s, i) => {
      if (s.raw) svgEl("polyline", { points: line(s.raw), class: "raw", stroke: color(i) }, svg);
      svgEl("polyline", { points: line(s.points), class: "series", stroke: color(i) }, svg);
    });
  }

  // TensorBoard's smoothing: an exponential moving average, debiased at the start.
  function smooth(points, w) {
    let last = 0, n = 0;
    return points.map((p) => {
      if (!isFinite(p[1])) return p;
      n += 1;
      last = last * w + (1 - w) * p[1];
      return [p[0], last / (1 - Math.pow(w, n))];
    });
  }
  const runs = data.runs;
  const names = runs.map((r) => r.name);
  const metric = (key, scale) => runs.map((r) => ({
    points: r.steps.map((s) => [s.step, s[key] === null || s[key] === undefined ? NaN : s[key] * (scale || 1)]),
  }));

  function lossSection() {
    const s = section("Loss");
    const c = node("div", { class: "controls" }, s);
    node("label", { for: "smoothing" }, c, "smoothing ");
    const input = node("input", { id: "smoothing", type: "range", min: "0", max: "0.99", step: "0.01", value: "0.6" }, c);
    const shown = node("span", {}, c, " 0.6");
    legend(s, names);
    const draw = () => {
      const w = Number(input.value);
      shown.textContent = " " + w.toFixed(2);
      lineChart(s, metric("loss").map((m) => ({ raw: m.points, points: smooth(m.points, w) })), "loss (nats)");
    };
    input.addEventListener("input", draw);
    draw();
  }
  function metricSection(title, key, label, scale) {
    const s = section(title);
    legend(s, names);
    lineChart(s, metric(key, scale), label);
  }

  function memorySection() {
    const s = section("Memory by category (peak, rank 0)");
    drawn += 1;
    const cats = data.categories;
    const rows = runs.filter((r) => r.summary && r.summary.memory_peak_bytes);
    const W = 640, bar = 22, m = { l: 150, r: 70, t: 8 };
    const H = m.t + Math.max(rows.length, 1) * (bar + 10) + 24;
    const svg = svgEl("svg", { viewBox: "0 0 " + W + " " + H, class: "chart", role: "img" }, s);
    if (rows.length === 0) {
      svgEl("text", { x: W / 2, y: H / 2, "text-anchor": "middle" }, svg).textContent = "no finished run";
      return;
    }
    const total = (r) => cats.reduce((a, c) => a + (r.summary.memory_peak_bytes[c] || 0), 0);
    const max = Math.max(...rows.map(total), 1);
    rows.forEach((r, i) => {
      const y = m.t + i * (bar + 10);
      svgEl("text", { x: m.l - 6, y: y + bar / 2 + 4, "text-anchor": "end" }, svg).textContent = r.name;
      let x = m.l;
      cats.forEach((c, j) => {
        const b = r.summary.memory_peak_bytes[c] || 0;
        const w = b / max * (W - m.l - m.r);
        const rect = svgEl("rect", { x: x, y: y, width: Math.max(w, 0), height: bar, fill: color(j) }, svg);
        svgEl("title", {}, rect).textContent = c + ": " + fmt(b / 1048576) + " MiB";
        x += w;
      });
      svgEl("text", { x: x + 4, y: y + bar / 2 + 4 }, svg).textContent = fmt(total(r) / 1048576) + " MiB";
    });
    legend(s, cats);
    node("p", { class: "note" }, s, "Each category at its own peak (the peaks need not coincide: " +
      "their sum can exceed the peak of the total, which the runs table shows).");
  }

  function table(host, header, rows, classOf) {
    const t = node("table", {}, host);
    const h = node("tr", {}, node("thead", {}, t));
    header.forEach((c) => node("th", {}, h, c));
    const tb = node("tbody", {}, t);
    rows.forEach((r, i) => {
      const tr = node("tr", classOf ? { class: classOf(i) } : {}, tb);
      r.forEach((v) => node("td", typeof v === "number" ? { class: "num" } : {}, tr,
        typeof v === "number" ? fmt(v) : (v === null || v === undefined ? "" : String(v))));
    });
    return t;
  }

  function summarySection() {
    const s = section("Runs", true);
    const keys = ["status", "steps", "final_loss", "tail_loss", "eval_loss", "tokens_per_s", "mfu", "params"];
    table(s, ["run"].concat(keys, ["peak memory (MiB)"]), runs.map((r) => {
      const m = r.summary || {};
      return [r.name].concat(keys.map((k) => (k in m ? m[k] : (k === "steps" ? r.steps.length : ""))),
        [m.memory_total_peak_bytes ? m.memory_total_peak_bytes / 1048576 : ""]);
    }), (i) => (runs[i].summary ? "" : "failed"));
    if (runs.some((r) => !r.summary)) node("p", { class: "note" }, s, "Runs without summary.json stopped before writing one.");
  }

  function flatten(v, prefix, out) {
    if (v !== null && typeof v === "object" && !Array.isArray(v)) {
      Object.keys(v).forEach((k) => flatten(v[k], prefix ? prefix + "." + k : k, out));
    } else {
      out[prefix] = JSON.stringify(v);
    }
    return out;
  }
  function configSection() {
    const s = section("Configuration", true);
    const withConfig = runs.filter((r) => r.summary && r.summary.config);
    if (withConfig.length === 0) {
      node("p", { class: "note" }, s, "No run recorded its configuration (summary.json of an older version).");
      return;
    }
    const flat = withConfig.map((r) => flatten(r.summary.config, "", {}));
    const keys = Array.from(new Set(flat.flatMap((f) => Object.keys(f)))).sort();
    const differs = keys.filter((k) => new Set(flat.map((f) => f[k])).size > 1);
    const c = node("div", { class: "controls" }, s);
    const all = node("input", { id: "all-keys", type: "checkbox" }, c);
    node("label", { for: "all-keys" }, c, " show all " + keys.length + " keys (" + differs.length + " differ)");
    let t = null;
    const draw = () => {
      if (t) t.remove();
      const shown = all.checked ? keys : differs;
      t = table(s, ["key"].concat(withConfig.map((r) => r.name)),
        shown.map((k) => [k].concat(flat.map((f) => (k in f ? f[k] : "—")))),
        (i) => (differs.includes(shown[i]) ? "differs" : ""));
    };
    all.addEventListener("change", draw);
    draw();
  }

  function sweepSection(sw) {
    const s = section("Sweep " + sw.name, true);
    const col = (n) => sw.header.indexOf(n);
    const num = (v) => (v === "" ? NaN : Number(v));
    const status = col("status");
    const W = 640, H = 260, m = { l: 64, r: 16, t: 12, b: 60 };
    drawn += 1;
    const svg = svgEl("svg", { viewBox: "0 0 " + W + " " + H, class: "chart", role: "img" }, s);
    const tps = sw.rows.map((r) => num(r[col("tokens_per_s_per_rank")]));
    const max = Math.max(...tps.filter(isFinite), 1);
    const bw = (W - m.l - m.r) / Math.max(sw.rows.length, 1);
    ticks(0, max, 4).forEach((t) => {
      const y = H - m.b - t / max * (H - m.t - m.b);
      svgEl("line", { x1: m.l, x2: W - m.r, y1: y, y2: y, class: "grid" }, svg);
      svgEl("text", { x: m.l - 6, y: y + 4, "text-anchor": "end" }, svg).textContent = fmt(t);
    });
    sw.rows.forEach((r, i) => {
      const x = m.l + i * bw;
      const ok = isFinite(tps[i]);
      const h = ok ? tps[i] / max * (H - m.t - m.b) : 0;
      const rect = svgEl("rect", { x: x + bw * 0.15, y: H - m.b - h, width: bw * 0.7, height: h, fill: ok ? color(0) : "#ccc" }, svg);
      svgEl("title", {}, rect).textContent = r[0] + ": " + (ok ? fmt(tps[i]) + " tokens/s per rank" : r[status]);
      svgEl("text", { x: x + bw / 2, y: H - m.b + 14, "text-anchor": "middle" }, svg).textContent = r[0];
      if (!ok) svgEl("text", { x: x + bw / 2, y: H - m.b - 6, "text-anchor": "middle" }, svg).textContent = r[status];
    });
    svgEl("line", { x1: m.l, x2: W - m.r, y1: H - m.b, y2: H - m.b, class: "axis" }, svg);
    svgEl("text", { x: 14, y: (H - m.b) / 2, transform: "rotate(-90 14 " + (H - m.b) / 2 + ")",
      "text-anchor": "middle" }, svg).textContent = "tokens/s per rank";
    const shown = sw.header.filter((h) => !/^peak_.*_bytes$/.test(h) || h === "peak_memory_bytes_per_rank");
    table(s, shown, sw.rows.map((r) => shown.map((h) => {
      const v = r[col(h)];
      return v !== "" && isFinite(Number(v)) && h !== "layout" ? Number(v) : v;
    })), (i) => (sw.rows[i][status] === "ok" ? "" : "failed"));
  }

  document.getElementById("subtitle").textContent = runs.length + " run(s), " + data.sweeps.length +
    " sweep(s) — written by ferrotron report";
  if (runs.length > 0) {
    expected += 5;
    lossSection();
    metricSection("Learning rate", "lr", "lr");
    metricSection("Throughput", "tokens_per_s", "tokens/s");
    metricSection("MFU", "mfu", "MFU (%)", 100);
    memorySection();
    summarySection();
    configSection();
  }
  data.sweeps.forEach((sw) => { expected += 1; sweepSection(sw); });
  body.dataset.chartsExpected = String(expected);
  body.dataset.chartsDrawn = String(drawn);
  body.dataset.errors = String(errors);
  body.dataset.ready = "1";
})();
