"""A writer of Python source whose every line knows the plan step it comes from.

The code generator (:mod:`jobrun.runner.codegen_task`) writes a task's steps through it:
`block` indents (as ``ast._Unparser.block`` does), `step` tags the lines written inside with a
``# file:line what`` comment and a handler for their failures, `function` opens a
generated function whose ``except`` hands a failure to the handler of the line it came
from (the first traceback entry of that function holds the line). `compile` executes the
module in its globals and puts its text in linecache, so tracebacks show it.
"""

from __future__ import annotations

import contextlib
import itertools
import linecache
import re
from collections.abc import Callable, Iterator
from typing import Any

# Turns the failure of a generated line into the error to report (it raises), or leaves it
# as it is (returns).
Handler = Callable[[BaseException], None]


class _Function:
    """The lines of one generated function, each with the handler of its step."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.handlers: list[Handler | None] = []
        self.depth = 0
        self.loops = 0  # loops open around the line being written


class Source:
    """A generated module: its functions, and the objects their lines name (its globals).

    The functions' ``except`` leaves exceptions of the types `pass_through` as they are.
    """

    def __init__(self, env: dict[str, Any], pass_through: tuple[type[BaseException], ...]):
        self.env = env
        env["PASS_THROUGH"] = pass_through
        self.functions: list[_Function] = []
        self.fn = _Function()
        self.comment = ""
        self.handler: Handler | None = None
        self._numbers = itertools.count(1)

    def fresh(self, prefix: str, label: str = "") -> str:
        """A new name: ``{prefix}{n}``, or ``{prefix}{n}_{label}`` (e.g. op3_add)."""
        name = f"{prefix}{next(self._numbers)}"
        return f"{name}_{re.sub(r'[^0-9A-Za-z_]', '_', label)}" if label else name

    def value(self, prefix: str, value: Any, label: str = "") -> str:
        """A new global of the module holding `value`."""
        name = self.fresh(prefix, label)
        self.env[name] = value
        return name

    def line(self, text: str) -> None:
        self.fn.lines.append("    " * self.fn.depth + text + self.comment)
        self.fn.handlers.append(self.handler)

    @contextlib.contextmanager
    def block(self, header: str) -> Iterator[None]:
        """`header`, then the lines written inside, indented (`pass` when there are none)."""
        self.line(header)
        self.fn.depth += 1
        start = len(self.fn.lines)
        yield
        if len(self.fn.lines) == start:
            self.line("pass")
        self.fn.depth -= 1

    @contextlib.contextmanager
    def loop(self, header: str) -> Iterator[None]:
        with self.block(header):
            self.fn.loops += 1
            yield
            self.fn.loops -= 1

    @contextlib.contextmanager
    def step(self, pos: Any, what: str, handler: Handler | None = None) -> Iterator[None]:
        """Lines written inside belong to the step at `pos`: its comment, and the handler
        of their failures (None: they raise their own errors)."""
        saved = self.comment, self.handler
        self.comment = "  # " + re.sub(r"[\r\n]", " ", f"{pos.file}:{pos.line} {what}")
        self.handler = handler
        try:
            yield
        finally:
            self.comment, self.handler = saved

    @contextlib.contextmanager
    def function(self, name: str, params: str = "") -> Iterator[None]:
        """A new function `name`: a `try` whose failures go through the line's handler."""
        saved = self.fn, self.comment, self.handler
        self.fn, self.comment, self.handler = _Function(), "", None
        self.functions.append(self.fn)
        with self.block(f"def {name}({params}):"):
            with self.block("try:"):
                yield
            self.line("except PASS_THROUGH:")
            self.line("    raise")
            self.line("except BaseException as e:")
            self.line("    failed(e)")
            self.line("    raise")
        self.fn, self.comment, self.handler = saved

    def stop(self) -> str:
        """The statement that leaves the innermost open loop or, outside any loop, ends
        the function, returning True (what `stop_if` does)."""
        return "break" if self.fn.loops else "return True"

    def compile(self, filename: str) -> None:
        """Define the functions in `env`; `filename` names the source in tracebacks."""
        lines: list[str] = []
        handlers: dict[int, Handler | None] = {}
        for fn in self.functions:
            for text, handler in zip(fn.lines, fn.handlers):
                lines.append(text)
                handlers[len(lines)] = handler
            lines.append("")

        def failed(e: BaseException) -> None:
            """Called by a generated function's `except`: the line that failed knows how
            to report it (its traceback entry in that function is the first)."""
            tb = e.__traceback__
            handler = handlers.get(tb.tb_lineno) if tb is not None else None
            if handler is not None:
                handler(e)

        self.env["failed"] = failed
        source = "\n".join(lines) + "\n"
        # Tracebacks through generated code show its lines (a few kB per task).
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        exec(compile(source, filename, "exec"), self.env)
