"""Our safetensors reader and writer: format, round trips, interop, strict validation."""

from __future__ import annotations

import hashlib
import io
import json
import struct
import subprocess
import sys
import textwrap
import threading
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from jobrun.errors import CheckpointError
from jobrun.runner import safetensors_io as sio
from jobrun.runner.safetensors_io import (
    ChunkHasher,
    Crc32,
    prefault,
    read_header,
    read_safetensors,
    write_safetensors,
)


def _sample(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    n = int(np.prod(shape)) if shape else 1
    if dtype == torch.bool:
        flat = torch.rand(n, generator=g) > 0.5
    elif dtype.is_complex:
        flat = torch.randn(n, dtype=dtype, generator=g)
    elif dtype.is_floating_point:
        flat = (torch.randn(n, generator=g) * 10).to(dtype)
    else:
        flat = torch.randint(0, 100, (n,), generator=g).to(dtype)
    return flat.reshape(shape)


DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    # float8 has no equality kernel everywhere: compare the bits.
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.element_size() == 1 and a.dtype not in (torch.bool, torch.uint8, torch.int8):
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return torch.equal(a, b)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (5,), (3, 4)], ids=str)
def test_round_trip_every_dtype_and_shape(tmp_path: Path, dtype, shape) -> None:
    t = _sample(dtype, shape)
    path = tmp_path / "t.safetensors"
    write_safetensors(path, {"x": t, "pad": torch.ones(3, dtype=torch.int8)})
    back = read_safetensors(path)
    assert _same(back["x"], t)
    assert torch.equal(back["pad"], torch.ones(3, dtype=torch.int8))


def test_file_layout_follows_the_spec(tmp_path: Path) -> None:
    tensors = {
        "b": torch.arange(3, dtype=torch.int8),
        "a": torch.arange(6, dtype=torch.float32).reshape(2, 3),
        "c": torch.tensor(1.5, dtype=torch.float64),
    }
    path = tmp_path / "t.safetensors"
    n = write_safetensors(path, tensors, {"k": "v"})
    raw = path.read_bytes()
    assert n == len(raw)
    (hlen,) = struct.unpack("<Q", raw[:8])
    assert hlen % 8 == 0  # data starts 8-aligned
    text = raw[8 : 8 + hlen].decode()
    assert text == text.rstrip() + " " * (len(text) - len(text.rstrip()))  # space padding
    header = json.loads(text)
    assert list(header) == ["__metadata__", "a", "b", "c"]  # keys sorted
    assert header["__metadata__"] == {"k": "v"}
    assert header["a"] == {
        "dtype": "F32",
        "shape": [2, 3],
        "data_offsets": header["a"]["data_offsets"],
    }
    data = raw[8 + hlen :]
    for name, t in tensors.items():
        begin, end = header[name]["data_offsets"]
        assert begin % t.element_size() == 0  # aligned for in-place views
        assert data[begin:end] == t.numpy().astype(t.numpy().dtype.newbyteorder("<")).tobytes()
    assert read_header(path) == header


def test_hasher_sees_exactly_the_bytes_written(tmp_path: Path) -> None:
    tensors = {f"small{i}": torch.randn(10) for i in range(50)}
    tensors["big"] = torch.randn(600_000)  # > 1 MiB: written straight from memory
    h = hashlib.sha256()
    path = tmp_path / "t.safetensors"
    n = write_safetensors(path, tensors, hasher=h)
    assert n == path.stat().st_size
    assert h.hexdigest() == hashlib.sha256(path.read_bytes()).hexdigest()
    h2 = hashlib.sha256()
    back = read_safetensors(path, hasher=h2)
    assert h2.hexdigest() == h.hexdigest()
    assert all(torch.equal(back[k], v) for k, v in tensors.items())


def digest(algo: str, data: bytes) -> str:
    return f"{zlib.crc32(data):08x}" if algo == "crc32" else hashlib.sha256(data).hexdigest()


@pytest.mark.parametrize("algo", ["crc32", "sha256"])
@pytest.mark.parametrize("chunk", [1, 7, 4096, 1 << 20, None], ids=str)
def test_chunk_hasher_digests_each_chunk(chunk: int | None, algo: str) -> None:
    rng = np.random.default_rng(0)
    sizes = [0, 3, 5000, 1, 3 << 20, 17, 2 << 20, 4096, 9]  # small and big pieces
    if chunk is not None and chunk < 100:
        sizes = [0, 3, 50, 1, 9]  # a digest every few bytes: keep it short
    pieces = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in sizes]
    data = b"".join(pieces)
    hasher = ChunkHasher(chunk, lanes=3, algo=algo)
    for piece in pieces:
        hasher.update(piece)
    step = chunk or len(data)
    expected = [digest(algo, data[i : i + step]) for i in range(0, len(data), step)]
    assert hasher.finish() == expected and hasher.finish() == expected
    assert ChunkHasher(chunk, algo=algo).finish() == [digest(algo, b"")]  # empty stream


def test_chunk_hasher_abort_leaves_no_thread_behind() -> None:
    import threading

    hasher = ChunkHasher(1 << 20, lanes=2)
    for _ in range(8):
        hasher.update(bytes(2 << 20))  # queued on both lanes
    hasher.abort()
    assert not [t for t in threading.enumerate() if t.name.startswith("jobrun-hash")]


def test_chunk_hasher_feeds_a_given_hashlib_object() -> None:
    outer = hashlib.sha256()
    hasher = ChunkHasher(hasher=outer)
    hasher.update(b"a" * (3 << 20))
    hasher.update(b"b")
    assert hasher.finish() == [outer.hexdigest()]
    assert outer.hexdigest() == hashlib.sha256(b"a" * (3 << 20) + b"b").hexdigest()


def test_chunk_digests_of_a_file_read_and_written(tmp_path: Path) -> None:
    tensors = {"big": torch.randn(700_000), "small": torch.arange(5)}
    path = tmp_path / "t.safetensors"
    wrote = ChunkHasher(1 << 20)
    write_safetensors(path, tensors, hasher=wrote)
    data = path.read_bytes()
    starts = range(0, len(data), 1 << 20)
    expected = [hashlib.sha256(data[i : i + (1 << 20)]).hexdigest() for i in starts]
    assert len(expected) == 3 and wrote.finish() == expected
    read = ChunkHasher(1 << 20)
    back = read_safetensors(path, hasher=read)
    assert read.finish() == expected and torch.equal(back["big"], tensors["big"])


def test_crc32_is_zlibs_incrementally() -> None:
    h = Crc32()
    assert h.hexdigest() == "00000000"
    h.update(b"123456789")
    assert h.hexdigest() == "cbf43926"  # the CRC-32 check value
    h.update(memoryview(b"x" * 10_000))
    assert h.value == zlib.crc32(b"123456789" + b"x" * 10_000)


@pytest.mark.parametrize("lanes", [1, 2, 3, 8])
@pytest.mark.parametrize("chunk", [1000, 1 << 16, None], ids=str)
def test_parallel_reads_give_the_bytes_and_the_digest_of_every_chunk(
    tmp_path: Path, monkeypatch, lanes: int, chunk: int | None
) -> None:
    monkeypatch.setattr(sio, "io_lanes", lambda: lanes)
    monkeypatch.setattr(sio, "_SLICE", 4096)  # many slices per chunk and per tensor
    tensors = {f"t{i}": _sample(torch.float32, (1 + 997 * i,)) for i in range(12)}
    tensors |= {"b": _sample(torch.bool, (333,)), "e": torch.empty(0), "h": _sample(torch.float16, (7,))}
    path = tmp_path / "t.safetensors"
    write_safetensors(path, tensors)
    data = path.read_bytes()
    hasher = ChunkHasher(chunk, algo="crc32")
    back = read_safetensors(path, hasher=hasher)
    assert list(back) == sorted(tensors)
    assert all(torch.equal(back[k], v) and back[k].dtype == v.dtype for k, v in tensors.items())
    step = chunk or len(data)
    assert hasher.finish() == [f"{zlib.crc32(data[i : i + step]):08x}" for i in range(0, len(data), step)]
    unhashed = read_safetensors(data)  # from memory, units of _UNIT, no digests
    assert all(torch.equal(unhashed[k], v) for k, v in tensors.items())


def test_units_cover_the_file_and_lanes_take_even_contiguous_runs() -> None:
    mem = memoryview(bytearray(100))
    spans = [sio._Span(0, mem[:10], read=False), sio._Span(10, mem[10:13]), sio._Span(13, mem[13:100])]
    units = sio._cut(spans, 100, 16)
    assert len(units) == 7
    assert [[(s.at, len(s.view), s.read) for s in u] for u in units[:2]] == [
        [(0, 10, False), (10, 3, True), (13, 3, True)], [(16, 16, True)]]
    assert sum(len(s.view) for u in units for s in u) == 100
    sizes = [sum(len(s.view) for s in u) for u in units]
    assert sio.deal(sizes, 2) == [[0, 1, 2], [3, 4, 5, 6]]
    assert sio.deal(sizes, 3) == [[0, 1], [2, 3], [4, 5, 6]]  # 32, 32 and 36 bytes
    assert sio.deal(sizes[:1], 4) == [[0]] and sio.deal([0, 0], 2) == [[0, 1]]
    assert sio.deal([100, 1, 1, 1], 2) == [[0], [1, 2, 3]]


def test_a_file_replaced_or_cut_while_it_is_read(tmp_path: Path) -> None:
    path = tmp_path / "t.safetensors"
    write_safetensors(path, {"a": torch.randn(1000)})
    other = tmp_path / "o.safetensors"
    write_safetensors(other, {"a": torch.randn(1000)})
    src = sio._FileSource(path, other.stat(), str(path))  # as if renamed over meanwhile
    with pytest.raises(CheckpointError, match="replaced while it was being read"), src.reader():
        pass
    src = sio._FileSource(path, path.stat(), str(path))
    with src.reader() as pread, pytest.raises(CheckpointError, match="truncated while reading"):
        pread(memoryview(bytearray(100)), path.stat().st_size - 50)


def test_a_failing_lane_fails_the_read_and_leaves_no_thread(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(sio, "io_lanes", lambda: 3)
    path = tmp_path / "t.safetensors"
    write_safetensors(path, {"a": torch.randn(300_000)})
    real = sio._FileSource._pread
    calls = []

    def flaky(self, fd, view, at):  # the last stretch of the file cannot be read
        calls.append(at)
        if at > 1_000_000:
            raise OSError(5, "Input/output error")
        real(self, fd, view, at)

    monkeypatch.setattr(sio._FileSource, "_pread", flaky)
    monkeypatch.setattr(sio, "_UNIT", 1 << 16)
    with pytest.raises(CheckpointError, match="Input/output error"):
        read_safetensors(path)
    assert len(calls) > 3 and not [t for t in threading.enumerate() if t.name == "jobrun-io"]


def test_prefault_keeps_what_memory_holds() -> None:
    a = np.arange(1 << 20, dtype=np.int64)  # 8 MiB already written: must stay as it is
    prefault(memoryview(a.view(np.uint8)))
    assert np.array_equal(a, np.arange(1 << 20, dtype=np.int64))
    fresh = torch.empty(3 << 20, dtype=torch.uint8)
    prefault(fresh.numpy().data)  # new memory: backed at once, then filled as usual
    fresh.fill_(7)
    assert int(fresh.sum()) == 7 * (3 << 20)
    prefault(memoryview(b"x" * (2 << 20)))  # read-only memory: left alone


def test_every_tensor_owns_its_memory(tmp_path: Path) -> None:
    tensors = {"big": torch.randn(400_000), "s1": torch.randn(3), "s2": torch.randn(4)}
    path = tmp_path / "t.safetensors"
    write_safetensors(path, tensors)
    back = read_safetensors(path)
    for name, t in back.items():
        assert t.storage_offset() == 0, name
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size(), name
    back["s1"].add_(1)  # writable, plain CPU tensors
    assert torch.equal(back["s1"], tensors["s1"] + 1)
    assert torch.equal(back["s2"], tensors["s2"])


def test_file_objects_bytes_and_non_contiguous_inputs() -> None:
    t = torch.arange(12.0).reshape(3, 4).t()  # non-contiguous
    a = np.arange(6, dtype=">i4").reshape(2, 3)[:, ::2]  # big-endian and strided
    buf = io.BytesIO()
    n = write_safetensors(buf, {"t": t, "a": a})
    assert n == len(buf.getvalue())
    back = read_safetensors(buf.getvalue())
    assert torch.equal(back["t"], t)
    assert np.array_equal(back["a"].numpy(), a)
    arrays = read_safetensors(bytearray(buf.getvalue()), as_numpy=True)
    assert isinstance(arrays["a"], np.ndarray) and arrays["a"].dtype == np.dtype("<i4")
    assert np.array_equal(arrays["a"], a)


def test_as_numpy_gives_raw_bits_for_bfloat16(tmp_path: Path) -> None:
    t = torch.tensor([1.5, -2.0, 3.25], dtype=torch.bfloat16)
    path = tmp_path / "t.safetensors"
    write_safetensors(path, {"x": t, "y": torch.tensor([True, False])})
    out = read_safetensors(path, as_numpy=True)
    assert out["x"].dtype == np.uint16
    assert np.array_equal(out["x"], t.view(torch.int16).numpy().view(np.uint16))
    assert out["y"].dtype == np.bool_ and out["y"].tolist() == [True, False]


def test_as_numpy_does_not_import_torch(tmp_path: Path) -> None:
    path = tmp_path / "t.safetensors"
    write_safetensors(path, {"x": torch.randn(3), "h": torch.ones(2, dtype=torch.bfloat16)})
    code = textwrap.dedent(
        f"""
        import sys
        from jobrun.runner.safetensors_io import read_header, read_safetensors
        out = read_safetensors({str(path)!r}, as_numpy=True)
        assert out["x"].shape == (3,) and sorted(read_header({str(path)!r})) == ["h", "x"]
        assert "torch" not in sys.modules, "torch was imported"
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_bad_inputs_to_the_writer(tmp_path: Path) -> None:
    with pytest.raises(TypeError):
        write_safetensors(tmp_path / "x", {"a": [1, 2]})
    with pytest.raises(TypeError):
        write_safetensors(tmp_path / "x", {"a": np.array(["text"])})
    with pytest.raises(ValueError):
        write_safetensors(tmp_path / "x", {"__metadata__": torch.ones(1)})
    with pytest.raises(TypeError):
        write_safetensors(tmp_path / "x", {"a": torch.ones(1)}, metadata={"k": 1})


# -------------------------------------------------------------------- interop


def test_the_safetensors_package_reads_our_files(tmp_path: Path) -> None:
    st = pytest.importorskip("safetensors.torch")
    tensors = {str(d): _sample(d, (2, 3)) for d in DTYPES if d not in (torch.uint32, torch.uint64)}
    tensors["empty"] = torch.zeros(0, 4)
    tensors["scalar"] = torch.tensor(3.0, dtype=torch.bfloat16)
    path = tmp_path / "ours.safetensors"
    write_safetensors(path, tensors, {"producer": "jobrun"})
    theirs = st.load_file(str(path))
    assert set(theirs) == set(tensors)
    assert all(_same(theirs[k], v) for k, v in tensors.items())
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"producer": "jobrun"}


def test_we_read_files_of_the_safetensors_package(tmp_path: Path) -> None:
    st = pytest.importorskip("safetensors.torch")
    tensors = {
        "w": torch.randn(5, 7),
        "b16": torch.randn(3, dtype=torch.bfloat16),
        "mask": torch.tensor([True, False, True]),
        "i8": torch.arange(5, dtype=torch.int8),
        "i64": torch.arange(3),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0),
    }
    path = tmp_path / "theirs.safetensors"
    st.save_file(tensors, str(path), metadata={"format": "pt"})
    ours = read_safetensors(path)
    assert set(ours) == set(tensors)
    assert all(torch.equal(ours[k], v) and ours[k].dtype == v.dtype for k, v in tensors.items())
    assert read_header(path)["__metadata__"] == {"format": "pt"}
    # Their layout may leave tensors unaligned (the bool before the int64): still correct.
    arrays = read_safetensors(path, as_numpy=True)
    assert np.array_equal(arrays["i64"], np.arange(3))


def test_numpy_interop(tmp_path: Path) -> None:
    stn = pytest.importorskip("safetensors.numpy")
    arrays = {"f": np.linspace(0, 1, 7, dtype=np.float32), "u": np.arange(4, dtype=np.uint16)}
    path = tmp_path / "n.safetensors"
    stn.save_file(arrays, str(path))
    ours = read_safetensors(path, as_numpy=True)
    assert all(np.array_equal(ours[k], v) and ours[k].dtype == v.dtype for k, v in arrays.items())
    write_safetensors(path, arrays)
    theirs = stn.load_file(str(path))
    assert all(np.array_equal(theirs[k], v) for k, v in arrays.items())


# -------------------------------------------------------------------- validation


def _file(header: dict, data: bytes, *, raw_header: bytes | None = None) -> bytes:
    text = raw_header if raw_header is not None else json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


def _entry(dtype: str, shape: list, begin: int, end: int) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


BAD_FILES = {
    "too short": (b"\x01\x02", "shorter than"),
    "header past end": (struct.pack("<Q", 1000) + b"{}", "runs past the end"),
    "header over limit": (struct.pack("<Q", 2**40) + b"{}", "over the"),
    "not json": (_file({}, b"", raw_header=b"{nope"), "not valid JSON"),
    "not an object": (_file({}, b"", raw_header=b"[1]     "), "not a JSON object"),
    "not utf-8": (_file({}, b"", raw_header=b'{"\xff":1}'), "not UTF-8"),
    "duplicate key": (
        _file(
            {},
            b"\0" * 4,
            raw_header=b'{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},'
            b'"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}}',
        ),
        "duplicate",
    ),
    "unknown dtype": (_file({"a": _entry("F128", [1], 0, 16)}, b"\0" * 16), "unknown dtype"),
    "bad shape": (_file({"a": _entry("U8", [-1], 0, 1)}, b"\0"), "bad shape"),
    "huge empty shape": (_file({"a": _entry("U8", [0, 2**62, 4], 0, 0)}, b""), "too large"),
    "float shape": (_file({"a": _entry("U8", [1.0], 0, 1)}, b"\0"), "bad shape"),
    "bad offsets": (_file({"a": _entry("U8", [1], 1, 0)}, b"\0"), "outside"),
    "offsets past data": (_file({"a": _entry("U8", [8], 0, 8)}, b"\0" * 4), "outside"),
    "size mismatch": (_file({"a": _entry("F32", [3], 0, 8)}, b"\0" * 8), "12 expected"),
    "overlap": (
        _file({"a": _entry("U8", [4], 0, 4), "b": _entry("U8", [4], 2, 6)}, b"\0" * 6),
        "overlaps",
    ),
    "gap": (_file({"a": _entry("U8", [2], 2, 4)}, b"\0" * 4), "belong to no tensor"),
    "trailing bytes": (_file({"a": _entry("U8", [2], 0, 2)}, b"\0" * 5), "after the last"),
    "extra field": (
        _file({"a": {**_entry("U8", [1], 0, 1), "x": 1}}, b"\0"),
        "needs exactly",
    ),
    "bad metadata": (_file({"__metadata__": {"k": 1}}, b""), "__metadata__"),
    "bool not 0/1": (_file({"a": _entry("BOOL", [2], 0, 2)}, b"\x00\x07"), "bool"),
    "nan literal": (_file({}, b"", raw_header=b'{"__metadata__":NaN}'), "not valid JSON"),
}


@pytest.mark.parametrize("as_numpy", [False, True])
@pytest.mark.parametrize("case", list(BAD_FILES))
def test_corrupt_headers_are_refused_naming_the_file(tmp_path: Path, case: str, as_numpy) -> None:
    data, expected = BAD_FILES[case]
    path = tmp_path / "bad.safetensors"
    path.write_bytes(data)
    with pytest.raises(CheckpointError) as info:
        read_safetensors(path, as_numpy=as_numpy)
    assert str(path) in info.value.message
    assert expected in info.value.message
    assert info.value.hint


def test_truncated_file_and_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "t.safetensors"
    write_safetensors(path, {"x": torch.randn(100)})
    raw = path.read_bytes()
    path.write_bytes(raw[:-10])
    with pytest.raises(CheckpointError, match="truncated"):
        read_safetensors(path)
    with pytest.raises(CheckpointError, match="cannot read .*missing.safetensors"):
        read_safetensors(tmp_path / "missing.safetensors")
    with pytest.raises(CheckpointError, match="cannot read"):
        read_header(tmp_path / "missing.safetensors")
