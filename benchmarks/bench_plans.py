"""3. Plan scale: compile, analyze and print generated plans of 10^3, 10^4, 10^5 ops.

The generated plan repeats a block of 10 op calls that uses every kind of step (ops with
literals and blobs, a loop with an index, an if/else, a stop_if) and defines new blobs,
so that the analyzer's sets grow with the plan as in a real one; it is clean (no
diagnostics). Each stage is timed on its own (CPU time, the median of several runs):
``compile_file`` (read, parse, substitute, build the IR), ``analyze``, ``render_text``.
The baseline is PyYAML reading the same file into plain Python data with libyaml
(``yaml.load(text, Loader=yaml.CSafeLoader)``): compile, which also keeps the position of
every value and builds the IR, should take no longer (ratio <= 1). Each timed call runs
with no other big tree alive, so the cyclic collector's passes cost every stage alike.
The growth factor is t(10N) / t(N), 10 meaning linear; the goal is on the exponent k of
t ~ N^k fitted over the whole range (k = 1 is linear; one growth factor alone is noisy).
"""

from __future__ import annotations

import gc
import math
import tempfile
import time
from pathlib import Path

from benchmarks.common import Mode, Row, median

RATIO_MAX = 1.0  # compile / yaml.load of the same file
K_MAX = 1.1  # linear (k = 1), with room for noise and cache effects: 12.6x per 10x
BLOCK_OPS = 10


def plan_text(n_ops: int) -> str:
    blocks = max(1, n_ops // BLOCK_OPS)
    lines = [
        "job: bench-plan-scale",
        "max_epochs: 1",
        "vars: {step: 2}",
        "init:",
        "  - task: setup",
        "    do:",
        "      - const: {out: total, value: 0}",
        "      - const: {out: flag, value: true}",
        "epoch:",
        "  - task: work",
        "    do:",
    ]
    for k in range(blocks):
        b = f"b{k}"
        lines += [
            f"      - add: {{in: [total, 1], out: {b}_a}}",
            f"      - mul: {{in: [{b}_a, \"${{step}}\"], out: {b}_m}}",
            f"      - sub: {{in: [{b}_m, total], out: {b}_s}}",
            "      - loop: 2",
            f"        as: {b}_i",
            "        do:",
            f"          - add: {{in: [total, {b}_i], out: total}}",
            f"          - ge: {{in: [total, 1000000], out: {b}_big}}",
            f"          - stop_if: {b}_big",
            "      - if: flag",
            f"        then: [{{add: {{in: [{b}_s, 1], out: {b}_r}}}}]",
            f"        else: [{{sub: {{in: [{b}_s, 1], out: {b}_r}}}}]",
            f"      - fill: {{out: {b}_w, shape: [1], value: 0.5}}",
            f"      - copy: {{in: {b}_w, out: {b}_c}}",
            f"      - lt: {{in: [{b}_r, {b}_c], out: done}}",
        ]
    lines += ["    outputs: [total, done]", "stop_when: [done]", ""]
    return "\n".join(lines)


def _cpu(fn) -> tuple[float, object]:
    gc.collect()
    c0 = time.process_time()
    out = fn()
    return time.process_time() - c0, out


def run(mode: Mode) -> list[Row]:
    import yaml

    from jobrun.plans.analyze import analyze
    from jobrun.plans.compile import compile_file
    from jobrun.plans.printer import render_text

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    sizes = mode.pick([1_000, 10_000, 100_000], [1_000, 10_000, 100_000], [300, 3_000])
    reps = mode.pick(3, 3, 1)  # yaml.load of 10^5 ops alone takes 10-20 s here
    stages = ("compile", "analyze", "print")
    times: dict[int, dict[str, float]] = {}
    base: dict[int, float] = {}
    with tempfile.TemporaryDirectory(prefix="jobrun-bench-plans-") as tmp:
        for n in sizes:
            path = Path(tmp) / f"plan{n}.yaml"
            path.write_text(plan_text(n))
            got: dict[str, list[float]] = {s: [] for s in (*stages, "yaml")}
            for _ in range(reps):
                # [0]: the loaded data is dropped at once, not kept alive during compile.
                got["yaml"].append(_cpu(lambda path=path: yaml.load(path.read_text(), Loader=loader))[0])
                t, plan = _cpu(lambda path=path: compile_file(path))
                got["compile"].append(t)
                t, diags = _cpu(lambda plan=plan: analyze(plan))
                got["analyze"].append(t)
                if diags:
                    raise RuntimeError(f"the generated plan has diagnostics: {diags[:3]}")
                got["print"].append(_cpu(lambda plan=plan: render_text(plan))[0])
                del plan
            times[n] = {s: median(got[s]) for s in stages}
            base[n] = median(got["yaml"])
    rows: list[Row] = []
    big = sizes[-1]
    for stage in (*stages, "total"):
        def t(n: int, stage: str = stage) -> float:
            return sum(times[n].values()) if stage == "total" else times[n][stage]

        growth = [t(b) / t(a) for a, b in zip(sizes, sizes[1:])]
        # t ~ N^k over the whole range: k = 1 is linear (one growth factor alone is noisy)
        k = math.log(t(big) / t(sizes[0])) / math.log(big / sizes[0])
        ratio = t(big) / base[big]
        if stage == "total":
            goal, ok = "information (the sum)", None
        elif stage == "compile":
            goal = f"<= {RATIO_MAX} x yaml.load, t ~ N^k with k <= {K_MAX}"
            ok = ratio <= RATIO_MAX and k <= K_MAX
        else:
            goal, ok = f"t ~ N^k with k <= {K_MAX}", k <= K_MAX
        rows.append(Row(
            section="plans", name=f"{stage} {big:,} ops", value=t(big), unit="s",
            baseline=base[big], baseline_name="yaml.load (CSafeLoader) of the same file",
            ratio=ratio, goal=goal, ok=ok,
            note="growth per 10x: " + ", ".join(f"{g:.1f}" for g in growth) + f"; k = {k:.2f}",
            extra={"seconds": {str(n): t(n) for n in sizes}, "growth_per_10x": growth,
                   "exponent_k": k,
                   "yaml_load_seconds": {str(n): base[n] for n in sizes}},
        ))
    return rows
