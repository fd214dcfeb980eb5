"""jobrun's benchmarks: one command, a table on stdout, the figures as JSON.

    python benchmarks/run.py [--quick | --smoke] [--json out.json] [--only SECTION ...]
    python benchmarks/run.py --device cuda [--quick]      # the GPU section, on a CUDA GPU

Sections: runner (jobrun vs a hand-written torch loop), loader (a torch Dataset read with
two DataLoader workers vs a hand loop over a DataLoader), dispatch (one core op in a plan
loop), plans (compile/analyze/print of 10^3..10^5 ops), checkpoint (save/load vs raw
I/O and torch.save/load, the async stall), memory (RSS over epochs, peak of a save),
startup (`jobrun --help`, `jobrun print`), restart (a rank's death to the restarted
ranks' first step, against a fresh start), fsdp and ddp (2 ranks against hand-written
FSDP2 and DistributedDataParallel loops), gpt (plans/gpt.yaml's steps/s against its
hand-written nanoGPT loop). Every figure is a ratio against a baseline
measured in the same run; each has a goal and says PASS or MISS. The full run takes a
few minutes; --quick (smaller state, fewer repetitions) is meant for CI; --smoke only
checks that everything runs (seconds; its figures mean little). See benchmarks/README.md.

The exit status is 0 when every section ran (goals missed included), 1 when one failed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the checkout importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import (  # noqa: E402
    bench_checkpoint,
    bench_ddp,
    bench_dispatch,
    bench_fsdp,
    bench_gpt,
    bench_gpu,
    bench_loader,
    bench_memory,
    bench_plans,
    bench_restart,
    bench_runner,
    bench_startup,
)
from benchmarks.common import Mode, Row, machine  # noqa: E402

SECTIONS = {
    "runner": bench_runner,
    "loader": bench_loader,
    "dispatch": bench_dispatch,
    "plans": bench_plans,
    "checkpoint": bench_checkpoint,
    "memory": bench_memory,
    "startup": bench_startup,
    "restart": bench_restart,
    "fsdp": bench_fsdp,
    "ddp": bench_ddp,
    "gpt": bench_gpt,
}
# On a CUDA GPU (--device cuda): measured only there.
GPU_SECTIONS = {"gpu": bench_gpu}
# One torch thread everywhere (child processes too, through OMP_NUM_THREADS): on a small
# shared machine, a second OpenMP thread that the kernel does not schedule makes the
# other spin at every parallel region, and epochs took 20x longer at random.
THREADS = 1


def _fmt(x: float | None) -> str:
    if x is None:
        return "-"
    if x == 0 or 0.01 <= abs(x) < 10_000:
        return f"{x:.3g}" if abs(x) < 100 else f"{x:.0f}"
    return f"{x:.2e}"


def table(rows: list[Row]) -> str:
    head = ("section", "figure", "value", "baseline", "ratio", "goal", "result")
    lines = [head]
    for r in rows:
        result = "-" if r.ok is None else ("PASS" if r.ok else "MISS")
        lines.append((
            r.section, r.name, f"{_fmt(r.value)} {r.unit}",
            f"{_fmt(r.baseline)} ({r.baseline_name})", f"{r.ratio:.3f}", r.goal, result,
        ))
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    out = []
    for i, line in enumerate(lines):
        out.append("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip())
        if i == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="CI size: a few minutes at most")
    size.add_argument("--smoke", action="store_true", help="a few seconds: checks that it runs")
    ap.add_argument("--json", metavar="PATH", help="write the figures here as JSON")
    ap.add_argument("--only", nargs="+", choices=[*SECTIONS, *GPU_SECTIONS], metavar="SECTION",
                    help=f"run only these sections ({', '.join([*SECTIONS, *GPU_SECTIONS])})")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cuda: the GPU sections (a GPT-shaped model in bf16 against a hand loop)")
    args = ap.parse_args(argv)
    mode = Mode("smoke" if args.smoke else "quick" if args.quick else "full")

    import torch

    default_threads = torch.get_num_threads()
    info = machine()
    print(f"jobrun benchmarks ({mode.name}): python {info['python']}, torch {info['torch']} "
          f"({THREADS} thread), {info['cpus']} CPUs ({info['cpu']}), {info['mem_gib']} GiB",
          flush=True)
    started = time.perf_counter()
    results: dict[str, dict] = {}
    rows: list[Row] = []
    failed = False
    torch.set_num_threads(THREADS)
    every = {**SECTIONS, **GPU_SECTIONS}
    for name in args.only or list(GPU_SECTIONS if args.device == "cuda" else SECTIONS):
        module = every[name]
        t0 = time.perf_counter()
        print(f"[{name}] ...", flush=True)
        try:
            got = module.run(mode)
        except Exception:  # noqa: BLE001 - reported, and the other sections still run
            failed = True
            err = traceback.format_exc()
            print(err, file=sys.stderr, flush=True)
            results[name] = {"error": err, "seconds": time.perf_counter() - t0, "rows": []}
            continue
        seconds = time.perf_counter() - t0
        rows += got
        results[name] = {"seconds": seconds, "rows": [r.to_json() for r in got]}
        for r in got:
            result = "" if r.ok is None else ("PASS" if r.ok else "MISS")
            print(f"  {r.name}: {_fmt(r.value)} {r.unit}, ratio {r.ratio:.3f} {result}", flush=True)
        print(f"[{name}] {seconds:.1f} s", flush=True)
    torch.set_num_threads(default_threads)
    total = time.perf_counter() - started
    print()
    print(table(rows))
    misses = [f"{r.section}: {r.name}" for r in rows if r.ok is False]
    print(f"\n{len(rows)} figures, {sum(r.ok is True for r in rows)} PASS, {len(misses)} MISS"
          f"{', ' + str(sum(1 for v in results.values() if 'error' in v)) + ' sections FAILED' if failed else ''}"
          f"; {total:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "mode": mode.name, "machine": info, "torch_threads": THREADS,
            "seconds": total, "sections": results, "misses": misses,
        }, indent=1, default=str) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
