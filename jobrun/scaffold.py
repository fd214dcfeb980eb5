"""`jobrun new`: start a plan from one of the bundled examples.

The examples (plans/ in the repository) ship inside the package as `jobrun.examples`, so
a user who installed jobrun from a wheel has them too. An example that uses files next
to it (user code in models/, data in data/) is copied with them: the new directory is a
plan a user can train and edit at once.
"""

from __future__ import annotations

import re
from importlib import resources
from pathlib import Path

from jobrun import safefs
from jobrun.errors import UsageError, did_you_mean

_JOB_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}\Z")
_JOB_LINE = re.compile(r"^job:.*$", re.M)
DEFAULT = "mlp"


def _root():
    return resources.files("jobrun.examples")


def examples() -> dict[str, str]:
    """Every example's name and the first line of its opening comment."""
    out = {}
    for entry in sorted(_root().iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".yaml"):
            first = entry.read_text().splitlines()[0] if entry.read_text() else ""
            out[entry.name.removesuffix(".yaml")] = first.lstrip("# ").strip()
    return out


def list_text() -> str:
    found = examples()
    width = max(map(len, found))
    return "\n".join(f"{name:<{width}}  {about}" for name, about in found.items())


def create(name: str, example: str = DEFAULT, where: Path = Path(".")) -> Path:
    """Write ``where/name/plan.yaml`` from ``example`` (its job renamed ``name``), with the
    example's models/ and data/ when it uses them. Nothing that exists is overwritten."""
    if not _JOB_NAME.match(name) or ".." in name:
        raise UsageError(f"bad name {name!r}", hint="a job name is 1-64 letters, digits, '_', '.' "
                                                    "or '-', starting with a letter or digit")
    found = examples()
    if example not in found:
        hint = did_you_mean(example, found) or f"examples: {', '.join(found)}"
        raise UsageError(f"no example named {example!r}", hint=hint)
    text = (_root() / f"{example}.yaml").read_text()
    dest = where / name
    if dest.exists():
        raise UsageError(f"{dest} exists already", hint="choose another name, or remove it")
    files = _used_files(text)
    try:
        dest.mkdir(parents=True)
        safefs.write_atomic(dest / "plan.yaml",
                            _renamed(_JOB_LINE.sub(f"job: {name}", text, count=1), example, dest).encode(),
                            durable=False)
        for rel in files:
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            safefs.write_atomic(dest / rel, (_root() / rel).read_bytes(), durable=False)
    except OSError as e:
        raise UsageError(f"cannot write {dest}: {e.strerror or e}",
                         hint="choose a writable directory") from None
    return dest


def _used_files(text: str) -> list[str]:
    """The files under data/ and models/ the example names (`data/shapes.npz`,
    `models.charlm:CharLM`, `plans/data/make_shapes.py`), with models/__init__.py."""
    out = []
    for sub, mark in (("data", "data/{}"), ("models", "models.{}")):
        if not (_root() / sub).is_dir():
            continue
        for entry in sorted((_root() / sub).iterdir(), key=lambda e: e.name):
            stem = entry.name.removesuffix(".py") if sub == "models" else entry.name
            if entry.is_file() and re.search(re.escape(mark.format(stem)) + r"(?![\w.])|"
                                             + re.escape(f"{sub}/{entry.name}"), text):
                out.append(f"{sub}/{entry.name}")
    if any(f.startswith("models/") for f in out) and (_root() / "models" / "__init__.py").is_file():
        out.append("models/__init__.py")
    return sorted(set(out))


def _renamed(text: str, example: str, dest: Path) -> str:
    """The example's comments name the new plan's paths (`jobrun train NAME/plan.yaml`)."""
    text = text.replace(f"plans/{example}.yaml", str(dest / "plan.yaml"))
    return re.sub(r"\bplans/(data|models)/", lambda m: f"{dest / m.group(1)}/", text)
