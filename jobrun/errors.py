"""Errors a user can cause. Each one formats itself; only the CLI prints them.

Every error carries what failed, where (a source position when there is one) and how
to fix it, plus the exit code the CLI should use.
"""

from __future__ import annotations


class Pos:
    """A position in a source file (1-based line and column; 0 when unknown).

    Treat it as immutable. A plain class rather than a frozen dataclass: the loader makes
    one for every key and value of a plan, and a frozen dataclass is slower to build.
    """

    __slots__ = ("file", "line", "col")

    def __init__(self, file: str, line: int = 0, col: int = 0):
        self.file = file
        self.line = line
        self.col = col

    def _triple(self) -> tuple[str, int, int]:
        return (self.file, self.line, self.col)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Pos):
            return NotImplemented
        return self._triple() == other._triple()

    def __hash__(self) -> int:
        return hash(self._triple())

    def __repr__(self) -> str:
        return f"Pos({self.file!r}, {self.line}, {self.col})"

    def __str__(self) -> str:
        if self.line <= 0:
            return self.file
        return f"{self.file}:{self.line}:{self.col}"


class SetPos(Pos):
    """A place in the plan whose value an override gave through a var (`batch_size:
    ${batch}` with `vars.batch=0`): messages point at the plan and say where the value
    came from, so that the user does not look for the fault in a line that looks right.

    ``sets``: the overrides, as written (`vars.batch=0`)."""

    __slots__ = ("sets",)

    def __init__(self, pos: Pos, sets: list[str]):
        super().__init__(pos.file, pos.line, pos.col)
        self.sets = sets


def with_origin(hint: str | None, pos: Pos | None) -> str | None:
    """`hint`, saying which override gave the value at `pos` when one did (once)."""
    if not isinstance(pos, SetPos):
        return hint
    note = f"the value here came from {' and '.join(f'`{s}`' for s in pos.sets)} on the command line"
    if not hint or note[1:] in hint:  # once: a message made again from one keeps its note
        return hint or note
    return f"{hint}{'' if hint.endswith(('.', '?')) else '.'} {note[0].upper()}{note[1:]}"


class _Reported:
    """What every error shown to a user has: a message, maybe a position and a hint,
    and the exit code the CLI should use."""

    exit_code = 1

    def __init__(self, message: str, pos: Pos | None = None, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.pos = pos
        self.hint = with_origin(hint, pos)

    def format_message(self) -> str:
        head = f"{self.pos}: error: {self.message}" if self.pos else f"error: {self.message}"
        if self.hint:
            head += f"\n  hint: {self.hint}"
        return head

    def __str__(self) -> str:
        return self.format_message()


class JobrunError(_Reported, Exception):
    """Base of every error jobrun reports to a user (never shown with a traceback)."""

    # Raised by every rank of a job at once, as they agreed: the job failed, no rank did
    # (the worker says it once and ends as a job does, so that no launcher names a rank).
    every_rank = False


class PlanError(JobrunError):
    """The plan file cannot be read as a plan (syntax, structure, types, names)."""

    exit_code = 2


class UsageError(JobrunError):
    """Bad command-line use (a missing run directory, a bad --set, ...)."""

    exit_code = 2


class RunError(JobrunError):
    """An op or task failed while the job ran."""

    exit_code = 1


class CheckpointError(JobrunError):
    """A checkpoint is missing, incomplete or corrupt, or cannot be written."""

    exit_code = 1


class Interrupted(_Reported, BaseException):
    """SIGINT/SIGTERM: the job stopped cleanly; its checkpoints are intact.

    A BaseException, as KeyboardInterrupt is: code that wraps the errors of user code
    (`except Exception`) must let it through.

    ``during``: the phase it stopped in when nothing can be resumed yet (start-up, init);
    ``hint``: how to go on (default: the resume of the run, made when the message is: it
    reads ./runs, and the job replaces the hint of a signal it stops for); ``why``: what
    sent the signal, when it is known to be no one's choice (a launcher that died)."""

    def __init__(self, signum: int, during: str | None = None, hint: str | None = None,
                 why: str | None = None):
        import signal

        name = signal.Signals(signum).name
        if during is not None:  # "": a command that runs no job
            super().__init__(f"interrupted{f' during {during}' if during else ''} ({why or name})", hint=None)
        else:
            super().__init__(f"stopped: {why}" if why else f"stopped by {name}", hint=hint)
        self.signum = signum
        self.exit_code = 128 + signum
        self._offer_resume = during is None and hint is None

    def format_message(self) -> str:
        if self._offer_resume and self.hint is None:
            from jobrun import hints

            self.hint = f"continue with `{hints.command('resume')}`"
        return super().format_message()


def did_you_mean(word: str, choices, most: int = 1, near=()) -> str | None:
    """A 'did you mean' hint, or None when nothing is close.

    Names every candidate as close as the closest one (`ad`: 'add' or 'and'), then, up to
    `most` in all, the next closest (`epochs`: 'epoch' or 'max_epochs'). `near`: the
    choices made close to where `word` is written (a blob of the same task); one a typo
    away from it comes first, though difflib finds short names little alike (`yy` read
    after `yb` was made: 'yb' or 'y').
    """
    import difflib

    first = sorted(c for c in near if _one_typo(word, c))
    close = difflib.get_close_matches(word, list(choices), n=max(most, 5), cutoff=0.6)
    if not close and not first:
        return None
    score = {c: difflib.SequenceMatcher(None, c, word).ratio() for c in close}
    best = sorted(c for c in close if score[c] == score[close[0]])
    rest = [c for c in close if c not in best][: max(0, most - len(best))]
    return "did you mean " + " or ".join(repr(c) for c in dict.fromkeys(first + best + rest)) + "?"


def _one_typo(word: str, name: str) -> bool:
    """`name` is `word` with one letter changed, added or dropped, or two next to each
    other swapped (names of two letters or more: any one-letter names are a typo apart)."""
    if min(len(word), len(name)) < 2 or word == name or abs(len(word) - len(name)) > 1:
        return False
    if len(word) != len(name):
        short, long = sorted((word, name), key=len)
        return any(long[:i] + long[i + 1:] == short for i in range(len(long)))
    diff = [i for i, (a, b) in enumerate(zip(word, name, strict=True)) if a != b]
    return len(diff) == 1 or (len(diff) == 2 and diff[1] == diff[0] + 1
                              and word[diff[0]] == name[diff[1]] and word[diff[1]] == name[diff[0]])


MAX_SAID = 2000  # characters of an exception's text a message shows


def said(e: BaseException) -> str:
    """An exception's text as a message shows it: str(e), cut (a user's exception may
    carry a whole tensor's repr), or a note when its __str__ raises."""
    try:
        return cut(str(e))
    except Exception:  # noqa: BLE001 - the user's __str__; the message must still be said
        return f"<{type(e).__name__}: its str() raised>"


def a_type(value: object) -> str:
    """`value`'s type as a message names it, with its article: 'an int', 'a Tensor'."""
    name = type(value).__name__
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def cut(text: str) -> str:
    """``text`` cut to MAX_SAID characters, saying how many were left out."""
    return text if len(text) <= MAX_SAID else f"{text[:MAX_SAID]}... ({len(text) - MAX_SAID} more characters)"


SECONDS_SETTINGS = {"JOBRUN_PROGRESS_SECONDS": 30.0, "JOBRUN_DIST_TIMEOUT": 300.0}  # name: default


def env_seconds(name: str) -> float:
    """A number of seconds > 0 from the environment variable ``name`` (its default of
    SECONDS_SETTINGS when unset); a UsageError for anything else (`abc` was a traceback,
    `nan` turned the progress lines off). The CLI reads them all as it starts."""
    import math
    import os

    default = SECONDS_SETTINGS[name]
    text = os.environ.get(name)
    if text is None:
        return default
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise UsageError(f"{name}={text!r}: a number of seconds > 0 expected",
                         hint=f"set it to e.g. {default:g}, or unset it (default {default:g} s)")
    return value
