"""The tensors file: safetensors, written and parsed by the reference library; checksummed by us.

The file format, and the parsing of headers that may be damaged or hostile, belong to the
``safetensors`` package. What is ours is the checksum that the manifest keeps of every
file: a CRC-32 (zlib) of every ``chunk`` bytes. It guards against torn writes and damaged
disks, not against tampering (whoever can change a file can rewrite the manifest beside
it), and CRC-32 is what lets a verified load keep up with ``torch.load``, which checks
nothing.

Reading the tensors with torch maps the file (the library's default; copy-on-write, so
changing a tensor never changes the file, and a deleted file's space is freed when its
tensors are): the checksum is computed on the mapped bytes the tensors are made of, so
what was checked is what is used. Reading them as numpy (``jobrun ckpt show``, which
must not import torch) reads the file into memory once, checksums it and hands the
bytes to the library.
"""

from __future__ import annotations

import errno
import os
import re
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from jobrun import safefs

_READ = 4 << 20  # the buffer of a checksum read

# numpy dtypes of the safetensors dtypes (numpy has no bfloat16 or float8: their raw bits).
_NUMPY = {
    "BOOL": "|b1", "U8": "|u1", "I8": "|i1", "U16": "<u2", "I16": "<i2", "F16": "<f2",
    "BF16": "<u2", "U32": "<u4", "I32": "<i4", "F32": "<f4", "U64": "<u8", "I64": "<i8",
    "F64": "<f8", "C64": "<c8", "F8_E4M3": "|u1", "F8_E5M2": "|u1", "F8_E4M3FNUZ": "|u1",
    "F8_E5M2FNUZ": "|u1",
}


class Checksums:
    """The CRC-32 of every ``chunk`` bytes of one file, fed the file's bytes in order."""

    def __init__(self, chunk: int) -> None:
        self.chunk = chunk
        self._done: list[str] = []
        self._crc = 0
        self._filled = 0  # bytes of the current chunk seen

    def update(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        while view:
            n = min(len(view), self.chunk - self._filled)
            self._crc = zlib.crc32(view[:n], self._crc)
            self._filled += n
            view = view[n:]
            if self._filled == self.chunk:
                self._done.append(f"{self._crc:08x}")
                self._crc = self._filled = 0

    def digests(self) -> list[str]:
        """One per chunk begun; an empty file has one (of no bytes)."""
        if self._filled or not self._done:
            return [*self._done, f"{self._crc:08x}"]
        return list(self._done)


def checksum_file(path: Path, chunk: int) -> list[str]:
    """The checksums of a file, read from its start to its end."""
    sums = Checksums(chunk)
    buf = memoryview(bytearray(_READ))
    with os.fdopen(safefs.open_read(path), "rb", buffering=0) as f:  # regular files only
        while n := f.readinto(buf):
            sums.update(buf[:n])
    return sums.digests()


def checksum_bytes(data: bytes, chunk: int) -> list[str]:
    sums = Checksums(chunk)
    sums.update(data)
    return sums.digests()


def _save_file(tensors: dict[str, Any], path: Path) -> None:
    import safetensors.torch

    safetensors.torch.save_file(tensors, path)
    # The library makes the file 0600 whatever the umask; every other file of a
    # checkpoint gets 0666 less the umask, and so must this one: another account (a
    # colleague's evaluation) found every epoch "DAMAGED: Permission denied".
    os.chmod(path, 0o666 & ~_umask())


def _umask() -> int:
    """The process's umask, read without changing it (Linux); else set and put back."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write(path: Path, tensors: dict[str, Any], chunk: int) -> tuple[int, list[str]]:
    """Write CPU tensors and numpy arrays as a safetensors file and fsync it; (size, checksums).

    The checksums are computed on the file read back (from the page cache) while the disk
    syncs it: the two wait on different things, and the checksums vouch for the file, not
    for what we meant to write. A failure raises OSError.
    """
    from safetensors import SafetensorError

    try:
        _save_file(distinct(tensors), path)
    except SafetensorError as e:
        raise _os_error(e, path) from e
    fd = os.open(path, os.O_RDONLY)
    try:
        with ThreadPoolExecutor(1, "jobrun-fsync") as pool:
            synced = pool.submit(os.fsync, fd)
            digests = checksum_file(path, chunk)
            synced.result()
        return os.fstat(fd).st_size, digests
    finally:
        os.close(fd)


def distinct(tensors: dict[str, Any]) -> dict[str, Any]:
    """torch tensors with memory of their own: numpy arrays are wrapped (no copy); a tensor
    whose memory another one already uses (tied weights, views of one tensor), which the
    library refuses to write, is copied."""
    import torch

    seen: set[int] = set()
    out: dict[str, Any] = {}
    for name, t in tensors.items():
        t = torch.from_numpy(t) if isinstance(t, np.ndarray) else t
        ptr = t.untyped_storage().data_ptr()
        if t.numel() and ptr in seen:
            t = t.clone()
        seen.add(ptr)
        out[name] = t
    return out


def _os_error(e: Exception, path: Path) -> OSError:
    """The OSError the library met (it reports it as text: "... (os error 28) ...")."""
    m = re.search(r"os error (\d+)", str(e))
    if m is None:
        return OSError(errno.EIO, f"safetensors: {e}", str(path))
    code = int(m.group(1))
    return OSError(code, os.strerror(code), str(path))


def read(path: Path, *, as_numpy: bool, sums: Checksums | None = None) -> dict[str, Any]:
    """The tensors of a safetensors file (CPU torch tensors, or numpy arrays), every byte of
    the file fed to ``sums`` in order on the way. A file the library cannot parse raises its
    SafetensorError."""
    if as_numpy:
        import safetensors

        with os.fdopen(safefs.open_read(path), "rb") as f:  # regular files only, no link
            data = f.read()
        if sums is not None:
            sums.update(data)
        return {name: _numpy(name, info) for name, info in safetensors.deserialize(data)}
    import torch
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.offset_keys()}
    if sums is not None:
        # The library has checked that the tensors, in the order of their offsets, fill the
        # file after the header with no gap: header + their bytes are the whole file.
        with os.fdopen(safefs.open_read(path), "rb") as f:
            head = f.read(8)
            sums.update(head)
            sums.update(f.read(int.from_bytes(head, "little")))
        for t in tensors.values():
            sums.update(t.reshape(-1).view(torch.uint8).numpy())
    return tensors


def _numpy(name: str, info: dict[str, Any]) -> np.ndarray:
    code = info["dtype"]
    if code not in _NUMPY:
        raise ValueError(f"tensor {name!r} has dtype {code}, which jobrun does not write")
    return np.frombuffer(info["data"], dtype=_NUMPY[code]).reshape(info["shape"])


class Lazy:
    """The tensors of a safetensors file, each read when asked for (a few blobs of a big
    checkpoint, e.g. its random state). Unchecked: the caller verifies the file first."""

    def __init__(self, path: Path, *, as_numpy: bool) -> None:
        from safetensors import safe_open

        try:
            self._file = safe_open(path, framework="np" if as_numpy else "pt")
        except RuntimeError as e:  # the library's "unable to open file": gone (a prune), unreadable
            if not os.access(path, os.R_OK):
                raise OSError(errno.ENOENT if not path.exists() else errno.EACCES,
                              "no such file" if not path.exists() else "permission denied",
                              str(path)) from e
            raise
        self._keys = set(self._file.keys())

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __getitem__(self, key: str) -> Any:
        return self._file.get_tensor(key)
