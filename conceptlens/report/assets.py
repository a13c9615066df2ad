"""The report's shared style sheet and script, written once to `report/static/`.

Vanilla JS only (no CDN, no framework): the index table is rendered from
`static/atlas-data.js` (a plain <script>, so it loads from file:// where fetch() cannot).
"""

CSS = """
:root { --fg:#1d2430; --muted:#5d6778; --line:#d9dee7; --bg:#fbfcfe; --accent:#1f6feb; }
* { box-sizing: border-box; }
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; color: var(--fg);
       background: var(--bg); margin: 0; padding: 0 24px 48px; max-width: 1280px; }
header { border-bottom: 1px solid var(--line); padding: 14px 0 8px; margin-bottom: 12px; }
header h1 { font-size: 20px; margin: 0 0 4px; }
nav a { margin-right: 14px; }
a { color: var(--accent); text-decoration: none; }
a:hover { text-decoration: underline; }
h2 { font-size: 16px; margin: 22px 0 8px; }
.muted, .meta { color: var(--muted); }
table { border-collapse: collapse; margin: 6px 0; }
.scroll { overflow-x: auto; max-width: 100%; }
th, td { padding: 3px 8px; border-bottom: 1px solid var(--line); text-align: left; vertical-align: top; }
td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; }
th.sort { cursor: pointer; user-select: none; white-space: nowrap; }
th.sort:after { content: " \\2195"; color: #aab; }
th.asc:after { content: " \\2191"; color: var(--fg); }
th.desc:after { content: " \\2193"; color: var(--fg); }
.controls { margin: 8px 0; display: flex; gap: 12px; align-items: center; flex-wrap: wrap; }
.controls input[type=search] { width: 320px; padding: 4px 6px; }
.ctx { font: 12.5px/1.9 ui-monospace, SFMono-Regular, Menlo, monospace; white-space: pre-wrap;
       word-break: break-word; margin: 2px 0; padding: 2px 6px; border-left: 3px solid var(--line); }
.ctx i { font-style: normal; background: rgba(255,120,0,var(--a,0)); border-radius: 2px; }
.ctx i.neg { background: rgba(30,110,235,var(--a,0)); }
.ctx i.c { outline: 1.5px solid #b34700; }
.ctx .v { color: var(--muted); display: inline-block; min-width: 56px; }
.grid { display: grid; grid-template-columns: repeat(auto-fit, minmax(300px, 1fr)); gap: 8px 28px; }
.tok { font-family: ui-monospace, monospace; background: #eef1f6; border-radius: 3px; padding: 0 4px; margin: 1px; display: inline-block; }
.good { color: #0a7d32; font-weight: 600; }
.bad { color: #b3261e; font-weight: 600; }
h3 { font-size: 14px; margin: 16px 0 4px; }
table.suite td { font-variant-numeric: tabular-nums; }
.ci { color: var(--muted); font-size: 12px; white-space: nowrap; }
svg text { font: 10px system-ui, sans-serif; fill: var(--muted); }
#map { border: 1px solid var(--line); background: white; }
#map circle { cursor: pointer; }
#map circle:hover { stroke: black; stroke-width: 1.5; }
.steer td { max-width: 900px; }
.pager { margin: 6px 0; }
figure { margin: 4px 0 12px; }
figcaption.legend { color: var(--muted); font-size: 12px; max-width: 900px; margin-top: 4px; }
.banner { background: #fff4d6; border: 1px solid #e0b44c; border-radius: 4px; padding: 6px 10px; margin: 8px 0; }
.control, .baseline { font-style: italic; color: var(--muted); }
.swatch { display: inline-block; width: 10px; height: 10px; border-radius: 50%; margin: 0 3px 0 8px; }
"""

JS = r"""
"use strict";
// Index: sortable, filterable table and 2-D map of all concepts, from window.ATLAS_DATA.
(function () {
  const D = window.ATLAS_DATA;
  if (!D || !document.getElementById("concepts")) return;
  const C = D.columns, idx = Object.fromEntries(C.map((c, i) => [c, i]));
  const PAGE = 200;
  let shown = PAGE, sortCol = null, sortDir = 1, rows = D.rows.slice();
  const q = document.getElementById("filter"), sel = document.getElementById("extractor");
  const body = document.querySelector("#concepts tbody"), count = document.getElementById("count");
  const more = document.getElementById("more");
  const fmt = (v, kind) => v === null || v === undefined ? "" :
    kind === "pct" ? (100 * v).toPrecision(3) + "%" : kind === "num" ? (+v).toPrecision(4) : String(v);
  // the page's escape, as report/html.py's esc: bidi controls shown as codes, then & < > " ' as entities
  const vis = s => String(s).replace(/[\u200e\u200f\u061c\u202a-\u202e\u2066-\u2069]/g,
    ch => "\u27e8U+" + ch.charCodeAt(0).toString(16).toUpperCase().padStart(4, "0") + "\u27e9");
  const esc = s => vis(s).replace(/[&<>"']/g, ch => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"}[ch]));
  const href = (name, i) => "concepts/" + encodeURIComponent(name) + "/" + encodeURIComponent(i) + ".html";
  function matches(r) {
    const ex = sel.value, text = q.value.trim().toLowerCase();
    if (ex && D.extractors[r[idx.ex]].name !== ex) return false;
    if (!text) return true;
    const hay = (D.extractors[r[idx.ex]].name + " " + r[idx.tokens] + " " +
                 (r[idx.promoted] || "") + " " + (r[idx.best_class] || "")).toLowerCase();
    const id = "#" + r[idx.concept];  // "#6" names concept 6, not 60 or 607
    return text.split(/\s+/).every(w => /^#\d+$/.test(w) ? w === id : hay.includes(w));
  }
  function render() {
    const keep = rows.filter(matches);
    const html = [];
    for (const r of keep.slice(0, shown)) {
      const e = D.extractors[r[idx.ex]];
      html.push("<tr><td>" + esc(e.name) + "</td><td class=num><a class=concept href=\"" + esc(href(e.name, r[idx.concept])) +
        "\">#" + esc(r[idx.concept]) + "</a></td>" + D.shown.map(([c, kind]) => "<td" + (kind === "text" ? "" : " class=num") + ">" +
        esc(fmt(r[idx[c]], kind)) + "</td>").join("") + "</tr>");
    }
    body.innerHTML = html.join("");
    count.textContent = "showing " + Math.min(shown, keep.length) + " of " + keep.length + " concepts (" + D.rows.length + " in all)";
    more.style.display = keep.length > shown ? "" : "none";
  }
  document.querySelectorAll("#concepts th.sort").forEach(th => th.addEventListener("click", () => {
    const col = idx[th.dataset.col];
    sortDir = sortCol === col ? -sortDir : (th.dataset.kind === "text" ? 1 : -1);
    sortCol = col;
    document.querySelectorAll("#concepts th.sort").forEach(h => h.classList.remove("asc", "desc"));
    th.classList.add(sortDir > 0 ? "asc" : "desc");
    rows.sort((a, b) => {
      const x = a[col], y = b[col];
      if (x === y) return 0;
      if (x === null) return 1;
      if (y === null) return -1;
      return (x < y ? -1 : 1) * sortDir;
    });
    render();
  }));
  q.addEventListener("input", () => { shown = PAGE; render(); drawMap(); });
  sel.addEventListener("change", () => { shown = PAGE; render(); drawMap(); });
  more.addEventListener("click", () => { shown += PAGE; render(); });

  const svg = document.getElementById("map"), mapSel = document.getElementById("map-extractor");
  const NS = "http://www.w3.org/2000/svg", W = +svg.getAttribute("width"), H = +svg.getAttribute("height");
  const palette = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"];
  function drawMap() {
    while (svg.firstChild) svg.removeChild(svg.firstChild);
    const ex = mapSel.value, pts = D.rows.filter(r => D.extractors[r[idx.ex]].name === ex && r[idx.x] !== null);
    if (!pts.length) return;
    const xs = pts.map(r => r[idx.x]), ys = pts.map(r => r[idx.y]);
    // reduce, not Math.min(...xs): a spread of more than ~1e5 arguments overflows the call stack
    const lo = a => a.reduce((m, v) => v < m ? v : m, Infinity), hi = a => a.reduce((m, v) => v > m ? v : m, -Infinity);
    const x0 = lo(xs), x1 = hi(xs), y0 = lo(ys), y1 = hi(ys);
    const sx = v => 12 + (W - 24) * (x1 > x0 ? (v - x0) / (x1 - x0) : 0.5);
    const sy = v => H - 12 - (H - 24) * (y1 > y0 ? (v - y0) / (y1 - y0) : 0.5);
    const classes = D.labels || [];
    const fmax = Math.max(hi(pts.map(r => r[idx.frequency] || 0)), 1e-12);
    for (const r of pts) {
      const a = document.createElementNS(NS, "a");
      a.setAttribute("href", href(ex, r[idx.concept]));
      const c = document.createElementNS(NS, "circle");
      c.setAttribute("cx", sx(r[idx.x]).toFixed(1)); c.setAttribute("cy", sy(r[idx.y]).toFixed(1));
      c.setAttribute("r", (2 + 4 * Math.sqrt((r[idx.frequency] || 0) / fmax)).toFixed(1));
      const k = r[idx.gain] > 0 ? classes.indexOf(r[idx.best_class]) : -1;  // no class above its base rate: grey
      c.setAttribute("fill", k >= 0 ? palette[k % palette.length] : "#999999");
      c.setAttribute("fill-opacity", matches(r) ? "0.75" : "0.08");
      const t = document.createElementNS(NS, "title");
      t.textContent = vis(ex + " #" + r[idx.concept] + ": " + r[idx.tokens] + (r[idx.best_class] ? " (" + r[idx.best_class] + ")" : ""));
      c.appendChild(t); a.appendChild(c); svg.appendChild(a);
    }
  }
  const legend = document.getElementById("map-classes");
  if (legend && D.labels) legend.innerHTML = "Classes:" + D.labels.map((c, k) =>
    "<span class=swatch style='background:" + palette[k % palette.length] + "'></span>" + esc(c)).join("");
  mapSel.addEventListener("change", drawMap);
  render(); drawMap();
})();
"""
