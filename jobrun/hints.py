"""The jobrun commands that messages suggest, written to be pasted as they are.

A command that acts on a run (`jobrun ckpt list`, `jobrun resume --force`) names that
run unless it is the latest one, which the bare command picks (docs/commands.md): the
hint stays short in the usual case, and acts on the same run in every case. A resume
that a failed resume suggests repeats what that resume was given (its overrides,
``--epoch``, ``--replicas``, ``--max-restarts``, ``--force``), but for the option it changes.

The run is the one this process acts on, set once where it is known: by the CLI when a
command picks its run, by `train` once it made its directory, by a worker from its
Launch (a spawned worker gets this process's :class:`Acting`). A message about another
run gives it (``run=``). No torch: the store and `ckpt list` use it too.
"""

from __future__ import annotations

import shlex
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Acting:
    """The run a command acts on, and (a resume) the arguments it was given besides the
    run: each an override (``("max_epochs=3",)``), an option with its value
    (``("--epoch", "2")``) or a flag (``("--force",)``)."""

    run: Path
    given: tuple[tuple[str, ...], ...] = ()


_acting: Acting | None = None


def act_on(run: str | Path | None, given: Iterable[tuple[str, ...]] = ()) -> None:
    """This process acts on ``run`` (None: on no run yet)."""
    use(None if run is None else Acting(Path(run), tuple(tuple(g) for g in given)))


def use(acting: Acting | None) -> None:
    global _acting
    _acting = acting


def acting() -> Acting | None:
    return _acting


def command(words: str, *args: str, run: str | Path | None = None) -> str:
    """`jobrun WORDS [RUN] ARGS...`, quoted for a shell: RUN is ``run`` (by default the
    run this process acts on), left out when it is the latest run."""
    return _join(words, run, args)


def train_again(source: str, sets: Iterable[str], run: str | Path | None = None, *,
                overwrite: bool = False) -> str:
    """`jobrun train PLAN KEY=VALUE... [--run-dir RUN [--overwrite]]`: a run's plan and
    overrides (run.json's ``source`` and ``sets``, then any given since) trained again, in
    ``run`` (over it with ``overwrite``), or without it in a new run directory."""
    where = [] if run is None else ["--run-dir", str(run), *(["--overwrite"] if overwrite else [])]
    return shlex.join(["jobrun", "train", source, *sets, *where])


def resume_again(*args: str) -> str:
    """The resume this process runs, again with ``args``: `jobrun resume [RUN] KEY=VALUE...
    --epoch 1 --force`. An option in ``args`` replaces the one given (`--epoch 1` for
    `--epoch 3`); a process that is no resume gave nothing to repeat."""
    given = _acting.given if _acting is not None else ()
    changed = {a for a in args if a.startswith("--")}
    kept = [word for group in given if group[0] not in changed for word in group]
    return _join("resume", None, (*kept, *args))


def _join(words: str, run: str | Path | None, args: Iterable[str]) -> str:
    target = Path(run) if run is not None else _acting.run if _acting is not None else None
    named = [] if target is None or _is_latest(target) else [str(target)]
    return shlex.join(["jobrun", *words.split(), *named, *args])


def _is_latest(run: Path) -> bool:
    """Whether ``run`` is the one a command given no run directory picks now."""
    from jobrun.errors import JobrunError
    from jobrun.runner.runs import latest  # reads ./runs: only when a hint is made

    try:
        return latest().path.resolve() == run.resolve()
    except (JobrunError, OSError):
        return False
