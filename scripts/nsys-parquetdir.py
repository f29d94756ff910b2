#!/usr/bin/env python3
"""Writes the tables of an SQLite file as a folder of Parquet files, one
`<TABLE>.parquet` per table with the same columns and types: the layout of
`nsys export --type parquetdir`. fragscope's tests turn the export of
scripts/gen-nsys.py into such a folder with it, so the Parquet reader is
tested on the same rows as the SQLite reader. The rows of the memory table
are written in a shuffled order (seeded), so the reader's sort by `start`
is exercised: a Parquet file promises no row order. Needs DuckDB
(installed in target/pyenv by scripts/install-deps).

Usage: nsys-parquetdir.py EXPORT.sqlite OUTDIR
"""
import os
import random
import sqlite3
import sys

import duckdb

TYPES = {"INTEGER": "BIGINT", "TEXT": "VARCHAR", "REAL": "DOUBLE"}


def main(src, out):
    os.makedirs(out, exist_ok=True)
    db = sqlite3.connect(src)
    duck = duckdb.connect()
    tables = [r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
    for t in tables:
        cols = [(c[1], TYPES.get(c[2].upper(), "VARCHAR")) for c in db.execute(f"PRAGMA table_info({t})")]
        duck.execute(f'CREATE TABLE "{t}" ({", ".join(f"{n} {ty}" for n, ty in cols)})')
        rows = db.execute(f'SELECT * FROM "{t}"').fetchall()
        if t == "CUDA_GPU_MEMORY_USAGE_EVENTS":
            random.Random(7).shuffle(rows)
        if rows:
            duck.executemany(f'INSERT INTO "{t}" VALUES ({", ".join("?" for _ in cols)})', rows)
        duck.execute(f"""COPY "{t}" TO '{os.path.join(out, t + ".parquet")}' (FORMAT PARQUET)""")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
