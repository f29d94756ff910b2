// fragscope's explorable MDTP (report.html). Plain script, no library.
// Reads view/manifest.js, view/tiles/N.png, view/index/P-K-J.js and
// view/stacks.js beside the page, from file:// or any static server: every
// file is an <img> or a <script> that calls fragscopeView back.
// Blocks are never drawn here: the tiles are fragscope's own rendering;
// this script places them, draws axes and marks, and answers the pointer.
(function () {
  'use strict';
  var V = (window.fragscopeView = window.fragscopeView || {});
  var M = null; // the manifest
  var root = null;
  var S = null; // state of the panel shown
  var tiles = {}; // url -> Image
  var nodes = {}; // "p-k-j" -> {n, data(Float64Array 6n)} | 'loading'
  var stacks = null;
  var stackWaiters = [];
  V.requested = []; // tile urls in the order asked, for tests
  V.errors = [];

  // ---- ticks: the same steps and labels as fragscope's PNGs (output::ticks)
  var KIB = 1024, BYTE_UNITS = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
  var NS = [[1, 'ns'], [1e3, '\u00b5s'], [1e6, 'ms'], [1e9, 's']];
  var MINUTE = 60e9, HOUR = 3600e9;
  function decades(scale, from, to) {
    var c = [];
    for (var e = from; e <= to; e++) [1, 2, 5].forEach(function (m) { c.push(m * Math.pow(10, e) * scale); });
    return c;
  }
  function candidates(unit, top) {
    var c = [];
    if (unit === 'bytes') {
      for (var u = 0; u < BYTE_UNITS.length; u++) {
        var scale = Math.pow(KIB, u);
        if (u + 1 < BYTE_UNITS.length && top >= scale * KIB) {
          for (var k = 0; k < 10; k++) c.push((1 << k) * scale);
        } else c = c.concat(decades(scale, 0, 2));
      }
      c = c.concat(decades(Math.pow(KIB, 4), 3, 6));
    } else if (unit === 'time') {
      c = decades(1, 0, 9);
      [1, 2, 5, 10, 15, 30].forEach(function (m) { c.push(m * MINUTE); });
      [1, 2, 3, 6, 12, 24].forEach(function (m) { c.push(m * HOUR); });
      c = c.concat(decades(24 * HOUR, 0, 4));
    } else c = decades(1, -6, 15);
    c.sort(function (a, b) { return a - b; });
    return c.filter(function (v, i) { return i === 0 || v !== c[i - 1]; });
  }
  function step(lo, hi, max, unit) {
    var span = Math.abs(hi - lo);
    max = Math.max(max, 2);
    var all = candidates(unit, Math.max(Math.abs(lo), Math.abs(hi)));
    if (!(span > 0) || !isFinite(span)) return all[0];
    for (var i = 0; i < all.length; i++) {
      var s = all[i];
      if (Math.max(Math.floor(hi / s) - Math.ceil(lo / s) + 1, 0) <= max) return s;
    }
    return Math.pow(10, Math.ceil(Math.log10(span / (max - 1))));
  }
  function decimals(s) {
    for (var d = 0; d < 6; d++) {
      var x = s * Math.pow(10, d);
      if (Math.abs(Math.round(x) - x) < 1e-6) return d;
    }
    return 6;
  }
  function number(v, d) {
    var s = v.toFixed(d);
    return s.charAt(0) === '-' && /^-[0.]*$/.test(s) ? s.slice(1) : s;
  }
  function bytesLabel(v) {
    if (v <= 0) return '0 B';
    for (var u = BYTE_UNITS.length - 1; u >= 0; u--) {
      var x = v / Math.pow(KIB, u);
      if (x >= 1) {
        var d = decimals(x);
        if (d <= 2) return number(x, d) + ' ' + BYTE_UNITS[u];
      }
    }
    return number(v, 0) + ' B';
  }
  function ticks(lo, hi, max, unit) {
    var s = step(lo, hi, max, unit);
    if (!(hi > lo) || !isFinite(s)) return { at: [lo], labels: labels([lo], unit) };
    var at = [];
    for (var k = Math.ceil(lo / s); k <= Math.floor(hi / s); k++) at.push(k * s);
    return { at: at, labels: labels(at, unit) };
  }
  function labels(at, unit) {
    var st = at.length > 1 ? at[1] - at[0] : 1;
    var top = at.reduce(function (m, v) { return Math.max(m, Math.abs(v)); }, 0);
    if (unit === 'bytes') return at.map(bytesLabel);
    if (unit === 'time') {
      var tu = timeUnit(st, top), d = decimals(st / tu[0]);
      return at.map(function (v) { return v === 0 ? '0' : number(v / tu[0], d) + ' ' + tu[1]; });
    }
    return at.map(function (v) { return number(v, decimals(st)); });
  }
  function timeUnit(st, top) {
    var whole = function (x) { return Math.abs(x - Math.round(x)) < 1e-9; };
    if (st >= HOUR && whole(st / HOUR)) return [HOUR, 'h'];
    if (st >= MINUTE && whole(st / MINUTE)) return [MINUTE, 'min'];
    for (var i = NS.length - 1; i >= 0; i--) {
      if (NS[i][0] <= Math.max(top, st) && decimals(st / NS[i][0]) <= 2) return NS[i];
    }
    return NS[0];
  }
  V.ticks = ticks; // for tests: compared with output::ticks
  // The PNGs' tick counts for an axis this long (frame::x_ticks_for, y_ticks_for).
  function xTicksFor(px) { return Math.min(Math.max(Math.floor(px / 110), 2), 10); }
  function yTicksFor(px) { return Math.min(Math.max(Math.floor(px / 40), 2), 8); }

  function timeText(ns) {
    if (M.entries) return 'entry ' + Math.round(ns);
    var a = Math.abs(ns);
    if (a >= 1e9) return (ns / 1e9).toFixed(a >= 1e11 ? 0 : 3) + ' s';
    if (a >= 1e6) return (ns / 1e6).toFixed(3) + ' ms';
    if (a >= 1e3) return (ns / 1e3).toFixed(3) + ' \u00b5s';
    return ns + ' ns';
  }
  function durText(ns) {
    if (M.entries) { var n = Math.round(ns); return n + (n === 1 ? ' entry' : ' entries'); }
    return timeText(ns);
  }
  function bytesText(b) {
    if (b < 1024) return b + ' B';
    var u = Math.min(Math.floor(Math.log(b) / Math.log(1024)), 4);
    return (b / Math.pow(1024, u)).toFixed(2) + ' ' + BYTE_UNITS[u];
  }
  function esc(s) {
    return String(s).replace(/[&<>"]/g, function (c) { return { '&': '&amp;', '<': '&lt;', '>': '&gt;', '"': '&quot;' }[c]; });
  }
  function script(src, onerror) {
    var el = document.createElement('script');
    el.src = src;
    el.onload = function () { el.remove(); }; // it has called back: done
    el.onerror = function () { el.remove(); V.errors.push('cannot load ' + src); if (onerror) onerror(); };
    document.head.appendChild(el);
  }
  // Where tile column c of n starts: fragscope's own integer edges.
  function edgeT(c, n) { return Math.floor(M.span * c / n); }

  // ---- layout of the canvases
  var PAD = { left: 84, right: 16, top: 8, bottom: 34 };
  var TL_HEIGHT = 170;

  V.manifest = function (m) {
    M = m;
    root = document.getElementById('fragscope-view');
    if (!root) return;
    var sel = root.querySelector('select.panel');
    m.panels.forEach(function (p, i) {
      var o = document.createElement('option');
      o.value = i;
      o.textContent = p.label;
      sel.appendChild(o);
    });
    sel.style.display = m.panels.length > 1 ? '' : 'none';
    sel.onchange = function () { show(+sel.value); };
    root.querySelector('input.search').oninput = function (e) { search(e.target.value); };
    var sw = function (c) { return '<b style="background:' + c + '"></b> '; };
    root.querySelector('.legend').innerHTML =
      'Blocks: <i></i> ' + esc(bytesText(m.min_size)) + ' to ' + esc(bytesText(m.max_size)) + ' (darker: larger) \u00b7 ' +
      sw('#fff') + 'free' + (m.panels.some(function (p) { return p.background !== '#fff'; })
        ? ', reserved by the allocator \u00b7 ' + sw('rgb(225,225,225)') + 'not reserved' : '') +
      ' \u00b7 ' + sw('rgb(220,0,0)') + 'OOM (the bar at its top: the request, on the same scale)' +
      ' \u00b7 outlined: ' + sw('rgb(255,140,0)') + 'search hits, ' + sw('rgb(255,0,160)') + 'the block clicked' +
      '<br>Timeline: live bytes (blue), reserved (grey), the fragmentation score (black, 0\u2013100 on the right); ' +
      'the strip at its bottom is the online OOM risk: ' + sw(RISK.medium) + 'medium ' + sw(RISK.high) + 'high ' +
      sw(RISK.critical) + 'critical ' + sw(RISK.oom) + 'after an OOM (none: low or unknown).';
    root.querySelector('.oom-prev').onclick = function () { stepOom(-1); };
    root.querySelector('.oom-next').onclick = function () { stepOom(1); };
    document.addEventListener('keydown', function (e) {
      if (!S || e.target.tagName === 'INPUT' || e.ctrlKey || e.metaKey || e.altKey) return;
      if (e.key === 'n') stepOom(1);
      else if (e.key === 'p') stepOom(-1);
    });
    setup();
    // A view to open at: #fragscope-view=PANEL,T0,T1,O0,O1 (ns from the
    // first event, collapsed bytes), as the address bar shows it.
    var at = /^#fragscope-view=(\d+),([\d.e+]+),([\d.e+]+),([\d.e+]+),([\d.e+]+)$/.exec(location.hash);
    show(at && +at[1] < m.panels.length ? +at[1] : 0);
    if (at) {
      S.ta = +at[2]; S.tb = +at[3]; S.oa = +at[4]; S.ob = +at[5];
      clampView();
      draw();
    }
    if (location.hash.indexOf('#fragscope-view') === 0) root.scrollIntoView();
  };
  // The address bar follows the view, so that a link shares it.
  var hashTimer = null;
  function remember() {
    clearTimeout(hashTimer);
    hashTimer = setTimeout(function () {
      var full = S.ta <= 0 && S.tb >= M.span && S.oa <= 0 && S.ob >= S.p.total && S.i === 0;
      var h = full ? '#fragscope-view' : '#fragscope-view=' + [S.i, Math.round(S.ta), Math.round(S.tb), Math.round(S.oa), Math.round(S.ob)].join(',');
      if (location.hash !== h) try { history.replaceState(null, '', h); } catch (e) { /* a page that cannot: no link */ }
    }, 300);
  }

  // The OOM after (dir 1) or before (-1) the one shown, or the view's
  // centre: centred, the zoom kept (a tenth of the trace at most), its
  // request and largest live blocks outlined.
  function stepOom(dir) {
    var os = S.p.ooms;
    if (!os.length) return;
    var mid = (S.ta + S.tb) / 2, k = S.oomAt;
    if (k === undefined || k === null) {
      k = -1;
      for (var i = 0; i < os.length; i++) if (os[i].t <= mid) k = i;
      if (dir > 0) k = k + 1; else if (k >= 0 && os[k].t >= mid) k = k - 1;
    } else k = k + dir;
    k = Math.max(0, Math.min(os.length - 1, k));
    var o = os[k], w = Math.min(S.tb - S.ta, M.span / 10);
    S.ta = o.t - w / 2; S.tb = o.t + w / 2;
    clampView();
    S.oomAt = k;
    S.stepPins = o.pinned.filter(function (b) { return b[0] !== null; }).map(function (b) {
      return [o.t - w / 100, o.t + w / 100, b[0], b[1]];
    });
    root.querySelector('.oom-at').textContent = 'OOM ' + (k + 1) + ' of ' + os.length + ' at ' + timeText(o.t) + ': ' +
      bytesText(o.requested) + ' requested, ' + o.class.replace('_', ' ') + (o.site ? ', at ' + o.site : '');
    drawNow();
  }

  function setup() {
    var c = root.querySelector('canvas.mdtp');
    c.addEventListener('wheel', onWheel, { passive: false });
    c.addEventListener('mousedown', onDown);
    window.addEventListener('mousemove', onMove);
    window.addEventListener('mouseup', function () {
      if (!S) return;
      S.dragged = !!(S.drag && S.drag.moved); // the click that ends a drag pins nothing
      S.drag = null;
    });
    c.addEventListener('dblclick', function () { reset(); draw(); });
    c.addEventListener('click', onClick);
    c.addEventListener('mouseleave', function () { tip(null); });
    var t = root.querySelector('canvas.timeline');
    t.addEventListener('wheel', function (e) { onWheel(e, 'time'); }, { passive: false });
    t.addEventListener('mousedown', function (e) { onDown(e, 'time'); });
    t.addEventListener('dblclick', function () { reset(); draw(); });
    window.addEventListener('resize', function () { draw(); });
  }

  function show(i) {
    var p = M.panels[i];
    S = { i: i, p: p, drag: null, pinned: null, hits: null, oomPins: null, shown: null, oomAt: null };
    root.querySelector('.ooms').style.display = p.ooms.length ? '' : 'none';
    root.querySelector('.oom-at').textContent = p.ooms.length ? p.ooms.length + (p.ooms.length === 1 ? ' OOM' : ' OOMs') + ' in this panel' : '';
    hoverSeq++;
    searchSeq++;
    S.levels = Object.keys(p.levels).map(function (k) { var v = k.split('-'); return [+v[0], +v[1]]; });
    reset();
    draw();
    // A search typed before applies to this panel too.
    var box = root.querySelector('input.search');
    if (box.value) search(box.value);
  }
  function reset() {
    S.ta = 0; S.tb = M.span;
    S.oa = 0; S.ob = S.p.total;
  }

  function size(c, h) {
    var w = Math.max(root.clientWidth, 300);
    var dpr = window.devicePixelRatio || 1;
    if (c.width !== Math.round(w * dpr) || c.height !== Math.round(h * dpr)) {
      c.width = Math.round(w * dpr); c.height = Math.round(h * dpr);
      c.style.width = w + 'px'; c.style.height = h + 'px';
    }
    var g = c.getContext('2d');
    g.setTransform(dpr, 0, 0, dpr, 0, 0);
    return { g: g, w: w, h: h, pw: w - PAD.left - PAD.right, ph: h - PAD.top - PAD.bottom };
  }
  function xOf(t, d) { return PAD.left + (t - S.ta) / (S.tb - S.ta) * d.pw; }
  function yOf(o, d) { return PAD.top + d.ph - (o - S.oa) / (S.ob - S.oa) * d.ph; }

  // The level to draw: deep enough for a tile pixel per screen pixel on
  // each axis where one exists, else the deepest written (enlarged).
  function wanted(d) {
    var dpr = window.devicePixelRatio || 1;
    return [Math.ceil(Math.log2(Math.max(M.span / (S.tb - S.ta) * d.pw * dpr / M.tile, 1))),
      Math.ceil(Math.log2(Math.max(S.p.total / (S.ob - S.oa) * d.ph * dpr / M.tile, 1)))];
  }
  function level(d) {
    var w = wanted(d), wantT = w[0], wantA = w[1];
    var best = null;
    S.levels.forEach(function (l) {
      var score = [Math.min(l[0], wantT), Math.min(l[1], wantA), -l[0], -l[1]];
      if (!best || cmp(score, best.s) > 0) best = { l: l, s: score };
    });
    return best.l;
  }
  function cmp(a, b) {
    for (var i = 0; i < a.length; i++) if (a[i] !== b[i]) return a[i] - b[i];
    return 0;
  }

  // A search is for the blocks in view: asked again once the view settles.
  var researchTimer = null, searchedView = '';
  function researchSoon() {
    var box = root.querySelector('input.search');
    var key = S.i + ':' + S.ta + ':' + S.tb;
    if (!box.value.trim() || key === searchedView) return;
    clearTimeout(researchTimer);
    researchTimer = setTimeout(function () { search(box.value); }, 250);
  }
  var pending = false;
  function draw() {
    if (pending) return;
    pending = true;
    requestAnimationFrame(function () { pending = false; drawNow(); });
  }
  V.redraw = function () { drawNow(); return V.state(); };

  function drawNow() {
    if (!S) return;
    var started = performance.now();
    var d = size(root.querySelector('canvas.mdtp'), Math.max(320, Math.min(560, Math.round(root.clientWidth * 0.42))));
    var g = d.g;
    g.clearRect(0, 0, d.w, d.h);
    g.fillStyle = S.p.background;
    g.fillRect(PAD.left, PAD.top, d.pw, d.ph);
    var L = level(d);
    g.save();
    g.beginPath(); g.rect(PAD.left, PAD.top, d.pw, d.ph); g.clip();
    // While the tiles of a new level load, the level shown before stands
    // in with the tiles it already has.
    if (S.shown && (S.shown[0] !== L[0] || S.shown[1] !== L[1])) drawLevel(g, d, S.shown, true);
    var n = drawLevel(g, d, L, false), missing = n[0], shown = n[1];
    if (!missing) S.shown = L;
    marks(g, d);
    g.restore();
    axes(g, d);
    timeline();
    researchSoon();
    remember();
    var st = root.querySelector('.status');
    var finest = L[0] === S.p.zt && L[1] === S.p.za && (level(d)[0] < wanted(d)[0] || level(d)[1] < wanted(d)[1]);
    st.textContent = timeText(S.ta) + ' \u2013 ' + timeText(S.tb) + ' of ' + timeText(M.span) +
      ' \u00b7 offsets ' + bytesLabel(S.oa) + ' \u2013 ' + bytesLabel(S.ob) +
      ' \u00b7 detail: time ' + L[0] + ' of ' + S.p.zt + ', address ' + L[1] + ' of ' + S.p.za +
      (finest ? ' (the finest written: zooming further enlarges its pixels)' : '') +
      (missing ? ' \u00b7 loading ' + missing + ' tiles' : '') +
      (S.p.index.indexed < S.p.index.blocks ? ' \u00b7 ' + S.p.index.indexed + ' of ' + S.p.index.blocks +
        ' blocks can be pointed at: the largest, from ' + bytesText(S.p.index.min_size) : '');
    var now = performance.now();
    V.last = { level: L, ms: now - started, missing: missing, shown: shown };
    // For the budgets: the first complete picture after navigation, and
    // each zoom step from its wheel event to its complete picture.
    if (stepAt !== null && !stepFramed) { V.frames.push(now - stepAt); stepFramed = true; }
    if (!missing) {
      if (V.firstComplete === undefined) V.firstComplete = now;
      if (stepAt !== null) { V.steps.push(now - stepAt); stepAt = null; }
    }
  }
  var stepAt = null, stepFramed = false;
  V.steps = []; // ms from each zoom or pan event to its complete picture
  V.frames = []; // ms from each zoom or pan event to its first frame
  // The client pixel showing (t, o), for tests.
  V.pixelOf = function (t, o) {
    var r = root.querySelector('canvas.mdtp').getBoundingClientRect();
    var d = { pw: r.width - PAD.left - PAD.right, ph: r.height - PAD.top - PAD.bottom };
    return { x: r.left + xOf(t, d), y: r.top + yOf(o, d), plot: { x: r.left + PAD.left, y: r.top + PAD.top, w: d.pw, h: d.ph } };
  };

  // Draws the tiles of level L in view; with `cached`, only those loaded.
  // Returns [tiles still loading, tiles drawn].
  function drawLevel(g, d, L, cached) {
    var nt = 1 << L[0], na = 1 << L[1];
    var ids = S.p.levels[L[0] + '-' + L[1]];
    var tw = M.span / nt, oh = S.p.total / na;
    // Tiles that only touch the view's edge (to rounding) are not in it.
    var E = 1e-7;
    var tx0 = Math.max(0, Math.floor(S.ta / tw + E)), tx1 = Math.min(nt - 1, Math.ceil(S.tb / tw - E) - 1);
    var ty0 = Math.max(0, Math.floor(S.oa / oh + E)), ty1 = Math.min(na - 1, Math.ceil(S.ob / oh - E) - 1);
    var scaleX = (tw / (S.tb - S.ta) * d.pw) / M.tile, scaleY = (oh / (S.ob - S.oa) * d.ph) / M.tile;
    g.imageSmoothingEnabled = scaleX < 1 || scaleY < 1;
    g.imageSmoothingQuality = 'high';
    var missing = 0, shown = 0;
    for (var ty = ty0; ty <= ty1; ty++) {
      for (var tx = tx0; tx <= tx1; tx++) {
        var id = ids[ty * nt + tx];
        if (id < 0) continue; // nothing drawn there: the background
        var img = cached ? tiles['view/tiles/' + id + '.png'] : tile(id);
        if (!img || img.failed) continue; // a tile that cannot load stays background
        var x0 = xOf(edgeT(tx, nt), d), x1 = xOf(edgeT(tx + 1, nt), d);
        var y1 = yOf(ty * oh, d), y0 = yOf((ty + 1) * oh, d);
        if (img.complete && img.naturalWidth) {
          g.drawImage(img, x0, y0, x1 - x0, y1 - y0);
          shown++;
        } else missing++;
      }
    }
    return [missing, shown];
  }

  function tile(id) {
    var url = 'view/tiles/' + id + '.png';
    var img = tiles[url];
    if (!img) {
      img = tiles[url] = new Image();
      img.onload = draw;
      img.onerror = function () { img.failed = true; V.errors.push('cannot load ' + url); draw(); };
      V.requested.push(url);
      img.src = url;
    }
    return img;
  }

  // OOMs (a red line, the request as a red bar at the top), iteration
  // starts (grey, when 4 px apart or more), search hits, pinned blocks.
  var STAGE_COLOURS = ['rgba(31,119,180,0.45)', 'rgba(255,127,14,0.45)', 'rgba(44,160,44,0.45)',
    'rgba(148,103,189,0.45)', 'rgba(140,86,75,0.45)', 'rgba(227,119,194,0.45)'];

  function marks(g, d) {
    if (V.marksOff) return; // tests: the tiles alone
    var its = S.p.iterations.filter(function (t) { return t >= S.ta && t <= S.tb; });
    if (its.length && its.length <= d.pw / 4) {
      g.strokeStyle = 'rgba(120,120,120,0.5)';
      g.lineWidth = 1;
      its.forEach(function (t) { var x = Math.round(xOf(t, d)) + 0.5; g.beginPath(); g.moveTo(x, PAD.top); g.lineTo(x, PAD.top + d.ph); g.stroke(); });
    }
    // Stage bands (record_function ranges, the outer two levels): a strip
    // per level along the top, named where a run is wide enough.
    (S.p.stages || []).forEach(function (st, k) {
      var y = PAD.top + 1 + st.depth * 12;
      var colour = STAGE_COLOURS[k % STAGE_COLOURS.length];
      st.spans.forEach(function (sp) {
        if (sp[1] < S.ta || sp[0] > S.tb) return;
        var x0 = xOf(Math.max(sp[0], S.ta), d), x1 = Math.max(xOf(Math.min(sp[1], S.tb), d), x0 + 1);
        g.fillStyle = colour;
        g.fillRect(x0, y, x1 - x0, 10);
        if (x1 - x0 > 8 * st.name.length) {
          g.fillStyle = '#222'; g.font = '9px system-ui, sans-serif';
          g.textAlign = 'left'; g.textBaseline = 'top';
          g.fillText(st.name, x0 + 2, y);
        }
      });
    });
    S.p.ooms.forEach(function (o) {
      if (o.t < S.ta || o.t > S.tb) return;
      var x = Math.round(xOf(o.t, d)) + 0.5;
      g.strokeStyle = 'rgb(220,0,0)'; g.lineWidth = 1;
      g.beginPath(); g.moveTo(x, PAD.top); g.lineTo(x, PAD.top + d.ph); g.stroke();
      var bar = Math.max(2, Math.min(d.ph, o.requested / (S.ob - S.oa) * d.ph));
      g.fillStyle = 'rgb(255,0,0)';
      g.fillRect(x - 1.5, PAD.top, 3, bar);
    });
    var box = function (b, colour, width) {
      var x0 = xOf(b[0], d), x1 = Math.max(xOf(b[1], d), x0 + 2);
      var y0 = yOf(b[2] + b[3], d), y1 = Math.max(yOf(b[2], d), y0 + 2);
      g.strokeStyle = colour; g.lineWidth = width;
      g.strokeRect(x0, y0, x1 - x0, y1 - y0);
    };
    if (S.hits) S.hits.forEach(function (b) { box(b, 'rgb(255,140,0)', 1.5); });
    if (S.oomPins) S.oomPins.forEach(function (b) { box(b, 'rgb(220,0,0)', 2); });
    if (S.stepPins) S.stepPins.forEach(function (b) { box(b, 'rgb(220,0,0)', 2); });
    if (S.pinned) box(S.pinned, 'rgb(255,0,160)', 2);
  }

  function axes(g, d) {
    g.fillStyle = '#222'; g.strokeStyle = '#222'; g.lineWidth = 1;
    g.font = '12px system-ui, sans-serif';
    g.strokeRect(PAD.left - 0.5, PAD.top - 0.5, d.pw + 1, d.ph + 1);
    var xt = ticks(S.ta, S.tb, xTicksFor(d.pw), M.entries ? 'count' : 'time');
    g.textAlign = 'center'; g.textBaseline = 'top';
    xt.at.forEach(function (t, i) {
      var x = Math.round(xOf(t, d)) + 0.5;
      g.beginPath(); g.moveTo(x, PAD.top + d.ph); g.lineTo(x, PAD.top + d.ph + 5); g.stroke();
      g.fillText(xt.labels[i], x, PAD.top + d.ph + 7);
    });
    g.save();
    g.fillStyle = '#555';
    g.textAlign = 'right'; g.textBaseline = 'top';
    g.fillText(M.entries ? 'trace entry (no timestamps)' : 'time since the first event', PAD.left + d.pw, PAD.top + d.ph + 20);
    g.translate(12, PAD.top + d.ph / 2); g.rotate(-Math.PI / 2); g.textAlign = 'center';
    g.fillText('address offset (collapsed)', 0, 0);
    g.restore();
    var yt = ticks(S.oa, S.ob, yTicksFor(d.ph), 'bytes');
    g.textAlign = 'right'; g.textBaseline = 'middle';
    yt.at.forEach(function (o, i) {
      var y = Math.round(yOf(o, d)) + 0.5;
      g.beginPath(); g.moveTo(PAD.left - 5, y); g.lineTo(PAD.left, y); g.stroke();
      g.fillText(yt.labels[i], PAD.left - 7, y);
    });
  }

  // ---- the timeline under the MDTP: live, reserved, score, OOM risk
  var RISK = { low: null, medium: 'rgba(255,224,178,0.9)', high: 'rgba(255,183,77,0.9)', critical: 'rgba(229,57,53,0.8)', oom: 'rgba(183,28,28,0.9)' };
  function timeline() {
    var d = size(root.querySelector('canvas.timeline'), TL_HEIGHT);
    var g = d.g, T = S.p.timeline;
    g.clearRect(0, 0, d.w, d.h);
    var ph = d.ph;
    var yb = function (v, top) { return PAD.top + ph - v / top * ph; };
    var top = 1;
    for (var i = 0; i < T.t.length; i++) top = Math.max(top, T.live[i], T.reserved[i] || 0);
    top *= 1.05;
    // The risk strip along the bottom.
    for (i = 0; i + 1 < T.t.length; i++) {
      var c = RISK[T.risk[i]];
      if (!c || T.t[i + 1] < S.ta || T.t[i] > S.tb) continue;
      g.fillStyle = c;
      g.fillRect(xOf(T.t[i], d), PAD.top + ph - 8, Math.max(1, xOf(T.t[i + 1], d) - xOf(T.t[i], d)), 8);
    }
    var line = function (vals, colour, width, scaleTop) {
      g.strokeStyle = colour; g.lineWidth = width; g.beginPath();
      var started = false;
      for (var i = 0; i < T.t.length; i++) {
        if (vals[i] === null || vals[i] === undefined) continue;
        if (T.t[i] < S.ta && !(i + 1 < T.t.length && T.t[i + 1] >= S.ta)) continue;
        if (T.t[i] > S.tb && i > 0 && T.t[i - 1] > S.tb) break;
        var x = xOf(T.t[i], d), y = yb(vals[i], scaleTop);
        if (started) g.lineTo(x, y); else { g.moveTo(x, y); started = true; }
      }
      g.stroke();
    };
    g.save(); g.beginPath(); g.rect(PAD.left, PAD.top, d.pw, ph); g.clip();
    if (T.reserved.some(function (v) { return v !== null; })) line(T.reserved, 'rgb(150,150,150)', 1.5, top);
    line(T.live, 'rgb(31,119,180)', 2, top);
    line(T.score, 'rgba(0,0,0,0.75)', 1, 100);
    S.p.ooms.forEach(function (o) {
      if (o.t < S.ta || o.t > S.tb) return;
      var x = Math.round(xOf(o.t, d)) + 0.5;
      g.strokeStyle = 'rgb(220,0,0)'; g.beginPath(); g.moveTo(x, PAD.top); g.lineTo(x, PAD.top + ph); g.stroke();
    });
    g.restore();
    // Axes: bytes on the left, the score's 0-100 on the right.
    g.fillStyle = '#222'; g.strokeStyle = '#222'; g.lineWidth = 1; g.font = '12px system-ui, sans-serif';
    g.strokeRect(PAD.left - 0.5, PAD.top - 0.5, d.pw + 1, ph + 1);
    var yt = ticks(0, top, yTicksFor(ph), 'bytes');
    g.textAlign = 'right'; g.textBaseline = 'middle';
    yt.at.forEach(function (v, i) { g.fillText(yt.labels[i], PAD.left - 7, yb(v, top)); });
    // The score's 0-100 on the right, inside the plot's edge.
    g.textAlign = 'right';
    [0, 50, 100].forEach(function (v) { g.fillText(String(v), PAD.left + d.pw - 4, Math.min(Math.max(yb(v, 100), PAD.top + 7), PAD.top + ph - 14)); });
    var xt = ticks(S.ta, S.tb, xTicksFor(d.pw), M.entries ? 'count' : 'time');
    g.textAlign = 'center'; g.textBaseline = 'top';
    xt.at.forEach(function (t, i) { g.fillText(xt.labels[i], xOf(t, d), PAD.top + ph + 7); });

  }

  // ---- zoom and pan
  function plotPoint(e) {
    var c = root.querySelector('canvas.mdtp'), r = c.getBoundingClientRect();
    var d = { pw: r.width - PAD.left - PAD.right, ph: r.height - PAD.top - PAD.bottom };
    var x = e.clientX - r.left, y = e.clientY - r.top;
    return {
      x: x, y: y, d: d,
      inside: x >= PAD.left && x < PAD.left + d.pw && y >= PAD.top && y < PAD.top + d.ph,
      t: S.ta + (x - PAD.left) / d.pw * (S.tb - S.ta),
      o: S.oa + (PAD.top + d.ph - y) / d.ph * (S.ob - S.oa),
    };
  }
  // Which axes a gesture moves: over the time axis or with Shift, time
  // only; over the address axis or with Alt, address only; else both.
  function axesOf(e, forced) {
    if (forced) return forced;
    var p = plotPoint(e);
    if (e.shiftKey || p.y >= PAD.top + p.d.ph) return 'time';
    if (e.altKey || p.x < PAD.left) return 'addr';
    return 'both';
  }
  function clampView() {
    var minT = Math.max(M.span / Math.pow(2, 40), 1), minO = Math.max(S.p.total / Math.pow(2, 40), 1);
    if (S.tb - S.ta < minT) { var mt = (S.ta + S.tb) / 2; S.ta = mt - minT / 2; S.tb = mt + minT / 2; }
    if (S.ob - S.oa < minO) { var mo = (S.oa + S.ob) / 2; S.oa = mo - minO / 2; S.ob = mo + minO / 2; }
    var w = Math.min(S.tb - S.ta, M.span);
    S.ta = Math.min(Math.max(S.ta, 0), M.span - w); S.tb = S.ta + w;
    var h = Math.min(S.ob - S.oa, S.p.total);
    S.oa = Math.min(Math.max(S.oa, 0), S.p.total - h); S.ob = S.oa + h;
  }
  function zoomAt(p, factor, which) {
    if (which !== 'addr') { S.ta = p.t - (p.t - S.ta) * factor; S.tb = p.t + (S.tb - p.t) * factor; }
    if (which !== 'time') { S.oa = p.o - (p.o - S.oa) * factor; S.ob = p.o + (S.ob - p.o) * factor; }
    clampView();
  }
  function onWheel(e, forced) {
    if (!S) return;
    e.preventDefault();
    var p = plotPoint(e);
    // A trackpad pinch comes as a wheel with ctrlKey.
    var factor = Math.pow(2, e.deltaY * (e.deltaMode === 1 ? 0.05 : 0.002) * (e.ctrlKey ? 4 : 1));
    zoomAt(p, factor, axesOf(e, forced));
    if (stepAt === null) { stepAt = performance.now(); stepFramed = false; }
    draw();
  }
  V.setView = function (ta, tb, oa, ob) { S.ta = ta; S.tb = tb; S.oa = oa; S.ob = ob; clampView(); drawNow(); return V.state(); };
  V.state = function () {
    return S && { panel: S.i, ta: S.ta, tb: S.tb, oa: S.oa, ob: S.ob, level: V.last && V.last.level, requested: V.requested.length };
  };
  function onDown(e, forced) {
    if (!S || e.button !== 0) return;
    S.drag = { x: e.clientX, y: e.clientY, ta: S.ta, tb: S.tb, oa: S.oa, ob: S.ob, which: forced || 'both', moved: false };
    e.preventDefault();
  }
  function onMove(e) {
    if (!S) return;
    if (S.drag) {
      var p = plotPoint(e), dr = S.drag;
      var dx = e.clientX - dr.x, dy = e.clientY - dr.y;
      if (Math.abs(dx) + Math.abs(dy) > 2) dr.moved = true;
      var dt = dx / p.d.pw * (dr.tb - dr.ta), dO = dy / p.d.ph * (dr.ob - dr.oa);
      S.ta = dr.ta - dt; S.tb = dr.tb - dt;
      if (stepAt === null) { stepAt = performance.now(); stepFramed = false; }
      if (dr.which !== 'time') { S.oa = dr.oa + dO; S.ob = dr.ob + dO; }
      clampView();
      draw();
      return;
    }
    if (e.target === root.querySelector('canvas.mdtp')) hover(e);
  }

  // ---- pointing at a block
  function nodeKey(pi, k, j) { return pi + '-' + k + '-' + j; }
  function nodeDone(key, nd) {
    nodes[key] = nd;
    var w = nodeWaiters[key] || [];
    delete nodeWaiters[key];
    w.forEach(function (f) { f(); });
  }
  V.node = function (p, k, j, n, node0, b64) {
    var key = nodeKey(p, k, j);
    var bin = atob(b64), bytes = new Uint8Array(bin.length);
    for (var i = 0; i < bin.length; i++) bytes[i] = bin.charCodeAt(i);
    new Response(new Blob([bytes]).stream().pipeThrough(new DecompressionStream('deflate'))).arrayBuffer().then(function (buf) {
      var u = new Uint8Array(buf), pos = 0;
      var next = function () {
        var v = 0, mul = 1, b;
        do { b = u[pos++]; v += (b & 0x7f) * mul; mul *= 128; } while (b & 0x80);
        return v;
      };
      var data = new Float64Array(n * 6), prev = node0;
      for (var r = 0; r < n; r++) {
        var start = prev + next(), dur = next();
        data[r * 6] = start; data[r * 6 + 1] = start + dur;
        data[r * 6 + 2] = next(); data[r * 6 + 3] = next();
        data[r * 6 + 4] = next() - 1; data[r * 6 + 5] = next();
        prev = start;
      }
      nodeDone(key, { n: n, data: data });
    }).catch(function (err) {
      V.errors.push('index ' + key + ': ' + err);
      nodeDone(key, { n: 0, data: new Float64Array(0) });
    });
  };
  var nodeWaiters = {};
  function withNode(pi, k, j, f) {
    var key = nodeKey(pi, k, j);
    var listed = M.panels[pi].index.nodes[k];
    if (!listed || listed.indexOf(j) < 0) return f();
    if (nodes[key]) return f();
    if (nodeWaiters[key]) { nodeWaiters[key].push(f); return; }
    nodeWaiters[key] = [f];
    script('view/index/' + key + '.js', function () { nodeDone(key, { n: 0, data: new Float64Array(0) }); });
  }
  // Every node that may hold a block over [t0, t1]: per level, the nodes
  // crossed (up to `cap` per level, the rest left out).
  function nodesOver(t0, t1, cap) {
    var out = [];
    for (var k = 0; k <= S.p.index.depth; k++) {
      var n = Math.pow(2, k);
      var j0 = Math.max(0, Math.floor(t0 / M.span * n)), j1 = Math.min(n - 1, Math.floor(t1 / M.span * n));
      if (j1 - j0 >= cap) { var m = Math.floor((t0 + t1) / 2 / M.span * n); j0 = j1 = Math.min(n - 1, Math.max(0, m)); }
      for (var j = j0; j <= j1; j++) out.push([k, j]);
    }
    return out;
  }
  function withNodes(pi, list, f) {
    var left = list.length;
    if (!left) return f();
    list.forEach(function (kj) { withNode(pi, kj[0], kj[1], function () { if (--left === 0) f(); }); });
  }
  function blocksIn(pi, list, visit) {
    list.forEach(function (kj) {
      var nd = nodes[nodeKey(pi, kj[0], kj[1])];
      if (!nd) return;
      for (var r = 0; r < nd.n; r++) visit(nd.data.subarray(r * 6, r * 6 + 6));
    });
  }
  // The block under a screen point: one that holds the point, else the
  // largest crossing its pixel.
  function blockAt(p, f) {
    var dt = (S.tb - S.ta) / p.d.pw, dO = (S.ob - S.oa) / p.d.ph;
    var list = nodesOver(p.t - dt / 2, p.t + dt / 2, 4), pi = S.i;
    withNodes(pi, list, function () {
      if (!S || S.i !== pi) return; // another panel since
      var exact = null, near = null;
      blocksIn(pi, list, function (b) {
        if (b[1] < p.t - dt / 2 || b[0] > p.t + dt / 2 || b[2] + b[3] < p.o - dO / 2 || b[2] > p.o + dO / 2) return;
        if (b[0] <= p.t && p.t <= b[1] && b[2] <= p.o && p.o < b[2] + b[3]) { if (!exact || b[3] < exact[3]) exact = b; }
        else if (!near || b[3] > near[3]) near = b;
      });
      var b = exact || near;
      V.lastHit = b ? { exact: !!exact, block: Array.prototype.slice.call(b) } : null;
      f(b ? Array.prototype.slice.call(b) : null);
    });
  }
  function oomAt(p) {
    var best = null;
    S.p.ooms.forEach(function (o) {
      var x = PAD.left + (o.t - S.ta) / (S.tb - S.ta) * p.d.pw;
      if (Math.abs(x - p.x) <= 4 && (!best || Math.abs(o.t - p.t) < Math.abs(best.t - p.t))) best = o;
    });
    return best;
  }
  function describe(b) {
    var site = b[4] >= 0 ? M.sites[b[4]] || '(stack ' + b[4] + ')' : '<no stack recorded>';
    // A block live at the end and one freed by the last event both end
    // at the trace's last instant: the page cannot tell them apart.
    var end = b[1] >= M.span ? 'not before the trace\'s last event (' + timeText(b[1]) + ')' : timeText(b[1]);
    var stream = S.p.index.streams[b[5]];
    return '<b>' + esc(bytesText(b[3])) + '</b> at offset ' + esc(bytesText(b[2])) +
      '<br>allocated ' + esc(timeText(b[0])) + ', freed ' + esc(end) +
      '<br>lifetime ' + esc(durText(b[1] - b[0])) +
      '<br>' + esc(S.p.label) + (stream && stream !== '0x0' ? ', stream ' + esc(stream) : '') +
      '<br>call site: <code>' + esc(site) + '</code>';
  }
  function describeOom(o) {
    return '<b>OOM</b> at ' + esc(timeText(o.t)) + ': request of <b>' + esc(bytesText(o.requested)) + '</b> failed' +
      '<br>class: <b>' + esc(o.class) + '</b>' +
      '<br>live ' + esc(bytesText(o.live)) + ', largest gap ' + esc(bytesText(o.largest_gap)) +
      // Under PyTorch's allocator the free memory is CUDA's and the unused
      // bytes of its segments; CUDA's own figure is the one in its error.
      (o.device_free !== null && o.device_free !== undefined
        ? (o.cuda_free !== null && o.cuda_free !== undefined
          ? ', free ' + esc(bytesText(o.device_free)) + ' (CUDA reported ' + esc(bytesText(o.cuda_free)) + ', the rest in PyTorch\'s cache)'
          : ', device free ' + esc(bytesText(o.device_free)))
        : '') +
      (o.retries ? '<br>retried ' + o.retries + ' time' + (o.retries === 1 ? '' : 's') + ' by the program, failing again' : '') +
      (o.site ? '<br>requested at <code>' + esc(o.site) + '</code>' : '') +
      (o.pinned.length ? '<br>outlined in red: the ' + o.pinned.length + ' largest blocks live then (the largest, not necessarily the cause)' : '');
  }
  var hoverSeq = 0;
  function hover(e) {
    var p = plotPoint(e);
    if (!p.inside) { tip(null); return; }
    var o = oomAt(p);
    if (o) {
      hoverSeq++; // a block still loading must not replace this
      S.oomPins = o.pinned.filter(function (b) { return b[0] !== null; }).map(function (b) {
        var w = (S.tb - S.ta) / p.d.pw * 6;
        return [o.t - w, o.t + w, b[0], b[1]];
      });
      tip(describeOom(o), e);
      draw();
      return;
    }
    if (S.oomPins) { S.oomPins = null; draw(); }
    var seq = ++hoverSeq;
    blockAt(p, function (b) {
      if (seq !== hoverSeq) return;
      S.hover = b;
      var note = S.p.index.indexed < S.p.index.blocks ? 'no block here of those that can be pointed at (the ' +
        S.p.index.indexed + ' largest, from ' + esc(bytesText(S.p.index.min_size)) + ')' : 'free space';
      tip(b ? describe(b) : note, e);
    });
  }
  function tip(html, e) {
    var el = root.querySelector('.tip');
    if (!html) { hoverSeq++; el.style.display = 'none'; return; }
    el.innerHTML = html;
    el.style.display = 'block';
    var r = root.getBoundingClientRect();
    el.style.left = Math.min(e.clientX - r.left + 14, r.width - 340) + 'px';
    el.style.top = (e.clientY - r.top + 14) + 'px';
  }
  function onClick(e) {
    if (S.dragged) return;
    var p = plotPoint(e);
    if (!p.inside) return;
    blockAt(p, function (b) {
      S.pinned = b;
      var el = root.querySelector('.details');
      if (!b) { el.innerHTML = ''; draw(); return; }
      el.innerHTML = describe(b) + '<br><i>loading the call stack\u2026</i>';
      withStacks(function () {
        var frames = b[4] >= 0 && stacks[b[4]];
        el.innerHTML = describe(b) + (frames ? '<pre>' + esc(frames.join('\n')) + '</pre>' : '<br>no call stack recorded');
      });
      draw();
    });
  }
  V.stacks = function (s) {
    stacks = s;
    var w = stackWaiters; stackWaiters = [];
    w.forEach(function (f) { f(); });
  };
  function withStacks(f) {
    if (stacks) return f();
    stackWaiters.push(f);
    if (stackWaiters.length === 1) script('view/stacks.js');
  }

  // ---- search: blocks whose call site (or any frame) holds the text
  var searchSeq = 0;
  function search(text) {
    text = text.trim().toLowerCase();
    var out = root.querySelector('.found'), seq = ++searchSeq, pi = S.i;
    searchedView = S.i + ':' + S.ta + ':' + S.tb;
    if (!text) { S.hits = null; out.textContent = ''; draw(); return; }
    withStacks(function () {
      if (seq !== searchSeq) return; // the text or the panel changed since
      var ids = {};
      Object.keys(M.sites).forEach(function (id) {
        var frames = stacks[id] || [];
        if (M.sites[id].toLowerCase().indexOf(text) >= 0 || frames.some(function (f) { return f.toLowerCase().indexOf(text) >= 0; })) ids[id] = true;
      });
      var list = nodesOver(S.ta, S.tb, 1 << 20);
      withNodes(pi, list, function () {
        if (seq !== searchSeq) return;
        var hits = [], bytes = 0;
        blocksIn(pi, list, function (b) {
          if (b[4] >= 0 && ids[b[4]] && b[1] >= S.ta && b[0] <= S.tb) { hits.push(Array.prototype.slice.call(b)); bytes += b[3]; }
        });
        S.hits = hits;
        out.textContent = hits.length + ' blocks in view (' + bytesText(bytes) + ' allocated) from ' + Object.keys(ids).length + ' call sites';
        draw();
      });
    });
  }
})();
