#!/usr/bin/env python3
"""Writes PyTorch-style CUDA memory snapshots for fragscope's tests and
benchmarks, with the expected answers beside them.

    python3 scripts/gen-snapshots.py OUT_DIR            # the test cases
    python3 scripts/gen-snapshots.py OUT_DIR --big MB [ring|staged]   # one large snapshot (ring: late start,
                                                                      # random addresses; staged: record_function ranges)

A small model of PyTorch's caching allocator produces them, so the final
segments and blocks are consistent with the trace: requests are rounded to
512 bytes; requests up to 1 MiB use 2 MiB small-pool segments, larger ones
20 MiB segments (or the request rounded to 2 MiB above 10 MiB); a free block
is split only when the rest is at least 512 bytes (small pool) or more than
1 MiB (large pool); frees merge neighbouring free blocks; when a new segment
does not fit in the device, empty cached segments are released and, failing
that, the request is an `oom` entry carrying the device's free memory.

For each case NAME it writes NAME.pickle and NAME.expected.json: the totals
`_memory_viz.py segsum` would print (computed here from the snapshot dict,
independently of fragscope), the final segment table, and for every OOM the
class SPEC §5 gives it from the allocator state at that instant.

Only the standard library is used.
"""

import json
import os
import pickle
import random
import sys

MiB = 1 << 20
SMALL = MiB
MIN_BLOCK = 512


def round_size(n, divisions=0):
    """PyTorch's round_size: 512 B steps, or with roundup_power2_divisions
    d > 1 (and n above 512·d) the next of d equal steps between the powers
    of two around n."""
    if n <= MIN_BLOCK:
        return MIN_BLOCK
    if divisions > 1 and n > MIN_BLOCK * divisions:
        if n & (n - 1) == 0:
            return n
        floor = 1 << (n.bit_length() - 1)
        step = floor // divisions
        if step == 0:
            return floor * 2
        down = n - n % step
        return n if down == n else down + step
    return max(1, (n + MIN_BLOCK - 1) // MIN_BLOCK) * MIN_BLOCK


def segment_size(req):
    if req <= SMALL:
        return 2 * MiB
    if req < 10 * MiB:
        return 20 * MiB
    return (req + 2 * MiB - 1) // (2 * MiB) * (2 * MiB)


class Device:
    def __init__(self, index, capacity, sites, time_us=True, rng=None,
                 max_split=None, divisions=0):
        # max_split: PyTorch's max_split_size in bytes (None: unlimited);
        # divisions: roundup_power2_divisions for every size.
        self.max_split = max_split
        self.divisions = divisions
        self.index = index
        self.capacity = capacity
        self.sites = sites
        self.expandable = False
        self.time_us = time_us
        self.rng = rng or random.Random(index)
        self.segments = []  # dicts: address, size, stream, pool, blocks
        self.trace = []
        self.next_addr = 0x7F0000000000 + (index << 40)
        self.clock = 1_748_729_391_000_000 + index * 17
        self.ooms = []

    def reserved(self):
        return sum(s["size"] for s in self.segments)

    def entry(self, action, **kw):
        self.clock += self.rng.randint(1, 40)
        e = {"action": action}
        e.update(kw)
        if self.time_us:
            e["time_us"] = self.clock
        self.trace.append(e)
        return e

    def new_segment(self, size, stream, pool):
        if self.reserved() + size > self.capacity:
            # The allocator's own release before a retry: its entries carry
            # the context of the malloc that needed room, not empty_cache's.
            self.empty_cache(frames=self.sites[0])
        if self.reserved() + size > self.capacity:
            return None
        seg = {"address": self.next_addr, "size": size, "stream": stream, "pool": pool,
               "blocks": [{"address": self.next_addr, "size": size, "requested": 0, "state": "inactive",
                           "frames": []}]}
        self.next_addr += size + 64 * MiB  # cudaMalloc leaves holes between segments
        self.segments.append(seg)
        self.entry("segment_alloc", addr=seg["address"], size=size, stream=stream)
        return seg

    def empty_cache(self, frames=None):
        frames = EMPTY_CACHE_FRAMES if frames is None else frames
        for seg in list(self.segments):
            if all(b["state"] == "inactive" for b in seg["blocks"]):
                self.segments.remove(seg)
                self.entry("segment_free", addr=seg["address"], size=seg["size"], stream=seg["stream"], frames=frames)

    def find_free(self, rounded, stream, pool):
        best = None
        for seg in self.segments:
            if seg["stream"] != stream or seg["pool"] != pool:
                continue
            for i, b in enumerate(seg["blocks"]):
                if b["state"] == "inactive" and b["size"] >= rounded:
                    if best is None or b["size"] < best[0]["blocks"][best[1]]["size"]:
                        best = (seg, i)
        if best is not None and self.max_split is not None:
            # Only the best fit is looked at: an oversize block is never
            # taken by a request below max_split_size, nor by a larger one
            # it would leave 20 MiB or more of.
            size = best[0]["blocks"][best[1]]["size"]
            if rounded < self.max_split and size >= self.max_split:
                return None
            if rounded >= self.max_split and size >= rounded + 20 * MiB:
                return None
        return best

    def malloc(self, req, stream=0):
        rounded = round_size(req, self.divisions)
        pool = "small" if req <= SMALL else "large"
        found = self.find_free(rounded, stream, pool)
        if found is None:
            seg = self.new_segment(segment_size(rounded if self.divisions > 1 else req), stream, pool)
            found = (seg, 0) if seg else None
        site = self.rng.choice(self.sites)
        if found is None:
            self.record_oom(req, stream, site)
            return None
        seg, i = found
        b = seg["blocks"][i]
        rest = b["size"] - rounded
        unlimited = self.max_split is None or rounded < self.max_split
        split = rest >= MIN_BLOCK if pool == "small" else (rest > SMALL and unlimited)
        if split:
            seg["blocks"].insert(i + 1, {"address": b["address"] + rounded, "size": rest, "requested": 0,
                                         "state": "inactive", "frames": []})
            b["size"] = rounded
        b["state"] = "active_allocated"
        b["requested"] = req
        b["frames"] = site
        self.entry("alloc", addr=b["address"], size=req, stream=stream, frames=site)
        return b["address"]

    def record_oom(self, req, stream, site):
        device_free = self.capacity - self.reserved()
        free_blocks = [b["size"] for s in self.segments for b in s["blocks"] if b["state"] != "active_allocated"]
        total_free = device_free + sum(free_blocks)
        largest = max([device_free] + free_blocks)
        cls = "capacity" if req > total_free else ("fragmentation" if req > largest else "allocator_policy")
        self.entry("oom", size=req, device_free=device_free, stream=stream, frames=site)
        self.ooms.append({"requested": req, "device_free": device_free, "class": cls})

    def free(self, addr):
        for seg in self.segments:
            for i, b in enumerate(seg["blocks"]):
                if b["address"] == addr and b["state"] == "active_allocated":
                    self.entry("free_requested", addr=addr, size=b["requested"], stream=seg["stream"], frames=b["frames"])
                    self.entry("free_completed", addr=addr, size=b["requested"], stream=seg["stream"], frames=b["frames"])
                    b["state"] = "inactive"
                    b["requested"] = 0
                    b["frames"] = []
                    # merge with free neighbours
                    if i + 1 < len(seg["blocks"]) and seg["blocks"][i + 1]["state"] == "inactive":
                        b["size"] += seg["blocks"].pop(i + 1)["size"]
                    if i > 0 and seg["blocks"][i - 1]["state"] == "inactive":
                        prev = seg["blocks"][i - 1]
                        prev["size"] += b["size"]
                        seg["blocks"].pop(i)
                    return True
        raise AssertionError("free of an unknown block")

    def snapshot_segments(self, legacy_history=False, drop_addresses=False):
        out = []
        for s in sorted(self.segments, key=lambda s: s["address"]):
            blocks = []
            for b in s["blocks"]:
                blk = {"size": b["size"], "state": b["state"]}
                if not drop_addresses:
                    blk["address"] = b["address"]
                if legacy_history:
                    if b["state"] == "active_allocated":
                        blk["history"] = [{"addr": b["address"], "real_size": b["requested"], "frames": b["frames"]}]
                else:
                    blk["requested_size"] = b["requested"] if b["state"] != "inactive" else 0
                    blk["frames"] = b["frames"]
                blocks.append(blk)
            active = sum(b["size"] for b in s["blocks"] if b["state"] != "inactive")
            out.append({
                "device": self.index, "address": s["address"], "total_size": s["size"],
                "allocated_size": active, "active_size": active,
                "requested_size": sum(b["requested"] for b in s["blocks"]),
                "stream": s["stream"], "segment_type": s["pool"], "segment_pool_id": (0, 0),
                "is_expandable": False, "frames": [], "blocks": blocks,
            })
        return out


class ExpandableDevice:
    """PyTorch's caching allocator with `expandable_segments:True`
    (CUDACachingAllocator.cpp of PyTorch 2.4/2.5), written independently of
    fragscope's Rust model, in the simplest form: every range is a list of
    blocks in address order, each "active_allocated", "inactive" (free and
    mapped) or "unmapped", and every search is a scan.

    - One virtual range per (stream, pool), 9/8 of the device in pages of
      2 MiB (small pool) or 20 MiB (large pool), all unmapped at first.
    - A request takes the best fit among the free mapped blocks of its
      stream and pool (size, then address), moving on to the next larger
      one while that could grow less (a block's size plus the unmapped
      block right after it).
    - Else the lowest unmapped block (with the free block before it) that
      has room: its pages are mapped (`segment_map`), merged with free
      neighbours; then more after it if needed.
    - The block is split when at least 512 bytes remain.
    - Freed blocks stay mapped. Releasing the cache (`empty_cache`, and
      before the allocator's last retry) unmaps the whole pages inside
      every free block (`segment_unmap`), large pool first, each pool in
      (size, address) order; a range left wholly unmapped is dropped.
    - When mapping would exceed the capacity: release the cache, retry,
      then an `oom` entry. Pages mapped before a failing mapping stay."""

    def __init__(self, index, capacity, sites, rng):
        self.index = index
        self.capacity = capacity
        self.sites = sites
        self.rng = rng
        self.ranges = []  # dicts: base, size, stream, pool, blocks
        self.trace = []
        self.next_addr = 0x7E0000000000 + (index << 40)
        self.clock = 1_748_729_391_000_000 + index * 17
        self.ooms = []
        self.reserved = 0

    entry = Device.entry
    time_us = True

    @staticmethod
    def page(pool):
        return 2 * MiB if pool == "small" else 20 * MiB

    def pool_blocks(self, stream, pool, state):
        return [(r, b) for r in self.ranges if r["stream"] == stream and r["pool"] == pool
                for b in r["blocks"] if b["state"] == state]

    @staticmethod
    def neighbour(r, b, step):
        i = r["blocks"].index(b) + step
        return r["blocks"][i] if 0 <= i < len(r["blocks"]) else None

    def best_fit(self, rounded, stream, pool):
        free = sorted(self.pool_blocks(stream, pool, "inactive"), key=lambda rb: (rb[1]["size"], rb[1]["address"]))
        fits = [rb for rb in free if rb[1]["size"] >= rounded]
        if not fits:
            return None

        def growable(rb):
            nxt = self.neighbour(rb[0], rb[1], 1)
            return rb[1]["size"] + (nxt["size"] if nxt and nxt["state"] == "unmapped" else 0)
        i = 0
        while i + 1 < len(fits) and growable(fits[i + 1]) < growable(fits[i]):
            i += 1
        return fits[i]

    def merge(self, r, b):
        """Merges b with neighbours of the same mapped-ness that are free."""
        same = (lambda x: x["state"] == "unmapped") if b["state"] == "unmapped" else (lambda x: x["state"] == "inactive")
        for step in (-1, 1):
            n = self.neighbour(r, b, step)
            if n is not None and same(n):
                lo, hi = (n, b) if step < 0 else (b, n)
                lo["size"] += hi["size"]
                r["blocks"].remove(hi)
                b = lo
        return b

    def map_pages(self, r, b, size):
        """Maps the pages covering the first `size` bytes of unmapped b."""
        page = self.page(r["pool"])
        end = r["base"] + -(-(b["address"] + size - r["base"]) // page) * page
        end = min(end, b["address"] + b["size"])
        nbytes = end - b["address"]
        if self.reserved + nbytes > self.capacity:
            return None
        if end < b["address"] + b["size"]:
            i = r["blocks"].index(b)
            r["blocks"].insert(i + 1, {"address": end, "size": b["address"] + b["size"] - end, "state": "unmapped",
                                       "requested": 0, "frames": []})
            b["size"] = nbytes
        b["state"] = "inactive"
        self.reserved += nbytes
        self.entry("segment_map", addr=b["address"], size=nbytes, stream=r["stream"])
        return self.merge(r, b)

    def grow(self, rounded, stream, pool):
        """try_allocate_expandable_block: a free block of at least `rounded`
        bytes made by mapping pages, or None."""
        cands = sorted(self.pool_blocks(stream, pool, "unmapped"), key=lambda rb: rb[1]["address"])
        found = None
        for r, u in cands:
            prev = self.neighbour(r, u, -1)
            start = prev if prev is not None and prev["state"] != "active_allocated" else u
            i, room = r["blocks"].index(start), 0
            while room < rounded and i < len(r["blocks"]) and r["blocks"][i]["state"] != "active_allocated":
                room += r["blocks"][i]["size"]
                i += 1
            if room >= rounded:
                found = (r, start)
                break
        if found is None:
            page = self.page(pool)
            span = -(-(self.capacity + self.capacity // 8) // page) * page
            r = {"base": self.next_addr, "size": span, "stream": stream, "pool": pool,
                 "blocks": [{"address": self.next_addr, "size": span, "state": "unmapped", "requested": 0,
                             "frames": []}]}
            self.next_addr += span + 6 * MiB  # the driver leaves room between reservations
            self.ranges.append(r)
            found = (r, r["blocks"][0])
        r, c = found
        if c["state"] == "unmapped":
            c = self.map_pages(r, c, min(c["size"], rounded))
            if c is None:
                return None
        while c["size"] < rounded:
            nxt = self.neighbour(r, c, 1)
            c = self.map_pages(r, nxt, min(rounded - c["size"], nxt["size"]))
            if c is None:
                return None
        return r, c

    def empty_cache(self, frames=None):
        for pool in ("large", "small"):
            free = sorted(((r, b) for r in self.ranges if r["pool"] == pool for b in r["blocks"]
                           if b["state"] == "inactive"),
                          key=lambda rb: (rb[0]["stream"], rb[1]["size"], rb[1]["address"]))
            for r, b in free:
                page = self.page(pool)
                lo = r["base"] + -(-(b["address"] - r["base"]) // page) * page
                hi = r["base"] + (b["address"] + b["size"] - r["base"]) // page * page
                if lo >= hi:
                    continue
                i = r["blocks"].index(b)
                parts = []
                if lo > b["address"]:
                    parts.append({"address": b["address"], "size": lo - b["address"], "state": "inactive",
                                  "requested": 0, "frames": []})
                mid = {"address": lo, "size": hi - lo, "state": "unmapped", "requested": 0, "frames": []}
                parts.append(mid)
                if hi < b["address"] + b["size"]:
                    parts.append({"address": hi, "size": b["address"] + b["size"] - hi, "state": "inactive",
                                  "requested": 0, "frames": []})
                r["blocks"][i:i + 1] = parts
                self.merge(r, mid)
                self.reserved -= hi - lo
                self.entry("segment_unmap", addr=lo, size=hi - lo, stream=r["stream"])
                if len(r["blocks"]) == 1:
                    self.ranges.remove(r)

    def malloc(self, req, stream=0):
        rounded = round_size(req)
        pool = "small" if rounded <= SMALL else "large"
        found = self.best_fit(rounded, stream, pool)
        if found is None:
            found = self.grow(rounded, stream, pool)
            if found is None:
                self.empty_cache()
                found = self.grow(rounded, stream, pool)
        site = self.rng.choice(self.sites)
        if found is None:
            device_free = self.capacity - self.reserved
            free = [b["size"] for r in self.ranges for b in r["blocks"] if b["state"] == "inactive"]
            total, largest = device_free + sum(free), max([device_free] + free)
            cls = "capacity" if req > total else ("fragmentation" if req > largest else "allocator_policy")
            self.entry("oom", size=req, device_free=device_free, stream=stream, frames=site)
            self.ooms.append({"requested": req, "device_free": device_free, "class": cls})
            return None
        r, b = found
        if b["size"] - rounded >= MIN_BLOCK:
            i = r["blocks"].index(b)
            r["blocks"].insert(i + 1, {"address": b["address"] + rounded, "size": b["size"] - rounded,
                                       "state": "inactive", "requested": 0, "frames": []})
            b["size"] = rounded
        b.update(state="active_allocated", requested=req, frames=site)
        self.entry("alloc", addr=b["address"], size=req, stream=stream, frames=site)
        return b["address"]

    def free(self, addr):
        for r in self.ranges:
            for b in r["blocks"]:
                if b["address"] == addr and b["state"] == "active_allocated":
                    for action in ("free_requested", "free_completed"):
                        self.entry(action, addr=addr, size=b["requested"], stream=r["stream"], frames=b["frames"])
                    b.update(state="inactive", requested=0, frames=[])
                    self.merge(r, b)
                    return True
        raise AssertionError("free of an unknown block")

    def snapshot_segments(self):
        """One segment per run of mapped blocks, as PyTorch reports them."""
        out = []
        for r in self.ranges:
            run = []
            for b in r["blocks"] + [None]:
                if b is not None and b["state"] != "unmapped":
                    run.append(b)
                    continue
                if run:
                    active = sum(x["size"] for x in run if x["state"] == "active_allocated")
                    out.append({
                        "device": self.index, "address": run[0]["address"], "total_size": sum(x["size"] for x in run),
                        "allocated_size": active, "active_size": active,
                        "requested_size": sum(x["requested"] for x in run),
                        "stream": r["stream"], "segment_type": r["pool"], "segment_pool_id": (0, 0),
                        "is_expandable": True, "frames": [],
                        "blocks": [{"address": x["address"], "size": x["size"], "state": x["state"],
                                    "requested_size": x["requested"], "frames": x["frames"]} for x in run],
                    })
                run = []
        return sorted(out, key=lambda s: s["address"])

    # Reused by the OOM checks of the expected answers.
    expandable = True

# What PyTorch records for a segment freed by the program's
# torch.cuda.empty_cache(): its Python stack.
EMPTY_CACHE_FRAMES = [{"name": "empty_cache", "filename": "/env/lib/python3.12/site-packages/torch/cuda/memory.py", "line": 224},
                      {"name": "<module>", "filename": "/work/train.py", "line": 120}]


def make_sites(n=6):
    """Frame lists shared between entries, as PyTorch's memo shares them."""
    cpp = [{"name": "c10::cuda::CUDACachingAllocator::Native::DeviceCachingAllocator::malloc", "filename": "CUDACachingAllocator.cpp", "line": 0},
           {"name": "at::detail::empty_cuda", "filename": "??", "line": 0}]
    torch = {"name": "_call_impl", "filename": "/env/lib/python3.12/site-packages/torch/nn/modules/module.py", "line": 1750}
    main = {"name": "<module>", "filename": "/work/train.py", "line": 90}
    sites = []
    for i in range(n):
        user = {"name": f"layer{i}", "filename": "/work/model.py", "line": 10 + 7 * i}
        sites.append(cpp + [user, torch, main])
    return sites


def totals(segments):
    """What _memory_viz.py segsum reports, from the snapshot's own dicts."""
    t = {"segments": 0, "reserved": 0, "allocated": 0, "free_internal": 0, "free_external": 0}
    for s in segments:
        t["segments"] += 1
        t["reserved"] += s["total_size"]
        for b in s["blocks"]:
            if b["state"] == "active_allocated":
                req = b["history"][0]["real_size"] if "history" in b else b.get("requested_size", b["size"])
                t["allocated"] += req
                t["free_internal"] += b["size"] - req
            else:
                t["free_external"] += b["size"]
    t["free"] = t["reserved"] - t["allocated"]
    return t


def workload(dev, steps, streams=(0,), rng=None, churn=0.5):
    rng = rng or dev.rng
    live = []
    sizes = [300, 4096, 70_000, 600_000, 3 * MiB + 17, 9 * MiB, 25 * MiB + 100]
    for _ in range(steps):
        if live and rng.random() < churn:
            dev.free(live.pop(rng.randrange(len(live))))
        else:
            a = dev.malloc(rng.choice(sizes) + rng.randint(0, 4000), stream=rng.choice(streams))
            if a is not None:
                live.append(a)
        if rng.random() < 0.02:
            dev.empty_cache()
    return live


def write_case(out, name, snapshot, devices, protocol=4, extra=None):
    with open(os.path.join(out, name + ".pickle"), "wb") as f:
        pickle.dump(snapshot, f, protocol=protocol)
    segs = snapshot if isinstance(snapshot, list) else snapshot["segments"]
    expected = {
        "devices": {str(d.index): totals([s for s in segs if s["device"] == d.index]) for d in devices},
        "segments": sorted([s["device"], s["address"], s["total_size"]] for s in segs),
        "ooms": [o for d in devices for o in d.ooms],
        "entries": {str(d.index): len(d.trace) for d in devices},
    }
    expected.update(extra or {})
    with open(os.path.join(out, name + ".expected.json"), "w") as f:
        json.dump(expected, f, indent=1, sort_keys=True)


def snapshot_of(devices, **kw):
    segs = [s for d in devices for s in d.snapshot_segments(**kw)]
    n = max(d.index for d in devices) + 1
    traces = [[] for _ in range(n)]
    for d in devices:
        traces[d.index] = d.trace
    return {"segments": segs, "device_traces": traces,
            "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": "", "max_split_size": -1,
                                   "expandable_segments": any(d.expandable for d in devices)}}


def cases(out):
    sites = make_sites()
    # basic: one device, one stream, segments released now and then.
    d = Device(0, 4 << 30, sites, rng=random.Random(1))
    workload(d, 3000)
    snap = snapshot_of([d])
    write_case(out, "basic", snap, [d])
    write_case(out, "proto5", snap, [d], protocol=5)
    write_case(out, "proto2", snap, [d], protocol=2)

    # oom: a small device, fragmentation OOMs (large requests among holes)
    # and capacity ones.
    d = Device(0, 200 * MiB, sites, rng=random.Random(2))
    live = workload(d, 400, churn=0.3)
    for a in live[::2]:
        d.free(a)
    d.malloc(30 * MiB)
    d.malloc(150 * MiB)
    d.malloc(900 * MiB)
    write_case(out, "oom", snapshot_of([d]), [d])
    # The same without time_us: time is entry order.
    untimed = snapshot_of([d])
    untimed["device_traces"] = [[{k: v for k, v in e.items() if k != "time_us"} for e in t]
                                for t in untimed["device_traces"]]
    write_case(out, "oom_no_time", untimed, [d])

    # expandable segments (ExpandableDevice: segment_map / segment_unmap):
    # two streams, both pools, empty_cache() now and then.
    d = ExpandableDevice(0, 2 << 30, sites, rng=random.Random(3))
    workload(d, 3000, streams=(0, 5))
    write_case(out, "expandable", snapshot_of([d]), [d])
    # The same without `allocator_settings` (older PyTorch writes none):
    # its expandable segments say the setting was on.
    bare = snapshot_of([d])
    del bare["allocator_settings"]
    write_case(out, "expandable_no_settings", bare, [d])
    # ... and with settings that contradict its segments (a hand-made
    # dict): the replay cannot be measured against it.
    off = snapshot_of([d])
    off["allocator_settings"]["expandable_segments"] = False
    write_case(out, "expandable_settings_off", off, [d])
    # ... and on a small device: mappings that fail, the cache released
    # before the last retry, OOMs.
    d = ExpandableDevice(0, 300 * MiB, sites, rng=random.Random(12))
    live = workload(d, 900, streams=(0, 5), churn=0.35)
    for a in live[::2]:
        d.free(a)
    for size in (120 * MiB, 250 * MiB, 900 * MiB):
        d.malloc(size, stream=5)
    write_case(out, "expandable_oom", snapshot_of([d]), [d])

    # two devices, several streams.
    d0 = Device(0, 2 << 30, sites, rng=random.Random(4))
    d1 = Device(1, 2 << 30, sites, rng=random.Random(5))
    workload(d0, 1500, streams=(0, 7, 9))
    workload(d1, 1500, streams=(0, 3))
    write_case(out, "two_devices", snapshot_of([d0, d1]), [d0, d1])
    # ... where the history kept holds nothing of device 1 (its last
    # entries were before the ring buffer's window): its state only.
    idle = snapshot_of([d0, d1])
    idle["device_traces"][1] = []
    write_case(out, "idle_device", idle, [d0, d1], extra={"entries": {"0": len(d0.trace), "1": 0}})

    # ring buffer: the trace lost its first 60 % (blocks allocated then are
    # alive or freed later without their alloc in the trace).
    d = Device(0, 4 << 30, sites, rng=random.Random(6))
    workload(d, 3000, churn=0.45)
    snap = snapshot_of([d])
    dropped = len(d.trace) * 6 // 10
    snap["device_traces"][0] = d.trace[dropped:]
    write_case(out, "ring", snap, [d], extra={"entries": {"0": len(d.trace) - dropped}})

    # a ring buffer of two entries (max_entries=2) that kept only frees:
    # a trace with no allocation, the state at one instant.
    d = Device(0, 1 << 30, sites, rng=random.Random(6))
    live = workload(d, 300, churn=0.2)
    d.free(live[0])
    snap = snapshot_of([d])
    frees = [e for e in d.trace if e["action"].startswith("free")]
    snap["device_traces"][0] = frees[-2:]
    write_case(out, "last_frees", snap, [d], extra={"entries": {"0": 2}})

    # ring_steps: a training loop that does not leak (weights kept, each
    # step's activations freed), with `ProfilerStep#N` annotations for all
    # 12 steps, but a trace that kept only its last entries, as PyTorch's
    # ring buffer does: it begins just after step 6 began, so steps 0-6 and
    # the weights' allocations are not in it whole, while the annotations
    # (far fewer) reach back to the start. Steps 7-11 are.
    d = Device(0, 8 << 30, sites, rng=random.Random(15))
    weights = [d.malloc(40 * MiB + 512 * i) for i in range(6)]
    annotations, starts = [], []
    for step in range(12):
        d.clock += 5
        annotations.append({"stage": "START", "name": f"ProfilerStep#{step}", "device": 0, "time_us": d.clock})
        starts.append(len(d.trace))
        acts = [d.malloc(rng_size) for rng_size in (3 * MiB + 100 * step, 9 * MiB, 700_000)]
        for a in reversed(acts):
            d.free(a)
        d.clock += 5
        annotations.append({"stage": "END", "name": f"ProfilerStep#{step}", "device": 0, "time_us": d.clock})
    snap = snapshot_of([d])
    snap["device_traces"][0] = d.trace[starts[6]:]
    snap["external_annotations"] = annotations
    assert weights and len(snap["device_traces"][0]) < len(d.trace)
    write_case(out, "ring_steps", snap, [d],
               extra={"entries": {"0": len(d.trace) - starts[6]}, "steps_before_trace": 7, "steps_in_trace": 5})
    # steps_no_time: the same loop's whole trace without time_us (older
    # PyTorch): its annotations' wall-clock times cannot be placed among
    # the entries.
    whole = snapshot_of([d])
    whole["device_traces"] = [[{k: v for k, v in e.items() if k != "time_us"} for e in t]
                              for t in whole["device_traces"]]
    whole["external_annotations"] = annotations
    write_case(out, "steps_no_time", whole, [d], extra={"annotated_steps": 12})

    # an empty snapshot: dumped before PyTorch reserved anything.
    write_case(out, "empty", {"segments": [], "device_traces": [],
                              "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": ""}}, [])

    # no time_us in the entries.
    d = Device(0, 1 << 30, sites, time_us=False, rng=random.Random(7))
    workload(d, 500)
    write_case(out, "no_time", snapshot_of([d]), [d])

    # legacy layouts: a bare list of segments; blocks with history and
    # without addresses.
    d = Device(0, 1 << 30, sites, rng=random.Random(8))
    workload(d, 800)
    write_case(out, "legacy_list", d.snapshot_segments(), [d], protocol=2, extra={"entries": {"0": 0}})
    legacy = {"segments": d.snapshot_segments(legacy_history=True, drop_addresses=True),
              "device_traces": [d.trace]}
    write_case(out, "legacy_history", legacy, [d], protocol=2)

    # max_split_size_mb:40 and roundup_power2_divisions:4, each on its own:
    # the settings change where blocks go; the snapshot records them.
    for name, kw, seed in (("max_split", {"max_split": 40 * MiB}, 9), ("roundup", {"divisions": 4}, 10)):
        d = Device(0, 8 << 30, sites, rng=random.Random(seed), **kw)
        workload(d, 3000, churn=0.45)
        snap = snapshot_of([d])
        snap["allocator_settings"]["max_split_size"] = kw.get("max_split", -1)
        snap["allocator_settings"]["roundup_power2_divisions"] = {
            str(1 << i): kw.get("divisions", 0) for i in range(16)}
        write_case(out, name, snap, [d])

    # roundup_growing: roundup_power2_divisions:4 on the sizes of a KV cache
    # regrown by torch.cat (kvcat on the H100: 2 KiB to 32 MiB, 16 KiB more
    # per token), small and large pools both.
    d = Device(0, 8 << 30, sites, rng=random.Random(14), divisions=4)
    cache = [None] * 8
    for token in range(160):
        for layer in range(8):
            grown = d.malloc(2048 + 16 * 1024 * token + 64 * layer)
            if cache[layer] is not None:
                d.free(cache[layer])
            cache[layer] = grown
        tmp = d.malloc(300 + 7 * token)
        d.free(tmp)
    snap = snapshot_of([d])
    snap["allocator_settings"]["roundup_power2_divisions"] = {str(1 << i): 4 for i in range(16)}
    write_case(out, "roundup_growing", snap, [d])

    # flush: a device that fills with cached segments; a larger request
    # then finds no room until PyTorch releases its whole cache (no OOM).
    # The capacity lies between the most reserved before and that plus the
    # segment the flush made room for.
    d = Device(0, 600 * MiB, sites, rng=random.Random(13))
    small = [d.malloc(25 * MiB) for _ in range(20)]
    for a in small:
        d.free(a)
    big = [d.malloc(90 * MiB) for _ in range(5)]
    for a in big[:3]:
        d.free(a)
    for _ in range(8):
        d.malloc(40 * MiB)
    flushes = sum(1 for i, e in enumerate(d.trace) if e["action"] == "segment_free"
                  and (i == 0 or d.trace[i - 1]["action"] != "segment_free"))
    write_case(out, "flush", snapshot_of([d]), [d], extra={"capacity": d.capacity, "flushes": flushes})

    compare_pair(out)
    stages(out)
    settings(out)
    host(out)
    private_pool(out)


# PyTorch 2.11's `allocator_settings`, every key at its default (2.13 adds
# the pinned ones).
SETTINGS_2_11 = {
    "PYTORCH_CUDA_ALLOC_CONF": "", "max_split_size": -1, "garbage_collection_threshold": 0.0,
    "expandable_segments": False, "pinned_num_register_threads": 1, "release_lock_on_cudamalloc": False,
    "pinned_use_cuda_host_register": False, "graph_capture_record_stream_reuse": False,
    "roundup_power2_divisions": {str(1 << i): 0 for i in range(16)},
}


class Staged(Device):
    """A Device that also writes `record_function` ranges and, for each
    range, the figures fragscope's "Memory per stage" must give, computed
    here from the model's own state as each entry is made."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.annotations = []
        self.open = []  # runs: dicts
        self.runs = []
        self.allocated = 0  # Σ block sizes of active blocks
        self.born = {}  # address -> (block size, run count at birth)

    def mark(self, stage, name):
        self.clock += 3
        self.annotations.append({"stage": stage, "name": name, "device": self.index, "time_us": self.clock})
        if stage == "START":
            parent = self.open[-1]["path"] if self.open else ()
            path = parent + (name.split("#")[0] + "#N" if name.split("#")[-1].isdigit() else name,)
            run = {"name": name, "path": path, "start": self.allocated, "peak": self.allocated, "frag": self.fragmentation(),
                   "reserved": self.reserved(), "largest": 0, "ended": False, "mine": set()}
            self.open.append(run)
            self.runs.append(run)
        else:
            run = next(r for r in reversed(self.open) if r["name"] == name)
            self.open.remove(run)
            run["ended"] = True
            run["held"] = sum(self.born[a][0] for a in run["mine"] if a in self.born)
            run["net"] = self.allocated - run["start"]

    def fragmentation(self):
        reserved = self.reserved()
        gaps = sum(b["size"] for s in self.segments for b in s["blocks"]
                   if b["state"] == "inactive" and b["size"] > 1024)
        return gaps / reserved if reserved else None

    def after(self, req=None):
        for run in self.open:
            run["reserved"] = max(run["reserved"], self.reserved())
            if self.allocated > run["peak"]:
                run["peak"], run["frag"] = self.allocated, self.fragmentation()
            if req is not None:
                run["largest"] = max(run["largest"], req)

    def new_segment(self, size, stream, pool):
        seg = super().new_segment(size, stream, pool)
        self.after()
        return seg

    def malloc(self, req, stream=0):
        a = super().malloc(req, stream)
        if a is not None:
            size = next(b["size"] for s in self.segments for b in s["blocks"] if b["address"] == a)
            self.allocated += size
            self.born[a] = (size, len(self.runs))
            for run in self.open:
                run["mine"].add(a)
            self.after(req)
        return a

    def free(self, addr):
        size = self.born.pop(addr)[0]
        for run in self.runs:
            run["mine"].discard(addr)
        super().free(addr)
        self.allocated -= size
        self.after()
        return True

    def expected(self):
        """Per path: the figures over its runs, as fragscope groups them."""
        out = {}
        for r in self.runs:
            key = " > ".join(r["path"])
            e = out.setdefault(key, {"runs": 0, "unfinished": 0, "peak_allocated_bytes": -1, "added_bytes": 0,
                                     "peak_reserved_bytes": 0, "held_at_end_bytes": None, "net_at_end_bytes": None,
                                     "fragmentation_at_peak": None, "largest_request_bytes": 0})
            e["runs"] += 1
            e["unfinished"] += 0 if r["ended"] else 1
            if r["peak"] > e["peak_allocated_bytes"]:
                e["peak_allocated_bytes"], e["fragmentation_at_peak"] = r["peak"], r["frag"]
            e["added_bytes"] = max(e["added_bytes"], r["peak"] - r["start"])
            e["peak_reserved_bytes"] = max(e["peak_reserved_bytes"], r["reserved"])
            if r["ended"]:
                e["held_at_end_bytes"] = max(e["held_at_end_bytes"] or 0, r["held"])
                e["net_at_end_bytes"] = r["net"] if e["net_at_end_bytes"] is None else max(e["net_at_end_bytes"], r["net"])
            e["largest_request_bytes"] = max(e["largest_request_bytes"], r["largest"])
        return out


def stages(out):
    """`stages`, and `stages_more`: the same loop whose backward pass makes
    gradients 2 MiB larger (what `compare` tells per stage)."""
    stages_case(out, "stages", 0)
    stages_case(out, "stages_more", 2 * MiB)


def stages_case(out, name, grow):
    """`stages`: a training loop with nested `record_function` ranges
    (ProfilerStep#k > forward > layer.i, backward, Optimizer.step#SGD.step),
    its last step cut by the snapshot; written in PyTorch 2.14's layout:
    `user_metadata` and `compile_context` on entries, `annotate` entries
    (`_annotate_tensor`), 2.11's `allocator_settings`, and the (empty)
    `host_segments` / `host_traces` that 2.14 always writes."""
    rng = random.Random(21)
    d = Staged(0, 4 << 30, make_sites(), rng=rng)
    weights = [d.malloc(8 * MiB + 512 * i) for i in range(4)]
    grads, momentum = [], []
    for step in range(1, 5):
        d.mark("START", f"ProfilerStep#{step}")
        d.mark("START", "forward")
        acts = []
        for layer in range(2):
            d.mark("START", f"layer.{layer}")
            tmp = d.malloc(rng.choice([3 * MiB, 5 * MiB + 7, 700_000]))
            acts.append(d.malloc(4 * MiB + rng.randint(0, 9999)))
            d.free(tmp)
            d.mark("END", f"layer.{layer}")
        if step == 4:
            break  # the snapshot is taken inside the forward pass
        d.mark("END", "forward")
        d.mark("START", "backward")
        for a in acts:
            g = d.malloc(6 * MiB + grow + rng.randint(0, 999))
            d.free(a)
            if step == 1:
                grads.append(g)
            else:
                d.free(g)
        d.mark("END", "backward")
        d.mark("START", "Optimizer.step#SGD.step")
        if step == 1:
            momentum = [d.malloc(8 * MiB + 512 * i) for i in range(4)]
        t = d.malloc(2 * MiB + 5)
        d.free(t)
        d.mark("END", "Optimizer.step#SGD.step")
        d.mark("END", f"ProfilerStep#{step}")
    snap = snapshot_of([d])
    snap["allocator_settings"] = dict(SETTINGS_2_11)
    snap["external_annotations"] = d.annotations
    for i, e in enumerate(snap["device_traces"][0]):
        e["compile_context"] = "N/A"
        e["user_metadata"] = "" if i % 3 else "epoch=0"
    # `_annotate_tensor(w, "weight")`: a label on a live storage.
    snap["device_traces"][0].append({"action": "annotate", "addr": weights[0], "size": 0, "stream": 0,
                                     "time_us": d.clock + 1, "frames": [], "user_metadata": "weight",
                                     "compile_context": "N/A"})
    snap["host_segments"] = []
    snap["host_traces"] = []
    write_case(out, name, snap, [d], extra={"stages": d.expected()})


def settings(out):
    """`settings_*`: 2.11's `allocator_settings` whose parsed string and
    values disagree (expandable segments asked, the platform without
    them) or agree."""
    for name, conf, changes in [
        ("settings_not_in_force", "expandable_segments:True,garbage_collection_threshold:0.8",
         {"garbage_collection_threshold": 0.8}),
        ("settings_agree", "garbage_collection_threshold:0.8,max_split_size_mb:64",
         {"garbage_collection_threshold": 0.8, "max_split_size": 64 * MiB}),
    ]:
        d = Device(0, 1 << 30, make_sites(), rng=random.Random(22),
                   max_split=changes.get("max_split_size"))
        workload(d, 300)
        snap = snapshot_of([d])
        snap["allocator_settings"] = dict(SETTINGS_2_11, PYTORCH_CUDA_ALLOC_CONF=conf, **changes)
        write_case(out, name, snap, [d])


def host(out):
    """`host_pinned`: a device's snapshot with PyTorch 2.14's pinned host
    memory (`host_segments` with `device` -1, `host_traces` a flat list of
    entries), and `host_pinned_without`: the same snapshot without them.
    The expected host figures come from walking the host model's entries."""
    d = Device(0, 2 << 30, make_sites(), rng=random.Random(31))
    workload(d, 800)
    h = Device(0, 1 << 30, make_sites(), rng=random.Random(32))
    workload(h, 300, churn=0.4)
    snap = snapshot_of([d])
    host_segments = h.snapshot_segments()
    for seg in host_segments:
        seg["device"] = -1
    allocated = reserved = peak_a = peak_r = 0
    for e in h.trace:
        if e["action"] == "alloc":
            allocated += e["size"]
        elif e["action"] == "free_completed":
            allocated -= e["size"]
        elif e["action"] == "segment_alloc":
            reserved += e["size"]
        elif e["action"] == "segment_free":
            reserved -= e["size"]
        peak_a, peak_r = max(peak_a, allocated), max(peak_r, reserved)
    expected = {"host": {
        "segments": len(host_segments), "reserved_bytes": sum(s["total_size"] for s in host_segments),
        "allocated_bytes": sum(b["requested_size"] for s in host_segments for b in s["blocks"]
                               if b["state"] == "active_allocated"),
        "entries": len(h.trace), "allocations": sum(1 for e in h.trace if e["action"] == "alloc"),
        "peak_allocated_bytes": peak_a, "peak_reserved_bytes": peak_r}}
    without = dict(snap)
    write_case(out, "host_pinned_without", without, [d])
    snap = dict(snap, host_segments=host_segments, host_traces=h.trace)
    write_case(out, "host_pinned", snap, [d], extra=expected)


def private_pool(out):
    """`private_pool`: one device whose requests go to the default pool
    and to a private one (`torch.cuda.MemPool`: `segment_pool_id` (0, 1)),
    whose blocks PyTorch never gives to the other pool's requests. Freed
    private blocks sit beside default-pool requests of their size."""
    rng = random.Random(41)
    d = Device(0, 4 << 30, make_sites(), rng=rng)
    p = Device(0, 4 << 30, make_sites(), rng=rng)
    p.trace = d.trace
    p.next_addr = d.next_addr + (1 << 36)

    def on(dev, op, *a):
        dev.clock = max(d.clock, p.clock)
        r = op(*a)
        d.clock = p.clock = dev.clock
        return r

    kept = []
    for step in range(6):
        mine = [on(p, p.malloc, 6 * MiB + 512 * step) for _ in range(3)]
        for a in mine[:2]:
            on(p, p.free, a)
        kept.append(mine[2])
        theirs = [on(d, d.malloc, 6 * MiB + 512 * step) for _ in range(3)]
        for a in theirs[1:]:
            on(d, d.free, a)
    segs = d.snapshot_segments()
    private = p.snapshot_segments()
    for seg in private:
        seg["segment_pool_id"] = (0, 1)
    snap = snapshot_of([d])
    snap["segments"] = sorted(segs + private, key=lambda s: s["address"])
    write_case(out, "private_pool", snap, [d], extra={"private_segments": len(private)})
    # The same with every segment in the default pool: only the what-if
    # may differ.
    merged = dict(snap, segments=[dict(seg, segment_pool_id=(0, 0)) for seg in snap["segments"]])
    write_case(out, "private_pool_merged", merged, [d])


def compare_pair(out):
    """Two snapshots of one run, before and after more work: some segments
    were released and others allocated in between. The expected
    only-in-A / only-in-B segments are computed here from the two dicts."""
    sites = make_sites()
    d = Device(0, 2 << 30, sites, rng=random.Random(21))
    live = workload(d, 1200)
    a = snapshot_of([d])
    a = pickle.loads(pickle.dumps(a))  # a deep copy of the state at A
    for addr in live:
        d.free(addr)
    d.empty_cache()
    workload(d, 900)
    b = snapshot_of([d])
    key = lambda s: (s["device"], s["address"], s["total_size"])
    ka, kb = {key(s) for s in a["segments"]}, {key(s) for s in b["segments"]}
    for name, snap, other in (("cmp_a", a, kb), ("cmp_b", b, ka)):
        with open(os.path.join(out, name + ".pickle"), "wb") as f:
            pickle.dump(snap, f, protocol=4)
    with open(os.path.join(out, "cmp.expected.json"), "w") as f:
        json.dump({"only_a": sorted(ka - kb), "only_b": sorted(kb - ka)}, f, indent=1)


def big(out, megabytes, shape="train"):
    """One large snapshot, fast: a training-like loop over size classes, each
    with its own 2 MiB-aligned segments cut into equal slots (exact sizes, so
    the import's size rule holds), 200 shared call sites, time_us, and
    segment growth over the run. About 58 bytes of pickle per entry.

    shape "ring": the import's hard case. Segments of 2 MiB (so thousands of
    them), slots taken at random (addresses jump around), and the trace is
    what a ring buffer that started late holds: its first 40 % is dropped,
    so many frees are of blocks it never saw allocated, and many segments
    were alive before its first entry."""
    rng = random.Random(11)
    sites = make_sites(200)
    classes = [512, 8192, 262_144, 2 * MiB + 512, 24 * MiB]
    seg_bytes = 2 * MiB if shape == "ring" else 20 * MiB
    per_seg = {c: max(1, seg_bytes // c) for c in classes}
    seg_len = {c: per_seg[c] * c for c in classes}
    segments = []  # [address, class, slots: list of None | (requested, site)]
    free_slots = {c: [] for c in classes}
    trace = []
    clock = 1_748_729_391_000_000
    addr = 0x7F0000000000
    live = []
    target = megabytes * MiB
    scale = 1 / 0.6 if shape == "ring" else 1
    while len(trace) * 58 < target * scale:
        c = rng.choice(classes)
        if not free_slots[c]:
            segments.append([addr, c, [None] * per_seg[c]])
            clock += 3
            trace.append({"action": "segment_alloc", "addr": addr, "size": seg_len[c], "stream": 0, "time_us": clock})
            free_slots[c] = [(len(segments) - 1, i) for i in reversed(range(per_seg[c]))]
            addr += (seg_len[c] + 4 * MiB) // (2 * MiB) * (2 * MiB)
        if shape == "ring":
            slots = free_slots[c]
            k = rng.randrange(len(slots))
            slots[k], slots[-1] = slots[-1], slots[k]
        si, slot = free_slots[c].pop()
        site = sites[rng.randrange(len(sites))]
        segments[si][2][slot] = site
        clock += rng.randint(1, 9)
        trace.append({"action": "alloc", "addr": segments[si][0] + slot * c, "size": c, "stream": 0,
                      "time_us": clock, "frames": site})
        live.append((si, slot))
        if len(live) > 3000 or rng.random() < 0.45:
            si, slot = live.pop(rng.randrange(len(live)))
            seg = segments[si]
            site = seg[2][slot]
            seg[2][slot] = None
            a = seg[0] + slot * seg[1]
            for action in ("free_requested", "free_completed"):
                clock += 1
                trace.append({"action": action, "addr": a, "size": seg[1], "stream": 0, "time_us": clock,
                              "frames": site})
            free_slots[seg[1]].append((si, slot))
    out_segs = []
    for a, c, slots in segments:
        blocks = []
        for i, site in enumerate(slots):
            b = {"address": a + i * c, "size": c, "requested_size": c if site else 0,
                 "state": "active_allocated" if site else "inactive", "frames": site or []}
            if blocks and not site and blocks[-1]["state"] == "inactive":
                blocks[-1]["size"] += c
            else:
                blocks.append(b)
        out_segs.append({"device": 0, "address": a, "total_size": len(slots) * c, "stream": 0,
                         "segment_type": "small" if c <= SMALL else "large", "is_expandable": False,
                         "frames": [], "blocks": blocks})
    if shape == "ring":
        trace = trace[int(len(trace) * 0.4):]
    snap = {"segments": out_segs, "device_traces": [trace]}
    if shape == "staged":
        # record_function ranges over the loop: a step every 6000 entries,
        # forward (with 4 layers), backward and the optimizer inside it.
        ann = []
        mark = lambda stage, name, t: ann.append({"stage": stage, "name": name, "device": 0, "time_us": t})
        t = [e["time_us"] for e in trace]
        for step, at in enumerate(range(0, len(t) - 6000, 6000)):
            mark("START", f"ProfilerStep#{step}", t[at])
            mark("START", "forward", t[at])
            for k in range(4):
                mark("START", f"layer.{k}", t[at + 500 * k])
                mark("END", f"layer.{k}", t[at + 500 * k + 499])
            mark("END", "forward", t[at + 2999])
            mark("START", "backward", t[at + 3000])
            mark("END", "backward", t[at + 4999])
            mark("START", "Optimizer.step#SGD.step", t[at + 5000])
            mark("END", "Optimizer.step#SGD.step", t[at + 5999])
            mark("END", f"ProfilerStep#{step}", t[at + 5999])
        snap["external_annotations"] = ann
    path = os.path.join(out, f"big-{megabytes}MB.pickle" if shape == "train" else f"big-{shape}-{megabytes}MB.pickle")
    with open(path, "wb") as f:
        pickle.dump(snap, f, protocol=4)
    print(f"{path}: {os.path.getsize(path)} bytes, {len(trace)} trace entries, {len(out_segs)} segments")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    os.makedirs(sys.argv[1], exist_ok=True)
    if len(sys.argv) >= 4 and sys.argv[2] == "--big":
        big(sys.argv[1], int(sys.argv[3]), sys.argv[4] if len(sys.argv) >= 5 else "train")
    else:
        cases(sys.argv[1])
