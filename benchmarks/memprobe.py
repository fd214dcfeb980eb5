"""Memory probes: resident set size from /proc/self/status (Linux; no psutil).

``rss()`` is a plan function: ``call: {fn: "benchmarks.memprobe:rss", out: [rss_mb,
peak_mb]}`` gives the current and the peak resident set size of the job's process in
MB. ``python -m benchmarks.memprobe save-peak WIDTH DIR`` (a fresh process) measures the
peak added by a checkpoint save, a prepare(copy=True) + write, and a load, each after
resetting the peak (``/proc/self/clear_refs``), and prints them as JSON.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

_FIELD = re.compile(r"^(VmRSS|VmHWM):\s+(\d+)\s+kB", re.M)


def status_kb() -> dict[str, int]:
    text = Path("/proc/self/status").read_text()
    return {k: int(v) for k, v in _FIELD.findall(text)}


def rss() -> tuple[float, float]:
    """(live RSS, peak RSS since the last call) of this process, in MB.

    The live RSS is read after a garbage collection and after handing the allocator's
    free memory back to the system (glibc's malloc_trim), so that it counts memory in
    use, not what malloc keeps for later (which moves by tens of MB from one epoch to
    the next). The peak is then reset, so the next call gives the peak of its epoch.
    """
    import gc

    gc.collect()
    _malloc_trim()
    s = status_kb()
    reset_peak()
    return s["VmRSS"] / 1024, s["VmHWM"] / 1024


def _malloc_trim() -> None:
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: the figure is then the allocator's view


def reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False when not allowed."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def _added(fn) -> float:
    """Bytes the peak RSS rose above the RSS before ``fn`` ran."""
    import gc

    gc.collect()
    if not reset_peak():
        raise OSError("cannot reset the peak RSS (/proc/self/clear_refs)")
    # The peak just reset is the RSS at the reset: read before as that, not as the RSS a
    # moment earlier, which can be higher (pages freed in between made the figure -0.2 MB).
    before = status_kb()["VmHWM"]
    fn()
    # A peak cannot fall, but the kernel's RSS counters are approximate (batched per CPU):
    # an operation that adds nothing read as -4 KB once (CI, store.load). Added is >= 0.
    return max(0, status_kb()["VmHWM"] - before) * 1024


def save_peak(width: int, directory: str) -> dict[str, float]:
    from benchmarks.bench_checkpoint import make_state, state_bytes
    from jobrun import store

    state = make_state(width)
    size = state_bytes(state)
    d = Path(directory)
    out: dict[str, float] = {"state_bytes": size}
    out["save"] = _added(lambda: store.save(state, {}, d, "local", 1))

    def async_save() -> None:
        prepared = store.prepare(state, {}, copy=True)
        store.write(prepared, d, "local", 2)

    out["prepare_copy_write"] = _added(async_save)
    loaded: list = []
    out["load"] = _added(lambda: loaded.append(store.load(d, "local", 1)))
    return out


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "save-peak":
        print(json.dumps(save_peak(int(sys.argv[2]), sys.argv[3])))
    else:
        raise SystemExit("usage: python -m benchmarks.memprobe save-peak WIDTH DIR")
