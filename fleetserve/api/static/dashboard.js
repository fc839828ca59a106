// The dashboard: reads the REST API (/api/v1) with the session cookie, every two seconds,
// sending back each answer's ETag (an unchanged answer costs an empty 304). Everything shown
// is set as text, never parsed as HTML: a service's name or a replica's reason is data.
"use strict";
(function () {
  const POLL_MS = 2000;
  const API = "/api/v1";
  const cache = new Map(); // url -> {etag, data}
  const main = document.getElementById("main");
  const banner = document.getElementById("banner");
  const updated = document.getElementById("updated");
  let chartData = null; // {service, step, points, replicas} of the service on screen
  let timer = null;
  let generation = 0; // a route change makes older answers stale

  class Gone extends Error {}

  // The events filter outlives each re-render (every two seconds): one input, kept, its
  // text and focus carried over; it keeps the rows whose text holds what is typed.
  const filter = (() => {
    const input = document.createElement("input");
    input.type = "search";
    input.id = "event-filter";
    input.placeholder = "filter events: kind, replica, status, text";
    input.setAttribute("aria-label", "filter events");
    const count = document.createElement("span");
    count.className = "muted";
    const box = document.createElement("div");
    box.className = "filter";
    box.append(input, count);
    input.addEventListener("input", () => { if (lastService) renderService(...lastService); });
    return { input, count, box };
  })();
  let lastService = null; // [svc, events] last rendered, for the filter to re-render at once

  async function getJSON(path) {
    const held = cache.get(path);
    const headers = held ? { "If-None-Match": held.etag } : {};
    const resp = await fetch(API + path, { headers, credentials: "same-origin" });
    if (resp.status === 401) {
      location.replace("/login");
      throw new Error("logged out");
    }
    if (resp.status === 304 && held) return held.data;
    if (resp.status === 404) throw new Gone(path);
    if (!resp.ok) {
      let message = "HTTP " + resp.status;
      try { message = (await resp.json()).error.message; } catch (e) { /* not JSON */ }
      throw new Error(message);
    }
    const data = await resp.json();
    const etag = resp.headers.get("ETag");
    if (etag) cache.set(path, { etag, data });
    return data;
  }

  function el(tag, props, ...children) {
    const e = document.createElement(tag);
    for (const k in props || {}) {
      if (k === "class") e.className = props[k];
      else if (k === "text") e.textContent = props[k];
      else e.setAttribute(k, props[k]);
    }
    for (const c of children) {
      if (c === null || c === undefined) continue;
      e.appendChild(typeof c === "string" || typeof c === "number" ? document.createTextNode(String(c)) : c);
    }
    return e;
  }

  function badge(status) {
    let kind = "";
    if (status === "READY") kind = "ok";
    else if (/^FAILED|PREEMPTED|CONTROLLER_FAILED/.test(status)) kind = "bad";
    else if (/INIT|PENDING|PROVISIONING|STARTING|NOT_READY/.test(status)) kind = "warn";
    return el("span", { class: "badge " + kind, "data-status": status }, status);
  }

  function table(headers, rows, cls) {
    const head = el("tr", {}, ...headers.map((h) => el("th", {}, h)));
    const t = el("table", { class: cls || "" }, el("thead", {}, head));
    const body = el("tbody");
    for (const r of rows) body.appendChild(r);
    t.appendChild(body);
    return el("div", { class: "scroll" }, t); // a narrow screen scrolls the table, not the page
  }

  function duration(seconds) {
    if (seconds === null || seconds === undefined || seconds < 0) return "-";
    const s = Math.floor(seconds);
    if (s < 60) return s + "s";
    if (s < 3600) return Math.floor(s / 60) + "m " + (s % 60) + "s";
    if (s < 86400) return Math.floor(s / 3600) + "h " + Math.floor((s % 3600) / 60) + "m";
    return Math.floor(s / 86400) + "d " + Math.floor((s % 86400) / 3600) + "h";
  }

  // 24-hour time, as the charts and the CLI show it (not the browser's 12-hour locale)
  function clock(t) { return new Date(t * 1000).toTimeString().slice(0, 8); }
  function now() { return Date.now() / 1000; }
  function ready(svc) { return svc.replicas.filter((r) => r.status === "READY").length; }
  function live(svc) { return svc.replicas.filter((r) => r.terminated_at === null); }

  function versionText(svc) {
    if (svc.serving_version && svc.serving_version !== svc.active_version)
      return `${svc.serving_version} → ${svc.active_version}`;
    return String(svc.active_version);
  }

  function serviceLink(name) {
    return el("a", { href: "#/service/" + encodeURIComponent(name) }, name);
  }

  // -- the list of services --------------------------------------------------------------

  function renderOverview(services) {
    const rows = services.map((svc) => el("tr", { "data-service": svc.name },
      el("td", {}, serviceLink(svc.name)),
      el("td", {}, badge(svc.status)),
      el("td", { class: "num" }, versionText(svc)),
      el("td", {}, svc.endpoint ? svc.endpoint : "-"),
      el("td", { class: "num", "data-ready": String(ready(svc)) },
        `${ready(svc)}/${svc.target_replicas}`),
      el("td", { class: "num" }, `${svc.min_replicas}–${svc.max_replicas}`),
      el("td", {}, svc.load_balancing_policy || "-"),
      el("td", {}, svc.failure_reason || ""),
    ));
    const content = services.length
      ? table(["Service", "Status", "Version", "Endpoint", "Ready/target", "Min–max",
        "Policy", "Problem"], rows, "services")
      : el("p", { class: "muted" }, "No services. Start one with `fleetserve up service.yaml`.");
    main.replaceChildren(el("h1", {}, "Services"), content);
  }

  // -- one service -------------------------------------------------------------------------

  function mergeHistory(name, h) {
    if (!chartData || chartData.service !== name) chartData = { service: name, points: [], replicas: {} };
    chartData.step = h.step_seconds;
    chartData.points.push(...h.points);
    for (const rid in h.replicas) {
      chartData.replicas[rid] = (chartData.replicas[rid] || []).concat(h.replicas[rid]);
    }
    const oldest = now() - (h.horizon_seconds || 3600);
    chartData.points = chartData.points.filter((p) => p.at >= oldest);
    for (const rid in chartData.replicas) {
      chartData.replicas[rid] = chartData.replicas[rid].filter((p) => p.at >= oldest);
      if (!chartData.replicas[rid].length) delete chartData.replicas[rid];
    }
  }

  function lastAt() {
    return chartData && chartData.points.length ? chartData.points[chartData.points.length - 1].at : null;
  }

  // One series per replica of the last hour: the live ones each in its own colour (its rank
  // among them: the same in every chart), the ended ones grey under one legend entry.
  function perReplica(field, liveIds) {
    const ids = Object.keys(chartData.replicas).map(Number).sort((a, b) => a - b);
    const live = ids.filter((rid) => liveIds.has(rid));
    const ended = ids.filter((rid) => !liveIds.has(rid));
    const points = (rid) => chartData.replicas[String(rid)].map((p) => [p.at, p[field]]);
    return [
      ...ended.map((rid) => ({ name: "replica " + rid, legend: "ended replicas",
        color: FleetCharts.ENDED, width: 1, points: points(rid) })),
      ...live.map((rid, rank) => ({ name: "replica " + rid, color: FleetCharts.colorOf(rank),
        points: points(rid) })),
    ];
  }

  function renderCharts(svc) {
    const pts = chartData ? chartData.points : [];
    const series = (field, scale) => pts.map((p) => [p.at, p[field] === null ? null : p[field] * (scale || 1)]);
    const liveIds = new Set(live(svc).map((r) => r.replica_id));
    const each = (field) => (chartData !== null ? perReplica(field, liveIds) : []);
    return el("div", { class: "charts" },
      FleetCharts.lineChart({ id: "rps", title: "Requests per second", unit: "req/s" },
        [...each("rps"), { name: "service", points: series("rps"), color: "#1d2330" }]),
      FleetCharts.lineChart({ id: "latency", title: "Latency (log scale)", unit: "ms", log: true },
        [{ name: "p50", points: series("p50", 1000), color: "#1d2330" },
          { name: "p99", points: series("p99", 1000), color: "#d62728" }]),
      FleetCharts.lineChart({ id: "inflight", title: "In flight", unit: "req", integer: true },
        each("inflight")),
      FleetCharts.lineChart({ id: "errors", title: "Errors per second", unit: "/s" },
        [...each("errors"), { name: "service", points: series("errors"), color: "#1d2330" }]),
      // READY under a dashed target drawn last: equal, both still show
      FleetCharts.lineChart({ id: "scale", title: "Autoscaler target and READY replicas", integer: true },
        [{ name: "ready", points: series("ready"), color: "#2ca02c", width: 3 },
          { name: "target", points: series("target"), color: "#1d2330", dash: "5 4" }]),
    );
  }

  function rollout(svc) {
    const versions = new Map();
    for (const r of live(svc)) {
      const v = versions.get(r.version) || { replicas: 0, ready: 0, rps: 0 };
      v.replicas++;
      if (r.status === "READY") v.ready++;
      const series = chartData && chartData.replicas[String(r.replica_id)];
      if (series && series.length && series[series.length - 1].rps) v.rps += series[series.length - 1].rps;
      versions.set(r.version, v);
    }
    const total = [...versions.values()].reduce((a, v) => a + v.rps, 0);
    const rolling = svc.serving_version !== null && svc.serving_version !== svc.active_version;
    if (!versions.size && !rolling) return null; // no replica: no version serves anything
    const title = rolling
      ? `Rolling out version ${svc.active_version} (${svc.update_mode || "rolling"}) over version ${svc.serving_version}`
      : `Version ${svc.active_version} serves`;
    const rows = [...versions.keys()].sort((a, b) => a - b).map((version) => {
      const v = versions.get(version);
      const share = total > 0 ? v.rps / total : null;
      const bar = el("span", { class: "share" });
      bar.style.width = share === null ? "0" : Math.round(share * 120) + "px";
      let intended = "-";
      if (svc.traffic_percent !== null && rolling)
        intended = (version === svc.active_version ? svc.traffic_percent : 100 - svc.traffic_percent) + "%";
      return el("tr", { "data-version": String(version) },
        el("td", { class: "num" }, String(version) + (rolling && version === svc.active_version ? " (new)" : "")),
        el("td", { class: "num" }, `${v.ready}/${v.replicas}`),
        el("td", {}, bar, share === null ? "no traffic" : Math.round(share * 100) + "%"),
        el("td", { class: "num" }, intended));
    });
    return el("section", { id: "rollout" }, el("h2", {}, title),
      table(["Version", "Ready/replicas", "Traffic share (last step)", "Canary split"], rows));
  }

  function renderService(svc, events) {
    lastService = [svc, events];
    const t = now();
    const facts = el("div", { class: "facts" },
      el("div", {}, el("span", {}, "status"), badge(svc.status)),
      el("div", {}, el("span", {}, "endpoint"), svc.endpoint || "-"),
      el("div", {}, el("span", {}, "version"), versionText(svc)),
      el("div", {}, el("span", {}, "ready/target"), `${ready(svc)}/${svc.target_replicas}`),
      el("div", {}, el("span", {}, "min–max"), `${svc.min_replicas}–${svc.max_replicas}`),
      el("div", {}, el("span", {}, "policy"), svc.load_balancing_policy || "-"),
      svc.spot_placer ? el("div", {}, el("span", {}, "spot placer"), svc.spot_placer) : null,
    );
    const replicaRows = live(svc).map((r) => el("tr", { "data-replica": String(r.replica_id) },
      el("td", { class: "num" }, String(r.replica_id)),
      el("td", {}, badge(r.status)),
      el("td", { class: "num" }, String(r.version)),
      el("td", {}, r.zone || "-"),
      el("td", {}, r.spot === null ? "-" : r.spot ? "spot" : "on-demand"),
      el("td", { class: "num" }, r.launched_at ? duration(t - r.launched_at) : "-"),
      el("td", {}, r.endpoint || "-"),
      el("td", {}, r.reason || ""),
      el("td", {}, el("a", { href: `${API}/services/${encodeURIComponent(svc.name)}/replicas/${r.replica_id}/logs?tail=500`,
        target: "_blank", rel: "noopener", "data-log": String(r.replica_id) }, "log")),
    ));
    const eventRows = events.slice().reverse().map((e) => el("tr", { "data-kind": e.kind },
      el("td", {}, clock(e.at)),
      el("td", {}, e.kind),
      el("td", { class: "num" }, e.replica_id === null ? "" : String(e.replica_id)),
      el("td", {}, e.status_to ? `${e.status_from || ""} → ${e.status_to}` : ""),
      el("td", {}, e.message),
    ));
    const wanted = filter.input.value.trim().toLowerCase();
    const shownRows = wanted ? eventRows.filter((row) => row.textContent.toLowerCase().includes(wanted)) : eventRows;
    filter.count.textContent = wanted ? `${shownRows.length} of ${eventRows.length}` : "";
    const focused = document.activeElement === filter.input;
    const caret = filter.input.selectionStart || 0;
    main.replaceChildren(...[
      el("p", {}, el("a", { href: "#/" }, "← services")),
      el("h1", {}, svc.name),
      facts,
      svc.failure_reason ? el("p", { class: "error" }, svc.failure_reason) : null,
      el("h2", {}, "Replicas"),
      replicaRows.length
        ? table(["ID", "Status", "Version", "Zone", "Spot", "Uptime", "Endpoint", "Reason", "Log"], replicaRows, "replicas")
        : el("p", { class: "muted" }, "No replica right now."),
      rollout(svc),
      el("h2", {}, "The last hour"),
      renderCharts(svc),
      el("h2", {}, "Events"),
      filter.box,
      shownRows.length ? table(["Time", "Kind", "Replica", "Status", "Message"], shownRows, "events")
        : el("p", { class: "muted" }, events.length ? "No event matches the filter." : "No events."),
    ].filter((x) => x !== null));
    if (focused) {
      filter.input.focus();
      filter.input.setSelectionRange(caret, caret);
    }
  }

  // -- polling -------------------------------------------------------------------------------

  function route() {
    const m = /^#\/service\/(.+)$/.exec(location.hash);
    if (!m) return { service: null };
    try {
      return { service: decodeURIComponent(m[1]) };
    } catch (e) { // a malformed link: shown as the text it is
      return { service: m[1] };
    }
  }

  async function refresh() {
    const mine = generation;
    const r = route();
    try {
      if (r.service === null) {
        const services = await getJSON("/services");
        if (mine !== generation) return;
        renderOverview(services);
      } else {
        const name = encodeURIComponent(r.service);
        const after = lastAt();
        const [svc, events, h] = await Promise.all([
          getJSON(`/services/${name}`),
          getJSON(`/services/${name}/events?limit=50`),
          getJSON(`/services/${name}/history` + (after === null ? "" : `?after=${after}`)),
        ]);
        if (mine !== generation) return;
        if (after === null || h.points.length || Object.keys(h.replicas).length) {
          if (after === null) chartData = null;
          mergeHistory(r.service, h);
        }
        renderService(svc, events);
      }
      banner.hidden = true;
      updated.textContent = "updated " + clock(now());
    } catch (e) {
      if (mine !== generation) return;
      if (e instanceof Gone) {
        main.replaceChildren(el("p", {}, el("a", { href: "#/" }, "← services")),
          el("p", { class: "error" }, `There is no service called ${r.service}.`));
        banner.hidden = true;
      } else {
        banner.textContent = "The controller is not answering (" + e.message + "); retrying.";
        banner.hidden = false;
      }
    }
  }

  async function loop(mine) {
    await refresh();
    if (mine === generation) timer = setTimeout(() => loop(mine), POLL_MS);
  }

  window.addEventListener("hashchange", () => {
    generation++;
    chartData = null;
    lastService = null;
    filter.input.value = "";
    clearTimeout(timer);
    main.replaceChildren(el("p", { class: "muted" }, "Loading…"));
    loop(generation);
  });
  document.getElementById("logout").addEventListener("click", async () => {
    await fetch("/ui/logout", { method: "POST", headers: { "Content-Type": "application/json" },
      body: "{}", credentials: "same-origin" });
    location.replace("/login");
  });
  loop(generation);
})();
