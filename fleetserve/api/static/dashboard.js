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
    return t;
  }

  function duration(seconds) {
    if (seconds === null || seconds === undefined || seconds < 0) return "-";
    const s = Math.floor(seconds);
    if (s < 60) return s + "s";
    if (s < 3600) return Math.floor(s / 60) + "m " + (s % 60) + "s";
    if (s < 86400) return Math.floor(s / 3600) + "h " + Math.floor((s % 3600) / 60) + "m";
    return Math.floor(s / 86400) + "d " + Math.floor((s % 86400) / 3600) + "h";
  }

  function clock(t) { return new Date(t * 1000).toLocaleTimeString(); }
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

  function perReplica(field, scale) {
    return Object.keys(chartData.replicas).sort((a, b) => a - b).map((rid) => ({
      name: "replica " + rid,
      color: FleetCharts.colorOf(Number(rid)), // a replica has one colour in every chart
      points: chartData.replicas[rid].map((p) => [p.at, p[field] === null ? null : p[field] * (scale || 1)]),
    }));
  }

  function renderCharts() {
    const pts = chartData ? chartData.points : [];
    const ms = (v) => (v >= 100 ? Math.round(v) : Math.round(v * 10) / 10).toString();
    const svc = (field, scale) => pts.map((p) => [p.at, p[field] === null ? null : p[field] * (scale || 1)]);
    const has = chartData !== null;
    return el("div", { class: "charts" },
      FleetCharts.lineChart({ id: "rps", title: "Requests per second", unit: "req/s" },
        [{ name: "service", points: svc("rps"), color: "#1d2330" }, ...(has ? perReplica("rps") : [])]),
      FleetCharts.lineChart({ id: "latency", title: "Latency", unit: "ms", format: ms },
        [{ name: "p50", points: svc("p50", 1000), color: "#1d2330" },
          { name: "p99", points: svc("p99", 1000), color: "#c2255c" }]),
      FleetCharts.lineChart({ id: "inflight", title: "In flight", unit: "req" },
        has ? perReplica("inflight") : []),
      FleetCharts.lineChart({ id: "errors", title: "Errors per second", unit: "/s" },
        [{ name: "service", points: svc("errors"), color: "#1d2330" }, ...(has ? perReplica("errors") : [])]),
      FleetCharts.lineChart({ id: "scale", title: "Autoscaler target and READY replicas" },
        [{ name: "target", points: svc("target"), color: "#868e96" },
          { name: "ready", points: svc("ready"), color: "#2f9e44" }]),
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
    ));
    const eventRows = events.slice().reverse().map((e) => el("tr", {},
      el("td", {}, clock(e.at)),
      el("td", {}, e.kind),
      el("td", { class: "num" }, e.replica_id === null ? "" : String(e.replica_id)),
      el("td", {}, e.status_to ? `${e.status_from || ""} → ${e.status_to}` : ""),
      el("td", {}, e.message),
    ));
    main.replaceChildren(...[
      el("p", {}, el("a", { href: "#/" }, "← services")),
      el("h1", {}, svc.name),
      facts,
      svc.failure_reason ? el("p", { class: "error" }, svc.failure_reason) : null,
      el("h2", {}, "Replicas"),
      replicaRows.length
        ? table(["ID", "Status", "Version", "Zone", "Spot", "Uptime", "Endpoint", "Reason"], replicaRows, "replicas")
        : el("p", { class: "muted" }, "No replica right now."),
      rollout(svc),
      el("h2", {}, "The last hour"),
      renderCharts(),
      el("h2", {}, "Events"),
      events.length ? table(["Time", "Kind", "Replica", "Status", "Message"], eventRows, "events")
        : el("p", { class: "muted" }, "No events."),
    ].filter((x) => x !== null));
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
      updated.textContent = "updated " + new Date().toLocaleTimeString();
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
