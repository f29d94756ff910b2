"""The `fragscope` Python package against a stand-in torch (standin/):
the `-m` form and `watch`, a program that catches its OOMs and goes on, a
failing or slow analysis, a missing binary, no CUDA and no torch.

Run by tests/it/python.rs with FRAGSCOPE_BIN set to the binary under
test; the stand-in's snapshot is a real H100 run beside the repository
(../shared/fixtures/gpu-h100/snapshots/varshape-default.pickle: a
fragmentation OOM that `expandable_segments:True` removes)."""

import json
import os
import subprocess
import sys
import tempfile
import textwrap
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
PACKAGE = os.path.join(ROOT, "python")
STANDIN = os.path.join(HERE, "standin")
SNAPSHOT = os.path.join(ROOT, "..", "shared", "fixtures", "gpu-h100", "snapshots", "varshape-default.pickle")
MIB = 1 << 20


def env(**extra):
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join([PACKAGE, STANDIN])
    e["STANDIN_SNAPSHOT"] = SNAPSHOT
    e["STANDIN_BUDGET"] = str(100 * MIB)
    e.update({k: v for k, v in extra.items() if v is not None})
    for k in [k for k, v in extra.items() if v is None]:
        e.pop(k, None)
    return e


def run(args, cwd, **extra):
    return subprocess.run([sys.executable] + args, cwd=cwd, env=env(**extra), capture_output=True, text=True,
                          timeout=300)


def script(dir, body, name="train.py"):
    path = os.path.join(dir, name)
    with open(path, "w") as f:
        f.write(textwrap.dedent(body))
    return path


def fake_binary(dir, body):
    """A `fragscope` that does something else (fails, hangs)."""
    path = os.path.join(dir, "fake-fragscope")
    with open(path, "w") as f:
        f.write("#!/bin/sh\n" + body + "\n")
    os.chmod(path, 0o755)
    return path


OOM = """
    import torch
    torch.empty(64 << 20)
    torch.empty(64 << 20)   # past the 100 MiB budget
    print("not reached")
"""


@unittest.skipUnless(os.path.isfile(SNAPSHOT), f"{SNAPSHOT} is not here (only beside the checkout and in CI)")
class Torch(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="fragscope-py-")

    def test_the_m_form_explains_the_oom_and_lets_it_raise(self):
        s = script(self.dir, OOM)
        p = run(["-m", "fragscope.torch", "--out", "oom", s, "--lr", "3"], self.dir)
        # The OOM is not swallowed: Python's own traceback, exit 1.
        self.assertEqual(p.returncode, 1, p.stderr)
        self.assertIn("OutOfMemoryError: CUDA out of memory", p.stderr)
        self.assertNotIn("not reached", p.stdout)
        # The first screen, before the traceback.
        self.assertIn("fragscope: CUDA out of memory on device 0: a request of 64.00 MiB", p.stderr)
        self.assertIn("fragscope:   verdict: failed: 1 OOM (fragmentation)", p.stderr)
        self.assertIn("expandable_segments:True", p.stderr.split("fragscope:   fix:")[1].splitlines()[0])
        self.assertLess(p.stderr.index("verdict:"), p.stderr.index("Traceback"))
        report = [d for d in os.listdir(os.path.join(self.dir, "oom")) if not d.endswith(".pickle")]
        self.assertEqual(len(report), 1)
        with open(os.path.join(self.dir, "oom", report[0], "report.json")) as f:
            self.assertEqual(json.load(f)["decision"]["verdict"]["kind"], "failed")

    def test_argv_and_the_module_form_are_pythons(self):
        script(self.dir, "import sys\nprint(sys.argv)\n", name="show.py")
        p = run(["-m", "fragscope.torch", "--", "show.py", "-x", "--out", "y"], self.dir)
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertEqual(p.stdout.strip(), "['show.py', '-x', '--out', 'y']")
        script(self.dir, "import sys\nprint(__name__, sys.argv[1:])\n", name="mymod.py")
        p = run(["-m", "fragscope.torch", "-m", "mymod", "a"], self.dir)
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertEqual(p.stdout.strip(), "__main__ ['a']")

    def test_a_program_that_catches_its_ooms_goes_on_and_each_is_explained_up_to_the_limit(self):
        s = script(self.dir, """
            import torch, fragscope.torch
            w = fragscope.torch.watch(out_dir="oom", limit=2)
            for i in range(3):
                try:
                    torch.empty(1 << 40)
                except torch.cuda.OutOfMemoryError:
                    print("caught", i)
            print("done", len(w.reports))
        """)
        p = run([s], self.dir)
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertEqual(p.stdout.split(), ["caught", "0", "caught", "1", "caught", "2", "done", "2"])
        self.assertEqual(p.stderr.count("verdict: failed"), 2)
        self.assertIn("OOM 3 not analysed: the limit of 2 is reached", p.stderr)

    def test_a_failing_analysis_says_why_and_keeps_the_snapshot(self):
        s = script(self.dir, OOM)
        bad = fake_binary(self.dir, "echo 'Error: boom' >&2; exit 1")
        p = run(["-m", "fragscope.torch", "--out", "oom", s], self.dir, FRAGSCOPE_BIN=bad)
        self.assertEqual(p.returncode, 1)
        self.assertIn("fragscope: the analysis failed: Error: boom; the snapshot is kept:", p.stderr)
        self.assertIn("OutOfMemoryError", p.stderr)
        self.assertTrue(any(f.endswith(".pickle") for f in os.listdir(os.path.join(self.dir, "oom"))))

    def test_a_slow_analysis_is_stopped_at_its_timeout(self):
        s = script(self.dir, OOM)
        slow = fake_binary(self.dir, "sleep 30")
        p = run(["-m", "fragscope.torch", "--timeout", "1", s], self.dir, FRAGSCOPE_BIN=slow)
        self.assertEqual(p.returncode, 1)
        self.assertIn("the analysis ran past 1.0 s and was stopped; the snapshot is kept", p.stderr)

    def test_a_missing_binary_is_said(self):
        s = script(self.dir, OOM)
        p = run(["-m", "fragscope.torch", s], self.dir, FRAGSCOPE_BIN=os.path.join(self.dir, "nowhere"))
        self.assertEqual(p.returncode, 1)
        self.assertIn("is not an executable file; the snapshot is kept", p.stderr)
        self.assertIn("OutOfMemoryError", p.stderr)

    def test_without_cuda_or_torch_the_m_form_exits_2(self):
        s = script(self.dir, OOM)
        p = run(["-m", "fragscope.torch", s], self.dir, STANDIN_CUDA="0")
        self.assertEqual(p.returncode, 2)
        self.assertIn("sees no CUDA device", p.stderr)
        e = env()
        e["PYTHONPATH"] = PACKAGE  # no torch at all (this Python has none)
        p = subprocess.run([sys.executable, "-m", "fragscope.torch", s], cwd=self.dir, env=e, capture_output=True,
                           text=True)
        if "No module named 'torch'" in p.stderr or "PyTorch is not installed" in p.stderr:
            self.assertEqual(p.returncode, 2, p.stderr)
            self.assertIn("fragscope.torch: PyTorch is not installed", p.stderr)

    def test_a_wrong_command_line_exits_2(self):
        for args in [[], ["--bogus", "x.py"], ["--limit"], ["missing.py"]]:
            p = run(["-m", "fragscope.torch"] + args, self.dir)
            self.assertEqual(p.returncode, 2, (args, p.stderr))

    def test_analyze_returns_the_report(self):
        sys.path.insert(0, PACKAGE)
        import fragscope

        r = fragscope.analyze(SNAPSHOT, no_plots=True, conf=["max_split_size_mb:64"])
        self.assertEqual(r["decision"]["verdict"]["kind"], "failed")
        names = [s["name"] for s in r["whatif"]["scenarios"]]
        self.assertIn("max_split_size_mb:64", names)
        with self.assertRaises(fragscope.FragscopeError) as e:
            fragscope.analyze(os.path.join(self.dir, "none.pickle"))
        self.assertIn("no such file", str(e.exception))
        bad = os.path.join(self.dir, "bad.pickle")
        with open(bad, "wb") as f:
            f.write(b"not a pickle")
        with self.assertRaises(fragscope.FragscopeError) as e:
            fragscope.analyze(bad)
        self.assertIn("failed", str(e.exception))


if __name__ == "__main__":
    unittest.main()
