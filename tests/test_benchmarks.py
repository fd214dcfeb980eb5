"""The benchmarks run: `python benchmarks/run.py --smoke` finishes and reports every figure
of every section, judged against its goal (no timing is asserted: the figures are
benchmarks/README.md's job; what is asserted is what a run must produce)."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from runner_util import HANG_S

ROOT = Path(__file__).resolve().parent.parent
SECTIONS = ("runner", "loader", "dispatch", "plans", "checkpoint", "memory", "startup", "restart", "fsdp",
            "ddp", "gpt")
# What a smoke run reports: every figure of every section (the sizes are the smoke ones).
EXPECTED_ROWS = {
    "runner": ["MLP example steps/s", "tiny MLP steps/s", "MLP example, every logger steps/s",
               "add in a plan loop, --profile"],
    "loader": ["Dataset, 2 workers steps/s"],
    "dispatch": ["add in a plan loop"],
    "plans": ["compile 3,000 ops", "analyze 3,000 ops", "print 3,000 ops", "total 3,000 ops"],
    "checkpoint": [
        "save", "save vs torch.save",
        "verified load (cold cache) vs torch.load", "verified load (cold cache) vs raw read",
        "verified load (warm cache) vs torch.load", "verified load (warm cache) vs raw read",
        "load (warm), checksums skipped", "verify (warm): checksum every byte",
        "async stall: prepare(copy=True, reuse=)", "async: epoch with its save (end to end)",
        "async: training blocked per save (end to end)", "async: blocked at epoch 1 (Adam's new state)",
    ],
    "memory": [
        "live RSS after each epoch", "peak RSS within each epoch", "store.save: peak added / state",
        "prepare(copy=True) + write: peak added / state", "store.load: peak added / state",
    ],
    "startup": ["jobrun --help", "jobrun print plans/mlp.yaml"],
    "restart": ["restart: death of a rank to the first new step"],
    "fsdp": ["parallel: fsdp steps/s (2 ranks)", "parallel: fsdp, amp: bf16 steps/s (2 ranks)",
             "jobrun train --replicas 2, parallel: fsdp steps/s"],
    "ddp": ["parallel: ddp steps/s (2 ranks, 20 MB of gradients)"],
    "gpt": ["plans/gpt.yaml steps/s"],
}


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the memory probes read /proc")
def test_smoke_run_reports_every_section(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    p = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "run.py"), "--smoke", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=HANG_S,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["mode"] == "smoke"
    assert {"python", "torch", "cpus"} <= set(data["machine"])
    assert set(data["sections"]) == set(SECTIONS)
    names = {name: [row["name"] for row in data["sections"][name]["rows"]] for name in SECTIONS}
    assert names == EXPECTED_ROWS
    for name in SECTIONS:
        section = data["sections"][name]
        assert "error" not in section, section.get("error")
        for row in section["rows"]:
            for key in ("value", "ratio", "baseline"):
                assert isinstance(row[key], int | float) and math.isfinite(row[key]), (name, row)
            assert row["value"] >= 0 and row["baseline"] > 0, row
            # A figure with a goal is judged; an information figure is not.
            if row["goal"].startswith("information"):
                assert row["ok"] is None, row
            else:
                assert isinstance(row["ok"], bool), row
    runner = data["sections"]["runner"]["rows"]
    assert all(row["extra"]["same_losses"] for row in runner)  # jobrun and the hand loop agree
    # the two plain rows carry their noise floor: a second hand loop against the first
    assert all(0.5 < row["extra"]["aa_ratio"] < 2 for row in runner[:2])
    for row in data["sections"]["fsdp"]["rows"][:2]:  # one hand epoch after each of jobrun's
        ours, hand = row["extra"]["jobrun_epoch_seconds"], row["extra"]["hand_epoch_seconds"]
        assert len(ours) == len(hand) > 0, row
        assert row["extra"]["same_losses"], row  # the hand loop computes what the job computes
        assert math.isfinite(row["extra"]["cpu_ratio"]), row
    gpt = data["sections"]["gpt"]["rows"][0]["extra"]  # the plan and nanoGPT's loop agree
    assert gpt["same_losses"] and len(gpt["plan_epoch_seconds"]) == len(gpt["hand_epoch_seconds"]) > 0
    (ddp,) = data["sections"]["ddp"]["rows"]
    assert len(ddp["extra"]["jobrun_epoch_seconds"]) == len(ddp["extra"]["hand_epoch_seconds"]) > 0
    assert ddp["extra"]["same_losses"]  # jobrun's DDP and the hand DDP loop compute the same numbers
    startup = data["sections"]["startup"]["rows"]
    assert [row["extra"]["imports_torch"] for row in startup] == [False, False]
    # the table is printed too, one line a figure
    table = [line for line in p.stdout.splitlines() if line.split()[:1] and line.split()[0] in SECTIONS]
    assert len(table) == sum(map(len, names.values()))
    assert all(line.rstrip().endswith(("PASS", "MISS", " -")) for line in table)


def test_each_jobrun_epoch_is_compared_with_the_hand_epochs_around_it():
    """The ddp and fsdp figures: a drift of the machine's speed within a run cancels, and
    neither side always runs first (jobrun's epoch k runs between hand epochs k-1 and k)."""
    from benchmarks.common import neighbour_ratios

    drifting = [1.0 + 0.1 * i for i in range(7)]  # the same work, each epoch 0.1 s slower
    ours, hand = drifting[0::2], drifting[1::2]  # jobrun, hand, jobrun, hand...
    assert [round(r, 12) for r in neighbour_ratios(ours, hand)] == [1.0, 1.0]  # right after: 1.083, 1.071
    assert neighbour_ratios([2.0, 4.0], [1.0, 3.0]) == [0.5]
    assert neighbour_ratios([2.0], [1.0]) == [0.5]  # one pair: the epoch after


def _script(name: str, *args: str) -> subprocess.CompletedProcess:
    """A tool of benchmarks/ run as its docstring says: a script, with nothing but jobrun
    installed on the path; it succeeded."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / name), *args],
                       cwd=ROOT, capture_output=True, text=True, timeout=HANG_S, env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p


@pytest.mark.slow
def test_epoch_split_times_every_piece_of_the_job() -> None:
    # The tool wraps jobrun's own functions (the ops the code generator takes, the metrics
    # line, samples/s, the mean loss): one renamed would leave its piece at 0 or fail.
    p = _script("epoch_split.py", "--tiny", "--reps", "1")
    rows = {m[1]: m[2].split() for m in re.finditer(r"^ *([a-z/ ]+?) +([-+0-9. ]+)$", p.stdout, re.M)}
    for piece in ("loop", "mean loss", "evaluate", "after", "log", "metrics line", "tensorboard",
                  "plain values", "samples/s"):
        assert piece in rows, p.stdout
    assert all(float(rows[piece][0]) > 0 for piece in ("loop", "mean loss", "evaluate", "after", "log",
                                                       "metrics line", "plain values", "samples/s")), p.stdout
    assert float(rows["loop"][1]) > 0 and float(rows["mean loss"][1]) == 0, p.stdout  # the ops loop has none


@pytest.mark.slow
def test_bytecode_counts_name_jobruns_own_work_per_step() -> None:
    # The counts are deterministic: the three loops run the same model on the same data,
    # so torch's own Python (the optimizer, the modules) is the same in each, and what
    # jobrun runs beyond the hand loop is its ops' and the generated loop's bytecodes.
    p = _script("instructions.py", "--bytecodes", "--top", "40")
    per_step = {m[1]: float(m[2]) for m in re.finditer(r"^  (jobrun|ops|hand) +[\d,]+ +([\d.]+) a step$", p.stdout, re.M)}
    assert set(per_step) == {"jobrun", "ops", "hand"}, p.stdout
    assert per_step["hand"] < per_step["ops"] < per_step["jobrun"], p.stdout
    beyond = {m[2]: float(m[1]) for m in re.finditer(r"^ +([\d.]+)  (.+)$", p.stdout, re.M)}
    # the step and the read, bound to their call site (jobrun/ops/bound.py), and the reader
    assert beyond.get("bound.py:step", 0) > 0 and beyond.get("bound.py:read", 0) > 0, p.stdout
    # a plain reader (CPU tensors, one process) reads its pass through a generator
    assert beyond.get("tensor_reader.py:read", 0) > 0 and "train.py:train_step" not in beyond, p.stdout
    assert any(fn.endswith(":do") and fn.startswith("<jobrun task 'train'") for fn in beyond), p.stdout
