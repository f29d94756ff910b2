"""A launch-bound PyTorch loop, for what `record` costs per step on a GPU
(issue 40: no more than PyTorch's own memory history, +16 % on an H100).

A 6-layer MLP, batch 32, AdamW: each step launches a few dozen small
kernels and allocates a few dozen tensors, so its time is the host's, not
the GPU's, and what a probe adds per call shows. Prints one JSON line: the
median microseconds per step over the timed steps (20 warm-up steps
first), and the tensor allocations PyTorch's allocator made per step.

    python3 scripts/gpu-launch-loop.py [--steps N] [--history]

--history turns on PyTorch's memory history (stacks="python"), the
comparison the issue names.
"""
import argparse, json, statistics, time

import torch

def make_step():
    """The loop's model on the GPU, and one step of it (also used by
    scripts/gpu-paired-cost.py)."""
    dev = torch.device("cuda")
    torch.manual_seed(0)
    layers = []
    for _ in range(6):
        layers += [torch.nn.Linear(512, 512), torch.nn.ReLU()]
    m = torch.nn.Sequential(*layers).to(dev)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
    x = torch.randn(32, 512, device=dev)

    def step():
        loss = m(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()

    return step


def timed(step, warmup, steps):
    """`warmup` untimed steps, then the median microseconds of `steps`
    timed ones, and the tensor allocations PyTorch made per step."""
    for _ in range(warmup):
        step()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    times = []
    for _ in range(steps):
        s = time.perf_counter()
        step()
        times.append(time.perf_counter() - s)
    after = torch.cuda.memory_stats()["allocation.all.allocated"]
    return statistics.median(times) * 1e6, (after - before) / steps


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--history", action="store_true")
    a = p.parse_args()
    step = make_step()
    if a.history:
        torch.cuda.memory._record_memory_history(max_entries=100_000, stacks="python")
    us, allocations = timed(step, 20, a.steps)
    print(json.dumps({
        "history": a.history,
        "steps": a.steps,
        "us_per_step": round(us, 1),
        "allocations_per_step": round(allocations, 1),
    }))


if __name__ == "__main__":
    main()
