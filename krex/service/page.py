"""The live node page: one self-contained HTML document (no build step, nothing fetched
from elsewhere) that polls ``/v1/node/summary`` every second and draws devices and
holders, queues, warm workers, a timeline of the last minutes of regions (waited,
held; not-clean ones marked), recent evaluations and each tenant's share.

The token (every data request needs one) is read from the page's fragment
(``/#token=…``) and sent as a bearer token; it never appears in a request URL.
Without it the page loads and says "HTTP 401".
"""

from __future__ import annotations

PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>krex node</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
body{font:14px system-ui,sans-serif;margin:16px;background:#fafafa;color:#222}
h1{font-size:20px;margin:0 0 4px}h2{font-size:15px;margin:18px 0 6px}
table{border-collapse:collapse;background:#fff}td,th{border:1px solid #ddd;padding:3px 8px;
text-align:left}th{background:#f0f0f0}#status{color:#666}.bad{color:#b00020;font-weight:600}
#timeline{background:#fff;border:1px solid #ddd}.legend span{display:inline-block;width:12px;
height:12px;margin:0 4px 0 12px;vertical-align:middle}
</style></head><body>
<h1>krex node</h1><div id="status">connecting…</div>
<h2>Devices</h2><table id="devices"><thead><tr><th>device</th><th>holder</th><th>queued</th>
<th>warm workers</th><th>busy</th><th>recycles</th></tr></thead><tbody></tbody></table>
<h2>Regions, last <span id="window">300</span> s</h2>
<div class="legend"><span style="background:#f2b134"></span>waited<span
style="background:#2f7ed8"></span>held<span style="background:#b00020"></span>not clean</div>
<svg id="timeline" width="960" height="220" role="img" aria-label="region timeline"></svg>
<h2>Tenants' share of region time</h2><table id="shares"><thead><tr><th>tenant</th>
<th>share</th></tr></thead><tbody></tbody></table>
<h2>Recent evaluations</h2><table id="evaluations"><thead><tr><th>record</th><th>tenant</th>
<th>verdict</th><th>speedup</th><th>findings</th></tr></thead><tbody></tbody></table>
<script>
"use strict";
const token = new URLSearchParams(location.hash.slice(1)).get("token");
const headers = token ? {"Authorization": "Bearer " + token} : {};
const WINDOW = 300;
function cell(row, text, cls) { const td = row.insertCell(); td.textContent = text;
  if (cls) td.className = cls; return td; }
function fill(id, rows, make) { const body = document.querySelector("#" + id + " tbody");
  body.replaceChildren(); for (const r of rows) make(body.insertRow(), r); }
function holder(h) { return h ? "job " + h.job_id + " region " + h.region : "-"; }
function draw(timeline) {
  const svg = document.getElementById("timeline"); const W = 960, H = 220, NS =
    "http://www.w3.org/2000/svg"; svg.replaceChildren();
  const devices = [...new Set(timeline.map(r => r.device))].sort();
  const lane = Math.max(18, Math.floor((H - 20) / Math.max(1, devices.length)));
  const x = ago => W - 10 - (W - 120) * Math.min(ago, WINDOW) / WINDOW;
  devices.forEach((d, i) => { const t = document.createElementNS(NS, "text");
    t.setAttribute("x", 4); t.setAttribute("y", 14 + i * lane + lane / 2); t.textContent = d;
    svg.appendChild(t); });
  for (const r of timeline) {
    const y = 6 + devices.indexOf(r.device) * lane, a = r.ago_s;
    const rect = (x0, x1, color, title) => { const e = document.createElementNS(NS, "rect");
      e.setAttribute("x", Math.round(Math.min(x0, x1))); e.setAttribute("y", y);
      e.setAttribute("width", Math.max(2, Math.round(Math.abs(x1 - x0))));
      e.setAttribute("height", lane - 6); e.setAttribute("fill", color);
      const tt = document.createElementNS(NS, "title"); tt.textContent = title;
      e.appendChild(tt); svg.appendChild(e); };
    const label = (r.tenant || "") + " " + (r.job || "") + " region " + r.region;
    rect(x(a), x(a - r.waited_s), "#f2b134", label + " waited " + r.waited_s.toFixed(3) + " s");
    rect(x(a - r.waited_s), x(a - r.waited_s - r.held_s), r.clean === false ? "#b00020" :
      "#2f7ed8", label + " held " + r.held_s.toFixed(3) + " s" +
      (r.clean === false ? " NOT CLEAN: " + r.reasons.join(", ") : ""));
  }
}
async function tick() {
  try {
    const res = await fetch("/v1/node/summary?seconds=" + WINDOW, {headers});
    if (!res.ok) throw new Error("HTTP " + res.status);
    const s = await res.json(); const st = document.getElementById("status");
    st.textContent = (s.daemon_error ? "daemon: " + s.daemon_error : "daemon up") +
      " · regions granted " + (s.counters.granted ?? "?") + " · updated " +
      new Date(s.now_wall_s * 1000).toLocaleTimeString();
    st.className = s.daemon_error ? "bad" : "";
    fill("devices", s.devices, (row, d) => { cell(row, d.name); cell(row, holder(d.holder));
      cell(row, d.queue.length); cell(row, d.workers); cell(row, d.busy);
      cell(row, Object.entries(d.recycles).map(([k, v]) => k + " " + v).join(", ")); });
    fill("shares", Object.entries(s.shares), (row, [t, f]) => { cell(row, t);
      cell(row, (100 * f).toFixed(1) + " %"); });
    fill("evaluations", s.evaluations, (row, e) => { cell(row, (e.record_id || "").slice(0, 12));
      cell(row, e.tenant); cell(row, e.verdict, e.verdict === "invalid" ? "bad" : "");
      cell(row, e.speedup == null ? "" : e.speedup.toFixed(3) + "x");
      cell(row, e.findings.map(f => f.code).join(" ")); });
    draw(s.timeline); document.body.dataset.updated = String(s.now_wall_s);
  } catch (err) { const st = document.getElementById("status");
    st.textContent = "cannot reach the service: " + err.message; st.className = "bad"; }
}
tick(); setInterval(tick, 1000);
</script></body></html>
"""
