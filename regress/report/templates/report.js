/* regress report: charts, the prompt table and prompt details, built from the JSON data block.
   Untrusted text (prompts, outputs, tokens, ids, tags) only ever goes into the page through
   textContent and createElement: never parsed as markup, never as a URL or an attribute that runs. */
(function () {
  "use strict";

  var D = JSON.parse(document.getElementById("data").textContent);
  var P = D.prompts;
  var MI = Object.create(null);
  D.metrics.forEach(function (name, i) { MI[name] = i; });
  var LABEL = { regression: "regression", drift: "drift", input_drift: "input drift", benign: "benign", identical: "identical" };
  var CLASS_RANK = Object.create(null);
  D.classes.forEach(function (k, i) { CLASS_RANK[k] = i; });
  var BY_ID = new Map();
  P.forEach(function (p, i) { BY_ID.set(p.id, i); });
  var SPEC = D.specs;  // per metric value: label, format, which way is better (from the metric's own spec)
  var PAGE = 50;
  var SVGNS = "http://www.w3.org/2000/svg";

  // ---------------------------------------------------------------- helpers

  // Control and bidi characters (and lone surrogates) shown as \uNNNN, as the server-rendered part,
  // the CLI, summary.md and junit.xml show them (regress.untrusted): a right-to-left override in an
  // id, a tag or an output cannot reorder what follows it, and the text reads as it is.
  var CONTROL = /[\u0000-\u0008\u000b-\u001f\u007f-\u009f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069]|[\ud800-\udbff](?![\udc00-\udfff])|(?<![\ud800-\udbff])[\udc00-\udfff]/g;
  function escapeControls(text) {
    return String(text).replace(CONTROL, function (c) { return "\\u" + ("000" + c.charCodeAt(0).toString(16)).slice(-4); });
  }
  function txt(text) { return document.createTextNode(escapeControls(text)); }
  function el(tag, cls, text) {
    var e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined && text !== null) e.textContent = escapeControls(text);
    return e;
  }
  function add(parent) {
    for (var i = 1; i < arguments.length; i++) if (arguments[i]) parent.appendChild(arguments[i]);
    return parent;
  }
  function sv(tag, attrs, text) {
    var e = document.createElementNS(SVGNS, tag);
    for (var k in attrs) if (Object.prototype.hasOwnProperty.call(attrs, k)) e.setAttribute(k, String(attrs[k]));
    if (text !== undefined) e.textContent = escapeControls(text);
    return e;
  }
  function val(p, name) {
    if (name === "severity") return p.v;
    var i = MI[name];
    return i === undefined ? null : p.m[i];
  }
  function isNum(v) { return typeof v === "number" && isFinite(v); }
  function spec(name) {
    var s = SPEC[name] || {};
    return { label: s.label || name, format: s.format || "num", better: s.better || null };
  }
  function fmt(name, v) {
    if (v === null || v === undefined) return "—";
    if (typeof v === "boolean") return v ? "yes" : "no";
    if (typeof v !== "number") return String(v);
    if (name === "severity") return v.toFixed(2);
    var f = spec(name).format;
    if (f === "pct") return (v * 100).toFixed(v >= 0.999 && v < 1 ? 2 : 1) + " %";
    if (f === "kl") return v !== 0 && Math.abs(v) < 1e-3 ? v.toExponential(1) : v.toFixed(4);
    if (f === "ratio") return v.toFixed(2) + "×";
    if (f === "int" || Number.isInteger(v)) return Math.round(v).toLocaleString("en-US");
    return String(Number(v.toPrecision(3)));
  }
  function plural(n, word) { return n.toLocaleString("en-US") + " " + word + (n === 1 ? "" : "s"); }
  function visible(tok) { return tok.replace(/ /g, "·").replace(/\n/g, "↵").replace(/\t/g, "→"); }
  function badge(k) { return el("span", "badge k-" + k, LABEL[k] || k); }

  // ---------------------------------------------------------------- state

  var DX = D.diagnosis;  // regress diagnose's record of this run: causes present, their mitigations (null: none)
  var NOT_DIAGNOSED = "(not diagnosed)";  // the cause filter's value for prompts without a diagnosis (no cause's name)
  var state = { classes: new Set(), tag: "", cause: "", metric: "", min: "", max: "", q: "", sort: "r", dir: 1, page: 0 };
  var rows = [];      // indices into P after filtering and sorting
  var current = -1;   // index into P shown in the detail drawer

  function matches(p, q) {
    if (p.id.toLowerCase().indexOf(q) >= 0) return true;
    var texts = [p.s, p.g, p.c];
    if (p.sm) p.sm.forEach(function (pair) { texts.push(pair[0], pair[1]); });
    if (p.pm) p.pm.forEach(function (m) { texts.push(m[1]); });
    if (p.dx) texts.push(p.dx.c.join(", "), p.dx.y);
    for (var i = 0; i < texts.length; i++) if (texts[i] && texts[i].toLowerCase().indexOf(q) >= 0) return true;
    return false;
  }

  function sortValue(p, key) {
    if (key === "r") return p.r;
    if (key === "id") return p.id;
    if (key === "k") return CLASS_RANK[p.k];
    if (key === "v") return p.v;
    if (key === "dx") return p.dx ? p.dx.c.join(", ") : null;
    var v = val(p, key.slice(2));
    return typeof v === "boolean" ? Number(v) : v;
  }

  function hasCause(p, cause) {
    if (cause === NOT_DIAGNOSED) return !p.dx;
    return !!p.dx && p.dx.c.indexOf(cause) >= 0;
  }

  function compute() {
    var q = state.q.trim().toLowerCase();
    var tag = state.tag === "" ? -1 : Number(state.tag);
    var lo = state.min === "" ? null : Number(state.min);
    var hi = state.max === "" ? null : Number(state.max);
    var ranged = state.metric !== "" && (lo !== null || hi !== null);
    rows = [];
    for (var i = 0; i < P.length; i++) {
      var p = P[i];
      if (state.classes.size && !state.classes.has(p.k)) continue;
      if (tag >= 0 && p.t.indexOf(tag) < 0) continue;
      if (state.cause && !hasCause(p, state.cause)) continue;
      if (ranged) {
        var v = val(p, state.metric);
        if (typeof v === "boolean") v = Number(v);
        if (!isNum(v) || (lo !== null && v < lo) || (hi !== null && v > hi)) continue;
      }
      if (q && !matches(p, q)) continue;
      rows.push(i);
    }
    var key = state.sort, dir = state.dir;
    rows.sort(function (a, b) {
      var x = sortValue(P[a], key), y = sortValue(P[b], key);
      var xn = x === null || x === undefined, yn = y === null || y === undefined;
      if (xn || yn) return xn === yn ? P[a].r - P[b].r : (xn ? 1 : -1);
      if (x < y) return -dir;
      if (x > y) return dir;
      return P[a].r - P[b].r;
    });
  }

  // ---------------------------------------------------------------- prompt table

  var COLUMNS = [
    { key: "r", label: "#", num: true, title: "rank: regressions first, then drift, input drift, benign, identical; most severe first" },
    { key: "id", label: "prompt" },
    { key: "k", label: "class" },
    { key: "v", label: "severity", num: true, title: "how far past its regression thresholds (1 = at a threshold)" }
  ].concat(D.key.map(function (name) {
    return { key: "m:" + name, label: spec(name).label, num: true, title: name + ": " + (D.descriptions[name] || "") };
  })).concat(DX ? [{ key: "dx", label: "why it drifted", title: "the source of its drift, as regress diagnose found it (hover for why and mitigation; open the prompt for its probes); empty: not diagnosed" }] : [])
    .concat([{ key: "tags", label: "tags", fixed: true },
      { key: "why", label: "reasons", fixed: true, title: "why the prompt is in its class: the first reason, (+n) for n more (hover the cell or open the prompt for all)" }]);

  function renderHead() {
    var head = document.getElementById("prompt-head");
    head.textContent = "";
    COLUMNS.forEach(function (c) {
      var th = el("th", (c.num ? "num " : "") + (c.fixed ? "" : "sortable"), c.label);
      if (c.title) th.title = c.title;
      if (!c.fixed) {
        th.tabIndex = 0;
        th.dataset.key = c.key;
        if (state.sort === c.key) th.setAttribute("aria-sort", state.dir > 0 ? "ascending" : "descending");
      }
      head.appendChild(th);
    });
  }

  function cell(p, c) {
    if (c.key === "r") return el("td", "num", p.r + 1);
    if (c.key === "id") return titled(el("td", "id", p.id));
    if (c.key === "k") return add(el("td"), badge(p.k));
    if (c.key === "v") return el("td", "num", fmt("severity", p.v));
    if (c.key === "tags") return titled(el("td", "tags", p.t.map(function (t) { return D.tags[t]; }).join(", ")));
    if (c.key === "why") return whyCell(p);
    if (c.key === "dx") return causeCell(p);
    var name = c.key.slice(2);
    return el("td", "num", fmt(name, val(p, name)));
  }

  // the prompt's causes (most specific first); the tooltip says why and what would have prevented it
  function causeCell(p) {
    var td = el("td", "dx");
    if (!p.dx) return td;
    p.dx.c.forEach(function (cause, i) {
      if (i) td.appendChild(txt(", "));
      td.appendChild(el("span", "cause", cause));
    });
    td.title = escapeControls(p.dx.c.join(", ") + (p.dx.e ? " (shown by a probe)" : " (by elimination)") +
      "\nwhy: " + p.dx.y + "\nmitigation: " + p.dx.mi);
    return td;
  }

  function titled(td) { td.title = td.textContent; return td; }

  // the first reason, and "(+n)" for the n more; the tooltip lists them all, one a line
  function whyCell(p) {
    var td = add(el("td", "why"), el("span", "first-reason", p.why.length ? p.why[0] : ""));
    if (p.why.length > 1) {
      var more = el("span", "more-reasons", " (+" + (p.why.length - 1) + ")");
      more.title = (p.why.length - 1) + " more reason" + (p.why.length > 2 ? "s" : "");
      td.appendChild(more);
    }
    td.title = escapeControls(p.why.join("\n"));
    return td;
  }

  function renderRows() {
    var body = document.getElementById("prompt-rows");
    body.textContent = "";
    var pages = Math.max(1, Math.ceil(rows.length / PAGE));
    if (state.page >= pages) state.page = pages - 1;
    var start = state.page * PAGE, end = Math.min(rows.length, start + PAGE);
    var frag = document.createDocumentFragment();
    for (var j = start; j < end; j++) {
      var p = P[rows[j]];
      var tr = el("tr");
      tr.tabIndex = 0;
      tr.dataset.idx = String(rows[j]);
      if (rows[j] === current) tr.className = "current";
      COLUMNS.forEach(function (c) { tr.appendChild(cell(p, c)); });
      frag.appendChild(tr);
    }
    if (!rows.length) {
      var td = el("td", "note", "No prompt matches these filters.");
      td.colSpan = COLUMNS.length;
      frag.appendChild(add(el("tr"), td));
    }
    body.appendChild(frag);
    var shown = document.getElementById("shown");
    shown.textContent = rows.length === P.length ? plural(P.length, "prompt") :
      rows.length.toLocaleString("en-US") + " of " + plural(P.length, "prompt");
    var pager = document.getElementById("pager");
    pager.textContent = "";
    var prev = el("button", "", "← previous"), next = el("button", "", "next →");
    prev.type = next.type = "button";
    prev.disabled = state.page === 0;
    next.disabled = state.page >= pages - 1;
    prev.addEventListener("click", function () { state.page--; renderRows(); });
    next.addEventListener("click", function () { state.page++; renderRows(); });
    add(pager, prev, el("span", "", rows.length ? (start + 1) + "–" + end + " of " + rows.length.toLocaleString("en-US") : "0"), next,
        el("span", "note", "page " + (state.page + 1) + " of " + pages));
  }

  function refresh() {
    compute();
    renderHead();
    renderRows();
    syncControls();
  }

  function syncControls() {
    document.querySelectorAll("#class-filter .chip").forEach(function (b) {
      b.setAttribute("aria-pressed", state.classes.has(b.dataset.class) ? "true" : "false");
    });
    document.getElementById("tag-filter").value = state.tag;
    var causeSel = document.getElementById("cause-filter");
    if (causeSel) causeSel.value = state.cause;
    document.getElementById("metric-filter").value = state.metric;
    document.getElementById("metric-min").value = state.min;
    document.getElementById("metric-max").value = state.max;
    document.getElementById("search").value = state.q;
  }

  function setupFilters() {
    var chips = document.getElementById("class-filter");
    var count = Object.create(null);
    P.forEach(function (p) { count[p.k] = (count[p.k] || 0) + 1; });
    D.classes.forEach(function (k) {
      var b = el("button", "chip k-" + k, LABEL[k] + " " + (count[k] || 0).toLocaleString("en-US"));
      b.type = "button";
      b.dataset.class = k;
      b.setAttribute("aria-pressed", "false");
      b.addEventListener("click", function () {
        if (state.classes.has(k)) state.classes.delete(k); else state.classes.add(k);
        state.page = 0;
        refresh();
      });
      chips.appendChild(b);
    });
    var tagSel = document.getElementById("tag-filter");
    var tagCount = D.tags.map(function () { return 0; });
    P.forEach(function (p) { p.t.forEach(function (t) { tagCount[t]++; }); });
    D.tags.map(function (t, i) { return [t, i]; })
      .sort(function (a, b) { return a[0] < b[0] ? -1 : a[0] > b[0] ? 1 : 0; })
      .forEach(function (ti) {
        var o = el("option", "", ti[0] + " (" + tagCount[ti[1]] + ")");
        o.value = String(ti[1]);
        tagSel.appendChild(o);
      });
    var metricSel = document.getElementById("metric-filter");
    ["severity"].concat(D.metrics).forEach(function (name) {
      var o = el("option", "", name);
      o.value = name;
      if (D.descriptions[name]) o.title = D.descriptions[name];
      metricSel.appendChild(o);
    });
    tagSel.addEventListener("change", function () { state.tag = tagSel.value; state.page = 0; refresh(); });
    var causeSel = document.getElementById("cause-filter");
    if (causeSel && DX) {
      var causeCount = Object.create(null), undiagnosed = 0;
      P.forEach(function (p) {
        if (!p.dx) { undiagnosed++; return; }
        p.dx.c.forEach(function (c) { causeCount[c] = (causeCount[c] || 0) + 1; });
      });
      DX.causes.forEach(function (c) {
        var o = el("option", "", c + " (" + (causeCount[c] || 0) + ")");
        o.value = c;
        causeSel.appendChild(o);
      });
      var none = el("option", "", "not diagnosed (" + undiagnosed + ")");
      none.value = NOT_DIAGNOSED;
      causeSel.appendChild(none);
      causeSel.addEventListener("change", function () { state.cause = causeSel.value; state.page = 0; refresh(); });
    }
    metricSel.addEventListener("change", function () { state.metric = metricSel.value; state.page = 0; refresh(); });
    ["min", "max"].forEach(function (which) {
      var input = document.getElementById("metric-" + which);
      input.addEventListener("input", function () { state[which] = input.value; state.page = 0; refresh(); });
    });
    var search = document.getElementById("search"), timer = 0;
    search.addEventListener("input", function () {
      clearTimeout(timer);
      timer = setTimeout(function () { state.q = search.value; state.page = 0; refresh(); }, 120);
    });
    document.getElementById("reset").addEventListener("click", function () {
      state.classes.clear();
      state.tag = state.cause = state.metric = state.min = state.max = state.q = "";
      state.sort = "r"; state.dir = 1; state.page = 0;
      refresh();
    });
    var head = document.getElementById("prompt-head");
    // A first click sorts worst first: descending where lower is better (and for severity).
    function worstFirst(key) {
      if (key === "v") return -1;
      return key.indexOf("m:") === 0 && spec(key.slice(2)).better === "lower" ? -1 : 1;
    }
    function sortBy(th) {
      if (!th || !th.dataset.key) return;
      var key = th.dataset.key;
      if (state.sort === key) state.dir = -state.dir;
      else { state.sort = key; state.dir = worstFirst(key); }
      state.page = 0;
      refresh();
    }
    head.addEventListener("click", function (e) { sortBy(e.target.closest("th")); });
    head.addEventListener("keydown", function (e) { if (e.key === "Enter") sortBy(e.target.closest("th")); });
    var body = document.getElementById("prompt-rows");
    body.addEventListener("click", function (e) {
      var tr = e.target.closest("tr");
      if (tr && tr.dataset.idx) open(Number(tr.dataset.idx));
    });
    body.addEventListener("keydown", function (e) {
      var tr = e.target.closest("tr");
      if (e.key === "Enter" && tr && tr.dataset.idx) open(Number(tr.dataset.idx));
    });
  }

  function showOnly(classes) {
    state.classes = new Set(classes);
    state.page = 0;
    refresh();
    document.getElementById("prompts").scrollIntoView();
  }

  // ---------------------------------------------------------------- charts

  function histogram(spec) {
    var W = 420, H = 170, L = 38, R = 10, T = 8, B = 24;
    var box = el("div", "chart");
    add(box, el("h3", "", spec.title), el("div", "sub", spec.sub));
    var s = sv("svg", { viewBox: "0 0 " + W + " " + H, role: "img", "aria-label": spec.title });
    box.appendChild(s);
    var n = spec.edges.length - 1;
    var counts = [];
    for (var b = 0; b < n; b++) counts.push(Object.create(null));
    var total = 0;
    spec.items.forEach(function (it) {
      var x = spec.pos(it.x);
      var bin = Math.min(n - 1, Math.max(0, Math.floor((x - spec.edges[0]) / (spec.edges[n] - spec.edges[0]) * n)));
      counts[bin][it.k] = (counts[bin][it.k] || 0) + 1;
      total++;
    });
    var max = 0;
    counts.forEach(function (c) { var t = 0; for (var k in c) t += c[k]; if (t > max) max = t; });
    var pw = W - L - R, ph = H - T - B;
    function X(pos) { return L + (pos - spec.edges[0]) / (spec.edges[n] - spec.edges[0]) * pw; }
    add(s, sv("line", { class: "axis", x1: L, y1: T + ph, x2: W - R, y2: T + ph }),
        sv("line", { class: "axis", x1: L, y1: T, x2: L, y2: T + ph }));
    if (!total) {
      s.appendChild(sv("text", { class: "empty", x: L + pw / 2, y: T + ph / 2, "text-anchor": "middle" }, spec.empty));
      return box;
    }
    niceTicks(0, max, 3).forEach(function (c) {
      if (c !== Math.round(c)) return;
      var y = T + ph - c / max * ph;
      if (c) s.appendChild(sv("line", { class: "grid", x1: L + 1, y1: y, x2: W - R, y2: y }));
      s.appendChild(sv("text", { class: "tick", x: L - 4, y: y + 3, "text-anchor": "end" }, c));
    });
    var order = D.classes.slice().reverse(); // identical at the bottom, regressions on top
    var bw = pw / n;
    counts.forEach(function (c, bin) {
      var y = T + ph;
      order.forEach(function (k) {
        if (!c[k]) return;
        var h = c[k] / max * ph;
        y -= h;
        var lo = spec.edges[bin], hi = spec.edges[bin + 1];
        var r = sv("rect", { class: "bar fill-" + k, x: X(lo) + 0.5, y: y, width: Math.max(bw - 1, 1), height: Math.max(h, 0.5) });
        r.appendChild(sv("title", {}, c[k] + " " + LABEL[k] + " · " + spec.range(lo, hi)));
        r.addEventListener("click", function () {
          var range = spec.filter(lo, hi);
          state.metric = spec.metric; state.min = range[0]; state.max = range[1];
          showOnly([k]);
        });
        s.appendChild(r);
      });
    });
    spec.ticks.forEach(function (t) {
      var x = X(t[0]);
      add(s, sv("line", { class: "axis", x1: x, y1: T + ph, x2: x, y2: T + ph + 3 }),
          sv("text", { class: "tick", x: x, y: H - 8, "text-anchor": x > W - R - 12 ? "end" : "middle" }, t[1]));
    });
    (spec.thresholds || []).forEach(function (t) {
      var pos = spec.pos(t[0]);
      if (pos < spec.edges[0] || pos > spec.edges[n]) return;
      var line = sv("line", { class: "thr thr-" + t[1], x1: X(pos), y1: T, x2: X(pos), y2: T + ph });
      line.appendChild(sv("title", {}, t[1] + " threshold " + t[0]));
      s.appendChild(line);
    });
    return box;
  }

  function niceTicks(lo, hi, count) {
    var step = Math.pow(10, Math.floor(Math.log10((hi - lo) / count || 1)));
    [1, 2, 5, 10].some(function (m) { if ((hi - lo) / (step * m) <= count) { step *= m; return true; } return false; });
    var out = [];
    for (var t = Math.ceil(lo / step) * step; t <= hi + 1e-9; t += step) out.push(Number(t.toPrecision(6)));
    return out;
  }

  function renderCharts() {
    var box = document.getElementById("charts");
    D.charts.forEach(function (c) { box.appendChild(chart(c)); });
  }

  // One histogram per charted metric value (its spec says the scale), with its thresholds.
  function chart(c) {
    var items = [];
    P.forEach(function (p) {
      var v = val(p, c.metric);
      if (isNum(v) && !(c.diverged && p.k === "identical")) items.push({ x: v, k: p.k });
    });
    var thresholds = [[c.benign, "benign"], [c.regression, "regression"]].filter(function (t) { return isNum(t[0]); });
    var h = { title: c.title, sub: plural(items.length, c.noun) + " · " + c.sub, items: items, metric: c.metric,
              thresholds: thresholds, empty: c.empty };
    if (c.scale === "position") positionScale(h);
    else if (c.scale === "log") logScale(h, c);
    else unitScale(h, c);
    return histogram(h);
  }

  // token positions: integer bins
  function positionScale(h) {
    var dmax = h.items.reduce(function (m, it) { return Math.max(m, it.x); }, 0);
    var width = Math.max(1, Math.ceil((dmax + 1) / 40));
    var edges = [];
    for (var e = 0; e <= Math.ceil((dmax + 1) / width); e++) edges.push(e * width);
    if (edges.length < 2) edges = [0, 1];
    h.edges = edges;
    h.pos = function (x) { return x; };
    h.ticks = niceTicks(0, edges[edges.length - 1], 6).map(function (t) { return [t, String(t)]; });
    h.range = function (lo, hi) { return hi - lo === 1 ? "token " + lo : "tokens " + lo + "–" + (hi - 1); };
    h.filter = function (lo, hi) { return [String(lo), String(hi - 1)]; };
  }

  // log10 scale, reaching past the regression threshold
  function logScale(h, c) {
    var minPos = Infinity, maxV = 0;
    h.items.forEach(function (it) {
      if (it.x > 0 && it.x < minPos) minPos = it.x;
      if (it.x > maxV) maxV = it.x;
    });
    var lo = Math.max(-8, Math.floor(Math.log10(isFinite(minPos) ? minPos : 1e-6)));
    var hi = Math.max(Math.ceil(Math.log10(Math.max(maxV, (isNum(c.regression) ? c.regression : 0) * 3, 1e-9))), lo + 1);
    var edges = [];
    for (var i = 0; i <= 36; i++) edges.push(lo + (hi - lo) * i / 36);
    var ticks = [];
    for (var d = lo; d <= hi; d += Math.max(1, Math.round((hi - lo) / 6))) ticks.push([d, "1e" + d]);
    h.edges = edges;
    h.ticks = ticks;
    h.pos = function (x) { return x > 0 ? Math.log10(x) : lo; };
    h.range = function (a, b) { return Math.pow(10, a).toExponential(1) + " – " + Math.pow(10, b).toExponential(1) + " nat"; };
    h.filter = function (a, b) { return [a === lo ? "" : Math.pow(10, a).toPrecision(4), Math.pow(10, b).toPrecision(4)]; };
  }

  // linear up to 1, from below the lowest value and the regression threshold
  function unitScale(h, c) {
    var smin = 1;
    h.items.forEach(function (it) { if (it.x < smin) smin = it.x; });
    var slo = Math.floor(Math.min(smin, isNum(c.regression) ? c.regression - 0.05 : smin) * 20) / 20;
    var edges = [];
    for (var j = 0; j <= 40; j++) edges.push(slo + (1 - slo) * j / 40);
    h.edges = edges;
    h.pos = function (x) { return x; };
    h.ticks = niceTicks(slo, 1, 6).map(function (t) { return [t, String(t)]; });
    h.range = function (a, b) { return a.toFixed(3) + " – " + b.toFixed(3); };
    h.filter = function (a, b) { return [a.toFixed(4), b.toFixed(4)]; };
  }

  // ---------------------------------------------------------------- detail

  function cut(n, where) {
    return el("span", "cut", where === "before" ? "… " + plural(n, "character") + " before … " : " … " + plural(n, "more character"));
  }

  function outputText(p, side) {
    var pre = el("pre", "text");
    if (p.s0) pre.appendChild(cut(p.s0, "before"));
    pre.appendChild(txt(p.s));
    if (p.s1) pre.appendChild(cut(p.s1, "after"));
    var rest = p[side];
    if (rest !== undefined) {
      if (rest) pre.appendChild(el("mark", side, rest));
      if (p[side + "1"]) pre.appendChild(cut(p[side + "1"], "after"));
    }
    return pre;
  }

  // Byte pieces (tokens shown as <0xE5><0x90>, holding part of a character) that together complete
  // characters: runs [first, end, text] over a row's token indices (w.pre, then the side's own).
  function pieceRuns(runs) {
    var of = Object.create(null), endsAt = Object.create(null);
    (runs || []).forEach(function (r) {
      for (var j = r[0]; j < r[1]; j++) of[j] = r[2];
      endsAt[r[1] - 1] = r[2];
    });
    return {
      title: function (j) { return of[j] === undefined ? "" : " · byte pieces of “" + escapeControls(of[j]) + "”"; },
      after: function (box, j) {
        if (endsAt[j] !== undefined) box.appendChild(el("span", "cut", "= " + visible(endsAt[j])));
      }
    };
  }

  function tokenRow(w, side) {
    var mine = w[side], other = w[side === "g" ? "c" : "g"];
    var runs = pieceRuns(w[side + "j"]), np = w.pre.length;
    var box = el("div", "toks");
    if (w.pre0) box.appendChild(el("span", "tok end", "… " + plural(w.pre0, "token")));
    w.pre.forEach(function (t, i) {
      var s = el("span", "tok shared", visible(t));
      s.title = "token " + ((w.pre0 || 0) + i) + " (same on both sides)" + runs.title(i);
      box.appendChild(s);
      runs.after(box, i);
    });
    mine.forEach(function (t, i) {
      var cls = i === 0 ? "tok diff first " + side : (other[i] === t ? "tok same" : "tok diff " + side);
      var s = el("span", cls, visible(t));
      s.title = "token " + (w.at + i) + (i === 0 ? " (first divergence)" : "") + runs.title(np + i);
      box.appendChild(s);
      runs.after(box, np + i);
    });
    var n = side === "g" ? w.gn : w.cn;
    var fin = p_finish(side);
    if (w.at + mine.length >= n) box.appendChild(el("span", "tok end", "end of output" + (fin ? " (" + fin + ")" : "")));
    else box.appendChild(el("span", "tok end", "… " + plural(n - w.at - mine.length, "more token")));
    return box;
  }
  var detailPrompt = null;
  function p_finish(side) {
    if (!detailPrompt || !detailPrompt.f) return "";
    return detailPrompt.f[side === "g" ? 0 : 1];
  }

  function topkTable(rows, title, chosenLp) {
    var box = el("div");
    box.appendChild(el("h4", "", title));
    if (!rows) { box.appendChild(el("p", "note", "no token at this position (the output ended)")); return box; }
    var t = el("table");
    add(t, add(el("thead"), add(el("tr"), el("th", "num", "#"), el("th", "", "token"), el("th", "num", "logprob"), el("th", "", "probability"))));
    var body = el("tbody");
    rows.forEach(function (r, i) {
      var tr = el("tr", r[2] === 1 ? "chosen" : r[2] === 2 ? "other" : "");
      var prob = isNum(r[1]) ? Math.exp(r[1]) : 0;
      var bar = el("span", "pbar");
      bar.style.width = Math.round(prob * 80) + "px";
      var pc = el("td");
      add(pc, bar, txt(" " + (prob * 100).toFixed(1) + " %"));
      var tok = el("td", "t", visible(r[0]));
      tok.title = r[2] === 1 ? "this side chose it" : r[2] === 2 ? "the other side chose it" : "";
      if (r[3]) {  // a byte piece completing characters begun by the pieces before it
        tok.appendChild(el("span", "cut", " → " + visible(r[3])));
        tok.title = (tok.title ? tok.title + " · " : "") + "with the byte pieces before it: " + escapeControls(r[3]);
      }
      add(tr, el("td", "num", i + 1), tok, el("td", "num", isNum(r[1]) ? r[1].toFixed(3) : "—"), pc);
      body.appendChild(tr);
    });
    t.appendChild(body);
    box.appendChild(t);
    var note = "bold: this side's choice; wavy: the other side's";
    if (isNum(chosenLp)) note = "chosen token logprob " + chosenLp.toFixed(3) + " · " + note;
    box.appendChild(el("p", "note", note));
    return box;
  }

  function renderDetail(p) {
    detailPrompt = p;
    var title = document.getElementById("detail-title");
    title.textContent = "";
    add(title, badge(p.k), el("span", "pid", p.id), el("span", "note", "severity " + fmt("severity", p.v) + " · rank " + (p.r + 1)));
    var body = document.getElementById("detail-body");
    body.textContent = "";
    if (p.t.length) {
      var tags = el("div", "tags");
      p.t.forEach(function (t) { tags.appendChild(el("span", "tag", D.tags[t])); });
      body.appendChild(tags);
    }
    if (p.why.length) {
      var ul = el("ul", "why");
      p.why.forEach(function (r) { ul.appendChild(el("li", "", r)); });
      body.appendChild(ul);
    }
    if (p.dx) body.appendChild(diagnosisBlock(p.dx));
    if (p.a) body.appendChild(answerBlock(p.a));
    if (p.pm) {
      body.appendChild(el("h3", "", "Prompt"));
      var pre = el("pre", "text");
      if (p.pm0) pre.appendChild(el("span", "cut", "… " + plural(p.pm0, "earlier message") + "\n"));
      p.pm.forEach(function (m) {
        if (m[0]) pre.appendChild(el("span", "role", m[0]));
        if (m[2]) pre.appendChild(cut(m[2], "before"));
        pre.appendChild(txt(m[1]));
      });
      body.appendChild(pre);
    }
    if (p.sm) body.appendChild(samplesBlock(p));
    if (p.s !== undefined) {
      var same = p.g === undefined;
      body.appendChild(el("h3", "", same ? "Output (identical on both sides)" : "Outputs, side by side"));
      if (same) {
        body.appendChild(outputText(p, null));
      } else {
        var sbs = el("div", "sbs");
        [["g", "golden (" + D.baseline + ")", 0], ["c", "candidate (" + D.candidate + ")", 1]].forEach(function (side) {
          var col = el("div");
          var h = el("h4", "", side[1]);
          if (p.f) h.appendChild(el("span", "fin", " · finished: " + p.f[side[2]]));
          add(col, h, outputText(p, side[0]));
          sbs.appendChild(col);
        });
        body.appendChild(sbs);
        body.appendChild(el("p", "note", "Plain: text both outputs share; highlighted: where they part."));
      }
    }
    if (p.w) {
      var w = p.w;
      body.appendChild(el("h3", "", "Tokens at the first divergence (token " + w.at + ")"));
      var grid = el("div", "tokens");
      add(grid, el("div", "side", "golden"), tokenRow(w, "g"), el("div", "side", "candidate"), tokenRow(w, "c"));
      body.appendChild(grid);
      body.appendChild(el("h3", "", "Top-k alternatives at token " + w.at));
      var margin = val(p, D.window.margin);
      if (isNum(margin)) body.appendChild(el("p", "note", "golden margin (top-1 − top-2 logprob): " + fmt(D.window.margin, margin) +
        " nat; below " + D.thresholds.near_tie_margin + " is a near-tie, from " + D.thresholds.confident_margin + " the golden was confident."));
      add(body, add(el("div", "topk"), topkTable(w.gk, "golden", w.gl), topkTable(w.ck, "candidate", w.cl)));
    }
    body.appendChild(el("h3", "", "Metrics"));
    var t = el("table", "metrics");
    var tb = el("tbody");
    D.metrics.forEach(function (name) {
      add(tb, add(el("tr"), el("th", "", name), el("td", "num", fmt(name, val(p, name))), el("td", "d", D.descriptions[name] || "")));
    });
    t.appendChild(tb);
    body.appendChild(t);
    body.scrollTop = 0;
  }

  // ---------------------------------------------------------------- sampled prompts

  // sm: [[golden text, candidate text], ...] sample by sample; sm0: samples not shown
  function samplesBlock(p) {
    var box = el("div", "samples");
    box.appendChild(el("h3", "", "Samples, side by side (" + plural(p.sm.length + (p.sm0 || 0), "sample") + " each)"));
    var t = el("table", "samples");
    add(t, add(el("thead"), add(el("tr"), el("th", "", "#"), el("th", "", "golden (" + D.baseline + ")"),
                                el("th", "", "candidate (" + D.candidate + ")"))));
    var tb = el("tbody");
    p.sm.forEach(function (pair, k) {
      add(tb, add(el("tr"), el("td", "num", String(k)), add(el("td"), el("pre", "text", pair[0])),
                  add(el("td"), el("pre", "text", pair[1]))));
    });
    t.appendChild(tb);
    box.appendChild(t);
    if (p.sm0) box.appendChild(el("p", "note", "… and " + plural(p.sm0, "more sample") + " (in the run directories)"));
    box.appendChild(el("p", "note", "Sample k of each side was drawn with the same seed; samples are compared as sets, not pair by pair."));
    return box;
  }

  // ---------------------------------------------------------------- diagnosis

  // dx: c causes, y why, mi mitigation, e explained by a probe, b batch variant, o [[probe, same, first divergence]]
  function diagnosisBlock(dx) {
    var box = el("div", "dx-detail");
    box.appendChild(el("h3", "", "Why it drifted"));
    var causes = el("p", "causes");
    dx.c.forEach(function (c) { causes.appendChild(el("span", "cause", c)); });
    causes.appendChild(el("span", "note", dx.e ? " shown by a probe that removed the drift" : " by elimination (no probe removed the drift)"));
    if (dx.b) causes.appendChild(el("span", "note", " · its output changed with the batch it was in"));
    box.appendChild(causes);
    var dl = el("dl", "dx-why");
    add(dl, el("dt", "", "why"), el("dd", "", dx.y), el("dt", "", "mitigation"), el("dd", "", dx.mi));
    box.appendChild(dl);
    if (dx.o && dx.o.length) {
      var t = el("table", "dx-obs");
      add(t, add(el("thead"), add(el("tr"), el("th", "", "probe"), el("th", "", "output"), el("th", "num", "first divergence"))));
      var tb = el("tbody");
      dx.o.forEach(function (o) {
        add(tb, add(el("tr", o[1] ? "same" : "differs"), el("td", "id", o[0]), el("td", "", o[1] ? "same" : "differs"),
                    el("td", "num", o[2] === null || o[2] === undefined ? "—" : o[2])));
      });
      t.appendChild(tb);
      box.appendChild(t);
    }
    return box;
  }

  function setupDiagnosis() {
    document.querySelectorAll("#diagnosis .dx-cause").forEach(function (b) {
      b.addEventListener("click", function () {
        state.classes.clear();
        state.cause = b.dataset.cause;
        state.page = 0;
        refresh();
        document.getElementById("prompts").scrollIntoView();
      });
    });
  }

  // ---------------------------------------------------------------- expected answers

  // a: [accepted answers, golden correct, candidate correct, found in golden, found in candidate]
  function answerBlock(a) {
    var box = el("div", "answer");
    box.appendChild(el("h3", "", "Expected answer"));
    var list = el("p", "accepted");
    list.appendChild(el("span", "note", a[0].length > 1 ? "accepted (any one): " : "accepted: "));
    a[0].forEach(function (x, i) {
      if (i) list.appendChild(el("span", "note", " | "));
      list.appendChild(el("code", "", x));
    });
    box.appendChild(list);
    var sides = el("div", "answer-sides");
    [["golden", a[1], a[3]], ["candidate", a[2], a[4]]].forEach(function (side) {
      var s = el("span", "answer-side " + (side[1] ? "ok" : "no"), side[0] + (side[1] ? " ✓ correct" : " ✗ incorrect"));
      if (side[1] && side[2] !== null && side[2] !== undefined) s.title = "contains “" + escapeControls(side[2]) + "”";
      sides.appendChild(s);
    });
    if (a[1] !== a[2]) sides.appendChild(el("span", "answer-flip " + (a[1] ? "lost" : "gained"), a[1] ? "answer lost" : "answer gained"));
    box.appendChild(sides);
    return box;
  }

  function setupAnswers() {
    document.querySelectorAll("#answers a.open-prompt, #noise a.open-prompt, #diagnosis a.open-prompt").forEach(function (a) {
      a.addEventListener("click", function (e) {
        var i = BY_ID.get(a.dataset.id);
        if (i === undefined) return;
        e.preventDefault();
        open(i);
      });
    });
  }

  function open(idx) {
    if (idx < 0 || idx >= P.length) return;
    current = idx;
    renderDetail(P[idx]);
    var aside = document.getElementById("detail");
    aside.hidden = false;
    history.replaceState(null, "", "#prompt=" + encodeURIComponent(P[idx].id));
    document.querySelectorAll("#prompt-rows tr").forEach(function (tr) {
      tr.classList.toggle("current", Number(tr.dataset.idx) === idx);
    });
  }

  function close() {
    document.getElementById("detail").hidden = true;
    current = -1;
    history.replaceState(null, "", location.pathname + location.search);
    document.querySelectorAll("#prompt-rows tr.current").forEach(function (tr) { tr.classList.remove("current"); });
  }

  function step(delta) {
    if (current < 0 || !rows.length) return;
    var at = rows.indexOf(current);
    var next = at < 0 ? 0 : Math.min(rows.length - 1, Math.max(0, at + delta));
    state.page = Math.floor(next / PAGE);
    renderRows();
    open(rows[next]);
  }

  function setupDetail() {
    document.getElementById("detail-close").addEventListener("click", close);
    document.getElementById("detail-next").addEventListener("click", function () { step(1); });
    document.getElementById("detail-prev").addEventListener("click", function () { step(-1); });
    document.addEventListener("keydown", function (e) {
      if (document.getElementById("detail").hidden) return;
      var tag = e.target && e.target.tagName;
      if (tag === "INPUT" || tag === "SELECT" || tag === "TEXTAREA") return;
      if (e.key === "Escape") close();
      else if (e.key === "j") step(1);
      else if (e.key === "k") step(-1);
    });
    document.querySelectorAll(".worst-table tr.open").forEach(function (tr) {
      function go() { var i = BY_ID.get(tr.dataset.id); if (i !== undefined) open(i); }
      tr.addEventListener("click", go);
      tr.addEventListener("keydown", function (e) { if (e.key === "Enter") go(); });
    });
    document.querySelectorAll(".counts .count").forEach(function (b) {
      b.addEventListener("click", function () { showOnly([b.dataset.class]); });
    });
    var more = document.querySelector(".show-worst");
    if (more) more.addEventListener("click", function (e) { e.preventDefault(); showOnly(["regression", "drift", "input_drift"]); });
    var h = location.hash;
    if (h.indexOf("#prompt=") === 0) {
      var id = null;
      try { id = decodeURIComponent(h.slice(8)); } catch (err) { id = null; }
      if (id !== null && BY_ID.has(id)) open(BY_ID.get(id));
    }
  }

  setupFilters();
  refresh();
  renderCharts();
  setupDetail();
  setupAnswers();
  setupDiagnosis();
  document.body.dataset.ready = "1";
})();
