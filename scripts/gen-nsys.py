#!/usr/bin/env python3
"""Writes an SQLite file in the shape of an Nsight Systems export
(`nsys profile --cuda-memory-usage=true`, `nsys export --type sqlite`), for
fragscope's tests: no real export with CUDA_GPU_MEMORY_USAGE_EVENTS could be
found in public repositories. The schema is the published one (NVIDIA's
"SQLite Schema Reference", nsys 2024.x: CUDA_GPU_MEMORY_USAGE_EVENTS and its
enum tables ENUM_CUDA_MEM_KIND and ENUM_CUDA_DEV_MEM_EVENT_OPER); written
from that schema only, independently of fragscope's reader.

The enum ids are shuffled on purpose (--shuffle-enums): a reader must take
the names from the enum tables, not the numbers. Besides the database,
OUT.expected.json holds what Python computes from the rows it wrote.

Usage: gen-nsys.py OUT.sqlite [--shuffle-enums] [--seed N] [--events N (default 3000)]
"""
import json
import random
import sqlite3
import sys

KINDS = ["PAGEABLE", "PINNED", "DEVICE", "ARRAY", "MANAGED", "DEVICE_STATIC", "MANAGED_STATIC", "UNKNOWN"]
OPERS = ["ALLOCATION", "DEALLOCATION"]


def main(out, shuffle, seed, events=3000):
    rng = random.Random(seed)
    kind_ids = list(range(len(KINDS)))
    oper_ids = [0, 1]
    if shuffle:
        rng.shuffle(kind_ids)
        oper_ids = [7, 3]
    kind_id = {k: kind_ids[i] for i, k in enumerate(KINDS)}
    oper_id = {o: oper_ids[i] for i, o in enumerate(OPERS)}
    db = sqlite3.connect(out)
    db.executescript("""
    CREATE TABLE ENUM_CUDA_MEM_KIND (id INTEGER NOT NULL PRIMARY KEY, name TEXT NOT NULL, label TEXT NOT NULL);
    CREATE TABLE ENUM_CUDA_DEV_MEM_EVENT_OPER (id INTEGER NOT NULL PRIMARY KEY, name TEXT NOT NULL, label TEXT NOT NULL);
    CREATE TABLE CUDA_GPU_MEMORY_USAGE_EVENTS (
        start INTEGER NOT NULL, globalPid INTEGER NOT NULL, deviceId INTEGER NOT NULL, contextId INTEGER NOT NULL,
        address INTEGER NOT NULL, pc INTEGER NOT NULL, bytes INTEGER NOT NULL,
        memKind INTEGER NOT NULL REFERENCES ENUM_CUDA_MEM_KIND(id),
        memoryOperationType INTEGER NOT NULL REFERENCES ENUM_CUDA_DEV_MEM_EVENT_OPER(id),
        name TEXT, correlationId INTEGER, localMemoryPoolAddress INTEGER, localMemoryPoolReleaseThreshold INTEGER,
        localMemoryPoolSize INTEGER, localMemoryPoolUtilizedSize INTEGER, importedMemoryPoolAddress INTEGER,
        importedMemoryPoolProcessId INTEGER);
    CREATE TABLE TARGET_INFO_SESSION_START_TIME (utcEpochNs INTEGER, utcTime TEXT, localTime TEXT);
    """)
    for k in KINDS:
        db.execute("INSERT INTO ENUM_CUDA_MEM_KIND VALUES (?, ?, ?)",
                   (kind_id[k], "CUDA_MEMOPR_MEMORY_KIND_" + k, k.title().replace("_", " ")))
    for o in OPERS:
        db.execute("INSERT INTO ENUM_CUDA_DEV_MEM_EVENT_OPER VALUES (?, ?, ?)",
                   (oper_id[o], "CUDA_DEV_MEM_EVENT_OPR_" + o, o.title()))
    pid = 4242
    gpid = (1 << 56) | (pid << 24) | 4243  # hardware id, pid, thread id
    t = 1_000_000
    rows = []
    live = {}  # address -> (bytes, kind, pooled)
    nxt = {"dev": 0x7F00_0000_0000, "pool": 0x7E00_0000_0000, "host": 0x5500_0000_0000, "managed": 0x7D00_0000_0000}
    device_live = peak = 0
    expected = {"rows": 0, "device_events": 0, "pooled": 0, "skipped": {}, "allocs": 0, "frees": 0}
    for _ in range(events):
        t += rng.randint(100, 5000)
        if live and rng.random() < 0.45:
            addr = rng.choice(sorted(live))
            size, kind, pooled = live.pop(addr)
            rows.append((t, addr, size, kind, "DEALLOCATION", pooled))
            continue
        r = rng.random()
        if r < 0.6:
            kind, pooled, region = "DEVICE", False, "dev"
        elif r < 0.75:
            kind, pooled, region = "DEVICE", True, "pool"
        elif r < 0.85:
            kind, pooled, region = "MANAGED", False, "managed"
        else:
            kind, pooled, region = rng.choice(["PINNED", "PAGEABLE"]), False, "host"
        size = rng.choice([512, 4096, 1 << 20, 3 << 20, 20 << 20]) + 512 * rng.randint(0, 8)
        addr = nxt[region]
        nxt[region] += (size + 0xFFFF) & ~0xFFFF
        live[addr] = (size, kind, pooled)
        rows.append((t, addr, size, kind, "ALLOCATION", pooled))
    for (t, addr, size, kind, op, pooled) in rows:
        db.execute("INSERT INTO CUDA_GPU_MEMORY_USAGE_EVENTS VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                   (t, gpid, 0, 1, addr, 0x4000, size, kind_id[kind], oper_id[op], None, None,
                    0x7E00_0000_0000 if pooled else None, 0 if pooled else None, 64 << 20 if pooled else None,
                    None, None, None))
        expected["rows"] += 1
        if kind in ("PINNED", "PAGEABLE"):
            name = "CUDA_MEMOPR_MEMORY_KIND_" + kind
            expected["skipped"][name] = expected["skipped"].get(name, 0) + 1
            continue
        expected["device_events"] += 1
        if op == "ALLOCATION":
            expected["allocs"] += 1
            expected["pooled"] += int(pooled)
            device_live += size
        else:
            expected["frees"] += 1
            device_live -= size
        peak = max(peak, device_live)
    expected["peak_live_bytes"] = peak
    expected["pid"] = pid
    db.commit()
    db.close()
    with open(out.rsplit(".", 1)[0] + ".expected.json", "w") as f:
        json.dump(expected, f, indent=1, sort_keys=True)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    args = sys.argv[1:]
    seed = int(args[args.index("--seed") + 1]) if "--seed" in args else 1
    events = int(args[args.index("--events") + 1]) if "--events" in args else 3000
    main(args[0], "--shuffle-enums" in args, seed, events)
