"""fragscope from Python: run the `fragscope` binary on a snapshot and read
its report, and (`fragscope.torch`) make a PyTorch OOM explain itself.

    import fragscope
    report = fragscope.analyze("snapshot.pickle")      # report.json, as a dict
    report["decision"]["verdict"]

The binary is the one `pip install` put beside this package, else
`$FRAGSCOPE_BIN`, else `fragscope` on PATH (`binary()` says which).
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile

__all__ = ["analyze", "binary", "FragscopeError"]


class FragscopeError(RuntimeError):
    """The binary is missing, failed, or gave no report."""


def binary():
    """The `fragscope` executable to run: `$FRAGSCOPE_BIN`, else the one
    installed into this environment's scripts directory, else PATH."""
    explicit = os.environ.get("FRAGSCOPE_BIN")
    if explicit:
        if not (os.path.isfile(explicit) and os.access(explicit, os.X_OK)):
            raise FragscopeError(f"FRAGSCOPE_BIN={explicit} is not an executable file")
        return explicit
    here = os.path.join(os.path.dirname(sys.executable), "fragscope")
    if os.path.isfile(here) and os.access(here, os.X_OK):
        return here
    found = shutil.which("fragscope")
    if found:
        return found
    raise FragscopeError(
        "the fragscope binary is not installed: `pip install fragscope` (or `pip install .` in a clone) puts it "
        "beside Python; or set FRAGSCOPE_BIN to its path"
    )


def _option(key, value):
    flag = "--" + key.replace("_", "-")
    if value is True:
        return [flag]
    if value is False or value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [x for v in value for x in (flag, str(v))]
    return [flag, str(value)]


def analyze(path, out=None, timeout=None, **options):
    """Runs `fragscope analyze PATH -o OUT` and returns `report.json` as a
    dict. Keyword options become flags: `capacity="80GiB"`, `no_plots=True`,
    `conf=["expandable_segments:True"]`. Without `out` the report goes to a
    temporary directory that is removed afterwards. Raises FragscopeError
    (with the binary's own message) when it fails or runs past `timeout`
    seconds."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FragscopeError(f"{path}: no such file or directory")
    keep = out is not None
    out = os.fspath(out) if keep else tempfile.mkdtemp(prefix="fragscope-")
    try:
        args = [binary(), "analyze", path, "-o", out]
        for key, value in options.items():
            args += _option(key, value)
        try:
            done = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise FragscopeError(f"fragscope analyze {path} ran past {timeout} s and was stopped") from None
        if done.returncode not in (0, 3):
            message = done.stderr.strip() or done.stdout.strip() or f"exit status {done.returncode}"
            raise FragscopeError(f"fragscope analyze {path} failed: {message}")
        try:
            with open(os.path.join(out, "report.json")) as f:
                return json.load(f)
        except (OSError, ValueError) as e:
            raise FragscopeError(f"fragscope analyze {path} wrote no readable report.json: {e}") from None
    finally:
        if not keep:
            shutil.rmtree(out, ignore_errors=True)
