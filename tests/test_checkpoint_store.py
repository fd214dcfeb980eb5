"""The checkpoint store: layout, verification, crash safety, listing, pruning, upload."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from runner_util import HANG_S

from jobrun import store as ck
from jobrun.errors import CheckpointError
from jobrun.store import SavedState, files, restore, tensorfile


def workspace(seed: int = 0) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return {
        "model": model,
        "opt": opt,
        "rng": torch.Generator().manual_seed(seed),
        "step": 10 + seed,
        "history": [0.5, float("nan"), (1, 2)],
        "emb": torch.randn(5, 2).to(torch.bfloat16),
        "table": np.arange(6, dtype=np.int32).reshape(2, 3),
    }


def files_of(rdir: Path) -> set[str]:
    return {p.name for p in rdir.iterdir()}


def hidden_entries(path: Path) -> list[str]:
    return [p.name for p in path.rglob(".*")]


def crc(data: bytes) -> str:
    return f"{zlib.crc32(data):08x}"


# -------------------------------------------------------------------- save and load


def test_save_load_round_trip_and_layout(tmp_path: Path) -> None:
    ws = workspace()
    res = ck.save(ws, {"loss": 0.25}, tmp_path, "train", 3)
    rdir = tmp_path / "train.3" / "rank-0"
    assert res.path == rdir
    assert files_of(rdir) == {"tensors.safetensors", "values.json", "MANIFEST.json", "COMMIT"}
    assert res.bytes == sum((rdir / n).stat().st_size for n in files_of(rdir))
    assert res.seconds > 0

    manifest = json.loads((rdir / "MANIFEST.json").read_bytes())
    assert manifest["format"] == ck.FORMAT and manifest["version"] == ck.FORMAT_VERSION
    assert (manifest["node"], manifest["epoch"], manifest["rank"]) == ("train", 3, 0)
    assert manifest["world_size"] == 1 and manifest["meta"] == {"loss": 0.25}
    assert abs(manifest["created"] - time.time()) < 60
    for name in ("tensors.safetensors", "values.json"):
        data = (rdir / name).read_bytes()
        assert manifest["files"][name] == {
            "size": len(data),
            "chunk_bytes": files.CHUNK_BYTES,  # far more than this file: one chunk
            "crc32_chunks": [crc(data)],
        }
    commit = json.loads((rdir / "COMMIT").read_bytes())
    assert (
        commit["manifest_sha256"]
        == hashlib.sha256((rdir / "MANIFEST.json").read_bytes()).hexdigest()
    )
    assert (commit["node"], commit["epoch"], commit["rank"], commit["world_size"]) == (
        "train",
        3,
        0,
        1,
    )

    blobs, meta = ck.load(tmp_path, "train", 3)
    assert meta == {"loss": 0.25}
    assert blobs["step"] == 10 and blobs["history"][2] == (1, 2)
    assert torch.equal(blobs["emb"], ws["emb"]) and blobs["emb"].dtype == torch.bfloat16
    assert np.array_equal(blobs["table"], ws["table"])
    model = torch.nn.Linear(4, 3)
    restore(model, blobs["model"])
    assert torch.equal(model.weight, ws["model"].weight)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    restore(opt, blobs["opt"])
    assert torch.equal(
        opt.state_dict()["state"][0]["exp_avg"], ws["opt"].state_dict()["state"][0]["exp_avg"]
    )
    rng = torch.Generator()
    restore(rng, blobs["rng"])
    assert torch.equal(torch.rand(3, generator=rng), torch.rand(3, generator=ws["rng"]))
    assert ck.verify(tmp_path, "train", 3) == []


def test_load_as_numpy(tmp_path: Path) -> None:
    ws = workspace()
    ck.save(ws, {}, tmp_path, "n", 0)
    blobs, _ = ck.load(tmp_path, "n", 0, as_numpy=True)
    assert isinstance(blobs["model"], SavedState)
    assert np.array_equal(blobs["model"].state["weight"], ws["model"].weight.detach().numpy())
    assert blobs["emb"].dtype == np.uint16  # bfloat16 bits


def test_prepare_copies_so_training_can_go_on(tmp_path: Path) -> None:
    w = torch.zeros(3)
    prepared = ck.prepare({"w": w}, {"epoch": 1})
    assert prepared.tensor_bytes == 12
    w.add_(5)  # training mutates the live tensor before the write
    res = ck.write(prepared, tmp_path, "n", 1)
    assert res.path.name == "rank-0"
    blobs, meta = ck.load(tmp_path, "n", 1)
    assert torch.equal(blobs["w"], torch.zeros(3)) and meta == {"epoch": 1}


def test_prepare_reuses_the_memory_of_an_earlier_copy(tmp_path: Path) -> None:
    w, a = torch.zeros(4), np.zeros(3)
    first = ck.prepare({"w": w, "a": a, "s": torch.zeros(2)})
    ck.write(first, tmp_path, "n", 0)
    w.add_(1)
    a += 2
    second = ck.prepare({"w": w, "a": a, "s": torch.zeros(5)}, reuse=first)
    assert second.tensors["w"] is first.tensors["w"]  # same memory, new values
    assert second.tensors["a"] is first.tensors["a"]
    assert second.tensors["s"] is not first.tensors["s"]  # shape changed: new memory
    ck.write(second, tmp_path, "n", 1)
    assert torch.equal(ck.load(tmp_path, "n", 1)[0]["w"], torch.ones(4))
    assert np.array_equal(ck.load(tmp_path, "n", 1)[0]["a"], np.full(3, 2.0))
    # A prepare without copies holds live tensors: never written into.
    live = ck.prepare({"w": w}, copy=False)
    third = ck.prepare({"w": torch.full((4,), 7.0)}, reuse=live)
    assert third.tensors["w"] is not w and torch.equal(w, torch.ones(4))


def test_write_from_another_thread_while_training_goes_on(tmp_path: Path) -> None:
    import threading

    w = torch.zeros(300_000)
    prepared = ck.prepare({"w": w})
    done: list[Any] = []
    thread = threading.Thread(target=lambda: done.append(ck.write(prepared, tmp_path, "n", 0)))
    thread.start()
    for _ in range(20):
        w.add_(1)
    thread.join()
    assert done and torch.equal(ck.load(tmp_path, "n", 0)[0]["w"], torch.zeros(300_000))


def test_a_copy_written_later_gives_the_same_bytes_as_a_save(tmp_path: Path) -> None:
    """An async save (prepare(copy=True) + write, reusing the last copy) is a sync save."""
    ws = workspace()
    first = ck.prepare(ws, {"e": 0})
    ck.write(first, tmp_path / "async", "n", 0)
    ws["model"].weight.data.add_(1)
    ws["step"] = 99
    again = ck.prepare(ws, {"e": 1}, reuse=first)
    assert again.tensors["model.weight"] is first.tensors["model.weight"]
    ck.write(again, tmp_path / "async", "n", 1)
    ck.save(ws, {"e": 1}, tmp_path / "sync", "n", 1)
    for name in ("tensors.safetensors", "values.json"):
        a = (tmp_path / "async" / "n.1" / "rank-0" / name).read_bytes()
        b = (tmp_path / "sync" / "n.1" / "rank-0" / name).read_bytes()
        assert a == b, name


def test_tensors_that_share_memory_and_foreign_byte_orders(tmp_path: Path) -> None:
    w = torch.arange(10.0)
    model = torch.nn.Linear(3, 3)
    ws = {
        "w": w, "head": w[:4], "tail": w[6:], "again": w, "tied": {"a": model.weight, "b": model.weight},
        "big_endian": np.arange(6, dtype=">i4").reshape(2, 3), "le": np.arange(3, dtype="<f8"),
    }
    ck.save(ws, {}, tmp_path, "n", 0)
    back, _ = ck.load(tmp_path, "n", 0)
    for key in ("w", "head", "tail", "again"):
        assert torch.equal(back[key], ws[key]), key
    assert torch.equal(back["tied"]["a"], model.weight) and torch.equal(back["tied"]["b"], model.weight)
    assert back["big_endian"].tolist() == [[0, 1, 2], [3, 4, 5]]
    assert np.array_equal(back["le"], ws["le"])
    assert w.tolist() == list(range(10))  # nothing written into the live tensors


def test_changing_loaded_tensors_leaves_the_checkpoint_alone(saved: Path) -> None:
    blobs, _ = ck.load(saved, "n", 1)
    blobs["w"].add_(1)  # training goes on with a restored tensor
    assert ck.verify(saved, "n", 1) == []
    assert torch.equal(ck.load(saved, "n", 1)[0]["w"], torch.arange(1000.0) * 2)


def test_unsupported_blobs_are_skipped_when_asked(tmp_path: Path) -> None:
    seen = []
    prepared = ck.prepare({"a": 1, "bad": object()}, on_unsupported=seen.append)
    assert [e.blob for e in seen] == ["bad"] and prepared.skipped == ["bad"]
    ck.write(prepared, tmp_path, "n", 0)
    assert ck.load(tmp_path, "n", 0)[0] == {"a": 1}
    with pytest.raises(CheckpointError, match="bad"):
        ck.prepare({"bad": object()})
    with pytest.raises(CheckpointError, match="JSON"):
        ck.prepare({"a": 1}, {"meta": object()})


def test_resave_of_the_same_epoch_replaces_it(tmp_path: Path) -> None:
    ck.save({"v": 1}, {}, tmp_path, "n", 2)
    ck.save({"v": 2}, {}, tmp_path, "n", 2)
    assert ck.load(tmp_path, "n", 2)[0] == {"v": 2}
    assert hidden_entries(tmp_path) == []


def test_failed_resave_keeps_the_old_one(tmp_path: Path, monkeypatch) -> None:
    ck.save({"v": 1}, {}, tmp_path, "n", 2)
    real = os.replace

    def fail_commit(src, dst):
        if Path(dst).name == "COMMIT":
            raise OSError(errno.EIO, "Input/output error")
        return real(src, dst)

    monkeypatch.setattr(os, "replace", fail_commit)
    with pytest.raises(CheckpointError, match="Input/output error"):
        ck.save({"v": 2}, {}, tmp_path, "n", 2)
    monkeypatch.undo()
    assert ck.load(tmp_path, "n", 2)[0] == {"v": 1}
    assert hidden_entries(tmp_path) == []


def test_multi_rank_save(tmp_path: Path) -> None:
    for r in range(3):
        ck.save(
            {"r": r, "t": torch.full((2,), float(r))}, {}, tmp_path, "n", 0, rank=r, world_size=3
        )
    assert ck.verify(tmp_path, "n", 0) == []
    assert ck.load(tmp_path, "n", 0, rank=2)[0]["r"] == 2
    [info] = ck.list_checkpoints(tmp_path)
    assert info.nodes["n"].ranks == [0, 1, 2] and info.nodes["n"].world_size == 3 and info.ok


# -------------------------------------------------------------------- corruption


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    ck.save({"w": torch.arange(1000.0), "note": "x"}, {}, tmp_path, "n", 0)
    ck.save({"w": torch.arange(1000.0) * 2, "note": "y"}, {}, tmp_path, "n", 1)
    return tmp_path


def expect_problem(ckpt: Path, epoch: int, pattern: str) -> None:
    with pytest.raises(CheckpointError, match=pattern) as info:
        ck.load(ckpt, "n", epoch)
    assert info.value.hint
    problems = ck.verify(ckpt, "n", epoch)
    assert problems and any(pytest.importorskip("re").search(pattern, p) for p in problems)
    latest, skipped = ck.latest_complete_epoch(ckpt, ["n"], 1)
    assert latest == 0 and [e for e, _ in skipped] == [1]


def test_truncated_file(saved: Path) -> None:
    path = saved / "n.1" / "rank-0" / "tensors.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    expect_problem(saved, 1, r"tensors\.safetensors is truncated: \d+ bytes, \d+ expected")
    assert not ck.list_checkpoints(saved)[1].ok  # sizes are checked cheaply


@pytest.mark.parametrize("where", ["data", "header"])
def test_one_flipped_byte(saved: Path, where: str) -> None:
    path = saved / "n.1" / "rank-0" / "tensors.safetensors"
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2 if where == "data" else 20] ^= 0x10
    path.write_bytes(raw)
    expect_problem(saved, 1, r"tensors\.safetensors: checksum mismatch")
    # Listing does not hash: the flip is found by verify / latest_complete_epoch only.
    assert ck.list_checkpoints(saved)[1].ok
    assert ck.latest_complete_epoch(saved, ["n"], 1, verify_hashes=False) == (1, [])


def test_flipped_byte_in_values(saved: Path) -> None:
    path = saved / "n.1" / "rank-0" / "values.json"
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0x01
    path.write_bytes(raw)
    expect_problem(saved, 1, r"values\.json: checksum mismatch")


def test_missing_commit(saved: Path) -> None:
    (saved / "n.1" / "rank-0" / "COMMIT").unlink()
    expect_problem(saved, 1, "incomplete save: no COMMIT marker")
    [_, info] = ck.list_checkpoints(saved)
    assert not info.ok and "incomplete save" in info.nodes["n"].problem


def test_missing_file(saved: Path) -> None:
    (saved / "n.1" / "rank-0" / "values.json").unlink()
    expect_problem(saved, 1, r"values\.json is missing")


def test_commit_not_matching_manifest(saved: Path) -> None:
    path = saved / "n.1" / "rank-0" / "MANIFEST.json"
    manifest = json.loads(path.read_bytes())
    manifest["meta"] = {"tampered": True}
    path.write_text(json.dumps(manifest))
    expect_problem(saved, 1, "COMMIT does not match MANIFEST.json")


def test_missing_rank(tmp_path: Path) -> None:
    ck.save({"a": 1}, {}, tmp_path, "n", 0, rank=0, world_size=2)
    ck.save({"a": 1}, {}, tmp_path, "n", 0, rank=1, world_size=2)
    ck.save({"a": 2}, {}, tmp_path, "n", 1, rank=0, world_size=2)
    with pytest.raises(CheckpointError, match=r"rank 1 is missing \(ranks found: 0\)"):
        ck.load(tmp_path, "n", 1, rank=1)
    assert any("rank 1 of 2 missing" in p for p in ck.verify(tmp_path, "n", 1))
    assert ck.verify(tmp_path, "n", 1, rank=0) == []
    latest, skipped = ck.latest_complete_epoch(tmp_path, ["n"], 2)
    assert latest == 0 and skipped[0][0] == 1 and "rank 1 of 2 missing" in skipped[0][1]
    latest, skipped = ck.latest_complete_epoch(tmp_path, ["n"], 4)
    assert latest is None and "world size 2, not 4" in skipped[-1][1]


def test_read_manifest_and_load_without_hashes(saved: Path) -> None:
    m = ck.read_manifest(saved, "n", 1)
    assert (m["node"], m["epoch"], m["rank"], m["world_size"]) == ("n", 1, 0, 1)
    path = saved / "n.1" / "rank-0" / "tensors.safetensors"
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0x01  # corrupt the last value, keep the size
    path.write_bytes(raw)
    blobs, _ = ck.load(saved, "n", 1, verify_hashes=False)  # the caller vouched for it
    assert blobs["note"] == "y"
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        ck.load(saved, "n", 1)
    (saved / "n.1" / "rank-0" / "COMMIT").unlink()
    with pytest.raises(CheckpointError, match="incomplete save"):
        ck.load(saved, "n", 1, verify_hashes=False)
    with pytest.raises(CheckpointError, match="incomplete save"):
        ck.read_manifest(saved, "n", 1)


def test_a_tensors_file_the_library_cannot_parse(saved: Path) -> None:
    rdir = saved / "n.1" / "rank-0"
    path = rdir / "tensors.safetensors"
    garbage = b"\xff" * path.stat().st_size  # same size: only the bytes tell
    path.write_bytes(garbage)
    for hashes in (True, False):  # a file that does not parse is checked to say why
        with pytest.raises(CheckpointError, match=r"tensors\.safetensors: checksum mismatch"):
            ck.load(saved, "n", 1, verify_hashes=hashes)
    manifest = json.loads((rdir / "MANIFEST.json").read_bytes())
    manifest["files"]["tensors.safetensors"]["crc32_chunks"] = [crc(garbage)]
    rewrite_manifest(rdir, manifest)  # a manifest that vouches for garbage
    for as_numpy in (False, True):
        with pytest.raises(CheckpointError, match=r"tensors\.safetensors cannot be read: .*header"):
            ck.load(saved, "n", 1, as_numpy=as_numpy)


def test_missing_epoch_and_copied_directories(saved: Path) -> None:
    with pytest.raises(CheckpointError, match="no checkpoint of node 'n' at epoch 7"):
        ck.load(saved, "n", 7)
    assert ck.verify(saved, "n", 7) and ck.verify(saved, "other", 0)
    # A rank directory copied under another epoch's name is refused, not loaded.
    (saved / "n.5").mkdir()
    os.rename(saved / "n.1" / "rank-0", saved / "n.5" / "rank-0")
    with pytest.raises(CheckpointError, match="epoch 1, not 5"):
        ck.load(saved, "n", 5)


# -------------------------------------------------------------------- hashes per chunk


@pytest.fixture
def small_chunks(monkeypatch) -> int:
    """Chunks of 64 KiB, so that a small checkpoint spans many of them."""
    monkeypatch.setattr(files, "CHUNK_BYTES", 64 << 10)
    return 64 << 10


def test_every_chunk_has_its_own_hash(tmp_path: Path, small_chunks: int) -> None:
    w = torch.randn(300_000)  # 1.2 MB: 19 chunks
    ck.save({"w": w, "note": "x" * 100_000}, {}, tmp_path, "n", 0)
    rdir = tmp_path / "n.0" / "rank-0"
    files = json.loads((rdir / "MANIFEST.json").read_bytes())["files"]
    for name, info in files.items():
        data = (rdir / name).read_bytes()
        chunks = [data[i : i + small_chunks] for i in range(0, len(data), small_chunks)]
        assert len(chunks) > 1 and info["chunk_bytes"] == small_chunks
        assert info["crc32_chunks"] == [crc(c) for c in chunks]
    assert torch.equal(ck.load(tmp_path, "n", 0)[0]["w"], w)
    assert ck.verify(tmp_path, "n", 0) == []


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_a_flipped_byte_in_any_chunk_is_found(tmp_path: Path, small_chunks: int, where) -> None:
    ck.save({"w": torch.randn(300_000)}, {}, tmp_path, "n", 0)
    ck.save({"w": torch.randn(300_000)}, {}, tmp_path, "n", 1)
    path = tmp_path / "n.1" / "rank-0" / "tensors.safetensors"
    raw = bytearray(path.read_bytes())
    at = {"first": 100, "middle": len(raw) // 2, "last": len(raw) - 1}[where]
    raw[at] ^= 0x04
    path.write_bytes(raw)
    k = at // small_chunks
    expect_problem(
        tmp_path,
        1,
        rf"tensors\.safetensors: checksum mismatch in bytes {k * small_chunks}-"
        rf"{(k + 1) * small_chunks} ",
    )


@pytest.mark.parametrize(
    "change",
    [
        lambda e: e.update(crc32_chunks=e["crc32_chunks"][:-1]),  # one digest short
        lambda e: e.update(crc32_chunks=e["crc32_chunks"] + ["0" * 8]),  # one too many
        lambda e: e.update(chunk_bytes=0),
        lambda e: e.update(crc32_chunks=["x" * 8] * len(e["crc32_chunks"])),
        lambda e: e.update(crc32_chunks=["0" * 9] * len(e["crc32_chunks"])),
        lambda e: e.update(sha256_chunks=e.pop("crc32_chunks")),  # a version 2 key
        lambda e: e.update(sha256=e.pop("crc32_chunks")[0]),  # the version 1 entry
    ],
    ids=["short", "long", "zero chunk", "not hex", "too long", "v2 key", "v1 entry"],
)
def test_malformed_chunk_entries_are_refused(tmp_path: Path, small_chunks: int, change) -> None:
    ck.save({"w": torch.randn(50_000)}, {}, tmp_path, "n", 0)
    ck.save({"w": torch.randn(50_000)}, {}, tmp_path, "n", 1)
    rdir = tmp_path / "n.1" / "rank-0"
    manifest = json.loads((rdir / "MANIFEST.json").read_bytes())
    change(manifest["files"]["tensors.safetensors"])
    rewrite_manifest(rdir, manifest)
    expect_problem(tmp_path, 1, r"bad entry for tensors\.safetensors")


def rewrite_manifest(rdir: Path, manifest: dict[str, Any]) -> None:
    """Replace a rank's manifest and make its COMMIT vouch for the new one."""
    raw = json.dumps(manifest, indent=1).encode()
    (rdir / "MANIFEST.json").write_bytes(raw)
    commit = json.loads((rdir / "COMMIT").read_bytes())
    commit["manifest_sha256"] = hashlib.sha256(raw).hexdigest()
    (rdir / "COMMIT").write_text(json.dumps(commit))


@pytest.mark.parametrize("version", [1, 2])
def test_formats_1_and_2_are_refused_with_a_message(tmp_path: Path, version: int) -> None:
    """Checkpoints of the jobrun before the safetensors library (SHA-256 checksums)."""
    ck.save({"a": 1}, {}, tmp_path, "n", 0)
    ck.save({"a": 2}, {}, tmp_path, "n", 1)
    rdir = tmp_path / "n.1" / "rank-0"
    manifest = json.loads((rdir / "MANIFEST.json").read_bytes())
    manifest["version"] = version
    for name, info in manifest["files"].items():  # what that format wrote
        data = (rdir / name).read_bytes()
        if version == 1:
            manifest["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        else:
            del info["crc32_chunks"]
            info["chunk_bytes"] = 64 << 20
            info["sha256_chunks"] = [hashlib.sha256(data).hexdigest()]
    rewrite_manifest(rdir, manifest)
    with pytest.raises(CheckpointError) as info:
        ck.load(tmp_path, "n", 1)
    message = info.value.message
    assert f"{rdir / 'MANIFEST.json'} has checkpoint format {version}" in message
    assert "written by an older jobrun" in message and "format 3 only" in message
    assert "train again" in info.value.hint
    assert "written by an older jobrun" in ck.verify(tmp_path, "n", 1)[0]
    assert not ck.list_checkpoints(tmp_path)[1].ok
    latest, skipped = ck.latest_complete_epoch(tmp_path, ["n"], 1)
    assert latest == 0 and "written by an older jobrun" in skipped[0][1]


@pytest.mark.parametrize("version", [ck.FORMAT_VERSION + 1, 0, "3", None, True])
def test_unknown_formats_are_refused(tmp_path: Path, version: Any) -> None:
    ck.save({"a": 1}, {}, tmp_path, "n", 0)
    rdir = tmp_path / "n.0" / "rank-0"
    manifest = json.loads((rdir / "MANIFEST.json").read_bytes())
    manifest["version"] = version
    rewrite_manifest(rdir, manifest)
    with pytest.raises(CheckpointError) as info:
        ck.load(tmp_path, "n", 0)
    assert f"has checkpoint format {version!r}; this jobrun reads format 3" in info.value.message
    assert "upgrade jobrun" in info.value.hint


# -------------------------------------------------------------------- crashes and errors


def test_crash_at_rename_leaves_earlier_epochs_valid(saved: Path, monkeypatch) -> None:
    real = os.replace

    def crash(src, dst):
        if Path(dst).name == "rank-0":
            raise OSError(errno.EIO, "Input/output error", str(dst))
        return real(src, dst)

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(CheckpointError, match="Input/output error"):
        ck.save({"w": torch.ones(3)}, {}, saved, "n", 2)
    monkeypatch.undo()
    assert ck.latest_complete_epoch(saved, ["n"], 1)[0] == 1
    assert ck.verify(saved, "n", 2)
    assert hidden_entries(saved) == []  # temporaries removed
    assert torch.equal(ck.load(saved, "n", 1)[0]["w"], torch.arange(1000.0) * 2)


def test_exception_while_writing_is_reraised_after_cleanup(saved: Path, monkeypatch) -> None:
    def boom(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(tensorfile, "_save_file", boom)
    with pytest.raises(KeyboardInterrupt):
        ck.save({"w": torch.ones(3)}, {}, saved, "n", 2)
    assert hidden_entries(saved) == [] and ck.latest_complete_epoch(saved, ["n"], 1)[0] == 1


class FullDisk:
    """A file whose writes fail with ENOSPC after ``room`` bytes."""

    def __init__(self, f, room: int) -> None:
        self.f, self.room = f, room

    def write(self, data) -> int:
        if len(data) > self.room:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.room -= len(data)
        return self.f.write(data)

    def fileno(self) -> int:
        return self.f.fileno()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.f.close()


def library_out_of_space(tensors, path) -> None:
    """What the safetensors library raises when the disk fills while it writes."""
    from safetensors import SafetensorError

    Path(path).with_name(".tmpXYZ").write_bytes(b"half")  # it writes beside, then renames
    raise SafetensorError(
        f'Error while serializing: I/O error: No space left on device (os error 28) at path "{path}"'
    )


@pytest.mark.parametrize("where", ["tensors", "values"])
def test_no_space_left(saved: Path, monkeypatch, where: str) -> None:
    if where == "tensors":
        monkeypatch.setattr(tensorfile, "_save_file", library_out_of_space)
    else:
        real = files._create
        monkeypatch.setattr(files, "_create", lambda path: FullDisk(real(path), 100))
    with pytest.raises(CheckpointError) as info:
        ck.save({"w": torch.randn(10_000), "v": "x" * 1000}, {}, saved, "n", 2)
    assert "no space left on device" in info.value.message
    assert "n.2" in info.value.message and "free disk space" in info.value.hint
    monkeypatch.undo()
    assert hidden_entries(saved) == []
    assert not (saved / "n.2").exists()
    assert ck.latest_complete_epoch(saved, ["n"], 1)[0] == 1


def test_a_failed_save_removes_the_epoch_directory_it_made_and_nothing_else(tmp_path: Path, monkeypatch) -> None:
    # Left empty, an epoch's directory was listed as INVALID and skipped with a warning
    # by every resume. Another rank's save there, or an older save of the epoch, stays.
    ck.save({"w": torch.ones(3)}, {}, tmp_path, "n", 1)
    ck.save({"w": torch.ones(3)}, {}, tmp_path, "n", 2, rank=0, world_size=2)
    monkeypatch.setattr(tensorfile, "_save_file", library_out_of_space)
    for epoch, rank, world in ((3, 0, 1), (2, 1, 2), (1, 0, 1)):  # new; beside a rank; a re-save
        with pytest.raises(CheckpointError, match="no space left on device"):
            ck.save({"w": torch.zeros(3)}, {}, tmp_path, "n", epoch, rank=rank, world_size=world)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["n.1", "n.2"]
    assert files_of(tmp_path / "n.2") == {"rank-0"} and hidden_entries(tmp_path) == []
    assert torch.equal(ck.load(tmp_path, "n", 1)[0]["w"], torch.ones(3))
    assert [(i.epoch, i.ok) for i in ck.list_checkpoints(tmp_path)] == [(1, True), (2, False)]  # rank 1 missing


def test_saves_that_fail_on_every_rank_leave_no_epoch_directory(tmp_path: Path, monkeypatch) -> None:
    # A full disk fails both ranks' saves of a new epoch; rank 0, which made the epoch's
    # directory, fails while rank 1's temporary directory is still there: rank 1, failing
    # last, removes it (left empty, ckpt list showed it INVALID and resumes skipped it).
    import threading

    writing = {r: threading.Event() for r in (0, 1)}
    fail = {r: threading.Event() for r in (0, 1)}

    def blocked_out_of_space(tensors, path) -> None:
        rank = 1 if "rank-1" in str(path) else 0
        writing[rank].set()
        assert fail[rank].wait(HANG_S)
        library_out_of_space(tensors, path)

    def save(rank: int, errors: list[str]) -> None:
        try:
            ck.save({"w": torch.ones(3)}, {}, tmp_path, "n", 1, rank=rank, world_size=2)
        except CheckpointError as e:
            errors.append(e.message)

    monkeypatch.setattr(tensorfile, "_save_file", blocked_out_of_space)
    errors: list[str] = []
    threads = {r: threading.Thread(target=save, args=(r, errors)) for r in (0, 1)}
    for r in (0, 1):  # rank 0 makes n.1, then rank 1 writes beside it
        threads[r].start()
        assert writing[r].wait(HANG_S)
    for r in (0, 1):
        fail[r].set()
        threads[r].join(HANG_S)
    assert len(errors) == 2 and all("no space left on device" in e for e in errors)
    assert list(tmp_path.iterdir()) == [] and ck.list_checkpoints(tmp_path) == []


def test_a_save_whose_empty_epoch_directory_another_rank_removed_goes_on(tmp_path: Path, monkeypatch) -> None:
    # Rank 0's save failed and removed the epoch's directory, empty, just before rank 1
    # made its temporary directory there: rank 1's save makes it again.
    real = os.mkdir

    def racing(path, *args, **kwargs):
        if Path(path).name.startswith(".tmp-") and not racing.done:
            racing.done = True
            os.rmdir(Path(path).parent)
        return real(path, *args, **kwargs)

    racing.done = False
    monkeypatch.setattr(os, "mkdir", racing)
    ck.save({"w": torch.ones(3)}, {}, tmp_path, "n", 1, rank=1, world_size=2)
    assert racing.done and files_of(tmp_path / "n.1") == {"rank-1"}


@pytest.mark.parametrize("code, what", [(errno.EACCES, "permission denied"),
                                        (errno.EROFS, "read-only file system")])
def test_permission_denied(tmp_path: Path, monkeypatch, code, what) -> None:
    real = os.mkdir

    def denied(path, *args, **kwargs):
        if ".tmp-rank-" in str(path):
            raise OSError(code, os.strerror(code), str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", denied)
    with pytest.raises(CheckpointError) as info:
        ck.save({"a": 1}, {}, tmp_path, "n", 0)
    # A read-only checkpoint directory of a run that resumes cannot just move: its
    # checkpoints are there. The hint names the directory to make writable first.
    assert what in info.value.message and f"make {tmp_path}" in info.value.hint, info.value.hint


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root ignores chmod")
def test_unwritable_directory(tmp_path: Path) -> None:
    tmp_path.chmod(0o500)
    try:
        with pytest.raises(CheckpointError, match="permission denied"):
            ck.save({"a": 1}, {}, tmp_path, "n", 0)
    finally:
        tmp_path.chmod(0o700)


KILLED_SAVE = textwrap.dedent(
    """
    import os, re, sys, time
    import numpy as np
    from jobrun import store

    where, pause_at = sys.argv[1], sys.argv[2]
    store.save({"w": np.zeros(10)}, {"epoch": 0}, where, "n", 0)
    real_fsync = os.fsync

    def pausing_fsync(fd):  # stop at one chosen fsync, for the parent to kill us there
        if re.search(pause_at, os.readlink(f"/proc/self/fd/{fd}")):
            print("paused", flush=True)
            time.sleep(60)
        real_fsync(fd)

    os.fsync = pausing_fsync
    big = np.random.default_rng(0).random(6_500_000)  # ~50 MB
    store.save({"w": big, "more": [big[:10]]}, {"epoch": 1}, where, "n", 1)
    print("done", flush=True)
    """
)

KILL_POINTS = {
    "data written, not synced": r"/tensors\.safetensors$",
    "renamed, no COMMIT": r"/n\.1$",
    "COMMIT being written": r"/\.COMMIT\.tmp-",
}


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc")
@pytest.mark.parametrize("point", list(KILL_POINTS))
def test_sigkill_during_save(tmp_path: Path, point: str) -> None:
    script = tmp_path / "save.py"
    script.write_text(KILLED_SAVE)
    ckpt = tmp_path / "ckpt"
    args = [sys.executable, str(script), str(ckpt), KILL_POINTS[point]]
    child = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "paused"
        child.send_signal(signal.SIGKILL)
    finally:
        child.wait(timeout=HANG_S)
    assert child.returncode == -signal.SIGKILL

    assert ck.verify(ckpt, "n", 0) == []
    assert ck.verify(ckpt, "n", 1)  # never reported valid
    with pytest.raises(CheckpointError):
        ck.load(ckpt, "n", 1)
    latest, skipped = ck.latest_complete_epoch(ckpt, ["n"], 1)
    assert latest == 0 and [e for e, _ in skipped] == [1]
    assert [i.epoch for i in ck.list_checkpoints(ckpt) if i.ok] == [0]
    # The next save of that epoch goes through despite the debris.
    ck.save({"w": np.ones(3)}, {}, ckpt, "n", 1)
    assert ck.latest_complete_epoch(ckpt, ["n"], 1) == (1, [])
    assert np.array_equal(ck.load(ckpt, "n", 1, as_numpy=True)[0]["w"], np.ones(3))


# -------------------------------------------------------------------- names


BAD_NODES = ["../x", "a/b", "..", ".hidden", "a..b", "", "x" * 65, "-x", "a b", "n\x00", 3, None]


@pytest.mark.parametrize("node", BAD_NODES, ids=repr)
def test_node_names_that_could_escape_are_refused(tmp_path: Path, node: Any) -> None:
    with pytest.raises(CheckpointError, match="bad node name"):
        ck.save({"a": 1}, {}, tmp_path, node, 0)
    with pytest.raises(CheckpointError, match="bad node name"):
        ck.load(tmp_path, node, 0)
    with pytest.raises(CheckpointError, match="bad node name"):
        ck.verify(tmp_path, node, 0)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("epoch", [-1, True, 1.5, "3", None], ids=repr)
def test_bad_epochs_are_refused(tmp_path: Path, epoch: Any) -> None:
    with pytest.raises(CheckpointError, match="epoch"):
        ck.save({"a": 1}, {}, tmp_path, "n", epoch)
    with pytest.raises(CheckpointError, match="epoch"):
        ck.load(tmp_path, "n", epoch)


def test_bad_ranks_are_refused(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="rank"):
        ck.save({"a": 1}, {}, tmp_path, "n", 0, rank=2, world_size=2)
    with pytest.raises(CheckpointError, match="rank"):
        ck.save({"a": 1}, {}, tmp_path, "n", 0, rank=-1)


# -------------------------------------------------------------------- listing, pruning, upload


def test_list_checkpoints(tmp_path: Path) -> None:
    assert ck.list_checkpoints(tmp_path / "nothing") == []
    for e in (0, 1, 10):
        ck.save({"w": torch.ones(4)}, {}, tmp_path, "a", e)
        ck.save({"w": torch.ones(2)}, {}, tmp_path, "b.x", e)
    (tmp_path / "b.x.10" / "rank-0" / "COMMIT").unlink()
    (tmp_path / "not-a-checkpoint").mkdir()
    (tmp_path / "a.01").mkdir()  # not a canonical epoch number
    infos = ck.list_checkpoints(tmp_path)
    assert [i.epoch for i in infos] == [0, 1, 10]
    assert list(infos[0].nodes) == ["a", "b.x"]
    a0 = infos[0].nodes["a"]
    assert a0.ranks == [0] and a0.world_size == 1 and a0.ok and a0.problem is None
    assert a0.bytes == sum(p.stat().st_size for p in (tmp_path / "a.0" / "rank-0").iterdir())
    assert a0.created is not None and a0.seconds is not None
    assert infos[2].nodes["a"].ok and not infos[2].nodes["b.x"].ok and not infos[2].ok
    latest, skipped = ck.latest_complete_epoch(tmp_path, ["a", "b.x"], 1)
    assert latest == 1 and skipped == [(10, skipped[0][1])] and "b.x" in skipped[0][1]
    assert ck.latest_complete_epoch(tmp_path, ["a"], 1) == (10, [])
    assert ck.latest_complete_epoch(tmp_path, ["zzz"], 1) == (None, [])


def test_prune_keeps_the_newest_complete_epochs(tmp_path: Path) -> None:
    for e in range(6):
        ck.save({"e": e}, {}, tmp_path, "a", e)
        ck.save({"e": e}, {}, tmp_path, "b", e)
    (tmp_path / "b.5" / "rank-0" / "COMMIT").unlink()  # epoch 5 is incomplete
    removed = ck.prune(tmp_path, 2, ["a", "b"])
    assert removed == [0, 1, 2]
    assert [i.epoch for i in ck.list_checkpoints(tmp_path)] == [3, 4, 5]
    assert ck.latest_complete_epoch(tmp_path, ["a", "b"], 1)[0] == 4
    assert ck.prune(tmp_path, 2, ["a", "b"]) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.3", "a.4", "a.5", "b.3", "b.4", "b.5"]
    with pytest.raises(CheckpointError, match="keep"):
        ck.prune(tmp_path, 0, ["a"])


def test_a_host_holding_one_rank_of_each_epoch_prunes_what_every_rank_saved(tmp_path: Path) -> None:
    # A host without a shared disk: rank 1 of a 2-rank job saved here, rank 0 elsewhere.
    for e in range(4):
        ck.save({"e": e}, {}, tmp_path, "n", e, rank=1, world_size=2)
    (tmp_path / "n.3" / "rank-1" / "COMMIT").unlink()  # rank 1's save of epoch 3 died
    assert ck.complete_epochs(tmp_path, ["n"]) == []  # rank 0's files are not here
    assert ck.prune(tmp_path, 1, ["n"]) == []  # so on its own it deletes nothing
    assert ck.saved_by(tmp_path, ["n"], 1, 2) == [0, 1, 2]
    assert ck.saved_by(tmp_path, ["n"], 0, 2) == []  # not rank 0's
    assert ck.saved_by(tmp_path, ["n"], 1, 3) == []  # saved by 2 ranks, not 3
    # The ranks together: rank 0 saved epochs 0-3, rank 1 epochs 0-2.
    complete = {0, 1, 2, 3} & set(ck.saved_by(tmp_path, ["n"], 1, 2))
    assert ck.prunable(tmp_path, 2, ["n"], complete=complete) == [0]
    assert ck.prunable(tmp_path, 1, ["n"], protect=[0], complete=complete) == [1]
    ck.delete_epochs(tmp_path, ["n"], [0, 1, 7])  # epoch 7 is not here: nothing to do
    assert sorted(p.name for p in tmp_path.iterdir()) == ["n.2", "n.3"]


@pytest.mark.parametrize("other", ["prune", "clean"])
def test_a_rank_writing_while_rank_0_prunes_or_cleans_keeps_its_save(tmp_path: Path, monkeypatch,
                                                                      other: str) -> None:
    # Rank 0 prunes (and cleans) while rank 1 is still writing the same epoch: seen as a
    # kill -9 + restart leaving epochs with rank 1 missing. Here rank 1 is this process and
    # rank 0 another one, which runs in the middle of rank 1's COMMIT.
    for e in range(3):
        for r in (0, 1):
            ck.save({"e": e}, {}, tmp_path, "n", e, rank=r, world_size=2)
    ck.save({"e": 3}, {}, tmp_path, "n", 3, rank=0, world_size=2)
    call = {"prune": f"store.prune({str(tmp_path)!r}, 1, ['n'])", "clean": f"store.clean({str(tmp_path)!r})"}
    write = files._write_file
    seen = []

    def commit_with_rank_0_busy(path: Path, data: bytes) -> int:
        n = write(path, data)
        if path.name.startswith(".COMMIT.tmp"):
            seen.append(path.name)
            subprocess.run([sys.executable, "-c", f"from jobrun import store; {call[other]}"], check=True)
        return n

    monkeypatch.setattr(files, "_write_file", commit_with_rank_0_busy)
    ck.save({"e": 3}, {}, tmp_path, "n", 3, rank=1, world_size=2)
    assert seen and seen[0].startswith(f".COMMIT.tmp-{os.getpid()}-")  # its writer's pid
    assert ck.verify(tmp_path, "n", 3) == []
    assert ck.latest_complete_epoch(tmp_path, ["n"], 2)[0] == 3


def test_prune_leaves_the_files_in_epochs_it_keeps_alone(tmp_path: Path) -> None:
    # What killed saves left inside epochs is for `clean` (before workers start), not for
    # a prune, which runs while other ranks write.
    for e in range(3):
        ck.save({"e": e}, {}, tmp_path, "n", e)
    dead = 2**22 + 12345  # above any pid_max: no such process
    left = tmp_path / "n.2" / f".tmp-rank-1-{dead}-deadbeef"
    left.mkdir()
    (tmp_path / ".deleting-n.0-0badf00d").mkdir()  # a prune killed before its rmtree
    assert ck.prune(tmp_path, 1, ["n"]) == [0, 1]
    assert left.is_dir() and not (tmp_path / ".deleting-n.0-0badf00d").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["n.2"]
    assert ck.clean(tmp_path) == [f"n.2/.tmp-rank-1-{dead}-deadbeef"]


def test_upload(tmp_path: Path) -> None:
    ckpt, dest = tmp_path / "ckpt", tmp_path / "exported"
    for r in range(2):
        ck.save({"r": r, "w": torch.full((3,), 1.0 + r)}, {}, ckpt, "n", 4, rank=r, world_size=2)
    out = ck.upload(ckpt, "n", 4, dest)
    assert out == dest / "n" and sorted(p.name for p in out.iterdir()) == ["rank-0", "rank-1"]
    assert ck.verify_dir(out / "rank-1") == []
    blobs, _ = ck.load_dir(out / "rank-1")
    assert blobs["r"] == 1 and torch.equal(blobs["w"], torch.full((3,), 2.0))
    ck.save({"r": 9}, {}, ckpt, "n", 5)
    ck.upload(ckpt, "n", 5, dest)  # replaces the previous upload atomically
    assert sorted(p.name for p in (dest / "n").iterdir()) == ["rank-0"]
    assert ck.load_dir(dest / "n" / "rank-0")[0] == {"r": 9}
    assert hidden_entries(dest) == []
    (ckpt / "n.4" / "rank-0" / "COMMIT").unlink()
    with pytest.raises(CheckpointError, match="cannot upload n.4"):
        ck.upload(ckpt, "n", 4, dest)
    with pytest.raises(CheckpointError, match="bad node name"):
        ck.upload(ckpt, "../n", 4, dest)


# -------------------------------------------------------------------- no torch for inspection


def test_list_verify_and_numpy_load_do_not_import_torch(tmp_path: Path) -> None:
    ck.save(workspace(), {"loss": 1.0}, tmp_path, "n", 0)
    code = textwrap.dedent(
        f"""
        import sys
        from jobrun import store as ck
        where = {str(tmp_path)!r}
        assert [i.epoch for i in ck.list_checkpoints(where)] == [0]
        assert ck.verify(where, "n", 0) == []
        assert ck.latest_complete_epoch(where, ["n"], 1) == (0, [])
        blobs, meta = ck.load(where, "n", 0, as_numpy=True)
        assert meta == {{"loss": 1.0}} and blobs["step"] == 10
        assert blobs["model"].state["weight"].shape == (3, 4)
        assert "torch" not in sys.modules, "torch was imported"
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_an_epoch_saved_again_by_fewer_ranks_drops_the_others(tmp_path: Path) -> None:
    # resume --replicas 1 of a 2-rank run saves epoch 2 again: rank 1's old files would
    # make the epoch a mix of two checkpoints (the ranks' world sizes disagree).
    for r in (0, 1):
        ck.save({"w": np.full(3, float(r))}, {}, tmp_path, "n", 2, rank=r, world_size=2)
    assert ck.verify(tmp_path, "n", 2) == []
    ck.save({"w": np.zeros(3)}, {}, tmp_path, "n", 2, rank=0, world_size=1)
    assert sorted(p.name for p in (tmp_path / "n.2").iterdir()) == ["rank-0"]
    assert ck.verify(tmp_path, "n", 2) == []
    assert ck.latest_complete_epoch(tmp_path, ["n"], 1)[0] == 2


def test_a_prune_killed_midway_leaves_what_the_next_clean_removes(tmp_path: Path, monkeypatch) -> None:
    """A rank directory is jobrun's while its manifest is there: deleted first (files in
    name order), a kill after it left the tensor file for good, no longer recognised. The
    manifest goes last now, so what a kill leaves is removed by the next clean."""
    import jobrun.safedel as safedel

    ck.save({"w": np.zeros(1000, dtype=np.float32)}, {}, tmp_path, "a", 1)
    ck.save({"w": np.zeros(10, dtype=np.float32)}, {}, tmp_path, "a", 2)
    real = os.unlink
    calls = []

    def killed_after_two(name, *a, **kw):
        if len(calls) == 2:
            raise KeyboardInterrupt  # the process dies here
        calls.append(name)
        return real(name, *a, **kw)

    monkeypatch.setattr(safedel.os, "unlink", killed_after_two)
    with pytest.raises(KeyboardInterrupt):
        ck.delete_epochs(tmp_path, ["a"], [1])
    monkeypatch.setattr(safedel.os, "unlink", real)
    assert calls == ["COMMIT", "tensors.safetensors"]  # MANIFEST.json would have gone second
    (left,) = [p for p in tmp_path.iterdir() if p.name.startswith(".deleting-")]
    removed = ck.clean(tmp_path)
    assert left.name in removed and not left.exists()
    assert [i.epoch for i in ck.list_checkpoints(tmp_path)] == [2]


def test_every_file_of_a_checkpoint_gets_the_mode_the_umask_gives(tmp_path: Path) -> None:
    """safetensors makes its file 0600 whatever the umask: another account could read a
    checkpoint's other files but not its tensors, and called every epoch DAMAGED."""
    old = os.umask(0o022)
    try:
        ck.save({"w": np.ones(4, dtype=np.float32)}, {}, tmp_path, "a", 1)
        os.umask(0o027)
        ck.save({"w": np.ones(4, dtype=np.float32)}, {}, tmp_path, "a", 2)
    finally:
        os.umask(old)
    for epoch, want in ((1, 0o644), (2, 0o640)):
        rdir = tmp_path / f"a.{epoch}" / "rank-0"
        modes = {p.name: p.stat().st_mode & 0o777 for p in rdir.iterdir()}
        assert modes["tensors.safetensors"] == want and set(modes.values()) == {want}, modes


def test_a_checkpoint_pruned_while_it_is_read_is_one_message(tmp_path: Path, monkeypatch) -> None:
    """`ckpt list` of a running job reads epochs the job may prune meanwhile. A tensor
    file gone between the library's open and torch's mapping of it raised "RuntimeError:
    unable to open file <...> in read-only mode: No such file or directory (2)", a
    traceback; now one CheckpointError."""
    import safetensors


    ck.save({"w": np.ones(4, dtype=np.float32)}, {}, tmp_path, "a", 1)
    rdir = tmp_path / "a.1" / "rank-0"
    opened = safetensors.safe_open

    def pruned_meanwhile(path, framework):
        opened(path, framework=framework)
        Path(path).unlink()
        raise RuntimeError(f"unable to open file <{path}> in read-only mode: No such file or directory (2)")

    monkeypatch.setattr(safetensors, "safe_open", pruned_meanwhile)
    with pytest.raises(CheckpointError, match="cannot read .*no such file"):
        ck.load(tmp_path, "a", 1, blobs=["w"])
    assert not (rdir / "tensors.safetensors").exists()


def test_a_signal_while_waiting_for_a_background_write_is_raised_once_it_is_done() -> None:
    """A second Ctrl-C while the run waited for its async save ended the process in the
    middle of the write: "FATAL: exception not rethrown", SIGABRT, the epoch half written."""
    import threading

    from jobrun.runner.saves import Writer

    class Stop(Exception):
        pass

    def stop(signum, frame):
        raise Stop

    done = threading.Event()
    old = signal.signal(signal.SIGUSR2, stop)
    try:
        writer = Writer(3, lambda: (time.sleep(0.5), done.set()))
        threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGUSR2)).start()
        with pytest.raises(Stop):
            writer.wait()
        assert done.is_set()
    finally:
        signal.signal(signal.SIGUSR2, old)
