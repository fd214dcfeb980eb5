"""What a little Python costs between torch's kernels: a hand-written training loop with a
few statements added to every step, against the same loop without them.

    python benchmarks/cold_calls.py [--tiny] [--reps 30]

The added work is a no-op call, one dict store, and the statements the generated code of
jobrun's training loop runs beyond a loop that calls jobrun's ops directly (the workspace
stores and tests; the progress tuple of the figures below left the loop in session 5).
Each is timed hot (a loop of it alone) and in the loop (CPU time a step, the loops taking
turns, medians of the repetitions; each loop its own model, built from one seed). What
this measures, on the 2-core machine of session 2026-11-27 (4): a no-op call costs about 2 us a step in the loop (50 ns hot); the
generated code's statements about 5 us (0.46 us hot). Between kernels the interpreter runs
from cold caches: a few distinct code paths cost microseconds, more repetitions of them
little. This is why the runner row's gap in time is about twice its gap in instructions.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any


def main() -> None:
    import torch
    import torch.nn.functional as F

    from jobrun.ops.context import OpContext
    from jobrun.ops.models import model_mlp

    args = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    args.add_argument("--tiny", action="store_true", help="the runner row's tiny MLP (default: the MLP example)")
    args.add_argument("--reps", type=int, default=30)
    opts = args.parse_args()
    torch.set_num_threads(1)
    sizes, batch = ([4, 8, 2], 8) if opts.tiny else ([16, 64, 64, 4], 64)
    ctx = OpContext(node="local", seed=0, device="cpu")
    x, y = torch.randn(2048, sizes[0]), torch.randint(0, sizes[-1], (2048,))
    order = torch.randperm(2048)
    G: dict[str, Any] = {"model": 1, "opt": 2, "loss": 0}

    class Workspace(dict):  # a private task's workspace (jobrun.runner.executor)
        __slots__ = ()
        __missing__ = staticmethod(G.__getitem__)

    L, progress = Workspace(), {}

    def noop(k: int, r: tuple) -> None:
        pass

    def one_store(k: int, r: tuple) -> None:
        progress["loop"] = k

    def generated(k: int, r: tuple) -> None:  # the generated loop's statements, as written
        if type(r) is not tuple or len(r) != 3:
            raise AssertionError
        L["xb"], L["yb"], L["end"] = r
        if (v := L["end"]) is True or (v is not False and v is not None):
            raise AssertionError
        _ = (G["model"], G["opt"], L["xb"], L["yb"])
        if "loss" in G:
            G["loss"] = r
        else:
            L["loss"] = r
        L["loss_last"] = r

    def loop(extra: Callable[[int, tuple], None] | None) -> Callable[[int], None]:
        model = model_mlp(ctx, sizes=sizes)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

        def run(steps: int) -> None:
            start = 0
            for k in range(steps):
                idx = order[start:start + batch]
                start = (start + batch) % len(x)
                xb, yb = x[idx], y[idx]
                if extra is not None:
                    extra(k, (xb, yb, False))
                opt.zero_grad(set_to_none=True)
                out = F.cross_entropy(model(xb), yb)
                out.backward()
                opt.step()
                out.item()

        return run

    extras = {"no-op call": noop, "one dict store": one_store, "generated statements": generated}
    loops = {"plain": loop(None), **{name: loop(fn) for name, fn in extras.items()}, "plain again": loop(None)}
    per_step: dict[str, list[float]] = {name: [] for name in loops}
    for rep in range(opts.reps):
        for name, run in list(loops.items())[:: 1 if rep % 2 else -1]:
            run(20)  # warm
            c0 = time.process_time()
            run(200)
            per_step[name].append((time.process_time() - c0) / 200 * 1e6)
    base = statistics.median(per_step["plain"])
    print(f"{'sizes ' + str(sizes) + ', batch ' + str(batch):40s} {'us a step':>10s} {'added':>8s} {'hot':>8s}")
    for name, times in per_step.items():
        hot = ""
        if name in extras:
            fn, r = extras[name], (x, y, False)
            t0 = time.perf_counter()
            for k in range(100_000):
                fn(k, r)
            hot = f"{(time.perf_counter() - t0) / 100_000 * 1e6:8.3f}"
        median = statistics.median(times)
        print(f"{name:40s} {median:10.2f} {median - base:+8.2f} {hot:>8s}")


if __name__ == "__main__":
    main()
