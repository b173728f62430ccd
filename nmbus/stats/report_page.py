"""The report page's HTML and its chart script, filled in by :mod:`report_html`.

``%NAME%`` marks a place :func:`report_html.render` fills; the script draws the
charts as inline SVG from the embedded JSON. Standard library only (nothing at all).
"""

TEMPLATE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>%TITLE%</title>
<script>
window.onerror = function (msg, src, line) {
  var el = document.documentElement;
  el.setAttribute("data-script-errors",
    (el.getAttribute("data-script-errors") || "") + msg + " @" + line + "; ");
};
</script>
<style>
:root { --ok:#1a9e5a; --degraded:#e0a100; --failing:#d64541; --idle:#9aa3ad;
  --ink:#1d2733; --mute:#68737f; --line:#e3e7ec; --bg:#f5f7fa; --p50:#4c8bf5;
  --p95:#f29d38; --p99:#d64541; --proc:#4c8bf5; --fail:#d64541; }
* { box-sizing: border-box; }
body { margin:0; font:14px/1.4 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;
  color:var(--ink); background:var(--bg); }
header { padding:14px 24px; background:#fff; border-bottom:1px solid var(--line);
  display:flex; align-items:center; gap:18px; flex-wrap:wrap; }
header h1 { margin:0; font-size:20px; }
header .meta { color:var(--mute); font-size:12px; }
.verdict { padding:5px 12px; border-radius:14px; font-weight:600; color:#fff; }
.verdict.ok { background:var(--ok); } .verdict.degraded { background:var(--degraded); }
.verdict.failing { background:var(--failing); } .verdict.idle { background:var(--idle); }
main { padding:16px 24px 40px; }
.cards { display:grid; grid-template-columns:repeat(6,minmax(140px,1fr)); gap:12px; }
.card { background:#fff; border:1px solid var(--line); border-radius:8px; padding:10px 14px;
  border-top:4px solid var(--p50); }
.card.failing { border-top-color:var(--failing); }
.card.degraded { border-top-color:var(--degraded); }
.card.ok { border-top-color:var(--ok); }
.card .k { color:var(--mute); font-size:12px; text-transform:uppercase; letter-spacing:.04em; }
.card .v { font-size:24px; font-weight:700; margin:2px 0; }
.card .s { color:var(--mute); font-size:12px; line-height:1.35; overflow-wrap:anywhere; }
section { margin-top:18px; }
h2 { font-size:15px; margin:0 0 8px; }
table { width:100%; border-collapse:collapse; background:#fff; border:1px solid var(--line);
  border-radius:8px; overflow:hidden; }
th, td { padding:6px 10px; border-bottom:1px solid var(--line); text-align:left; }
th { font-size:12px; color:var(--mute); font-weight:600; background:#fafbfc; }
td.num, th.num { text-align:right; font-variant-numeric:tabular-nums; white-space:nowrap; }
td.err { font-family:ui-monospace,Menlo,Consolas,monospace; font-size:12px; }
td.empty { color:var(--mute); text-align:center; }
td.spark { width:130px; padding:2px 8px; }
.dot { display:inline-block; width:10px; height:10px; border-radius:50%; margin-right:7px;
  background:var(--idle); }
.dot.ok { background:var(--ok); } .dot.degraded { background:var(--degraded); }
.dot.failing { background:var(--failing); }
.bar { display:inline-block; width:50px; height:6px; background:var(--line); border-radius:3px;
  margin-right:6px; vertical-align:middle; overflow:hidden; }
.bar i { display:block; height:100%; background:var(--ok); }
.bar i.degraded { background:var(--degraded); } .bar i.failing { background:var(--failing); }
.grid { display:grid; grid-template-columns:repeat(auto-fill,minmax(520px,1fr)); gap:12px; }
.panel { background:#fff; border:1px solid var(--line); border-radius:8px; padding:10px 12px; }
.panel h3 { margin:0 0 4px; font-size:14px; }
.chart svg { width:100%; height:auto; display:block; }
.chart .t { font-size:11px; fill:var(--mute); }
.chart .title { font-size:12px; fill:var(--ink); font-weight:600; }
.chart .nodata { font-size:12px; fill:var(--mute); }
.two { display:grid; grid-template-columns:1fr 1fr; gap:12px; }
.note { color:var(--mute); font-size:12px; margin-top:14px; }
.hint { color:var(--mute); font-size:12px; margin:0 0 6px; }
table.inner { border:0; border-radius:0; margin-top:8px; }
#top-errors .chart svg { max-width:1100px; }
@media (max-width: 1100px) { .cards { grid-template-columns:repeat(3,1fr); }
  .two { grid-template-columns:1fr; } }
</style></head>
<body>
<header>
  <h1>%TITLE%</h1>
  <span class="verdict %STATUS%">%VERDICT%</span>
  <span class="meta">%RANGE% · %WINDOW% · %SOURCE% · generated %GENERATED%</span>
  <span class="meta" id="thresholds">Thresholds: %THRESHOLDS%.</span>
</header>
<main>
<div class="cards">%CARDS%</div>
<section><h2>Queues</h2>
<p class="hint" id="bar-scale">The failure-rate bar is on a log scale: a quarter of it
for each tenfold, from 0.01 % (a sliver) to 100 % (full).</p>
<table><thead><tr><th>queue</th><th class="num">processed</th><th class="num">failed</th>
<th class="num">failure rate</th><th class="num">throughput</th><th class="num">queue p50</th>
<th class="num">p95</th><th class="num">p99</th><th class="num">max</th>
<th class="num">end-to-end p95</th><th>throughput over time</th></tr></thead>
<tbody>%QUEUE_ROWS%</tbody></table></section>
<section><h2>Latency percentiles and throughput over time</h2>
<div class="grid">%PANELS%</div></section>
<section class="two">
  <div class="panel"><h3>Failures by message type</h3>
    <div class="chart" data-kind="failures"></div></div>
  <div class="panel"><h3>Attempts per message</h3>
    <div class="chart" data-kind="retries"></div>
    <p class="hint">Attempts are handler runs the bus counted. A RetryLater is not an
    attempt: messages whose last deferral came before they finished are drawn apart.</p>
  </div>
</section>
<section class="panel" id="top-errors"><h3>Top errors</h3>
  <p class="hint">Grouped by first line, with numbers, UUIDs and hex masked.</p>
  <div class="chart" data-kind="errors"></div>
  <table class="inner"><thead><tr><th>error (first line, masked)</th><th>queue</th>
  <th>type</th><th class="num">failed</th><th class="num">recovered</th>
  <th class="num">example id</th></tr></thead><tbody>%ERROR_ROWS%</tbody></table>
</section>
<section class="panel" id="versions"><h3>Messages by type and version</h3>
  <p class="hint">A message's version is its nmbus-version header, 1 when it has none.</p>
  <table class="inner"><thead><tr><th>queue</th><th>type</th><th class="num">version</th>
  <th class="num">processed</th><th class="num">failed</th></tr></thead>
  <tbody>%VERSION_ROWS%</tbody></table>
</section>
<p class="note">%PCT_NOTE%</p>
</main>
<script type="application/json" id="nmbus-data">%DATA%</script>
<script>%SCRIPT%</script>
</body></html>
"""

SCRIPT = r"""
(function () {
  "use strict";
  var D = JSON.parse(document.getElementById("nmbus-data").textContent);
  var NS = "http://www.w3.org/2000/svg";
  var css = getComputedStyle(document.documentElement);
  function color(name) { return css.getPropertyValue("--" + name).trim() || "#888"; }
  function el(tag, attrs, parent, text) {
    var e = document.createElementNS(NS, tag);
    for (var k in attrs) { e.setAttribute(k, attrs[k]); }
    if (text !== undefined) { e.textContent = text; }
    if (parent) { parent.appendChild(e); }
    return e;
  }
  function svg(host, w, h) {
    var s = el("svg", {viewBox: "0 0 " + w + " " + h, role: "img"});
    host.appendChild(s);
    return s;
  }
  function fmtMs(v) {
    if (v === null || v === undefined) { return "–"; }
    if (v >= 1000) { return (v / 1000).toFixed(v >= 10000 ? 0 : 1) + " s"; }
    if (v >= 1) { return v.toFixed(v >= 10 ? 0 : 1) + " ms"; }
    return v.toFixed(2) + " ms";
  }
  function fmtN(v) { return v === null || v === undefined ? "–" : v.toLocaleString("en"); }
  function fmtTime(iso, withDay) {
    var d = new Date(iso), p = function (x) { return String(x).padStart(2, "0"); };
    var day = p(d.getUTCMonth() + 1) + "-" + p(d.getUTCDate());
    var hm = p(d.getUTCHours()) + ":" + p(d.getUTCMinutes());
    if (D.window === "day") { return day; }
    if (D.window === "second") { hm += ":" + p(d.getUTCSeconds()); }
    return withDay ? day + " " + hm : hm;
  }
  function legend(s, items, x, y) {
    items.forEach(function (it) {
      el("rect", {x: x, y: y - 8, width: 10, height: 10, rx: 2, fill: it.color}, s);
      el("text", {x: x + 14, y: y + 1, "class": "t"}, s, it.name);
      x += 14 + it.name.length * 6.5 + 12;
    });
  }
  function noData(s, w, h, text) {
    el("text", {x: w / 2, y: h / 2, "text-anchor": "middle", "class": "nodata"}, s,
       text || "no data in this range");
  }
  // Evenly spaced round times (UTC) within [x0, x1]: a step from a list of round
  // durations, the first giving at most `most` ticks, each tick a multiple of it.
  var STEPS = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600,
               43200, 86400, 172800, 604800, 1209600, 2592000].map(function (x) {
                 return x * 1000; });
  function timeTicks(x0, x1, most) {
    var step = STEPS[STEPS.length - 1];
    for (var k = 0; k < STEPS.length; k++) {
      if ((x1 - x0) / STEPS[k] <= most) { step = STEPS[k]; break; }
    }
    var out = [];
    for (var t = Math.ceil(x0 / step) * step; t <= x1; t += step) { out.push(t); }
    return out;
  }
  // Shorten an SVG text until it fits in `width` pixels, measured as drawn.
  function fit(t, text, width) {
    t.textContent = text;
    if (!t.getComputedTextLength || t.getComputedTextLength() <= width) { return; }
    var lo = 0, hi = text.length;
    while (lo < hi) {
      var mid = Math.ceil((lo + hi) / 2);
      t.textContent = text.slice(0, mid) + "…";
      if (t.getComputedTextLength() <= width) { lo = mid; } else { hi = mid - 1; }
    }
    t.textContent = text.slice(0, lo) + "…";
  }
  // Time series: x is window start (ISO), series values per point; log scale for latency.
  function timeChart(host, opt) {
    var W = 560, H = 180, L = 56, R = 12, T = 26, B = 24;
    var s = svg(host, W, H);
    el("text", {x: 4, y: 14, "class": "title"}, s, opt.title);
    legend(s, opt.series, W - R - opt.series.reduce(function (a, x) {
      return a + 26 + x.name.length * 6.5; }, 0), 14);
    var xs = opt.x.map(function (t) { return new Date(t).getTime(); });
    var vals = [];
    opt.series.forEach(function (se) { se.values.forEach(function (v) {
      if (v !== null && v !== undefined && (!opt.log || v > 0)) { vals.push(v); } }); });
    if (!xs.length || !vals.length) { noData(s, W, H); return; }
    var step = D.window_seconds * 1000;
    var x0 = Math.min.apply(null, xs), x1 = Math.max.apply(null, xs) + step;
    var vmax = opt.stacked ? Math.max.apply(null, opt.x.map(function (_, i) {
      return opt.series.reduce(function (a, se) { return a + (se.values[i] || 0); }, 0); }))
      : Math.max.apply(null, vals);
    var vmin = opt.log ? Math.min.apply(null, vals) : 0;
    var y, ticks = [];
    if (opt.log) {
      var lo = Math.floor(Math.log10(vmin)), hi = Math.ceil(Math.log10(vmax));
      if (hi === lo) { hi += 1; }
      for (var k = lo; k <= hi; k++) { ticks.push(Math.pow(10, k)); }
      y = function (v) { return T + (H - T - B) * (1 - (Math.log10(Math.max(v, Math.pow(10, lo)))
        - lo) / (hi - lo)); };
    } else {
      var mag = Math.pow(10, Math.floor(Math.log10(vmax || 1)));
      var top = Math.ceil((vmax || 1) / mag) * mag;
      for (var j = 0; j <= 4; j++) { ticks.push(top * j / 4); }
      y = function (v) { return T + (H - T - B) * (1 - v / top); };
    }
    var x = function (t) { return L + (W - L - R) * (t - x0) / Math.max(1, x1 - x0); };
    ticks.forEach(function (tv) {
      el("line", {x1: L, x2: W - R, y1: y(tv), y2: y(tv), stroke: color("line")}, s);
      el("text", {x: L - 6, y: y(tv) + 4, "text-anchor": "end", "class": "t"}, s,
         opt.fmt(tv));
    });
    var days = (x1 - x0) > 86400000;
    timeTicks(x0, x1, 6).forEach(function (t) {
      var label = el("text", {x: x(t), y: H - 8, "text-anchor": "middle", "class": "t tick"}, s,
         fmtTime(new Date(t).toISOString(), days));
      var b = label.getBBox ? label.getBBox() : null;
      if (b && b.width && (b.x < 0 || b.x + b.width > W)) {  // a tick at the very edge
        s.removeChild(label);
        return;
      }
      el("line", {x1: x(t), x2: x(t), y1: H - B, y2: H - B + 4, stroke: color("mute")}, s);
    });
    if (opt.stacked) {
      var bw = Math.max(1, (W - L - R) * step / Math.max(1, x1 - x0) - 1);
      var base = opt.x.map(function () { return 0; });
      opt.series.forEach(function (se) {
        se.values.forEach(function (v, i) {
          if (!v) { return; }
          var y0 = y(base[i]), y1 = y(base[i] + v);
          var r = el("rect", {x: x(xs[i]), y: y1, width: bw, height: Math.max(0.5, y0 - y1),
            fill: se.color}, s);
          el("title", {}, r, fmtTime(opt.x[i], true) + " " + se.name + ": " + opt.fmt(v));
          base[i] += v;
        });
      });
    } else {
      opt.series.forEach(function (se) {
        var d = "", pen = false;
        se.values.forEach(function (v, i) {
          if (v === null || v === undefined || (opt.log && v <= 0)) { pen = false; return; }
          var px = x(xs[i] + step / 2);
          d += (pen ? "L" : "M") + px.toFixed(1) + "," + y(v).toFixed(1);
          pen = true;
          if (se.values.length <= 120) {
            var c = el("circle", {cx: px, cy: y(v), r: 2.2, fill: se.color}, s);
            el("title", {}, c, fmtTime(opt.x[i], true) + " " + se.name + ": " + opt.fmt(v));
          }
        });
        el("path", {d: d, fill: "none", stroke: se.color, "stroke-width": 1.8}, s);
      });
    }
  }
  // Horizontal bars: rows of {label, value, note, color}.
  function hbars(host, rows, empty, width, labels) {
    var W = width || 560, rowH = 22, L = labels || 236, R = 90;
    var H = Math.max(60, 10 + rows.length * rowH);
    var s = svg(host, W, H);
    if (!rows.length) { noData(s, W, H, empty); return; }
    var vmax = Math.max.apply(null, rows.map(function (r) { return r.value; })) || 1;
    rows.forEach(function (r, i) {
      var yy = 6 + i * rowH, w = (W - L - R) * r.value / vmax;
      var t = el("text", {x: L - 8, y: yy + 14, "text-anchor": "end", "class": "t"}, s);
      fit(t, r.label, L - 12);
      el("title", {}, t, r.label);
      var b = el("rect", {x: L, y: yy + 3, width: Math.max(1, w), height: rowH - 8, rx: 2,
        fill: r.color}, s);
      el("title", {}, b, r.label + ": " + fmtN(r.value) + (r.note ? " (" + r.note + ")" : ""));
      var v = el("text", {x: L + w + 6, y: yy + 14, "class": "t"}, s,
         fmtN(r.value) + (r.note ? "  " + r.note : ""));
      if (v.getComputedTextLength && L + w + 6 + v.getComputedTextLength() > W) {
        v.setAttribute("x", W - 2);  // no room right of a long bar: end at the edge
        v.setAttribute("text-anchor", "end");
      }
    });
  }
  // Messages by the attempts they took: one column per count, stacked by outcome.
  function attempts(host) {
    var by = {};
    D.queues.forEach(function (qq) { qq.retries.forEach(function (r) {
      var b = by[r.retry_count] || (by[r.retry_count] = {processed: 0, deferred: 0, failed: 0});
      var deferred = r.deferred || 0;
      if (r.outcome === "failed") { b.failed += r.messages; }
      else { b.processed += r.messages - deferred; b.deferred += deferred; }
    }); });
    var counts = Object.keys(by).map(Number).sort(function (a, b) { return a - b; });
    var W = 560, H = 220, L = 56, R = 12, T = 26, B = 30;
    var s = svg(host, W, H);
    var series = [{key: "processed", name: "processed", color: color("proc")},
                  {key: "deferred", name: "processed, deferred first", color: color("p95")},
                  {key: "failed", name: "failed", color: color("fail")}];
    legend(s, series, L, 14);
    if (!counts.length) { noData(s, W, H, "no messages"); return; }
    var total = function (n) { return by[n].processed + by[n].deferred + by[n].failed; };
    var vmax = Math.max.apply(null, counts.map(total)) || 1;
    var mag = Math.pow(10, Math.floor(Math.log10(vmax)));
    var top = Math.ceil(vmax / mag) * mag;
    var y = function (v) { return T + (H - T - B) * (1 - v / top); };
    for (var j = 0; j <= 4; j++) {
      var tv = top * j / 4;
      el("line", {x1: L, x2: W - R, y1: y(tv), y2: y(tv), stroke: color("line")}, s);
      el("text", {x: L - 6, y: y(tv) + 4, "text-anchor": "end", "class": "t"}, s, fmtN(tv));
    }
    var slot = (W - L - R) / counts.length, bw = Math.min(56, slot * 0.7);
    counts.forEach(function (n, i) {
      var cx = L + slot * (i + 0.5), base = 0;
      series.forEach(function (se) {
        var v = by[n][se.key];
        if (!v) { return; }
        var r = el("rect", {x: cx - bw / 2, y: y(base + v), width: bw,
          height: Math.max(0.5, y(base) - y(base + v)), fill: se.color}, s);
        el("title", {}, r, n + " attempt(s), " + se.name + ": " + fmtN(v));
        base += v;
      });
      el("text", {x: cx, y: y(base) - 4, "text-anchor": "middle", "class": "t"}, s,
         fmtN(total(n)));
      el("text", {x: cx, y: H - B + 14, "text-anchor": "middle", "class": "t"}, s, String(n));
    });
    el("text", {x: L + (W - L - R) / 2, y: H - 2, "text-anchor": "middle", "class": "t"}, s,
       "attempts");
  }
  function sparkline(host, points) {
    var W = 120, H = 26, s = svg(host, W, H);
    var v = points.map(function (p) { return p.processed + p.failed; });
    if (!v.length) { return; }
    var m = Math.max.apply(null, v) || 1, d = "";
    v.forEach(function (x, i) {
      d += (i ? "L" : "M") + (2 + (W - 4) * (v.length === 1 ? 0.5 : i / (v.length - 1))).toFixed(1)
        + "," + (H - 2 - (H - 4) * x / m).toFixed(1);
    });
    el("path", {d: d, fill: "none", stroke: color("proc"), "stroke-width": 1.5}, s);
  }
  var byQueue = {};
  D.queues.forEach(function (q) { byQueue[q.queue] = q; });
  var drawn = 0;
  document.querySelectorAll(".chart").forEach(function (host) {
    var kind = host.getAttribute("data-kind"), q = byQueue[host.getAttribute("data-queue")];
    if (kind === "latency") {
      var w = q.windows;
      timeChart(host, {title: "Queue latency (log scale)", log: true, fmt: fmtMs,
        x: w.map(function (p) { return p.start; }), series: [
          {name: "p50", color: color("p50"), values: w.map(function (p) { return p.q_p50; })},
          {name: "p95", color: color("p95"), values: w.map(function (p) { return p.q_p95; })},
          {name: "p99", color: color("p99"), values: w.map(function (p) { return p.q_p99; })}]});
    } else if (kind === "throughput") {
      var w2 = q.windows;
      timeChart(host, {title: "Messages per " + D.window, stacked: true, fmt: fmtN,
        x: w2.map(function (p) { return p.start; }), series: [
          {name: "processed", color: color("proc"),
           values: w2.map(function (p) { return p.processed; })},
          {name: "failed", color: color("fail"),
           values: w2.map(function (p) { return p.failed; })}]});
    } else if (kind === "failures") {
      var rows = [];
      D.queues.forEach(function (qq) { qq.labels.forEach(function (l) {
        if (l.failed) { rows.push({label: qq.queue + " · " + l.label, value: l.failed,
          note: (100 * l.failure_rate).toFixed(2) + "%", color: color("fail")}); } }); });
      rows.sort(function (a, b) { return b.value - a.value; });
      hbars(host, rows.slice(0, 12), "no failed messages");
    } else if (kind === "errors") {
      hbars(host, D.top_errors.filter(function (e) { return e.failed; }).map(function (e) {
        return {label: e.error + " · " + e.label, value: e.failed,
                note: "e.g. id " + e.example_id,
                color: color("p95")}; }), "no message failed", 1100, 560);
    } else if (kind === "retries") {
      attempts(host);
    }
    drawn += 1;
  });
  document.querySelectorAll("td.spark").forEach(function (td) {
    var q = byQueue[td.getAttribute("data-queue")];
    if (q) { sparkline(td, q.windows); }
  });
  // Every label must lie inside its drawing: count those that do not (0 expected).
  var clipped = 0;
  document.querySelectorAll(".chart svg").forEach(function (sv) {
    var w = sv.viewBox.baseVal.width;
    sv.querySelectorAll("text").forEach(function (t) {
      var b = t.getBBox();
      if (b.width && (b.x < -0.5 || b.x + b.width > w + 0.5)) {
        clipped += 1;
        document.documentElement.setAttribute("data-clipped-text", t.textContent);
      }
    });
  });
  document.documentElement.setAttribute("data-clipped-labels", String(clipped));
  document.documentElement.setAttribute("data-charts-rendered", String(drawn));
})();
"""
