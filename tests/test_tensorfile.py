"""The tensors file: written and parsed by the safetensors library; our checksums of it."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import SafetensorError

from jobrun.store import tensorfile

DTYPES = [
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint16,
    torch.uint32, torch.uint64, torch.float16, torch.bfloat16, torch.float32, torch.float64,
    torch.complex64, torch.float8_e4m3fn, torch.float8_e5m2,
]


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


def _bits(t: torch.Tensor) -> bytes:
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


def crcs(data: bytes, chunk: int) -> list[str]:
    return [f"{zlib.crc32(data[i : i + chunk]):08x}" for i in range(0, max(len(data), 1), chunk)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (5,), (3, 4)], ids=str)
def test_every_dtype_and_shape_comes_back_with_torch_and_numpy(tmp_path: Path, dtype, shape):
    t = _sample(dtype, shape)
    path = tmp_path / "t.safetensors"
    size, digests = tensorfile.write(path, {"x": t, "pad": torch.ones(3, dtype=torch.int8)}, 64)
    assert size == path.stat().st_size and digests == crcs(path.read_bytes(), 64)
    for as_numpy in (False, True):
        sums = tensorfile.Checksums(64)
        back = tensorfile.read(path, as_numpy=as_numpy, sums=sums)
        assert sums.digests() == digests  # every byte of the file, once
        x = back["x"]
        assert tuple(x.shape) == shape
        got = x.tobytes() if as_numpy else _bits(x)
        assert got == _bits(t)
        if not as_numpy:
            assert x.dtype == dtype
    raw = tensorfile.read(path, as_numpy=True)["x"].dtype
    assert raw == {torch.bfloat16: np.uint16, torch.float8_e4m3fn: np.uint8,
                   torch.float8_e5m2: np.uint8}.get(dtype, raw)  # numpy has no such dtypes


@pytest.mark.parametrize("chunk", [1, 7, 4096, 1 << 20], ids=str)
def test_checksums_are_one_crc32_per_chunk_however_the_bytes_come(chunk: int) -> None:
    rng = np.random.default_rng(0)
    sizes = [0, 3, 5000, 1, 3 << 20, 17, 4096, 9] if chunk > 100 else [0, 3, 50, 1, 9]
    pieces = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in sizes]
    sums = tensorfile.Checksums(chunk)
    for piece in pieces:
        sums.update(piece)
    data = b"".join(pieces)
    assert sums.digests() == crcs(data, chunk) == tensorfile.checksum_bytes(data, chunk)
    assert tensorfile.Checksums(chunk).digests() == [f"{zlib.crc32(b''):08x}"]  # empty file


def test_numpy_arrays_are_written_without_torch_types(tmp_path: Path) -> None:
    arrays = {"f": np.linspace(0, 1, 7, dtype=np.float32), "u": np.arange(4, dtype=np.uint16),
              "b": np.array([True, False])}
    path = tmp_path / "n.safetensors"
    tensorfile.write(path, arrays, 1 << 20)
    back = tensorfile.read(path, as_numpy=True)
    assert all(np.array_equal(back[k], v) and back[k].dtype == v.dtype for k, v in arrays.items())


BAD_FILES = {
    "too short": b"\x01\x02",
    "header past end": struct.pack("<Q", 1000) + b"{}",
    "not json": struct.pack("<Q", 5) + b"{nope",
    "offsets past data": struct.pack("<Q", 54)
    + b'{"a":{"dtype":"U8","shape":[8],"data_offsets":[0,8]}}' + b"\0" * 4,
}


@pytest.mark.parametrize("as_numpy", [False, True])
@pytest.mark.parametrize("case", list(BAD_FILES))
def test_files_the_library_cannot_parse_are_refused(tmp_path: Path, case: str, as_numpy) -> None:
    path = tmp_path / "bad.safetensors"
    path.write_bytes(BAD_FILES[case])
    with pytest.raises(SafetensorError):
        tensorfile.read(path, as_numpy=as_numpy, sums=tensorfile.Checksums(64))
