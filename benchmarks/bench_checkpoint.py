"""4. Checkpoint: save and load of a model + optimizer state, and the async stall.

The state: an MLP (3 Linear layers) and Adam's two moment buffers per parameter: about
3 x 4 bytes per parameter (536 MB in the full run). Each repetition, in turns:

* jobrun: ``checkpoint.save`` (safetensors + JSON + manifest with SHA-256 of every file,
  fsync of files and directories, atomic rename, COMMIT marker) and ``checkpoint.load``
  (which verifies every hash on the bytes it reads);
* raw: the same tensor bytes written into one file with large writes and one fsync, and
  read back into preallocated buffers: the disk's speed, no format, no checks;
* torch: ``torch.save`` of the two state dicts (+ flush + fsync) and
  ``torch.load(weights_only=True)``.

Loads are measured twice: cold (each file's pages dropped from the page cache first, with
posix_fadvise(DONTNEED) after its fsync: what a resume after a restart sees) and warm
(the file still cached: memory speed, where hashing shows most). Figures are wall-clock
seconds (this is I/O), medians over the repetitions; ratios are speeds relative to raw
(raw time / subject time), so >= 0.8 means at least 80% of raw speed.

The async stall: with ``checkpoint: {async: true}`` the training thread only runs
``checkpoint.prepare(blobs, copy=True)`` (a private copy of every tensor) and a
background thread writes. The stall is that copy, measured fresh and with ``reuse=`` the
previous Prepared, against a synchronous save of the same state.
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
    from jobrun.runner import checkpoint as store

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
        _timed(lambda: store.load(ckpt, "local", rep, verify_hashes=False)))


def run(mode: Mode) -> list[Row]:
    from jobrun.runner import checkpoint as store

    width = mode.pick(4096, 2048, 512)
    reps = mode.pick(6, 3, 1)
    state = make_state(width)
    size = state_bytes(state)
    tensors = tensors_of(state)
    meta = {"epoch": 0}
    t: dict[str, list[float]] = {k: [] for k in (
        "save", "raw_write", "torch_save", "load_cold", "raw_read_cold", "torch_load_cold",
        "load_warm", "raw_read_warm", "torch_load_warm", "load_nohash_warm",
        "prepare", "prepare_reuse",
    )}
    root = Path(tempfile.mkdtemp(prefix="jobrun-bench-ckpt-", dir=os.environ.get("JOBRUN_BENCH_DIR")))
    try:
        prev = None
        for rep in range(reps):
            d = root / f"rep{rep}"
            d.mkdir()
            _io_rep(rep, d, state, tensors, t)
            shutil.rmtree(d)
            # The async stall: a fresh private copy, then one reusing the last one's memory.
            gc.collect()
            t0 = time.perf_counter()
            fresh = store.prepare(state, meta, copy=True)
            t["prepare"].append(time.perf_counter() - t0)
            del fresh
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

    def row(name: str, subject: str, base: str, base_name: str, goal: str, ok: bool | None,
            ratio: float | None = None, note: str = "") -> None:
        r = ratio if ratio is not None else m[base] / m[subject]
        rows.append(Row(
            section="checkpoint", name=name, value=m[subject], unit="s", baseline=m[base],
            baseline_name=base_name, ratio=r, goal=goal, ok=ok if ok is not None else None,
            note=note or f"{mb:.0f} MB state, {mb / m[subject]:.0f} MB/s",
            extra={"seconds": t[subject], "baseline_seconds": t[base]},
        ))

    def speed_ok(subject: str, raw: str, tor: str) -> bool:
        return m[raw] / m[subject] >= GOAL_RAW and m[subject] <= m[tor]

    goal = f"speed >= {GOAL_RAW}x raw and not slower than torch"
    row("save", "save", "raw_write", "raw write + fsync", goal,
        speed_ok("save", "raw_write", "torch_save"))
    row("save vs torch.save", "save", "torch_save", "torch.save + fsync", ">= 1.0",
        m["torch_save"] / m["save"] >= 1.0)
    row("load (cold cache)", "load_cold", "raw_read_cold", "raw read (cold)", goal,
        speed_ok("load_cold", "raw_read_cold", "torch_load_cold"))
    row("load (cold) vs torch.load", "load_cold", "torch_load_cold", "torch.load (cold)", ">= 1.0",
        m["torch_load_cold"] / m["load_cold"] >= 1.0)
    row("load (warm cache)", "load_warm", "raw_read_warm", "raw read (warm)", goal,
        speed_ok("load_warm", "raw_read_warm", "torch_load_warm"))
    row("load (warm) vs torch.load", "load_warm", "torch_load_warm", "torch.load (warm)",
        ">= 1.0", m["torch_load_warm"] / m["load_warm"] >= 1.0)
    row("load (warm), hashes skipped", "load_nohash_warm", "raw_read_warm", "raw read (warm)",
        "information", None, note="verify_hashes=False: the cost of reading alone")
    for key, label in (("prepare", "async stall: prepare(copy=True)"),
                       ("prepare_reuse", "async stall: prepare(copy=True, reuse=)")):
        ratio = m[key] / m["save"]
        row(label, key, "save", "synchronous save", f"<= {GOAL_STALL:.0%} of a synchronous save",
            ratio <= GOAL_STALL, ratio=ratio, note=f"{mb:.0f} MB state; ratio = stall / save")
    for r in rows:
        r.extra["state_bytes"] = size
    return rows
