"""Shared helpers: timing, medians, the result rows, facts about the machine, the plans
and the two torchrun ranks of the ddp and fsdp sections.

Every figure is a ratio against a baseline measured in the same run, with baseline and
subject alternating (the machine is shared and noisy): ``alternate`` runs them in turns
and the figures are medians over the repetitions.
"""

from __future__ import annotations

import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NoReturn

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Mode:
    """How hard to work: ``full`` (the figures in the README), ``quick`` (CI), ``smoke``."""

    name: str

    @property
    def quick(self) -> bool:
        return self.name != "full"

    @property
    def smoke(self) -> bool:
        return self.name == "smoke"

    def pick(self, full: Any, quick: Any, smoke: Any) -> Any:
        return {"full": full, "quick": quick, "smoke": smoke}[self.name]


@dataclass
class Row:
    """One figure: ``value`` (in ``unit``) is the subject, ``ratio`` = subject / baseline."""

    section: str
    name: str
    value: float
    unit: str
    baseline: float | None
    baseline_name: str
    ratio: float
    goal: str
    ok: bool | None  # None: no goal, information only
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def alternate(reps: int, *fns: Callable[[], float]) -> list[list[float]]:
    """Run ``fns`` in turns ``reps`` times (the order flips every repetition, so neither
    always goes first); each returns its own measurement. One list per fn."""
    out: list[list[float]] = [[] for _ in fns]
    for r in range(reps):
        order = list(range(len(fns)))
        if r % 2:
            order.reverse()
        for i in order:
            gc.collect()
            out[i].append(fns[i]())
    return out


def close_losses(a: list[float], b: list[float]) -> bool:
    """Whether two sides' logged losses agree on a GPU: bf16 autocast and cudnn's choice
    of algorithms sum in other orders, so close (2 % relative), not equal."""
    return len(a) == len(b) and all(abs(x - y) <= 2e-2 * max(1.0, abs(y)) for x, y in zip(a, b))


def paired_ratio(subject: list[float], baseline: list[float]) -> float:
    """The median of per-repetition ratios (robust to drift of a shared machine)."""
    return median([s / b for s, b in zip(subject, baseline) if b])


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "cpu": _cpu_model(),
        "mem_gib": _mem_gib(),
    }
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_threads_default"] = torch.get_num_threads()
    except ImportError:
        info["torch"] = None
    try:
        info["git"] = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True, text=True, timeout=10,
        ).stdout.strip()
    except OSError:
        info["git"] = None
    return info


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _mem_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def reader_order(n: int, pass_index: int) -> Any:
    """The order in which jobrun's shuffled reader reads pass ``pass_index`` of ``n``
    records (the first reader of node ``local`` in a plan of seed 0), from the reader's
    own seed function: a hand loop that reads in it reads the very batches the job reads."""
    import jobrun

    return jobrun.reader_order(n, pass_index)


class ReaderBatches:
    """The batches of jobrun's shuffled reader (`passes: 0`) over ``n`` records, ``batch``
    records each, pass after pass, as record indices in its order (:func:`reader_order`):
    ``next()`` gives the next batch's, or this rank's part of it (its chunk of ``world``)."""

    def __init__(self, n: int, batch: int, rank: int = 0, world: int = 1) -> None:
        self.n, self.batch, self.rank, self.world = n, batch, rank, world
        self.steps = 0
        self.order: Any = None

    def next(self) -> Any:
        lo = self.steps * self.batch % self.n
        if lo == 0:  # a pass's order, as the shuffled reader makes it
            self.order = reader_order(self.n, self.steps * self.batch // self.n)
        self.steps += 1
        idx = self.order[lo:lo + self.batch]
        return idx.chunk(self.world)[self.rank] if self.world > 1 else idx


def python_env() -> dict[str, str]:
    """The environment for child processes: the checkout importable, output unbuffered."""
    env = dict(os.environ)
    paths = [str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["PYTHONUNBUFFERED"] = "1"
    env["OMP_NUM_THREADS"] = env["JOBRUN_THREADS"] = "1"  # as in this process (see run.py)
    return env


def run_python(code: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True,
        timeout=timeout, env=python_env(), cwd=ROOT,
    )


def loop_plan(job: str, init: list[str], steps: int, *, head: str = "", step: str = "",
              outputs: str = "[loss_last]") -> str:
    """A benchmark's plan: `init` ops (one YAML flow mapping each) in a setup task, then
    an epoch of `steps` training steps, each a `read` of `data` (without `done`: it goes on
    into the next pass) and a `train.step` (with `step`'s extra arguments). ``head``: top-level
    lines after max_epochs; max_epochs is the placeholder EPOCHS."""
    ops = "".join(f"\n      - {op}" for op in init)
    return f"""
job: {job}
seed: 0
max_epochs: EPOCHS
{head}init:
  - task: setup
    do:{ops}
epoch:
  - task: train
    do:
      - loop: {steps}
        do:
          - read: {{in: data, out: [xb, yb]}}
          - train.step: {{in: [model, opt, xb, yb], out: loss{step}}}
    outputs: {outputs}
"""


def mlp_plan(job: str, *, n: int, batch: int, sizes: list[int], steps: int, head: str = "",
             step: str = "") -> str:
    """`loop_plan` of an MLP on data.synthetic's classification records, read shuffled,
    with SGD (the ddp and fsdp sections); the epoch outputs its last step's loss."""
    return loop_plan(job, [
        f"data.synthetic: {{out: [x, y], task: classification, n: {n}, features: {sizes[0]}, classes: {sizes[-1]}}}",
        f"reader: {{in: [x, y], out: data, batch_size: {batch}, shuffle: true, passes: 0}}",
        f"model.mlp: {{out: model, sizes: {sizes}}}",
        "optimizer: {in: model, out: opt, lr: 0.01, momentum: 0.9}",
    ], steps, head=head, step=step)


# Two ranks under torchrun (the ddp and fsdp sections). A rank runs the job through
# jobrun's runner and, after each of its epochs, one epoch of a hand-written loop that
# computes the same numbers: the same two processes give both figures, each jobrun epoch
# next to a hand one, as epochs drift together within a run.

def torchrun(module: str, *args: str) -> dict[str, Any]:
    """``python -m module ARGS`` as 2 ranks started by torchrun: what rank 0 printed last
    (a line of JSON)."""
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        "-m", module, *args], cwd=ROOT, env=python_env(),
                       capture_output=True, text=True, timeout=900)
    if p.returncode != 0:
        # The failing rank's own traceback comes first; torchrun's summary after it says
        # only which rank exited.
        first = p.stderr.find("Traceback")
        raise RuntimeError(f"the ranks of {module} {' '.join(args[:1])} failed ({p.returncode}): "
                           f"{p.stderr[first:first + 3000] if first >= 0 else p.stderr[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def rank_both(root: Path, plan: str, hand: Callable[[], Any]) -> dict[str, Any]:
    """One rank (under torchrun): joins its group as a `jobrun train --replicas 2` rank
    does, runs ``plan`` (a plan's text, written by rank 0 into ``root``) through jobrun's
    runner and one epoch of the hand loop (``hand()`` builds it; its ``epoch()`` returns
    its seconds and last loss) after each of jobrun's epochs. Returns both sides' epoch
    seconds and last losses (jobrun's on rank 0 only), for :func:`rank_exit`."""
    import torch.distributed as dist

    from benchmarks.inproc import metrics, run_plan
    from jobrun.runner import group

    group.start("cpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    path = root / "plan.yaml"
    if rank == 0:
        path.write_text(plan)
    dist.barrier()
    times: list[tuple[float, float]] = []
    cpu: list[float] = []
    loop: list[Any] = []

    def between(epoch: int) -> None:
        if not loop:  # built outside jobrun's epochs (it draws no random numbers)
            loop.append(hand())
        # Every rank starts the hand epoch together, as every rank starts a jobrun epoch
        # after the last one's stop agreement (a collective): a rank that ended jobrun's
        # epoch first would otherwise wait for the others inside the hand epoch's time.
        dist.barrier()
        c0 = time.process_time()
        times.append(loop[0].epoch())
        cpu.append(time.process_time() - c0)

    epochs = run_plan(path, root / "run", between, rank=rank, world_size=world)
    losses = [e["outputs"]["train"]["loss_last"] for e in metrics(root / "run") if e.get("event") == "epoch"] \
        if rank == 0 else []
    return {"jobrun": [e.seconds for e in epochs], "hand": [t for t, _ in times], "jobrun_loss": losses,
            "hand_loss": [loss for _, loss in times], "jobrun_cpu": [e.cpu for e in epochs], "hand_cpu": cpu}


def rank_exit(out: dict[str, Any]) -> NoReturn:
    """Rank 0 prints ``out`` (the line :func:`torchrun` returns); the ranks leave."""
    import torch.distributed as dist

    from jobrun.runner import group

    if dist.get_rank() == 0:
        print(json.dumps(out), flush=True)
    group.finish()  # as jobrun's workers leave: together (see group.finish)
    # And without the interpreter's teardown, as jobrun's spawned workers leave when they
    # stop early (workers._leave): in about one full smoke run in eight a rank aborted in
    # it ("terminate called without an active exception", SIGABRT) after everything was
    # done; never in 55 runs of these ranks on their own.
    sys.stderr.flush()
    os._exit(0)


def neighbour_ratios(ours: list[float], hand: list[float]) -> list[float]:
    """One run's hand/jobrun ratios (its first epoch of each side dropped already): each
    jobrun epoch against the mean of the hand epochs just before and just after it, so
    that neither side always runs first and a drift of the machine's speed within the
    run cancels (with one pair only: the epoch after)."""
    pairs = [((hand[i - 1] + hand[i]) / 2, ours[i]) for i in range(1, min(len(ours), len(hand)))]
    return [h / o for h, o in pairs or list(zip(hand[:1], ours[:1]))]


@dataclass
class Paired:
    """jobrun's and the hand loop's epoch seconds (and CPU seconds: this process's, its
    communication threads' included) from `reps` torchrun runs of `epochs` epochs a side
    (the first of each side dropped: it warms up), each run's ratios
    (:func:`neighbour_ratios`), and whether every run's losses agreed."""

    reps: int
    epochs: int
    ours: list[float] = field(default_factory=list)
    hand: list[float] = field(default_factory=list)
    ours_cpu: list[float] = field(default_factory=list)
    hand_cpu: list[float] = field(default_factory=list)
    ratios: list[float] = field(default_factory=list)
    cpu_ratios: list[float] = field(default_factory=list)
    same_losses: bool = True

    @property
    def ratio(self) -> float:
        # Epochs drift together (within a run by +-8%): each jobrun epoch is compared with
        # the hand epochs around it, and the figure is the median of those ratios.
        return statistics.median(self.ratios)

    def row(self, section: str, name: str, steps: int, baseline_name: str, goal: float, ok: bool) -> Row:
        """The section's figure: steps/s of jobrun against the hand loop's."""
        return Row(
            section=section, name=name, value=steps / statistics.median(self.ours), unit="steps/s",
            baseline=steps / statistics.median(self.hand), baseline_name=baseline_name, ratio=self.ratio,
            goal=f"jobrun/hand >= {goal}", ok=ok,
            note=f"{steps} steps an epoch, epochs alternating in the same 2 processes, {self.reps} runs of "
                 f"{self.epochs} epochs a side, first dropped; ratio: median over jobrun epochs of the hand "
                 f"epochs around each (cpu_ratio: the same in CPU seconds, less sensitive to a loaded machine)",
            extra={"jobrun_epoch_seconds": self.ours, "hand_epoch_seconds": self.hand,
                   "jobrun_epoch_cpu_seconds": self.ours_cpu, "hand_epoch_cpu_seconds": self.hand_cpu,
                   "same_losses": self.same_losses, "cpu_ratio": statistics.median(self.cpu_ratios),
                   "ratio_of_medians": statistics.median(self.hand) / statistics.median(self.ours)},
        )


def paired_epochs(module: str, reps: int, epochs: int, *args: str) -> Paired:
    """`reps` runs of ``torchrun(module, "both", ROOT, EPOCHS, *args)``, whose ranks end
    in :func:`rank_both`'s result."""
    got = Paired(reps, epochs)
    with tempfile.TemporaryDirectory(prefix=f"jobrun-bench-{module.rsplit('_', 1)[-1]}-") as tmp:
        for r in range(reps):
            root = Path(tmp) / f"both{r}"
            root.mkdir()
            out = torchrun(module, "both", str(root), str(epochs), *args)
            ours, hand = out["jobrun"][1:], out["hand"][1:]
            ours_cpu, hand_cpu = out["jobrun_cpu"][1:], out["hand_cpu"][1:]
            got.ours += ours
            got.hand += hand
            got.ours_cpu += ours_cpu
            got.hand_cpu += hand_cpu
            got.ratios += neighbour_ratios(ours, hand)
            got.cpu_ratios += neighbour_ratios(ours_cpu, hand_cpu)
            # The same numbers on both sides (each epoch's last loss; jobrun rounds its
            # outputs to 6 digits): otherwise the two are not the same work.
            got.same_losses &= len(out["jobrun_loss"]) == len(out["hand_loss"]) == epochs and all(
                abs(a - b) <= 1e-4 * max(1.0, abs(b)) for a, b in zip(out["jobrun_loss"], out["hand_loss"]))
    return got
