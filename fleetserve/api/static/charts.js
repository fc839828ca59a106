// Line charts as SVG, drawn from the points of /api/v1/services/NAME/history. Small on
// purpose: time on x, one polyline per series, a gap where a value is missing.
"use strict";
window.FleetCharts = (function () {
  const NS = "http://www.w3.org/2000/svg";
  // Eight hues far apart (no two blues or two purples): a replica's colour is its rank among
  // the live replicas (dashboard.js), so a two-replica service shows two distinct colours.
  const PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b",
    "#e377c2", "#17becf"];
  const ENDED = "#c3c8d2"; // replicas that ended within the hour: drawn, one legend entry
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
    let t0 = Infinity, t1 = -Infinity, top = 0, least = Infinity, count = 0;
    for (const s of series) {
      for (const [t, v] of s.points) {
        t0 = Math.min(t0, t); t1 = Math.max(t1, t);
        if (v !== null && v !== undefined) {
          top = Math.max(top, v); count++;
          if (v > 0) least = Math.min(least, v);
        }
      }
    }
    if (!count) {
      const empty = svgEl("text", { x: W / 2, y: H / 2, "text-anchor": "middle" });
      empty.textContent = "no data yet";
      svg.appendChild(empty);
      box.dataset.points = "0";
      return box;
    }
    if (t1 - t0 < 1) { t0 -= 30; t1 += 1; }
    const x = (t) => L + ((t - t0) / (t1 - t0)) * (W - L - R);
    const scale = opts.log ? logScale(least, top) : niceScale(top, opts.integer);
    const y = scale.y;
    scale.ticks.forEach((v, i) => {
      svg.appendChild(svgEl("line", { x1: L, x2: W - R, y1: y(v), y2: y(v),
        class: i ? "grid" : "axis" }));
      const label = svgEl("text", { x: L - 4, y: y(v) + 3, "text-anchor": "end", "data-tick": v });
      const last = i === scale.ticks.length - 1;
      label.textContent = scale.label(v) + (last && opts.unit ? " " + opts.unit : "");
      svg.appendChild(label);
    });
    box.dataset.scale = opts.log ? "log" : "linear";
    const legend = document.createElement("div");
    legend.className = "legend";
    const named = new Set();
    series.forEach((s, i) => {
      const color = s.color || PALETTE[i % PALETTE.length];
      let run = [], drawn = 0;
      const flush = () => {
        if (run.length) {
          const attrs = { points: run.join(" "), stroke: color, "data-series": s.name };
          if (s.dash) attrs["stroke-dasharray"] = s.dash;
          if (s.width) attrs["stroke-width"] = s.width;
          svg.appendChild(svgEl("polyline", attrs));
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
      const label = s.legend === undefined ? s.name : s.legend; // null: no entry of its own
      if (label === null || named.has(label)) return;
      named.add(label);
      const item = document.createElement("span");
      item.dataset.series = label;
      item.dataset.color = color;
      const swatch = document.createElement("i");
      swatch.style.background = color;
      if (s.dash) swatch.className = "dashed";
      item.appendChild(swatch);
      item.appendChild(document.createTextNode(label));
      legend.appendChild(item);
    });
    box.dataset.points = String(count);
    box.appendChild(legend);
    return box;
  }

  // A linear axis from 0 with 3 to 5 round ticks: steps of 1, 2 or 5 times a power of ten
  // (whole numbers for counts), the top a multiple of the step at or above the largest value.
  function niceScale(max, integer) {
    const rough = (max > 0 ? max * 1.05 : 1) / 4;
    const mag = Math.pow(10, Math.floor(Math.log10(rough)));
    let step = [1, 2, 5, 10].map((m) => m * mag).find((v) => v >= rough * 0.999);
    if (integer) step = Math.max(1, Math.round(step));
    const top = Math.max(step, Math.ceil(max / step - 1e-9) * step);
    const ticks = [];
    for (let k = 0; k * step <= top + step / 1e6; k++) ticks.push(Number((k * step).toPrecision(12)));
    const decimals = Math.max(0, -Math.floor(Math.log10(step) + 1e-9));
    return {
      ticks,
      label: (v) => v.toFixed(decimals),
      y: (v) => T + (1 - v / top) * (H - T - B),
    };
  }

  // A log axis over whole powers of ten (latency: a 1 ms p50 beside a 250 ms p99 is not a
  // flat line at 0); a value of 0 sits on the bottom line.
  function logScale(least, max) {
    let lo = Math.floor(Math.log10(isFinite(least) ? least : 1));
    let hi = Math.ceil(Math.log10(max > 0 ? max : 10));
    if (hi <= lo) hi = lo + 1;
    const ticks = [];
    for (let e = lo; e <= hi; e++) ticks.push(Number(Math.pow(10, e).toPrecision(12)));
    return {
      ticks,
      label: (v) => String(v),
      y: (v) => {
        const l = v > 0 ? Math.min(Math.max(Math.log10(v), lo), hi) : lo;
        return T + (1 - (l - lo) / (hi - lo)) * (H - T - B);
      },
    };
  }

  function colorOf(rank) { return PALETTE[Math.abs(rank) % PALETTE.length]; }

  return { lineChart, colorOf, ENDED, niceScale, logScale };
})();
