// Line charts as SVG, drawn from the points of /api/v1/services/NAME/history. Small on
// purpose: time on x, one polyline per series, a gap where a value is missing.
"use strict";
window.FleetCharts = (function () {
  const NS = "http://www.w3.org/2000/svg";
  const PALETTE = ["#2b59c3", "#d9480f", "#2f9e44", "#ae3ec9", "#f08c00", "#0c8599",
    "#c2255c", "#5c940d", "#364fc7", "#862e9c"];
  const W = 480, H = 170, L = 46, R = 8, T = 8, B = 20;

  function svgEl(tag, attrs) {
    const e = document.createElementNS(NS, tag);
    for (const k in attrs) e.setAttribute(k, String(attrs[k]));
    return e;
  }

  function clock(t) {
    const d = new Date(t * 1000);
    return d.toTimeString().slice(0, 8);
  }

  // series: [{name, points: [[t, v|null], ...]}]; opts: {title, unit, format}
  function lineChart(opts, series) {
    const box = document.createElement("div");
    box.className = "chart";
    box.dataset.chart = opts.id || opts.title;
    const h = document.createElement("h3");
    h.textContent = opts.title;
    box.appendChild(h);
    const svg = svgEl("svg", { viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": opts.title });
    box.appendChild(svg);
    let t0 = Infinity, t1 = -Infinity, top = 0, count = 0;
    for (const s of series) {
      for (const [t, v] of s.points) {
        t0 = Math.min(t0, t); t1 = Math.max(t1, t);
        if (v !== null && v !== undefined) { top = Math.max(top, v); count++; }
      }
    }
    const fmt = opts.format || ((v) => (Math.round(v * 100) / 100).toString());
    if (!count) {
      const empty = svgEl("text", { x: W / 2, y: H / 2, "text-anchor": "middle" });
      empty.textContent = "no data yet";
      svg.appendChild(empty);
      box.dataset.points = "0";
      return box;
    }
    if (t1 - t0 < 1) { t0 -= 30; t1 += 1; }
    top = top > 0 ? top * 1.1 : 1;
    const x = (t) => L + ((t - t0) / (t1 - t0)) * (W - L - R);
    const y = (v) => T + (1 - v / top) * (H - T - B);
    for (const f of [0, 0.5, 1]) {
      svg.appendChild(svgEl("line", { x1: L, x2: W - R, y1: y(top * f), y2: y(top * f),
        class: f ? "grid" : "axis" }));
      const label = svgEl("text", { x: L - 4, y: y(top * f) + 3, "text-anchor": "end" });
      label.textContent = fmt(top * f) + (f === 1 && opts.unit ? " " + opts.unit : "");
      svg.appendChild(label);
    }
    for (const [t, anchor] of [[t0, "start"], [t1, "end"]]) {
      const label = svgEl("text", { x: x(t), y: H - 5, "text-anchor": anchor });
      label.textContent = clock(t);
      svg.appendChild(label);
    }
    const legend = document.createElement("div");
    legend.className = "legend";
    series.forEach((s, i) => {
      const color = s.color || PALETTE[i % PALETTE.length];
      let run = [], drawn = 0;
      const flush = () => {
        if (run.length) {
          svg.appendChild(svgEl("polyline", { points: run.join(" "), stroke: color,
            "data-series": s.name }));
          drawn += run.length;
        }
        run = [];
      };
      for (const [t, v] of s.points) {
        if (v === null || v === undefined) { flush(); continue; }
        run.push(`${x(t).toFixed(1)},${y(v).toFixed(1)}`);
      }
      flush();
      if (drawn === 1) { // a lone point: a dot, so it shows
        const [t, v] = s.points.find((p) => p[1] !== null && p[1] !== undefined);
        svg.appendChild(svgEl("circle", { cx: x(t), cy: y(v), r: 2, fill: color }));
      }
      const item = document.createElement("span");
      const swatch = document.createElement("i");
      swatch.style.background = color;
      item.appendChild(swatch);
      item.appendChild(document.createTextNode(s.name));
      legend.appendChild(item);
    });
    box.dataset.points = String(count);
    box.appendChild(legend);
    return box;
  }

  function colorOf(n) { return PALETTE[(Math.abs(n) + PALETTE.length - 1) % PALETTE.length]; }

  return { lineChart, colorOf };
})();
