"""`jobrun ckpt list|show` and `jobrun export`: read checkpoints without running anything.

Listing and showing read safetensors as numpy, so they work without importing torch.
An epoch is a number or `best`: the best epoch by the plan's `checkpoint.best`.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from jobrun import hints, safefs, store
from jobrun.errors import CheckpointError, UsageError, a_type
from jobrun.ops.core import SAVE_SUFFIXES
from jobrun.plans import ir
from jobrun.runner import rng
from jobrun.runner.display import human_size
from jobrun.runner.monitor import (
    EARLY_STOP_META,
    EarlyStopping,
    best_epoch,
    epoch_value,
    ranked_epochs,
)
from jobrun.runner.rundir import RunDir, jobruns_own
from jobrun.store import SavedState, shards

Epoch = int | str  # a number, or "best"
_CUT = 200  # characters of a value shown in text


class _Run:
    """A run's checkpoint directory, nodes and plan, as the commands here need them."""

    def __init__(self, run_dir: str | None):
        run = RunDir(Path(run_dir)) if run_dir else RunDir.latest()
        ckpt_dir = run.checkpoints
        if ckpt_dir is None:
            raise UsageError(f"the job in {run.path} writes no checkpoints", hint="add a `checkpoint:` block")
        self.path, self.ckpt_dir = run.path, ckpt_dir
        self.plan = run.plan()
        self.nodes = list(self.plan.nodes)
        self.hosts = run.several_hosts()

    def infos(self) -> list[store.EpochInfo]:
        return store.list_checkpoints(self.ckpt_dir) if self.ckpt_dir.is_dir() else []

    def epoch(self, epoch: Epoch) -> int:
        if epoch == "best":
            return best_epoch(self.infos(), self.nodes, self.plan, str(self.path))
        if epoch == "latest":
            infos = self.infos()
            latest = latest_complete(self.ckpt_dir, self.nodes, self.hosts, infos)
            if latest is None:
                raise CheckpointError(f"no complete checkpoint in {self.ckpt_dir}",
                                      hint=f"`{hints.command('ckpt list', run=self.path)}` shows what is there")
            newest = max(info.epoch for info in infos)
            if newest > latest:  # said: the newest one is what the user expects
                print(f"note: epoch {newest} is not complete (see `{hints.command('ckpt list', run=self.path)}`); the latest "
                      f"complete one is epoch {latest}", file=sys.stderr)
            return latest
        return int(epoch)

    @property
    def best(self) -> ir.Best | None:
        return self.plan.checkpoint.best if self.plan.checkpoint is not None else None

    def load(self, epoch: int, node: str, rank: int, *, as_numpy: bool = True,
             only: list[str] | None = None) -> dict[str, Any]:
        """The blobs of a rank (``only`` these, from a rank already read whole), tensors as
        numpy arrays, or as the torch tensors a resume restores without ``as_numpy``."""
        if node not in self.nodes:
            raise UsageError(f"the job has no node {node!r}", hint=f"nodes: {', '.join(self.nodes)}")
        if not (self.ckpt_dir / f"{node}.{epoch}").exists():
            raise UsageError(f"no checkpoint of epoch {epoch} for node {node!r}",
                             hint=present({i.epoch for i in self.infos()}, self.path))
        try:
            world = store.read_manifest(self.ckpt_dir, node, epoch).get("world_size")
        except Exception:  # noqa: BLE001 - a damaged manifest: the load below says what is wrong
            world = None
        if isinstance(world, int) and not 0 <= rank < world:  # asked for, not lost
            raise UsageError(f"epoch {epoch} of node {node!r} was saved by {world} rank(s): there is no "
                             f"rank {rank}", hint="leave --rank out (rank 0)" if world == 1
                             else f"give --rank 0 to {world - 1}")
        blobs, _meta = store.load(self.ckpt_dir, node, epoch, rank=rank, as_numpy=as_numpy, blobs=only)
        blobs.pop("jobrun:rng", None)
        if shards.holds_shards(blobs):  # parallel: fsdp: every rank's part makes the whole
            trees = [blobs if r == rank else store.load(self.ckpt_dir, node, epoch, rank=r, as_numpy=as_numpy,
                                                         blobs=list(blobs))[0]
                     for r in range(store.read_manifest(self.ckpt_dir, node, epoch)["world_size"])]
            blobs = shards.whole(trees)
        return blobs


def latest_complete(ckpt_dir: Path, nodes: list[str], hosts: bool,
                    infos: list[store.EpochInfo]) -> int | None:
    """The newest complete epoch of ``infos`` (store.list_checkpoints of ``ckpt_dir``), as
    resume picks it without reading the checksums; ``hosts``: a run on several hosts."""
    complete = store.complete_epochs(ckpt_dir, nodes) if infos else []
    if hosts and not complete:  # no shared disk: an epoch whose ranks here are
        complete = store.intact_epochs(nodes, infos)  # intact (rank 0's hold a DDP model)
    return complete[-1] if complete else None


def epoch_of(run_dir: str | None, epoch: Epoch) -> int:
    """The epoch number ``epoch`` (N, latest or best) means in a run."""
    return _Run(run_dir).epoch(epoch)


def present(epochs: Iterable[int], run: Path) -> str:
    """The hint for an epoch of ``run`` that has no checkpoint: the epochs that have one."""
    found = sorted(set(epochs))
    return (f"epochs present: {', '.join(map(str, found)) or 'none'} "
            f"(`{hints.command('ckpt list', run=run)}` shows them)")


# -- list ------------------------------------------------------------------------------------


def list_text(run_dir: str | None, verify: bool = False, as_json: bool = False) -> str:
    """Every saved epoch and node; with `checkpoint.best`, each one's monitored value and
    which epoch is the best (the one `--epoch best` takes)."""
    run = _Run(run_dir)
    infos = run.infos()
    best = run.best
    here = store.intact_epochs(run.nodes, infos) if run.hosts and best else []
    ranked = ranked_epochs(infos, run.nodes, best.monitor, here) if best else []
    top = ranked[0][0] if ranked else None
    rows: list[dict[str, Any]] = []
    for info in infos:
        for node, n in sorted(info.nodes.items()):
            problem = n.problem
            # On a host of a run without a shared disk, the other ranks are on other hosts.
            elsewhere = n.missing if run.hosts and not n.ok and n.intact_here else None
            if verify and (n.ok or elsewhere):
                problems = [p for r in n.ranks for p in store.verify(run.ckpt_dir, node, info.epoch, rank=r)] \
                    or rng.saved_problems(run.ckpt_dir, node, info.epoch, n.ranks)
                problem = problems[0] if problems else problem
                elsewhere = None if problems else elsewhere
            rows.append({
                "epoch": info.epoch, "node": node, "ranks": len(n.ranks), "world_size": n.world_size,
                "bytes": n.bytes, "saved_at": n.created, "valid": problem is None, "problem": problem,
                "on_other_hosts": elsewhere,
                "monitor": best.monitor.name.name if best else None,
                "value": epoch_value(n.meta or {}, best.monitor) if best else None,
                "best": info.epoch == top,
            })
    if as_json:
        return json.dumps({"run_dir": str(run.path), "checkpoints": rows}, indent=2)
    if not rows:
        return f"{run.path}: no checkpoints in {run.ckpt_dir}"
    return _table(rows, best)


def _table(rows: list[dict[str, Any]], best: ir.Best | None) -> str:
    name = best.monitor.name.name if best else ""
    width = max(len(name), 10)
    column = f"  {name:>{width}}" if best else ""
    lines = [f"{'epoch':>5}  {'node':<16} {'ranks':>5}  {'size':>10}  {'saved':<19}{column}  status"]
    for r in rows:
        when = _dt.datetime.fromtimestamp(r["saved_at"]).strftime("%Y-%m-%d %H:%M:%S") if r["saved_at"] else "-"
        status = "ok" if r["valid"] else f"INVALID: {r['problem']}"
        if r["on_other_hosts"]:
            status = (f"ok here (rank {', '.join(map(str, r['on_other_hosts']))} of {r['world_size']} "
                      "on other hosts)")
        if r["best"] and best is not None:
            status += f", best {name} ({best.monitor.mode})"
        ranks = f"{r['ranks']}/{r['world_size']}" if r["world_size"] else str(r["ranks"])
        value = ""
        if best is not None:
            shown = "-" if r["value"] is None else f"{r['value']:.6g}"
            value = f"  {shown:>{width}}"
        lines.append(f"{r['epoch']:>5}  {r['node']:<16} {ranks:>5}  {human_size(r['bytes']):>10}  "
                     f"{when:<19}{value}  {status}")
    return "\n".join(lines)


# -- show ------------------------------------------------------------------------------------


def _select(blobs: dict[str, Any], wanted: tuple[str, ...], where: str) -> dict[str, Any]:
    if not wanted:
        return blobs
    missing = [b for b in wanted if b not in blobs]
    if missing:
        raise UsageError(f"{where} has no blob {missing[0]!r}",
                         hint=f"blobs: {', '.join(sorted(blobs)) or 'none'} (checkpoints hold what steps after "
                              "init change; add one init made and nothing changes to `checkpoint.include`)")
    return {b: blobs[b] for b in wanted}


def show_text(run_dir: str | None, epoch: Epoch, node: str | None, rank: int, wanted: tuple[str, ...],
              as_json: bool = False, values: bool = False) -> str:
    """The blobs of one checkpoint: tensors as dtype and shape (their values with
    `values`), states of objects key by key, other values as JSON. `as_json`: every
    value in full, plus each tensor's dtype and shape under "tensors"."""
    run = _Run(run_dir)
    e = run.epoch(epoch)
    shown: dict[str, dict[str, Any]] = {}
    for n in [node] if node else run.nodes:
        shown[n] = dict(sorted(_select(run.load(e, n, rank), wanted, f"node {n!r} epoch {e}").items()))
    early = _early_stop(run, e)
    if as_json:
        return json.dumps({
            "epoch": e, "rank": rank, "early_stop": early,
            "nodes": {n: {k: _jsonable(v) for k, v in blobs.items()} for n, blobs in shown.items()},
            "tensors": {n: {k: {"dtype": str(v.dtype), "shape": list(v.shape)}
                            for k, v in _flatten(blobs).items() if _is_tensor(v)}
                        for n, blobs in shown.items()},
        }, indent=2, allow_nan=False)
    lines = [f"epoch {e}" + (f" rank {rank}" if rank else "")]
    if early is not None:
        lines.append(_early_stop_text(early))
    for n, blobs in shown.items():
        lines.append(f"node {n}:")
        for name, value in blobs.items():
            lines += _describe(name, value, values, "  ")
    return "\n".join(lines)


def _early_stop(run: _Run, epoch: int) -> dict[str, Any] | None:
    """The early_stop state saved with `epoch`: what a resume from it counts on (None: the
    plan has no early_stop); `note` says why a saved state is not used."""
    spec = run.plan.early_stop
    if spec is None:
        return None
    info = next((i for i in run.infos() if i.epoch == epoch and run.nodes[0] in i.nodes), None)
    meta = (info.nodes[run.nodes[0]].meta if info is not None else None) or {}
    state, note = EarlyStopping.restored(spec, meta.get(EARLY_STOP_META))
    return {**state.state(), "patience": spec.patience, "note": note}


def _early_stop_text(s: dict[str, Any]) -> str:
    """`early_stop: val_loss best 0.27 (epoch 3), 2/3 epochs without improvement`."""
    best = "-" if s["best"] is None else f"{s['best']:.6g} (epoch {s['best_epoch']})"
    text = f"early_stop: {s['monitor']} ({s['mode']}) best {best}, {s['wait']}/{s['patience']} epochs without improvement"
    if s["bad_value"] is not None:
        text += f", {s['monitor']} was {s['bad_value']} after epoch {s['bad_epoch']} (it stops)"
    return text + (f" (note: {s['note']})" if s["note"] else "")


def _describe(name: str, value: Any, values: bool, indent: str) -> list[str]:
    if isinstance(value, SavedState):
        head = f"{indent}{name} = state of {value.type_name}"
        if not isinstance(value.state, dict):
            return [head + f": {_value_text(value.state, values)}"]
        lines = [head]
        for key, sub in _flatten({"": value.state}).items():
            if key == ".param_groups" and _is_optimizer_state(value) and isinstance(sub, list):
                lines += _groups_text(sub, indent + "    ")
            else:
                lines += _describe(key.removeprefix("."), sub, values, indent + "    ")
        return lines
    if isinstance(value, list | tuple | dict) and _holds_tensor(value):
        # a tuple of tensors (an LSTM's hidden state): each tensor by the key it is saved under
        return [line for key, sub in _flatten({name: value}).items() for line in _describe(key, sub, values, indent)]
    return [f"{indent}{name} = {_value_text(value, values)}"]


def _groups_text(groups: list[Any], indent: str) -> list[str]:
    """An optimizer's parameter groups, one a line with all its options (a group's `lr`,
    `weight_decay`, `initial_lr` are what a reader looks for); only `params`, the
    indices of its parameters, is cut."""
    lines = []
    for i, group in enumerate(groups):
        if not isinstance(group, dict):
            lines.append(f"{indent}param_groups.{i} = {_cut(json.dumps(_jsonable(group)))}")
            continue
        options = {k: v for k, v in group.items() if k != "params"}
        text = json.dumps(_jsonable(options))
        if "params" in group:
            text += f" params={_cut(json.dumps(_jsonable(group['params'])))}"
        lines.append(f"{indent}param_groups.{i} = {text}")
    return lines


def _value_text(value: Any, values: bool) -> str:
    if _is_tensor(value):
        text = f"tensor {value.dtype} {list(value.shape)}"
        # A 0-d tensor is one number (train.step's loss): shown as a number would be.
        return text + f": {_cut(json.dumps(_jsonable(value)))}" if values or value.ndim == 0 else text
    return _cut(json.dumps(_jsonable(value)))


def _cut(text: str) -> str:
    return text if len(text) <= _CUT else text[:_CUT] + f"...<+len={len(text)}>"


def _is_tensor(value: Any) -> bool:
    # Tensors come back from the store as numpy arrays; numpy scalars are plain values.
    return hasattr(value, "dtype") and hasattr(value, "shape") and hasattr(value, "ndim") \
        and type(value).__name__ == "ndarray"


# -- export ----------------------------------------------------------------------------------


def export(run_dir: str | None, epoch: Epoch, node: str | None, wanted: tuple[str, ...], output: str) -> Path:
    """Write blobs of one checkpoint to a .safetensors, .pt or .json file.

    One blob that holds a module's state is written with the module's own state_dict
    keys (`0.weight`), so plain PyTorch loads it with `model.load_state_dict(...)`; one
    that holds an optimizer's (a scheduler's) state goes to .pt as that state_dict, for
    `opt.load_state_dict(...)` (.safetensors and .json would lose part of an optimizer's:
    refused); several blobs keep the blob name as a prefix of each key (`model.0.weight`).
    """
    run = _Run(run_dir)
    e = run.epoch(epoch)
    n = node or run.nodes[0]
    chosen = [*(["--epoch", str(epoch)] if epoch != "latest" else []), *(["--node", node] if node else [])]
    blobs = _select(run.load(e, n, 0), wanted, f"node {n!r} epoch {e}")
    out = Path(output)
    suffix = out.suffix.lower()
    owned = jobruns_own(run.path, run.ckpt_dir, out)
    if owned is not None:
        raise UsageError(f"cannot export to {out}: it {owned}, which the run needs",
                         hint="give -o a file of your own (e.g. model.safetensors)")
    if suffix not in SAVE_SUFFIXES:
        raise UsageError(f"cannot export to {suffix or 'a file without suffix'!r}",
                         hint="use -o FILE.safetensors, FILE.json or FILE.pt")
    optimizer = next((name for name, v in blobs.items() if _is_optimizer_state(v)), None)
    if optimizer is not None and suffix != ".pt":
        lost = "its param_groups" if suffix == ".safetensors" else "its int keys and tensors (as strings and lists)"
        raise UsageError(
            f"blob {optimizer!r} holds the state of a {blobs[optimizer].type_name}: a {suffix} file would "
            f"lose {lost}, so `load_state_dict` could not take it back",
            hint=f"export it alone to a .pt file: `{hints.command('export', *chosen, '--blob', optimizer, '-o', f'{optimizer}.pt', run=run.path)}`, then "
                 f"`opt.load_state_dict(torch.load('{optimizer}.pt', weights_only=True))`")
    only = next(iter(blobs.values())) if len(blobs) == 1 else None
    tensors = dict(only.state) if _is_module_state(only) else _flatten(blobs)
    own = None
    if suffix == ".pt" and isinstance(only, SavedState) and not _is_module_state(only):
        # an optimizer's (a scheduler's) own state_dict, decoded as resume decodes it
        own = run.load(e, n, 0, as_numpy=False, only=list(blobs))[next(iter(blobs))].state
    if suffix == ".safetensors":
        for name in blobs:
            if not any(k == name or k.startswith(name + ".") for k, v in _flatten(blobs).items() if _is_tensor(v)):
                raise UsageError(f"blob {name!r} holds {_kind(blobs[name])}, no tensor, so it cannot go "
                                 "into a .safetensors file", hint="export it to a .json file")
    if not out.parent.is_dir():
        raise UsageError(f"cannot write {out}: directory {out.parent} does not exist",
                         hint="create it first, or give another -o")
    _write(out, suffix, blobs, tensors, own)
    return out


def _write(out: Path, suffix: str, blobs: dict[str, Any], tensors: dict[str, Any], own: Any) -> None:
    """``own``: for .pt, an object's state_dict to write as it is instead of ``tensors``."""
    try:
        if suffix == ".safetensors":
            import numpy as np
            from safetensors.numpy import save as to_bytes

            # np.ascontiguousarray makes a 0-d array 1-d (BatchNorm's num_batches_tracked)
            data = to_bytes({k: np.require(v, requirements='C') for k, v in tensors.items() if _is_tensor(v)})
            safefs.write_atomic(out, data)
        elif suffix == ".json":
            text = json.dumps({k: _jsonable(v) for k, v in blobs.items()}, indent=2, allow_nan=False) + "\n"
            safefs.write_atomic(out, text.encode())
        else:
            import torch

            state = own if own is not None else {
                k: torch.from_numpy(v.copy()) if _is_tensor(v) else v for k, v in tensors.items()}
            safefs.write_with(out, lambda f: torch.save(state, f))
    except safefs.UnsafeFile as e:
        raise UsageError(f"refusing to write {out}: {e.strerror}", hint="remove it, or give another -o") from None
    except (OSError, RuntimeError) as e:
        # torch.save reports a failed write (a full or read-only file system) as a RuntimeError.
        raise UsageError(f"cannot write {out}: {getattr(e, 'strerror', None) or e}",
                         hint="check that its directory is writable and has space") from None


def _is_module_state(value: Any) -> bool:
    """A module's state_dict: names to tensors, nothing else (an optimizer's state nests,
    a reader's holds numbers)."""
    return isinstance(value, SavedState) and isinstance(value.state, dict) and bool(value.state) and all(
        isinstance(k, str) and _is_tensor(v) for k, v in value.state.items())


def _is_optimizer_state(value: Any) -> bool:
    """A torch optimizer's state_dict: per-parameter state under int keys, and param_groups."""
    return isinstance(value, SavedState) and isinstance(value.state, dict) and set(value.state) == {
        "state", "param_groups"}


def _kind(value: Any) -> str:
    if isinstance(value, SavedState):
        return f"the state of a {value.type_name}"
    return a_type(value)


def _holds_tensor(value: Any) -> bool:
    if isinstance(value, dict):
        return any(_holds_tensor(v) for v in value.values())
    if isinstance(value, list | tuple):
        return any(_holds_tensor(v) for v in value)
    return _is_tensor(value)


def _flatten(blobs: dict[str, Any]) -> dict[str, Any]:
    """Module/optimizer states come back as SavedState; their values as blob.key, and the
    items of a list or tuple that holds tensors as blob.0, blob.1 (the checkpoint's keys)."""
    out: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, SavedState):
            walk(prefix, value.state)
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}", v)
        elif isinstance(value, list | tuple) and _holds_tensor(value):
            for i, v in enumerate(value):
                walk(f"{prefix}.{i}", v)
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
