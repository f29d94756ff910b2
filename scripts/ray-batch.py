#!/usr/bin/env python3
"""Analyse a batch of traces on a Ray cluster: one Ray task per shard, each
running `fragscope analyze INPUT... -o OUT --shard I/N`, then one
`fragscope summarize OUT` once they are all done.

fragscope has no scheduler of its own; this driver is the whole glue. Every
worker must see the inputs and OUT at the same paths (a shared file system,
or object-store URLs) and have the fragscope binary at the path --fragscope
gives (default: where `fragscope` is on the driver's PATH).

    python3 scripts/ray-batch.py runs/ -o out                  # local Ray, one shard per CPU
    python3 scripts/ray-batch.py runs/ -o out --address auto   # an existing cluster
    python3 scripts/ray-batch.py runs/ -o out --shards 64 -- --no-plots --fail-on high

Arguments after `--` go to every `analyze`. Exit status: 0 when every shard
and the summary succeeded; 1 when a shard failed (its traces are listed in
the summary as errors where they could be analysed at all) or summarize
failed; 3 when a shard's CI gate tripped (--fail-on, --max-score).
"""
import argparse
import os
import shutil
import subprocess
import sys

import ray


@ray.remote(num_cpus=1)
def analyze_shard(fragscope, inputs, out, index, count, extra):
    cmd = [fragscope, "analyze", *inputs, "-o", out, "--shard", f"{index}/{count}", "--jobs", "1", *extra]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:  # no such binary on this worker
        return index, 1, "", f"cannot run {fragscope}: {e}"
    return index, p.returncode, p.stdout.strip(), p.stderr.strip()


def count_traces(inputs):
    """How many traces the inputs hold (for the default shard count): the
    entries of each directory, or the input itself."""
    n = 0
    for i in inputs:
        if "://" in i:  # an object-store prefix: not counted here
            return None
        if os.path.isdir(i) and not any(f.startswith("events-") for f in os.listdir(i)):
            n += sum(1 for f in os.listdir(i) if not f.startswith("."))
        else:
            n += 1
    return n


def main():
    argv = sys.argv[1:]
    extra = []
    if "--" in argv:
        extra = argv[argv.index("--") + 1 :]
        argv = argv[: argv.index("--")]
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("inputs", nargs="+", help="trace directories, snapshots, or directories of them")
    ap.add_argument("-o", "--output", required=True, help="output root shared by every worker")
    ap.add_argument(
        "--shards",
        type=int,
        help="number of shards (default: one per CPU of the cluster, at most one per trace); "
        "keep it fixed for a job that reruns into the same output root, or parts of an "
        "earlier count will be found twice by summarize",
    )
    ap.add_argument("--address", help="Ray cluster address (default: start a local one)")
    ap.add_argument("--num-cpus", type=int, help="CPUs of the local Ray (default: all)")
    ap.add_argument("--fragscope", default=shutil.which("fragscope") or "fragscope", help="the fragscope binary")
    args = ap.parse_args(argv)

    # Local paths become absolute (workers start elsewhere); URLs stay.
    place = lambda p: p if "://" in p else os.path.abspath(p)
    inputs = [place(i) for i in args.inputs]
    out = place(args.output)
    traces = count_traces(inputs)
    if args.address:
        ray.init(address=args.address)
    else:
        ray.init(num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False)
    cpus = int(ray.cluster_resources().get("CPU", 1))
    shards = args.shards or max(1, min(cpus, traces or cpus))
    print(f"{traces if traces is not None else 'remote'} inputs, {shards} shards on {cpus} CPUs", file=sys.stderr)

    tasks = [analyze_shard.remote(args.fragscope, inputs, out, i, shards, extra) for i in range(shards)]
    status = 0
    for index, rc, stdout, stderr in sorted(ray.get(tasks)):
        print(f"shard {index}/{shards}: exit {rc}: {stdout.splitlines()[-1] if stdout else ''}", file=sys.stderr)
        if rc != 0:
            if stderr:
                print(stderr, file=sys.stderr)
            # An error (1) outranks a tripped gate (3).
            status = 3 if rc == 3 and status != 1 else 1
    ray.shutdown()

    # Summarize whatever parts exist, even after a failed shard: the others'
    # results stay usable and the failed traces show as error rows.
    p = subprocess.run([args.fragscope, "summarize", out])
    if p.returncode != 0:
        status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
