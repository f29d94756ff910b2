#!/usr/bin/env python3
"""Reads a batch summary dataset (OUT/summary.parquet, hive-partitioned by
source and date) with DuckDB, or pyarrow when DuckDB is not installed, and
prints what it found as JSON: the engine, the row count, the partition
values and the rows per cluster label. Used by the tests; also a usage
example:

    python3 scripts/readback-summary.py OUT/summary.parquet
"""
import json
import sys

path = sys.argv[1]
try:
    import duckdb

    con = duckdb.connect()
    q = f"SELECT * FROM read_parquet('{path}/**/*.parquet', hive_partitioning = true)"
    rows = con.execute(f"SELECT count(*) FROM ({q})").fetchone()[0]
    sources = sorted(r[0] for r in con.execute(f"SELECT DISTINCT source FROM ({q})").fetchall())
    dates = sorted(str(r[0]) for r in con.execute(f"SELECT DISTINCT date FROM ({q})").fetchall())
    labels = dict(con.execute(f"SELECT cluster_label, count(*) FROM ({q}) GROUP BY 1").fetchall())
    worst = con.execute(f"SELECT trace FROM ({q}) ORDER BY score_p95 DESC NULLS LAST LIMIT 1").fetchone()[0]
    engine = "duckdb " + duckdb.__version__
except ImportError:
    import pyarrow.dataset as ds

    t = ds.dataset(path, format="parquet", partitioning="hive").to_table()
    rows = t.num_rows
    sources = sorted(set(t.column("source").to_pylist()))
    dates = sorted(set(str(d) for d in t.column("date").to_pylist()))
    labels = {}
    for l in t.column("cluster_label").to_pylist():
        labels[l] = labels.get(l, 0) + 1
    p95 = t.column("score_p95").to_pylist()
    worst = t.column("trace").to_pylist()[max(range(rows), key=lambda i: p95[i] if p95[i] is not None else -1)]
    import pyarrow

    engine = "pyarrow " + pyarrow.__version__
print(json.dumps({"engine": engine, "rows": rows, "sources": sources, "dates": dates,
                  "labels": {str(k): v for k, v in labels.items()}, "worst": worst}))
