"""4. Checkpoint: save and load of a model + optimizer state, and the async stall.

The state: an MLP (3 Linear layers) and Adam's two moment buffers per parameter: about
3 x 4 bytes per parameter (536 MB in the full run). Each repetition, in turns:

* jobrun: ``store.save`` (safetensors written by the library, values JSON, a manifest
  with a CRC-32 of every 16 MiB of every file, fsync of files and directories, atomic
  rename, COMMIT marker) and ``store.load`` (the library maps the file; every byte is
  checksummed on the mapped pages the tensors are made of);
* raw: the same tensor bytes written into one file with large writes and one fsync, and
  read back into preallocated buffers: the disk's speed, no format, no checks;
* torch: ``torch.save`` of the two state dicts (+ flush + fsync) and
  ``torch.load(weights_only=True)``.

Goals: a save at least as fast as torch.save and at least 0.8x a raw write + fsync; a
verified load at least 0.7x as fast as torch.load (which checks nothing: a resume loads
once, so the checksums and the library may cost a little). Loads are measured cold (each
file's pages dropped from the page cache first, with posix_fadvise(DONTNEED) after its
fsync: what a resume after a restart sees) and warm (the file still cached: memory
speed, where checksums show most). Figures are wall-clock seconds (this is I/O), medians
over the repetitions; ratios are speeds relative to the baseline (baseline time /
subject time, the median of the repetitions' ratios: each pair ran side by side).
``verify`` (what ``jobrun resume`` runs before it loads: every byte checksummed,
nothing kept) and a load without checksums are shown for information.

The async stall: with ``checkpoint: {async: true}`` the training thread only runs
``store.prepare(blobs, copy=True)`` (a private copy of every tensor) and a background
thread runs the same ``store.write``. The stall is that copy, into the previous save's
copy (``reuse=``, what every save of a job does from its second save of the same
state on), against a synchronous save of the same state. End to end: a job whose epochs
train a big MLP and save a checkpoint every epoch, run in this process with async false
and true in turns; the figure is the wall time of an epoch with its save (train + save,
or train + stall, the background write competing with the next epoch for the CPU),
median over epochs. Epoch 1 is left out of those medians and shown on its own: its save
is the first to hold Adam's moments (created by the first step), so it copies them into
new memory.
"""

from __future__ import annotations

import gc
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import Mode, Row, median

GOAL_RAW = 0.8
GOAL_LOAD = 0.7
GOAL_STALL = 0.10
_CHUNK = 64 << 20


def make_state(width: int) -> dict[str, Any]:
    """{"model", "opt"}: an MLP of ~3.3 * width^2 parameters and Adam with its state."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
        nn.Linear(width, width * 2 // 3),
    )
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    opt.step()  # creates exp_avg and exp_avg_sq
    opt.zero_grad(set_to_none=True)
    return {"model": model, "opt": opt}


def tensors_of(state: dict[str, Any]) -> list[Any]:
    import torch

    out = list(state["model"].state_dict().values())
    for s in state["opt"].state.values():
        out += [v for v in s.values() if isinstance(v, torch.Tensor)]
    return out


def state_bytes(state: dict[str, Any]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors_of(state))


def drop_cache(path: Path) -> None:
    """Evict a file's (clean, fsynced) pages from the page cache."""
    for f in [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _write_all(fd: int, data: memoryview) -> None:
    while len(data):
        n = os.write(fd, data[:_CHUNK])
        data = data[n:]


def raw_write(tensors: list[Any], path: Path) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        for t in tensors:
            _write_all(fd, memoryview(t.detach().contiguous().numpy()).cast("B"))
        os.fsync(fd)
    finally:
        os.close(fd)


def raw_read(tensors: list[Any], path: Path) -> list[Any]:
    import torch

    out = []
    fd = os.open(path, os.O_RDONLY)
    try:
        for t in tensors:
            buf = torch.empty_like(t, memory_format=torch.contiguous_format)
            view = memoryview(buf.numpy()).cast("B")
            got = 0
            while got < len(view):
                n = os.readv(fd, [view[got:got + _CHUNK]])
                if not n:
                    raise EOFError(path)
                got += n
            out.append(buf)
    finally:
        os.close(fd)
    return out


def torch_write(state: dict[str, Any], path: Path) -> None:
    import torch

    with open(path, "xb") as f:
        torch.save({"model": state["model"].state_dict(), "opt": state["opt"].state_dict()}, f)
        f.flush()
        os.fsync(f.fileno())


def torch_read(path: Path) -> Any:
    import torch

    return torch.load(path, map_location="cpu", weights_only=True)


def _timed(fn) -> float:
    gc.collect()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _rotated(items: list, rep: int) -> list:
    """The order of one repetition: each item goes first, second, ... equally often."""
    k = rep % len(items)
    return items[k:] + items[:k]


def _io_rep(rep: int, d: Path, state: dict, tensors: list, t: dict[str, list[float]]) -> None:
    from jobrun import store

    ckpt, raw, pt = d / "ckpt", d / "raw.bin", d / "state.pt"
    saves = [
        ("save", lambda: store.save(state, {"epoch": rep}, ckpt, "local", rep)),
        ("raw_write", lambda: raw_write(tensors, raw)),
        ("torch_save", lambda: torch_write(state, pt)),
    ]
    for name, fn in _rotated(saves, rep):
        t[name].append(_timed(fn))
    loads = [
        ("load", ckpt, lambda: store.load(ckpt, "local", rep)),
        ("raw_read", raw, lambda: raw_read(tensors, raw)),
        ("torch_load", pt, lambda: torch_read(pt)),
    ]
    for temp in ("cold", "warm"):
        for name, path, fn in _rotated(loads, rep):
            if temp == "cold":
                drop_cache(path)
            t[f"{name}_{temp}"].append(_timed(fn))
    t["load_nohash_warm"].append(
        _timed(lambda: _touch(store.load(ckpt, "local", rep, verify_hashes=False))))
    t["verify_warm"].append(_timed(lambda: store.verify(ckpt, "local", rep)))


def _touch(loaded: tuple[dict[str, Any], Any]) -> None:
    """Read every byte of a load without checksums: its tensors map the file lazily."""
    for value in tensors_of_loaded(loaded[0]):
        value.sum()


def tensors_of_loaded(blobs: dict[str, Any]) -> list[Any]:
    import torch

    out: list[Any] = []

    def walk(v: Any) -> None:
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, dict):
            for x in v.values():
                walk(x)
        elif isinstance(v, list | tuple):
            for x in v:
                walk(x)
        elif hasattr(v, "state"):  # SavedState
            walk(v.state)

    walk(blobs)
    return out


def async_supported() -> bool:
    from jobrun.errors import PlanError
    from jobrun.plans.compile import compile_text

    try:
        compile_text("job: j\nmax_epochs: 1\ncheckpoint: {dir: c, async: true}\n"
                     "epoch: [{task: t, do: [{const: {out: x, value: 1}}]}]\n")
    except PlanError:
        return False
    return True


def e2e_plan(background: bool, width: int, epochs: int) -> dict:
    return {
        "job": "bench-async",
        "seed": 0,
        "device": "cpu",
        "max_epochs": epochs,
        "checkpoint": {"dir": "checkpoints", "every": 1, "keep": 1, "async": background},
        "init": [{"task": "setup", "do": [
            {"data.synthetic": {"out": ["x", "y"], "task": "classification", "n": 256,
                                "features": width // 4, "classes": 16, "noise": 8.0}},
            {"reader": {"in": ["x", "y"], "out": "train_data", "batch_size": 32,
                        "shuffle": True, "passes": 0}},
            {"model.mlp": {"out": "model", "sizes": [width // 4, width, width, width // 4]}},
            {"optimizer": {"in": "model", "out": "opt", "target": "torch.optim.Adam",
                           "lr": 0.0001}},
        ]}],
        "epoch": [{"task": "train", "do": [
            {"loop": None, "do": [
                {"read": {"in": "train_data", "out": ["xb", "yb", "end"]}},
                {"stop_if": "end"},
                {"train.step": {"in": ["model", "opt", "xb", "yb"], "out": "loss"}},
            ]},
        ], "outputs": ["loss"]}],
    }


def async_e2e(mode: Mode) -> list[Row]:
    import re

    from benchmarks.inproc import run_plan, write_plan

    width = mode.pick(4096, 2048, 512)
    epochs = mode.pick(5, 4, 3)
    reps = mode.pick(2, 1, 1)
    wall: dict[bool, list[float]] = {False: [], True: []}
    train: dict[bool, list[float]] = {False: [], True: []}
    blocked: list[float] = []
    first: list[float] = []  # epoch 1: Adam's moments are new, so nothing to reuse
    with tempfile.TemporaryDirectory(prefix="jobrun-bench-async-",
                                     dir=os.environ.get("JOBRUN_BENCH_DIR")) as tmp:
        tmpd = Path(tmp)
        paths = {b: write_plan(e2e_plan(b, width, epochs), tmpd, f"async-{b}.yaml")
                 for b in (False, True)}
        for rep in range(reps):
            for background in (False, True) if rep % 2 == 0 else (True, False):
                got = run_plan(paths[background], run_dir=tmpd / f"run-{rep}-{background}")
                shutil.rmtree(tmpd / f"run-{rep}-{background}")
                wall[background] += [e.wall for e in got[1:]]
                train[background] += [e.seconds for e in got[1:]]
                if background:
                    stalls = [float(m.group(1)) / 1000 for e in got
                              if (m := re.search(r"\(([0-9.]+) ms blocked\)", e.ckpt))]
                    blocked += stalls[1:]
                    first += stalls[:1]
    sync, asy = median(wall[False]), median(wall[True])
    save = sync - median(train[False])
    hidden = (sync - asy) / save if save > 0 else 0.0
    rows = [Row(
        section="checkpoint", name="async: epoch with its save (end to end)", value=asy,
        unit="s", baseline=sync, baseline_name="the same epoch, synchronous save",
        ratio=asy / sync, goal="async / sync < 1", ok=asy < sync,
        note=f"MLP width {width}, Adam; {hidden:.0%} of the save hidden; "
        f"train {median(train[True]):.2f} s vs {median(train[False]):.2f} s (sync)",
        extra={"async_epoch_s": wall[True], "sync_epoch_s": wall[False],
               "async_train_s": train[True], "sync_train_s": train[False],
               "save_hidden_fraction": hidden},
    )]
    def stall_row(name: str, stalls: list[float], note: str) -> None:
        stall = median(stalls)
        rows.append(Row(
            section="checkpoint", name=name, value=stall, unit="s", baseline=save,
            baseline_name="synchronous save in the job", ratio=stall / save,
            goal=f"<= {GOAL_STALL:.0%} of a synchronous save", ok=stall / save <= GOAL_STALL,
            note=note, extra={"blocked_s": stalls},
        ))

    if blocked:
        stall_row("async: training blocked per save (end to end)", blocked,
                  "the runner's own `ms blocked` (copy + wait)")
    if first:
        stall = median(first)
        rows.append(Row(
            section="checkpoint", name="async: blocked at epoch 1 (Adam's new state)",
            value=stall, unit="s", baseline=save, baseline_name="synchronous save in the job",
            ratio=stall / save, goal="information", ok=None,
            note="the first save of Adam's moments (2/3 of the state): copied into new memory",
            extra={"blocked_s": first},
        ))
    return rows


def run(mode: Mode) -> list[Row]:
    from jobrun import store

    width = mode.pick(4096, 2048, 512)
    reps = mode.pick(6, 3, 1)
    state = make_state(width)
    size = state_bytes(state)
    tensors = tensors_of(state)
    meta = {"epoch": 0}
    t: dict[str, list[float]] = {k: [] for k in (
        "save", "raw_write", "torch_save", "load_cold", "raw_read_cold", "torch_load_cold",
        "load_warm", "raw_read_warm", "torch_load_warm", "load_nohash_warm", "verify_warm",
        "prepare_reuse",
    )}
    root = Path(tempfile.mkdtemp(prefix="jobrun-bench-ckpt-", dir=os.environ.get("JOBRUN_BENCH_DIR")))
    try:
        prev = None
        for rep in range(reps):
            d = root / f"rep{rep}"
            d.mkdir()
            _io_rep(rep, d, state, tensors, t)
            shutil.rmtree(d)
            # The async stall: a private copy into the last one's memory.
            gc.collect()
            if prev is None:
                prev = store.prepare(state, meta, copy=True)
            t0 = time.perf_counter()
            prev = store.prepare(state, meta, copy=True, reuse=prev)
            t["prepare_reuse"].append(time.perf_counter() - t0)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    m = {k: median(v) for k, v in t.items() if v}
    mb = size / 1e6
    rows: list[Row] = []

    def paired(subject: str, base: str) -> float:
        """Speed ratio: the median over repetitions of base / subject timed side by side
        (the disk's speed drifts by +-40 % from one second to the next here; a pair sees
        the same drift, two separate medians do not)."""
        return median([b / x for b, x in zip(t[base], t[subject], strict=True)])

    def row(name: str, subject: str, base: str, base_name: str, goal: str, ok: bool | None,
            ratio: float | None = None, note: str = "") -> None:
        r = ratio if ratio is not None else paired(subject, base)
        rows.append(Row(
            section="checkpoint", name=name, value=m[subject], unit="s", baseline=m[base],
            baseline_name=base_name, ratio=r, goal=goal, ok=ok if ok is not None else None,
            note=note or f"{mb:.0f} MB state, {mb / m[subject]:.0f} MB/s",
            extra={"seconds": t[subject], "baseline_seconds": t[base]},
        ))

    row("save", "save", "raw_write", "raw write + fsync", f">= {GOAL_RAW}",
        paired("save", "raw_write") >= GOAL_RAW)
    row("save vs torch.save", "save", "torch_save", "torch.save + fsync", ">= 1.0",
        paired("save", "torch_save") >= 1.0)
    for temp in ("cold", "warm"):
        row(f"verified load ({temp} cache) vs torch.load", f"load_{temp}", f"torch_load_{temp}",
            f"torch.load(weights_only=True) ({temp})", f">= {GOAL_LOAD}",
            paired(f"load_{temp}", f"torch_load_{temp}") >= GOAL_LOAD)
        row(f"verified load ({temp} cache) vs raw read", f"load_{temp}", f"raw_read_{temp}",
            f"raw read ({temp})", "information", None)
    row("load (warm), checksums skipped", "load_nohash_warm", "raw_read_warm", "raw read (warm)",
        "information", None, note="verify_hashes=False, every byte then read once")
    row("verify (warm): checksum every byte", "verify_warm", "raw_read_warm", "raw read (warm)",
        "information", None, note="store.verify: what resume checks before it loads")
    ratio = m["prepare_reuse"] / m["save"]
    row("async stall: prepare(copy=True, reuse=)", "prepare_reuse", "save", "synchronous save",
        f"<= {GOAL_STALL:.0%} of a synchronous save", ratio <= GOAL_STALL, ratio=ratio,
        note=f"{mb:.0f} MB state; ratio = stall / save")
    for r in rows:
        r.extra["state_bytes"] = size
    del state, tensors, prev
    gc.collect()
    if async_supported():
        rows += async_e2e(mode)
    return rows
