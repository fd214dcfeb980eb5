"""`jobrun ckpt list|show` and `jobrun export`: read checkpoints without running anything.

Listing and showing read safetensors as numpy, so they work without importing torch.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
from pathlib import Path
from typing import Any

from jobrun import store
from jobrun.errors import CheckpointError, UsageError
from jobrun.runner import rng
from jobrun.runner.display import human_size
from jobrun.runner.rundir import RunDir
from jobrun.store import SavedState


def _locate(run_dir: str | None) -> tuple[Path, Path, list[str]]:
    run = RunDir(Path(run_dir)) if run_dir else RunDir.latest()
    ckpt_dir = run.checkpoints
    if ckpt_dir is None:
        raise UsageError(f"the job in {run.path} writes no checkpoints", hint="add a `checkpoint:` block")
    return run.path, ckpt_dir, list(run.plan().nodes)


def list_text(run_dir: str | None, verify: bool = False, as_json: bool = False) -> str:
    path, ckpt_dir, _ = _locate(run_dir)
    infos = store.list_checkpoints(ckpt_dir) if ckpt_dir.is_dir() else []
    rows: list[dict[str, Any]] = []
    for info in infos:
        for node, n in sorted(info.nodes.items()):
            problem = n.problem
            if verify and n.ok:
                problems = (store.verify(ckpt_dir, node, info.epoch)
                            or rng.saved_problems(ckpt_dir, node, info.epoch, n.ranks))
                problem = problems[0] if problems else None
            rows.append({
                "epoch": info.epoch, "node": node, "ranks": len(n.ranks), "world_size": n.world_size,
                "bytes": n.bytes, "saved_at": n.created, "valid": problem is None, "problem": problem,
            })
    if as_json:
        return json.dumps({"run_dir": str(path), "checkpoints": rows}, indent=2)
    if not rows:
        return f"{path}: no checkpoints in {ckpt_dir}"
    lines = [f"{'epoch':>5}  {'node':<16} {'ranks':>5}  {'size':>10}  {'saved':<19}  status"]
    for r in rows:
        when = _dt.datetime.fromtimestamp(r["saved_at"]).strftime("%Y-%m-%d %H:%M:%S") if r["saved_at"] else "-"
        status = "ok" if r["valid"] else f"INVALID: {r['problem']}"
        ranks = f"{r['ranks']}/{r['world_size']}" if r["world_size"] else str(r["ranks"])
        lines.append(f"{r['epoch']:>5}  {r['node']:<16} {ranks:>5}  {human_size(r['bytes']):>10}  {when:<19}  {status}")
    return "\n".join(lines)


def _load(ckpt_dir: Path, epoch: int, node: str, rank: int, nodes: list[str]) -> dict[str, Any]:
    if node not in nodes:
        raise UsageError(f"the job has no node {node!r}", hint=f"nodes: {', '.join(nodes)}")
    if not (ckpt_dir / f"{node}.{epoch}").exists():
        epochs = sorted({i.epoch for i in store.list_checkpoints(ckpt_dir)}) if ckpt_dir.is_dir() else []
        raise CheckpointError(
            f"no checkpoint of epoch {epoch} for node {node!r}",
            hint=f"epochs present: {', '.join(map(str, epochs)) if epochs else 'none'}",
        )
    blobs, _meta = store.load(ckpt_dir, node, epoch, rank=rank, as_numpy=True)
    blobs.pop("jobrun:rng", None)
    return blobs


def _select(blobs: dict[str, Any], wanted: tuple[str, ...], where: str) -> dict[str, Any]:
    if not wanted:
        return blobs
    missing = [b for b in wanted if b not in blobs]
    if missing:
        raise UsageError(f"{where} has no blob {missing[0]!r}",
                         hint=f"blobs: {', '.join(sorted(blobs)) or 'none'}")
    return {b: blobs[b] for b in wanted}


def show_text(run_dir: str | None, epoch: int, node: str | None, rank: int, wanted: tuple[str, ...],
              as_json: bool = False) -> str:
    _, ckpt_dir, nodes = _locate(run_dir)
    shown: dict[str, Any] = {}
    for n in [node] if node else nodes:
        blobs = _select(_load(ckpt_dir, epoch, n, rank, nodes), wanted, f"node {n!r} epoch {epoch}")
        shown[n] = {k: _jsonable(v) for k, v in sorted(blobs.items())}
    if as_json:
        return json.dumps({"epoch": epoch, "rank": rank, "nodes": shown}, indent=2, allow_nan=False)
    lines = [f"epoch {epoch}" + (f" rank {rank}" if rank else "")]
    for n, blobs in shown.items():
        lines.append(f"node {n}:")
        for name, value in blobs.items():
            lines.append(f"  {name} = {_brief(value)}")
    return "\n".join(lines)


def export(run_dir: str | None, epoch: int, node: str | None, wanted: tuple[str, ...], output: str) -> Path:
    _, ckpt_dir, nodes = _locate(run_dir)
    n = node or nodes[0]
    blobs = _select(_load(ckpt_dir, epoch, n, 0, nodes), wanted, f"node {n!r} epoch {epoch}")
    out = Path(output)
    suffix = out.suffix.lower()
    if suffix not in (".safetensors", ".json", ".pt"):
        raise UsageError(f"cannot export to {suffix or 'a file without suffix'!r}",
                         hint="use -o FILE.safetensors, FILE.json or FILE.pt")
    tensors = _flatten(blobs)
    if suffix == ".safetensors":
        for name in blobs:
            if not any(k == name or k.startswith(name + ".") for k, v in tensors.items() if hasattr(v, "dtype")):
                raise UsageError(f"blob {name!r} holds {_kind(blobs[name])}, no tensor, so it cannot go "
                                 "into a .safetensors file", hint="export it to a .json file")
    if not out.parent.is_dir():
        raise UsageError(f"cannot write {out}: directory {out.parent} does not exist",
                         hint="create it first, or give another -o")
    tmp = out.with_name(f".{out.name}.tmp")
    try:
        if suffix == ".safetensors":
            import numpy as np
            from safetensors.numpy import save_file

            save_file({k: np.ascontiguousarray(v) for k, v in tensors.items() if hasattr(v, "dtype")}, tmp)
        elif suffix == ".json":
            tmp.write_text(json.dumps({k: _jsonable(v) for k, v in blobs.items()}, indent=2,
                                      allow_nan=False) + "\n")
        else:
            import torch

            torch.save({k: torch.from_numpy(v.copy()) if hasattr(v, "dtype") else v
                        for k, v in tensors.items()}, tmp)
        tmp.replace(out)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise UsageError(f"cannot write {out}: {e.strerror or e}",
                         hint="check that its directory is writable and has space") from None
    return out


def _kind(value: Any) -> str:
    if isinstance(value, SavedState):
        return f"the state of a {value.type_name}"
    return f"a {type(value).__name__}"


def _flatten(blobs: dict[str, Any]) -> dict[str, Any]:
    """Module/optimizer states come back as SavedState; export their tensors as blob.key."""
    out: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, SavedState):
            walk(prefix, value.state)
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}", v)
        else:
            out[prefix] = value

    for name, value in blobs.items():
        walk(name, value)
    return out


def _jsonable(value: Any) -> Any:
    if isinstance(value, SavedState):
        return {"type": value.type_name, "state": _jsonable(value.state)}
    if hasattr(value, "tolist") and hasattr(value, "dtype"):
        return _jsonable(value.tolist())
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # "inf", "-inf", "nan": the form `log` and `save` write too
    return value


def _brief(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 200 else text[:200] + f"...<+len={len(text)}>"
