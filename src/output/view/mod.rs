//! The explorable view of `report.html`: the MDTP as a tile pyramid the
//! page zooms through, with an index of the blocks under the cursor.
//!
//! Written beside the report in `view/`, and read by the page from
//! `file://` with no server: tiles as `<img>`, everything else as scripts
//! that call the page back (a browser refuses `fetch` of `file://`).
//!
//! - `view/manifest.js`: the panels, their levels and which tile file
//!   each tile is, the timeline series, OOMs and iteration boundaries.
//! - `view/tiles/N.png`: 256 × 256 tiles. The deepest level of a panel is
//!   drawn by the MDTP's own rasteriser ([`crate::output::plot::raster_panel`]),
//!   one column of tiles at a time; every coarser level is the one below
//!   it averaged 2 × 2 (or 2 × 1), which is exactly each pixel's coverage.
//!   Identical tiles share one file; a tile with nothing on it has none.
//! - `view/index/P-K-J.js`: the blocks of panel P in node J of time level
//!   K. A block is kept once, in the deepest node whose time range holds
//!   its whole life (a segment tree over time), so hovering at a time reads
//!   one small node per level.
//! - `view/stacks.js`: the full call stack of each call site named, read
//!   when a block is clicked.
//!
//! **Depth.** Time levels go down until four block lives in five are at
//! least [`MIN_LIFE_PX`] pixels wide, address levels until the median block is
//! [`MIN_BLOCK_PX`] pixels tall, within a budget of pixels per event
//! ([`PX_PER_EVENT`]) so that the view costs a fixed share of the analysis;
//! time goes deeper first. Past the deepest level the page enlarges its
//! tiles, pixel for pixel.
//!
//! **Index.** Every block when a panel has at most [`MAX_INDEXED`] of
//! them; else the largest [`MAX_INDEXED`], and the manifest says from what
//! size on, so the page can say what it cannot point at.

use std::collections::BTreeMap;
use std::path::Path;

use ahash::AHashMap;
use anyhow::{Context, Result};
use serde_json::{Value, json};

use crate::analysis::Analysis;
use crate::analysis::layout::{Layout, Lifetime};
use crate::output::plot::{Collapse, PanelGeometry, PlotConfig, encode_png, panel_pids, raster_panel};
use crate::trace::event::NO_STACK;

/// Tile side, in pixels.
pub const TILE: u32 = 256;
/// Time levels go down until four block lives in five are this many pixels wide.
pub const MIN_LIFE_PX: f64 = 4.0;
/// Address levels go down until the median block is this many pixels tall.
pub const MIN_BLOCK_PX: f64 = 2.0;
/// Pixels of the deepest level per event of the trace (all panels), and the
/// floor for small traces: what the view may cost in time and memory.
pub const PX_PER_EVENT: f64 = 1.0;
pub const MIN_PIXELS: u64 = 1 << 20;
/// The view's files may take this share of the trace's own size (its
/// Parquet parts, or the snapshot file), and at least [`MIN_VIEW_BYTES`]:
/// [`TILE_SHARE`] of it for tiles, the rest for the block index.
pub const VIEW_SHARE: f64 = 0.12;
pub const MIN_VIEW_BYTES: u64 = 2 << 20;
pub const TILE_SHARE: f64 = 0.7;
/// What an indexed block costs, compressed, to size the index from its
/// budget (measured: 16 bytes on a 10 M-event synthetic trace).
const INDEX_BYTES_PER_BLOCK: u64 = 16;
/// Deepest levels at all.
pub const MAX_TIME_LEVEL: u32 = 14;
pub const MAX_ADDR_LEVEL: u32 = 3;
/// Blocks indexed per panel at most.
pub const MAX_INDEXED: usize = 200_000;

/// What was written, for the page and the log.
#[derive(Clone, Debug, Default)]
pub struct ViewFiles {
    pub tiles: usize,
    pub tile_files: usize,
    pub index_files: usize,
    pub bytes: u64,
}

/// One panel's pyramid: its depth, and per level the file of each tile
/// (row-major from the lowest offsets; -1: nothing drawn).
struct Pyramid {
    zt: u32,
    za: u32,
    /// The allocator view: address space outside every segment is grey.
    reserved: bool,
    levels: BTreeMap<(u32, u32), Vec<i64>>,
}

/// Writes `dir/view/`, replacing an older one. None when the analysis kept
/// no layout (no device memory, or `--no-plots`).
pub fn write_view(a: &Analysis, dir: &Path, cfg: &PlotConfig) -> Result<Option<ViewFiles>> {
    let Some(layout) = &a.layout else { return Ok(None) };
    let pids = panel_pids(a, &PlotConfig { pid: cfg.pid, max_panels: cfg.max_panels, ..PlotConfig::default() })?;
    if pids.is_empty() {
        return Ok(None);
    }
    let started = std::time::Instant::now();
    // Never a half-written view left as if complete, nor an old one half
    // removed.
    let files = crate::trace::write_dir_atomic(&dir.join("view"), |staging| fill(a, layout, &pids, staging))?;
    tracing::debug!(
        "view: {} tiles in {} files, {} index files, {} bytes, {:.3} s",
        files.tiles,
        files.tile_files,
        files.index_files,
        files.bytes,
        started.elapsed().as_secs_f64()
    );
    Ok(Some(files))
}

/// Writes the view's files into `staging`.
fn fill(a: &Analysis, layout: &Layout, pids: &[u32], staging: &Path) -> Result<ViewFiles> {
    for sub in ["tiles", "index"] {
        std::fs::create_dir_all(staging.join(sub)).with_context(|| format!("cannot create {}", staging.display()))?;
    }
    let mut files = ViewFiles::default();
    let tile_dir = staging.join("tiles");
    let mut tiles = TileFiles::new(&tile_dir);
    let (t0, t1) = (a.first_ts, a.last_ts.max(a.first_ts + 1));
    let (min_size, max_size) = layout.lives.iter().fold((u64::MAX, 0), |(lo, hi), l| (lo.min(l.size), hi.max(l.size)));
    let log = ((min_size.max(1) as f64).log2(), (max_size.max(1) as f64).log2());
    let budget = ((a.events as f64 * PX_PER_EVENT) as u64).max(MIN_PIXELS) / pids.len() as u64;
    let bytes_budget = ((source_bytes(a) as f64 * VIEW_SHARE) as u64).max(MIN_VIEW_BYTES);
    let tile_budget = (bytes_budget as f64 * TILE_SHARE) as u64;
    let max_indexed = (((bytes_budget - tile_budget) / INDEX_BYTES_PER_BLOCK) as usize / pids.len()).min(MAX_INDEXED);
    let mut panels = Vec::new();
    let mut stacks_named: BTreeMap<u32, String> = BTreeMap::new();
    for (pi, &pid) in pids.iter().enumerate() {
        let collapse = Collapse::new(layout.footprint.regions(pid));
        let total = collapse.total.max(1);
        // Indices of the panel's lives, 4 bytes each.
        let lives: Vec<u32> = (0..layout.lives.len() as u32).filter(|&i| layout.lives.pid(i as usize) == pid).collect();
        let segments: Vec<Lifetime> = layout.segments.iter().filter(|s| s.pid == pid).copied().collect();
        let (zt, za) = depth(layout, &lives, (t0, t1), total, budget);
        // The budget left by earlier panels goes to the later ones.
        let limit = tile_budget * (pi as u64 + 1) / pids.len() as u64;
        let pyramid =
            render_pyramid(layout, &lives, &segments, &collapse, (t0, t1, total), (zt, za), log, &mut tiles, limit)?;
        let index =
            write_index(layout, &lives, &collapse, pi, (t0, t1), zt, max_indexed, &staging.join("index"), &mut files)?;
        for &s in &index.stacks {
            stacks_named.entry(s).or_insert_with(|| site_name(a, s));
        }
        panels.push(panel_manifest(a, pid, &collapse, &pyramid, index));
    }
    files.tiles = tiles.tiles;
    files.tile_files = tiles.written;
    files.bytes += tiles.bytes;
    let stacks = full_stacks(a, stacks_named.keys().copied());
    let stacks_js = format!("fragscopeView.stacks({});\n", serde_json::to_string(&stacks)?);
    files.bytes += write(&staging.join("stacks.js"), stacks_js.as_bytes())?;
    let manifest = json!({
        "version": 1,
        "name": a.trace.name,
        "tile": TILE,
        "entries": a.entry_order(),
        "t0": 0,
        "span": t1 - t0,
        "log": [log.0, log.1],
        "min_size": if min_size == u64::MAX { 0 } else { min_size },
        "max_size": max_size,
        "sites": stacks_named.iter().map(|(k, v)| (k.to_string(), Value::from(v.clone()))).collect::<serde_json::Map<_, _>>(),
        "panels": panels,
    });
    let manifest_js = format!("fragscopeView.manifest({});\n", serde_json::to_string(&manifest)?);
    files.bytes += write(&staging.join("manifest.js"), manifest_js.as_bytes())?;
    Ok(files)
}

/// The size of what was analysed: the trace's Parquet parts, or the
/// snapshot or trace file imported.
fn source_bytes(a: &Analysis) -> u64 {
    let size = |p: &Path| std::fs::metadata(p).map_or(0, |m| if m.is_file() { m.len() } else { 0 });
    let parts: u64 = a.trace.parts.iter().map(|p| size(p)).sum();
    if parts > 0 { parts } else { size(&a.trace.dir) }
}

fn write(path: &Path, bytes: &[u8]) -> Result<u64> {
    std::fs::write(path, bytes).with_context(|| format!("cannot write {}", path.display()))?;
    Ok(bytes.len() as u64)
}

/// The deepest time and address levels of a panel: blocks wide and tall
/// enough to see, within the pixel budget, time first.
fn depth(layout: &Layout, lives: &[u32], (t0, t1): (u64, u64), total: u64, budget: u64) -> (u32, u32) {
    if lives.is_empty() {
        return (0, 0);
    }
    let quantile = |mut v: Vec<u64>, q: f64| {
        let k = ((v.len() - 1) as f64 * q) as usize;
        *v.select_nth_unstable(k).1
    };
    // Most blocks: four in five lives, half the sizes.
    let life = quantile(lives.iter().map(|&i| layout.lives.duration(i as usize)).collect(), 0.2).max(1);
    let size = quantile(lives.iter().map(|&i| layout.lives.size(i as usize)).collect(), 0.5).max(1);
    let levels = |need: f64, max: u32| (need.max(1.0).log2().ceil() as u32).min(max);
    // At least the levels that fill a page's width and height (2, 1).
    let mut zt = levels(MIN_LIFE_PX * (t1 - t0) as f64 / (TILE as f64 * life as f64), MAX_TIME_LEVEL).max(2);
    let mut za = levels(MIN_BLOCK_PX * total as f64 / (TILE as f64 * size as f64), MAX_ADDR_LEVEL).max(1);
    // No column narrower than a unit of time (a nanosecond, or an entry).
    zt = zt.min(63 - (t1 - t0).max(1).leading_zeros());
    let pixels = |zt: u32, za: u32| u64::from(TILE * TILE) << (zt + za);
    while pixels(zt, za) > budget.max(u64::from(TILE * TILE)) && zt + za > 0 {
        // As the levels are written: past (2, 1), an address level costs
        // two time levels, so address goes first.
        if za > 1 && 2 * (za - 1) > zt.saturating_sub(2) || zt == 0 { za -= 1 } else { zt -= 1 }
    }
    (zt, za)
}

/// Tile files, one per distinct tile.
struct TileFiles<'a> {
    dir: &'a Path,
    /// Distinct tiles by two independent 64-bit hashes of their pixels.
    seen: AHashMap<(u64, u64), i64>,
    tiles: usize,
    written: usize,
    bytes: u64,
}

impl<'a> TileFiles<'a> {
    fn new(dir: &'a Path) -> Self {
        TileFiles { dir, seen: AHashMap::new(), tiles: 0, written: 0, bytes: 0 }
    }

    /// Where it stands, to take back a level with [`TileFiles::forget`].
    fn mark(&self) -> (u64, usize, usize) {
        (self.bytes, self.written, self.tiles)
    }

    /// Takes back the files written since `mark`.
    fn forget(&mut self, (bytes, written, tiles): (u64, usize, usize)) {
        for id in written..self.written {
            let _ = std::fs::remove_file(self.dir.join(format!("{id}.png")));
        }
        self.seen.retain(|_, id| (*id as usize) < written);
        (self.bytes, self.written, self.tiles) = (bytes, written, tiles);
    }

    /// The file numbers of `tiles` (RGB, TILE × TILE each), writing those
    /// not seen before; -1 for a blank tile.
    fn add(&mut self, tiles: Vec<Vec<u8>>, blank: u8) -> Result<Vec<i64>> {
        let hashers = [ahash::RandomState::with_seeds(1, 2, 3, 4), ahash::RandomState::with_seeds(5, 6, 7, 8)];
        let mut ids = vec![-1i64; tiles.len()];
        let mut to_encode: Vec<(usize, i64)> = Vec::new();
        for (k, t) in tiles.iter().enumerate() {
            self.tiles += 1;
            if t.iter().all(|&b| b == blank) {
                continue;
            }
            let h = (hashers[0].hash_one(t), hashers[1].hash_one(t));
            ids[k] = match self.seen.get(&h).copied() {
                Some(id) => id,
                None => {
                    let id = self.written as i64;
                    self.written += 1;
                    self.seen.insert(h, id);
                    to_encode.push((k, id));
                    id
                }
            };
        }
        // Two threads encode: the PNGs are most of the view's time.
        let encoded: Vec<Result<(i64, Vec<u8>)>> = std::thread::scope(|s| {
            let half = to_encode.len().div_ceil(2);
            let (a, b) = to_encode.split_at(half);
            let tiles = &tiles;
            let job = |part: &'_ [(usize, i64)]| {
                part.iter().map(|&(k, id)| Ok((id, encode_png(&tiles[k], TILE, TILE)?))).collect::<Vec<_>>()
            };
            let hb = s.spawn(move || job(b));
            let mut out = job(a);
            out.extend(hb.join().unwrap_or_else(|_| vec![Err(anyhow::anyhow!("a tile encoder panicked"))]));
            out
        });
        for e in encoded {
            let (id, png) = e?;
            self.bytes += write(&self.dir.join(format!("{id}.png")), &png)?;
        }
        Ok(ids)
    }
}

/// The time columns of a level: 2^level of them over [t0, t1), at integer
/// edges (the page places tiles at the same ones).
#[derive(Clone, Copy)]
struct Columns {
    t0: u64,
    span: u64,
    n: u64,
}

impl Columns {
    fn new(t0: u64, t1: u64, level: u32) -> Columns {
        Columns { t0, span: t1 - t0, n: 1 << level }
    }

    fn edge(self, c: u64) -> u64 {
        self.t0 + (u128::from(self.span) * u128::from(c) / u128::from(self.n)) as u64
    }

    fn of(self, t: u64) -> u64 {
        ((u128::from(t.saturating_sub(self.t0)) * u128::from(self.n) / u128::from(self.span)) as u64).min(self.n - 1)
    }

    /// The first and last columns of a life: it holds [start, end), so
    /// one freed at a column's edge is not in the column after it (a
    /// sliver there otherwise).
    fn of_life(self, l: &Lifetime) -> (u64, u64) {
        (self.of(l.start), self.of(if l.end > l.start { l.end - 1 } else { l.start }))
    }
}

/// Renders the deepest level column by column with the MDTP's rasteriser,
/// then each coarser level from the one below it.
#[allow(clippy::too_many_arguments)]
fn render_pyramid(
    layout: &Layout,
    lives: &[u32],
    segments: &[Lifetime],
    collapse: &Collapse,
    (t0, t1, total): (u64, u64, u64),
    (zt, za): (u32, u32),
    log: (f64, f64),
    tiles: &mut TileFiles,
    budget: u64,
) -> Result<Pyramid> {
    let started = std::time::Instant::now();
    let (cols, rows) = (1usize << zt, 1usize << za);
    let (w, h) = (TILE as usize * cols, TILE as usize * rows);
    let columns = Columns::new(t0, t1, zt);
    let edge = |c: usize| columns.edge(c as u64);
    // Each life in every column it crosses.
    let mut by_col: Vec<Vec<u32>> = vec![Vec::new(); cols];
    for &i in lives {
        let (c0, c1) = columns.of_life(&layout.lives.get(i as usize));
        by_col[c0 as usize..=c1 as usize].iter_mut().for_each(|col| col.push(i));
    }
    let mut seg_by_col: Vec<Vec<u32>> = vec![Vec::new(); cols];
    for (i, s) in segments.iter().enumerate() {
        let (c0, c1) = columns.of_life(s);
        seg_by_col[c0 as usize..=c1 as usize].iter_mut().for_each(|col| col.push(i as u32));
    }
    let reserved = !segments.is_empty();
    let blank = if reserved { crate::output::plot::UNRESERVED as u8 } else { 255 };
    // The deepest level, as one image of w × h.
    let mut image = vec![255u8; w * h * 3];
    let mut strip = vec![255u8; TILE as usize * h * 3];
    let mut col_lives: Vec<Lifetime> = Vec::new();
    let mut col_segs: Vec<Lifetime> = Vec::new();
    for c in 0..cols {
        strip.fill(255);
        let p = PanelGeometry {
            pid: 0,
            x0: 0,
            x1: TILE as i32,
            y0: 0,
            y1: h as i32,
            t0: edge(c),
            t1: edge(c + 1).max(edge(c) + 1),
            o0: 0,
            o1: total,
            time: None,
        };
        col_lives.clear();
        col_lives.extend(by_col[c].iter().map(|&i| Lifetime { pid: 0, ..layout.lives.get(i as usize) }));
        col_segs.clear();
        col_segs.extend(seg_by_col[c].iter().map(|&i| Lifetime { pid: 0, ..segments[i as usize] }));
        raster_panel(&mut strip, TILE, &p, collapse, col_lives.iter().copied(), &col_segs, reserved, log);
        for y in 0..h {
            let from = y * TILE as usize * 3;
            let to = (y * w + c * TILE as usize) * 3;
            image[to..to + TILE as usize * 3].copy_from_slice(&strip[from..from + TILE as usize * 3]);
        }
    }
    drop((by_col, seg_by_col, strip));
    tracing::debug!("view: deepest level {zt}/{za} ({w} x {h}) drawn at {:.3} s", started.elapsed().as_secs_f64());
    // Every level, from the deepest: time halves first, then address.
    let mut images: BTreeMap<(u32, u32), (Vec<u8>, usize, usize)> = BTreeMap::new();
    let (mut cur, mut cw) = (image, w);
    for t in (0..=zt).rev() {
        let (mut img, mut ih) = (cur.clone(), h);
        for a in (0..=za).rev() {
            let next = (a > 0).then(|| halve(&img, cw, ih, false));
            images.insert((t, a), (img, cw, ih));
            match next {
                Some(n) => {
                    img = n;
                    ih /= 2;
                }
                None => break,
            }
        }
        if t > 0 {
            cur = halve(&cur, cw, h, true);
            cw /= 2;
        }
    }
    drop(cur);
    tracing::debug!("view: levels at {:.3} s", started.elapsed().as_secs_f64());
    // Written coarse to fine until the byte budget is spent: the level that
    // overflows it and every deeper one are left out, and the page enlarges
    // the deepest written.
    // Levels (2, 1) fill a page's width and height; past them, time goes
    // twice as deep as address (an iteration is a time window first).
    let mut order: Vec<(u32, u32)> = images.keys().copied().collect();
    order.sort_by_key(|&(t, a)| (t.saturating_sub(2).max(2 * a.saturating_sub(1)), t + a, std::cmp::Reverse(t)));
    let mut levels = BTreeMap::new();
    // Bytes of each level written: a level twice as deep takes at most
    // about twice its parent's, so one sure not to fit is not encoded.
    let mut sizes: BTreeMap<(u32, u32), u64> = BTreeMap::new();
    for key in order {
        let Some((img, iw, ih)) = images.remove(&key) else { continue };
        let parent = [(key.0.wrapping_sub(1), key.1), (key.0, key.1.wrapping_sub(1))]
            .iter()
            .filter_map(|k| sizes.get(k))
            .max()
            .copied();
        if parent.is_some_and(|p| tiles.bytes + p * 3 / 2 > budget) {
            break;
        }
        let before = tiles.mark();
        let ids = tiles.add(cut(&img, iw, ih), blank)?;
        if !levels.is_empty() && tiles.bytes > budget {
            tiles.forget(before);
            break;
        }
        sizes.insert(key, tiles.bytes - before.0);
        levels.insert(key, ids);
    }
    let zt = levels.keys().map(|k| k.0).max().unwrap_or(0);
    let za = levels.keys().map(|k| k.1).max().unwrap_or(0);
    Ok(Pyramid { zt, za, reserved, levels })
}

/// The tiles of an image, row-major from its bottom row of tiles (lowest
/// offsets) up.
fn cut(img: &[u8], w: usize, h: usize) -> Vec<Vec<u8>> {
    let (nx, ny, t) = (w / TILE as usize, h / TILE as usize, TILE as usize);
    let mut out = Vec::with_capacity(nx * ny);
    for ty in 0..ny {
        let top = h - (ty + 1) * t;
        for tx in 0..nx {
            let mut tile = Vec::with_capacity(t * t * 3);
            for y in top..top + t {
                let from = (y * w + tx * t) * 3;
                tile.extend_from_slice(&img[from..from + t * 3]);
            }
            out.push(tile);
        }
    }
    out
}

/// Half the width (`across`) or half the height: each pixel the mean of
/// the two it replaces, rounded.
fn halve(img: &[u8], w: usize, h: usize, across: bool) -> Vec<u8> {
    let mean = |a: u8, b: u8| (u16::from(a) + u16::from(b)).div_ceil(2) as u8;
    if across {
        let nw = w / 2;
        let mut out = vec![0u8; nw * h * 3];
        for y in 0..h {
            for x in 0..nw {
                for k in 0..3 {
                    out[(y * nw + x) * 3 + k] = mean(img[(y * w + 2 * x) * 3 + k], img[(y * w + 2 * x + 1) * 3 + k]);
                }
            }
        }
        out
    } else {
        let nh = h / 2;
        let mut out = vec![0u8; w * nh * 3];
        for y in 0..nh {
            let (r0, r1) = (2 * y * w * 3, (2 * y + 1) * w * 3);
            for (x, o) in out[y * w * 3..(y + 1) * w * 3].iter_mut().enumerate() {
                *o = mean(img[r0 + x], img[r1 + x]);
            }
        }
        out
    }
}

/// A panel's index, once written.
struct Index {
    depth: u32,
    nodes: BTreeMap<u32, Vec<u32>>,
    indexed: usize,
    blocks: usize,
    min_size: u64,
    stacks: Vec<u32>,
    streams: Vec<u64>,
}

/// Writes the block index of panel `pi`: each block in the deepest node of
/// the time segment tree that holds its whole life. A node's file holds its
/// blocks by start, each as six LEB128 numbers (start after the previous
/// start, or after the node's start, which the file also gives; duration; collapsed offset; size;
/// stack + 1, 0 for none; stream number), zlib-compressed, in base64.
#[allow(clippy::too_many_arguments)]
fn write_index(
    layout: &Layout,
    lives: &[u32],
    collapse: &Collapse,
    pi: usize,
    (t0, t1): (u64, u64),
    zt: u32,
    max_indexed: usize,
    dir: &Path,
    files: &mut ViewFiles,
) -> Result<Index> {
    use std::io::Write as _;
    let mut chosen: Vec<u32> = lives.to_vec();
    let mut min_size = 0;
    if chosen.len() > max_indexed {
        // The largest blocks: all of a size or none, unless the blocks of
        // the largest size alone are too many (then the first of them).
        // The page says from what size on it can point at blocks.
        let mut ranked = chosen.clone();
        let cut = layout.lives.size(
            *ranked.select_nth_unstable_by_key(max_indexed, |&i| std::cmp::Reverse(layout.lives.size(i as usize))).1
                as usize,
        );
        drop(ranked);
        if chosen.iter().any(|&i| layout.lives.size(i as usize) > cut) {
            chosen.retain(|&i| layout.lives.size(i as usize) > cut);
        } else {
            chosen.retain(|&i| layout.lives.size(i as usize) == cut);
            chosen.truncate(max_indexed);
        }
        min_size = chosen.iter().map(|&i| layout.lives.size(i as usize)).min().unwrap_or(0);
    }
    let columns = Columns::new(t0, t1, zt);
    let mut nodes: BTreeMap<(u32, u64), Vec<u32>> = BTreeMap::new();
    // Blocks outside the footprint are not drawn, so not indexed.
    chosen.retain(|&i| collapse.offset(layout.lives.get(i as usize).addr).is_some());
    for &i in &chosen {
        let ((mut c0, mut c1), mut k) = (columns.of_life(&layout.lives.get(i as usize)), zt);
        while c0 != c1 {
            c0 >>= 1;
            c1 >>= 1;
            k -= 1;
        }
        nodes.entry((k, c0)).or_default().push(i);
    }
    let mut stacks: Vec<u32> = Vec::new();
    let mut streams: Vec<u64> = vec![0];
    let mut stream_ids: AHashMap<u64, u64> = AHashMap::from_iter([(0, 0)]);
    let mut listed: BTreeMap<u32, Vec<u32>> = BTreeMap::new();
    let mut packed = Vec::new();
    for ((k, j), blocks) in nodes.iter_mut() {
        blocks.sort_by_key(|&i| {
            let l = layout.lives.get(i as usize);
            (l.start, l.addr)
        });
        packed.clear();
        // The node's start, given to the page: its own arithmetic in
        // doubles could differ by a nanosecond on long traces.
        let node_start = Columns::new(t0, t1, *k).edge(*j);
        let mut prev = node_start;
        for &i in blocks.iter() {
            let l = layout.lives.get(i as usize);
            if l.stack != NO_STACK {
                stacks.push(l.stack);
            }
            let stream = layout.stream_of(i as usize);
            let sid = *stream_ids.entry(stream).or_insert_with(|| {
                streams.push(stream);
                streams.len() as u64 - 1
            });
            let stack = if l.stack == NO_STACK { 0 } else { u64::from(l.stack) + 1 };
            let offset = collapse.offset(l.addr).unwrap_or(0);
            for v in [l.start.saturating_sub(prev), l.end - l.start, offset, l.size, stack, sid] {
                leb128(&mut packed, v);
            }
            prev = l.start;
        }
        let mut z = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::fast());
        z.write_all(&packed).context("cannot compress the block index")?;
        let z = z.finish().context("cannot compress the block index")?;
        let text = format!(
            "fragscopeView.node({pi},{k},{j},{},{},\"{}\");\n",
            blocks.len(),
            node_start - t0,
            base64::Engine::encode(&base64::engine::general_purpose::STANDARD, z)
        );
        files.bytes += write(&dir.join(format!("{pi}-{k}-{j}.js")), text.as_bytes())?;
        files.index_files += 1;
        listed.entry(*k).or_default().push(*j as u32);
    }
    stacks.sort_unstable();
    stacks.dedup();
    Ok(Index { depth: zt, nodes: listed, indexed: chosen.len(), blocks: lives.len(), min_size, stacks, streams })
}

fn leb128(out: &mut Vec<u8>, mut v: u64) {
    loop {
        let byte = (v & 0x7f) as u8;
        v >>= 7;
        if v == 0 {
            out.push(byte);
            return;
        }
        out.push(byte | 0x80);
    }
}

fn site_name(a: &Analysis, stack: u32) -> String {
    a.trace
        .stacks
        .as_deref()
        .and_then(|s| crate::analysis::sites::call_site(s, stack))
        .unwrap_or_else(|| crate::analysis::sites::NO_SITE.to_string())
}

fn full_stacks(a: &Analysis, ids: impl Iterator<Item = u32>) -> serde_json::Map<String, Value> {
    let Some(stacks) = a.trace.stacks.as_deref() else { return Default::default() };
    ids.map(|id| {
        let frames: Vec<Value> =
            stacks.frames_of(id).map(|f| Value::from(crate::analysis::sites::format_frame(f))).collect();
        (id.to_string(), Value::from(frames))
    })
    .collect()
}

fn panel_manifest(a: &Analysis, pid: u32, collapse: &Collapse, p: &Pyramid, index: Index) -> Value {
    let t0 = a.first_ts;
    let rows: Vec<&crate::analysis::Row> = a.rows.iter().filter(|r| r.pid == pid && !r.at_oom).collect();
    let rel = |t: u64| t.saturating_sub(t0);
    let timeline = json!({
        "t": rows.iter().map(|r| rel(r.t_ns)).collect::<Vec<_>>(),
        "live": rows.iter().map(|r| r.metrics.live_bytes).collect::<Vec<_>>(),
        "reserved": rows.iter().map(|r| r.reserved_bytes()).collect::<Vec<_>>(),
        "score": rows.iter().map(|r| (r.metrics.score * 10.0).round() / 10.0).collect::<Vec<_>>(),
        "risk": rows.iter().map(|r| r.oom_risk_online.map(|x| x.name())).collect::<Vec<_>>(),
    });
    let ooms: Vec<Value> = a
        .ooms
        .iter()
        .filter(|o| o.pid == pid)
        .map(|o| {
            json!({
                "t": rel(o.t_ns),
                "requested": o.requested,
                "class": o.class.name(),
                "live": o.live_bytes,
                "largest_gap": o.largest_gap,
                "device_free": o.device_free,
                "cuda_free": o.cuda_free,
                "retries": o.retries,
                "site": o.request_site,
                "pinned": o.top_blocks.iter().map(|&(addr, size)| json!([collapse.offset(addr), size])).collect::<Vec<_>>(),
            })
        })
        .collect();
    let iterations: Vec<u64> = a
        .iterations
        .iter()
        .filter(|it| it.pid == pid)
        .flat_map(|it| it.boundaries_t_ns.iter().map(|&b| rel(b)))
        .collect();
    // Stage bands: the runs of the outer two levels of stages.
    let stages: Vec<Value> = a
        .stages
        .stages
        .iter()
        .filter(|s| s.device == pid && s.depth() <= 1)
        .map(|s| {
            json!({
                "name": s.name(),
                "depth": s.depth(),
                "spans": s.spans.iter().map(|&(x, y)| json!([rel(x), rel(y)])).collect::<Vec<_>>(),
            })
        })
        .collect();
    json!({
        "id": pid,
        "label": format!("{} {}", if a.unit() == "device" { "device" } else { "process" }, a.who(pid)),
        "total": collapse.total.max(1),
        "regions": collapse.regions.iter().skip(1).map(|r| r.2).collect::<Vec<_>>(),
        "zt": p.zt,
        "za": p.za,
        "background": if p.reserved { "rgb(225,225,225)" } else { "#fff" },
        "levels": p.levels.iter().map(|((t, z), ids)| (format!("{t}-{z}"), json!(ids))).collect::<serde_json::Map<_, _>>(),
        "index": {
            "depth": index.depth,
            "nodes": index.nodes.iter().map(|(k, js)| (k.to_string(), json!(js))).collect::<serde_json::Map<_, _>>(),
            "indexed": index.indexed,
            "blocks": index.blocks,
            "min_size": index.min_size,
            "streams": index.streams.iter().map(|s| format!("{s:#x}")).collect::<Vec<_>>(),
        },
        "timeline": timeline,
        "ooms": ooms,
        "iterations": iterations,
        "stages": stages,
    })
}
