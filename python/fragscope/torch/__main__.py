"""python -m fragscope.torch [--out DIR] [--limit N] [--timeout S] [--max-entries N] [--plots]
                            [--] script.py ARGS… | -m module ARGS…

Runs a script (or a module, as `python -m`) under `fragscope.torch.watch`,
with no change to it: each OOM is explained on stderr and written to DIR
(default fragscope-oom). Exit status: the program's; 2 when PyTorch or
CUDA is missing or the command line is wrong."""

import os
import runpy
import sys

from . import TorchUnavailable, watch

USAGE = __doc__.split("\n\n")[0]


def main(argv):
    opts = {"out": "fragscope-oom", "limit": "5", "timeout": "300", "max-entries": "1000000"}
    plots = False
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "--":
            i += 1
            break
        if a == "--plots":
            plots = True
            i += 1
            continue
        if a in ("-h", "--help"):
            print(__doc__)
            return 0
        key = a[2:].split("=", 1)[0] if a.startswith("--") else None
        if key in opts:
            if "=" in a:
                opts[key] = a.split("=", 1)[1]
                i += 1
            elif i + 1 < len(argv):
                opts[key] = argv[i + 1]
                i += 2
            else:
                print(f"fragscope.torch: {a} needs a value\n{USAGE}", file=sys.stderr)
                return 2
            continue
        if a.startswith("--"):
            print(f"fragscope.torch: unknown option {a}\n{USAGE}", file=sys.stderr)
            return 2
        break
    rest = argv[i:]
    if not rest:
        print(f"fragscope.torch: no script to run\n{USAGE}", file=sys.stderr)
        return 2
    try:
        limit = None if opts["limit"] in ("none", "all") else int(opts["limit"])
        timeout = float(opts["timeout"])
        max_entries = int(opts["max-entries"])
    except ValueError as e:
        print(f"fragscope.torch: {e}\n{USAGE}", file=sys.stderr)
        return 2
    module = None
    if rest[0] == "-m":
        if len(rest) < 2:
            print(f"fragscope.torch: -m needs a module\n{USAGE}", file=sys.stderr)
            return 2
        module, args = rest[1], rest[2:]
    else:
        script, args = rest[0], rest[1:]
        if not os.path.isfile(script):
            print(f"fragscope.torch: {script}: no such file", file=sys.stderr)
            return 2
    try:
        watch(out_dir=opts["out"], max_entries=max_entries, limit=limit, timeout=timeout, plots=plots)
    except TorchUnavailable as e:
        print(f"fragscope.torch: {e}", file=sys.stderr)
        return 2
    # As Python runs them: argv and the first path entry of the program's.
    if module is not None:
        sys.argv = [module] + args
        sys.path.insert(0, os.getcwd())
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        sys.argv = [script] + args
        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
        runpy.run_path(script, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
