"""What `record` costs per step of a launch-bound PyTorch loop, against
PyTorch's memory history, measured in ONE process (issue 40: the whole
`record` must cost no more per step than the memory history).

scripts/gpu-loop-cost starts a process per configuration; on a GPU
virtual machine one configuration's step varied up to 30 % between
processes, more than the configurations differ. Here one process runs the
loop of scripts/gpu-launch-loop.py in blocks, and each block runs under
one configuration:

  plain      nothing on;
  history    PyTorch's memory history on (stacks="python", as the
             fixtures' README measured it), then off again;
  LABEL      `fragscope record --pid <this process>` started before the
             block (the block waits for its "recording pid" line) and
             stopped with SIGINT after it; each --record LABEL=BINARY[,FLAG...]
             is one such configuration.

Each round runs every configuration once, in an order rotated each round;
each block has 30 untimed warm-up steps, then --steps timed ones, and
counts as its median step. The summary gives each configuration's median
block against plain and against history, and the ratios of blocks of the
same round (paired), with their range, and their geometric mean with a
95 % bootstrap interval. --pin puts the loop on one CPU and the recorders
on the others, which narrows the spread between blocks. A recorder that loses events or
exits with an error stops the run.

    sudo python3 scripts/gpu-paired-cost.py --rounds 10 --steps 400 \
        --record record=./fragscope --record no-launch=./fragscope,--no-launch

--from LOG... runs nothing (and needs no GPU): it pools the rows that
earlier runs printed (their logs) and prints the same summary over all
their rounds, each round paired within its own run.
"""
import argparse, importlib.util, json, math, os, random, shutil, signal, statistics, subprocess, sys, tempfile, threading

p = argparse.ArgumentParser()
p.add_argument("--rounds", type=int, default=10)
p.add_argument("--steps", type=int, default=400)
p.add_argument("--record", action="append", default=[], metavar="LABEL=BINARY[,FLAG...]")
p.add_argument("--pin", type=int, metavar="CPU", help="run the loop on this CPU only, the recorders on the others")
p.add_argument("--from", dest="logs", nargs="+", metavar="LOG", help="summarise earlier runs' logs instead of running")
a = p.parse_args()


def gmean(xs):
    return math.exp(statistics.fmean(math.log(x) for x in xs))


def ci(xs, n=4000):
    """95 % bootstrap interval of the geometric mean over rounds."""
    rng = random.Random(0)
    means = sorted(gmean(rng.choices(xs, k=len(xs))) for _ in range(n))
    return f"{means[n // 40]:.3f}-{means[n - 1 - n // 40]:.3f}"


def summary(rows, steps):
    """Each configuration's median block and p10, and its ratios to plain
    and history: of the medians, and of the blocks of one round (a round
    is a (run, round) pair)."""
    configs = list(dict.fromkeys(r["config"] for r in rows))
    rounds = sorted({(r["run"], r["round"]) for r in rows})
    by = {c: [r["us_per_step"] for r in rows if r["config"] == c] for c in configs}
    pair = {(r["run"], r["round"], r["config"]): r["us_per_step"] for r in rows}
    print()
    print(f"{len(rounds)} rounds of {steps} steps; medians of the blocks (p10), and of the same round's ratios (min-max)")
    for c in configs:
        p10 = statistics.quantiles(by[c], n=10)[0] if len(by[c]) > 1 else by[c][0]
        line = f"{c:12} {statistics.median(by[c]):8.1f} us/step (p10 {p10:.1f})"
        for base in ("plain", "history"):
            if c == base or base not in by:
                continue
            ratios = [pair[(run, r, c)] / pair[(run, r, base)] for run, r in rounds]
            line += (f"   /{base} {statistics.median(by[c]) / statistics.median(by[base]):.3f}"
                     f" paired {statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})"
                     f" geomean {gmean(ratios):.3f} [{ci(ratios)}]"
                     f" lower in {sum(x < 1 for x in ratios)} of {len(ratios)}")
        print(line)


if a.logs:
    pooled = []
    for run, log in enumerate(a.logs):
        try:
            with open(log) as f:
                pooled += [dict(json.loads(l), run=run) for l in f if l.startswith('{"round"')]
        except (OSError, ValueError) as e:
            sys.exit(f"{log}: {e}")
    if not pooled:
        sys.exit(f"no rows in {' '.join(a.logs)}")
    summary(pooled, a.steps)
    sys.exit(0)

import torch

others = None
if a.pin is not None:
    others = os.sched_getaffinity(0) - {a.pin}
    os.sched_setaffinity(0, {a.pin})

# The loop of scripts/gpu-launch-loop.py (a file name Python cannot import).
_spec = importlib.util.spec_from_file_location(
    "launch_loop", os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu-launch-loop.py"))
_loop = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_loop)
step = _loop.make_step()


def block():
    return _loop.timed(step, 30, a.steps)


class Recorder:
    """`fragscope record --pid` on this process, for one block."""

    def __init__(self, spec):
        binary, *flags = spec.split(",")
        self.dir = tempfile.mkdtemp()
        out = os.path.join(self.dir, "t")
        cmd = [binary, "record", "-o", out, *flags, "--pid", str(os.getpid())]
        pin = (lambda: os.sched_setaffinity(0, others)) if others else None
        self.p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, preexec_fn=pin)
        self.lines = []
        ready = threading.Event()

        def drain():
            for line in self.p.stderr:
                self.lines.append(line.rstrip("\n"))
                if line.startswith("fragscope: recording pid"):
                    ready.set()
            ready.set()

        self.reader = threading.Thread(target=drain, daemon=True)
        self.reader.start()
        if not ready.wait(120) or self.p.poll() is not None:
            self.p.kill()
            sys.exit(f"{' '.join(cmd)} did not start recording:\n" + "\n".join(self.lines))

    def stop(self):
        self.p.send_signal(signal.SIGINT)
        rc = self.p.wait(120)
        self.reader.join(10)
        shutil.rmtree(self.dir, ignore_errors=True)
        text = "\n".join(self.lines)
        if rc != 0 or "lost events: 0" not in text:
            sys.exit(f"the recorder exited {rc} or lost events:\n{text}")
        return next((l.strip() for l in self.lines if l.strip().startswith("events:")), "")


configs = ["plain", "history"] + [r.split("=", 1)[0] for r in a.record]
specs = dict(r.split("=", 1) for r in a.record)
rows = []
for _ in range(20):
    step()
for rnd in range(a.rounds):
    for k in range(len(configs)):
        how = configs[(k + rnd) % len(configs)]
        rec = None
        if how == "history":
            torch.cuda.memory._record_memory_history(max_entries=100_000, stacks="python")
        elif how != "plain":
            rec = Recorder(specs[how])
        us, allocs = block()
        events = ""
        if how == "history":
            torch.cuda.memory._record_memory_history(enabled=None)
        elif rec:
            events = rec.stop()
        row = {"round": rnd, "config": how, "us_per_step": float(f"{us:.1f}"), "allocations_per_step": allocs,
               "events": events}
        rows.append(row)
        print(json.dumps(row), flush=True)

summary([dict(r, run=0) for r in rows], a.steps)
