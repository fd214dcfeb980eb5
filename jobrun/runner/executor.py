"""Executes tasks: the plan IR compiled into Python functions over workspaces.

Each task is compiled once per node into functions bound to that node's global workspace
(a dict living the whole job) and to the task's own child workspace (a dict cleared when
the task ends). A private task reads through to the global workspace, writes to names that
exist there update them, and new names stay in the child.

A block (a run of steps: a task's `do`, a loop's body, a branch) becomes one generated
Python function: its op calls and `stop_if`s are written out inline (``r = op3(ctx,
L['model'], L['opt'], L['xb'], L['yb'])``), and control steps (loops, ifs, parallel) are
closures it calls. Why: between torch's kernels Python runs with cold caches, at several
times its micro-benchmark cost. In the training loop of benchmarks/bench_runner.py (read,
stop_if, train.step) one closure per op call, blob read and output cost about 8 us a step
over a hand-written loop; the generated function costs about 4 us. The op functions,
literal inputs and arguments are the function's globals (never written as text), and the
index of the running step (``at``) finds the plan position of a failing op.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import linecache
import threading
from collections.abc import Callable
from typing import Any

from jobrun.errors import Interrupted, JobrunError, RunError
from jobrun.ops.context import OpContext
from jobrun.ops.core import truthy
from jobrun.ops.registry import registry, resolve_impl
from jobrun.plans import ir

Thunk = Callable[[], None]


class StopBlock(Exception):
    """`stop_if` fired: leave the innermost loop (or the task's `do`)."""


class OpFailed(RunError):
    """An op raised: carries the plan position, the task and the node."""


# Leave every block as they are: control flow and interruptions, never an op's failure.
_PASS_THROUGH = (StopBlock, KeyboardInterrupt, Interrupted)


def _private_workspace(g: dict[str, Any]) -> dict[str, Any]:
    """A private task's own workspace: a dict whose missing names are read from `g`.

    Its ``__missing__`` is `g`'s own ``__getitem__`` (a C function, hence a class per
    task), so that ``L[name]`` reads a global blob (model, optimizer, reader: most reads
    of a training loop) without running Python code; a name in neither raises
    KeyError(name).
    """

    class PrivateWorkspace(dict):
        __slots__ = ()
        __missing__ = staticmethod(g.__getitem__)

    return PrivateWorkspace()


@dataclasses.dataclass
class NodeRuntime:
    """One node (on this rank): its global workspace and its op context."""

    name: str
    ctx: OpContext
    globals: dict[str, Any] = dataclasses.field(default_factory=dict)
    task_ctxs: list[OpContext] = dataclasses.field(default_factory=list)


class CompiledTask:
    def __init__(self, task: ir.Task, node: NodeRuntime):
        self.task = task
        self.node = node
        self.ctx = dataclasses.replace(node.ctx, task=task.name)
        node.task_ctxs.append(self.ctx)
        g = node.globals
        self.local: dict[str, Any] = g if task.workspace == "global" else _private_workspace(g)
        b = _Builder(self.ctx, g, self.local, task, node.name)
        self._init = b.block(task.init)
        self._do = b.block(task.do)
        self._exit = b.block(task.exit)
        self._get = b.getter

    def run(self) -> dict[str, Any]:
        """Run init, do (all instances), exit; return the declared outputs."""
        try:
            _run_section(self._init)
            if self.task.instances == 1:
                _run_section(self._do)
            else:
                _run_concurrently([self._do] * self.task.instances, f"task {self.task.name!r}")
            _run_section(self._exit)
            return {ref.name: self._output(ref) for ref in self.task.outputs}
        finally:
            if self.local is not self.node.globals:
                self.local.clear()

    def _output(self, ref: ir.BlobRef) -> Any:
        try:
            return self._get(ref.name)()
        except KeyError:
            raise RunError(
                f"task {self.task.name!r} on node {self.node.name!r} ended without defining its output {ref.name!r}",
                ref.pos,
                "define it in the task's steps, or remove it from `outputs`",
            ) from None


def _run_section(thunk: Thunk) -> None:
    with contextlib.suppress(StopBlock):
        thunk()


def _run_concurrently(thunks: list[Thunk], what: str) -> bool:
    """Run thunks in threads; re-raise the first error. True when one hit stop_if."""
    errors: list[BaseException] = []
    stopped = threading.Event()

    def body(fn: Thunk) -> None:
        try:
            fn()
        except StopBlock:
            stopped.set()
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            errors.append(e)

    threads = [threading.Thread(target=body, args=(fn,), name=what, daemon=True) for fn in thunks[1:]]
    for t in threads:
        t.start()
    body(thunks[0])
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return stopped.is_set()


class _Report:
    """A running `report`: its thread repeats the body every period until `finish`."""

    def __init__(self, period: float, body: Thunk):
        self.period = period
        self.body = body
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._loop, name="report", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while not self.stop.wait(self.period):
            try:
                _run_section(self.body)
            except BaseException as e:  # noqa: BLE001 - re-raised by finish()
                self.error = e
                return

    def finish(self, final: bool) -> None:
        self.stop.set()
        self.thread.join()
        if final:
            if self.error is not None:
                raise self.error
            _run_section(self.body)


class _Builder:
    """Compiles steps of one task into functions bound to its workspaces."""

    def __init__(self, ctx: OpContext, g: dict, local: dict, task: ir.Task, node: str):
        self.ctx = ctx
        self.g = g
        self.l = local
        self.private = local is not g
        self.task = task
        self.node = node
        self.ops = registry()

    # -- workspace access -------------------------------------------------------------
    def getter(self, name: str) -> Callable[[], Any]:
        """The blob's current value; KeyError(name) when it is not defined.

        A C call: the private workspace reads through to the global one by itself.
        """
        return functools.partial(self.l.__getitem__, name)

    def setter(self, name: str) -> Callable[[Any], None]:
        g, l_ = self.g, self.l
        if not self.private:
            return functools.partial(g.__setitem__, name)

        def set_(v: Any) -> None:
            if name in g:
                g[name] = v
            else:
                l_[name] = v

        return set_

    def read(self, ref: ir.BlobRef, what: str) -> Callable[[], Any]:
        get = self.getter(ref.name)

        def read() -> Any:
            try:
                return get()
            except KeyError:
                raise self._undefined(ref, what) from None

        return read

    def _undefined(self, ref: ir.BlobRef, what: str) -> RunError:
        return RunError(
            f"{what}: blob {ref.name!r} is not defined on node {self.node!r}",
            ref.pos, "define it earlier (e.g. in the init group)",
        )

    # -- blocks ---------------------------------------------------------------------
    def block(self, steps: tuple[ir.Step, ...]) -> Thunk:
        """The steps as one generated function (see the module docstring)."""
        if any(isinstance(s, ir.Report) for s in steps):
            return self._block_with_reports(steps)
        code = _BlockCode(self.ctx, self.g, self.l, self.private)
        for s in steps:
            if isinstance(s, ir.OpCall):
                self._op(code, s)
            elif isinstance(s, ir.StopIf):
                self._stop_if(code, s)
            elif isinstance(s, ir.Loop) and all(isinstance(b, ir.OpCall | ir.StopIf) for b in s.body):
                self._inline_loop(code, s)
            else:
                code.call(self.step(s))
        return code.function(f"<jobrun task {self.task.name!r} on node {self.node!r}>")

    def _inline_loop(self, code: _BlockCode, s: ir.Loop) -> None:
        """A loop of op calls and stop_ifs, written into the enclosing block's function:
        no call or handler per iteration; a `stop_if` of its body is a `break`. Does what
        `loop` does, and its errors are the same."""
        progress = self.ctx.progress if self.ctx.progress is not None else {}
        task = code._name("task", self.task.name)
        code.open_loop(
            self._loop_header(code, s, task, code._name("progress", progress)),
            s.index.name if s.index else None,
        )
        for b in s.body:
            if isinstance(b, ir.OpCall):
                self._op(code, b)
            else:
                self._stop_if(code, b)
        code.end_loop()

    def _loop_header(self, code: _BlockCode, s: ir.Loop, task: str, progress: str) -> list[str]:
        if s.count is None:
            return ["i = -1", "while True:", "    i += 1", f"    {progress}['loop'] = ({task}, i, None)"]
        if isinstance(s.count, ir.BlobRef):
            read = code._name("count", self.read(s.count, "loop count"))
            as_int = code._name("as_int", functools.partial(_as_int, s=s))
            head = [f"n = {read}()", "if n.__class__ is not int or n < 0:", f"    n = {as_int}(n)"]
        else:
            head = [f"n = {code._name('n', s.count)}"]
        return [*head, "for i in range(n):", f"    {progress}['loop'] = ({task}, i, n)"]

    def _block_with_reports(self, steps: tuple[ir.Step, ...]) -> Thunk:
        items: list[tuple[ir.Report | None, Thunk]] = []
        for s in steps:
            items.append((s, self.block(s.body)) if isinstance(s, ir.Report) else (None, self.block((s,))))

        def run_block() -> None:
            running: list[_Report] = []
            ok = False
            try:
                for report, thunk in items:
                    if report is None:
                        thunk()
                    else:
                        running.append(_Report(report.period, thunk))
                ok = True
            except StopBlock:
                ok = True
                raise
            finally:
                for r in reversed(running):
                    r.finish(final=ok)

        return run_block

    def step(self, s: ir.Step) -> Thunk:
        """A control step as a closure (`block` writes op calls and stop_if inline)."""
        if isinstance(s, ir.Loop):
            return self.loop(s)
        if isinstance(s, ir.If):
            return self.if_(s)
        if isinstance(s, ir.Parallel):
            return self.parallel(s)
        raise RunError(f"cannot run step {type(s).__name__}", getattr(s, "pos", None))

    # -- control steps ------------------------------------------------------------------
    def loop(self, s: ir.Loop) -> Thunk:
        body = self.block(s.body)
        set_index = self.setter(s.index.name) if s.index else None
        count = s.count
        read_count = self.read(count, "loop count") if isinstance(count, ir.BlobRef) else None
        progress = self.ctx.progress if self.ctx.progress is not None else {}
        task = self.task.name

        def run_loop() -> None:
            n = count
            if read_count is not None:
                n = read_count()
                if n.__class__ is not int or n < 0:
                    n = _as_int(n, s)
            # The live display shows the innermost running loop: the last one to update.
            i = 0
            try:
                if n is None:
                    while True:
                        progress["loop"] = (task, i, None)
                        if set_index:
                            set_index(i)
                        body()
                        i += 1
                else:
                    for i in range(n):
                        progress["loop"] = (task, i, n)
                        if set_index:
                            set_index(i)
                        body()
            except StopBlock:
                pass

        return run_loop

    def _stop_if(self, code: _BlockCode, s: ir.StopIf) -> None:
        ref, undefined = s.cond, self._undefined

        def on_error(e: BaseException) -> None:
            if isinstance(e, KeyError):
                raise undefined(ref, "stop_if") from None

        truth = functools.partial(self._truth, ref=ref)
        code.stop_if(ref.name, truth, on_error)

    def _truth(self, value: Any, ref: ir.BlobRef) -> bool:
        if value is True:
            return True
        if value is False or value is None:
            return False
        try:
            return truthy(value)
        except JobrunError as e:
            raise RunError(f"blob {ref.name!r}: {e.message}", ref.pos, e.hint) from None

    def if_(self, s: ir.If) -> Thunk:
        branches = [(self.read(b.cond, "if"), b.cond, self.block(b.body)) for b in s.branches]
        orelse = self.block(s.orelse) if s.orelse is not None else None

        def run_if() -> None:
            for cond, ref, body in branches:
                if self._truth(cond(), ref):
                    body()
                    return
            if orelse is not None:
                orelse()

        return run_if

    def parallel(self, s: ir.Parallel) -> Thunk:
        bodies = [self.block(b.body) for b in s.branches]

        def run_parallel() -> None:
            if _run_concurrently(bodies, "parallel"):
                raise StopBlock

        return run_parallel

    # -- op calls -------------------------------------------------------------------
    def _op(self, code: _BlockCode, s: ir.OpCall) -> None:
        spec = self.ops.get(s.op)
        if spec is None:
            raise RunError(f"unknown op {s.op!r}", s.pos, "`jobrun ops` lists the ops")
        impl = resolve_impl(spec)
        kwargs = dict(s.args)
        if getattr(impl, "wants_names", False):
            kwargs["_names"] = tuple(i.name if isinstance(i, ir.BlobRef) else repr(i.value) for i in s.ins)
        if getattr(impl, "wants_out_names", False):
            kwargs["_out_names"] = tuple(o.name for o in s.outs)
        impl, kwargs = _bound(impl, self.ctx, kwargs)
        fail = self._failure(s)

        def on_error(e: BaseException) -> None:
            raise fail(e) from e

        code.op(impl, s.ins, kwargs, [o.name for o in s.outs], on_error)

    def _failure(self, s: ir.OpCall) -> Callable[[BaseException], BaseException]:
        where = f"in task {self.task.name!r} on node {self.node!r}"
        if self.ctx.world_size > 1:
            where += f" (rank {self.ctx.rank})"

        def fail(e: BaseException) -> BaseException:
            if isinstance(e, OpFailed):
                return e
            if isinstance(e, KeyError) and e.args and isinstance(e.args[0], str):
                return OpFailed(
                    f"op `{s.op}` {where}: blob {e.args[0]!r} is not defined",
                    s.pos, "define it earlier (e.g. in the init group)",
                )
            if isinstance(e, JobrunError):
                message = e.message.removeprefix(f"{s.op}: ")  # the op is named already
                return OpFailed(f"op `{s.op}` {where}: {message}", s.pos, e.hint)
            return OpFailed(f"op `{s.op}` {where} failed: {type(e).__name__}: {e}", s.pos)

        return fail


class _BlockCode:
    """The source of one block's function, and the objects its source names.

    Steps are numbered; ``at`` holds the running one, and ``on_error[at]`` turns its
    failure into the error to report (it raises), or lets it through unchanged (None).
    Blob names appear in the source only as ``repr`` string literals; everything else
    (ops, literal inputs, arguments) is a global of the generated function.
    """

    def __init__(self, ctx: OpContext, g: dict, local: dict, private: bool):
        self.private = private
        self.lines: list[str] = []
        self.indent = ""  # inside an inline loop: its body's
        self.on_error: list[Callable[[BaseException], None] | None] = []
        self.env: dict[str, Any] = {
            "ctx": ctx, "G": g, "L": local, "StopBlock": StopBlock,
            "PASS_THROUGH": _PASS_THROUGH, "results": _results, "on_error": self.on_error,
        }

    def _name(self, prefix: str, value: Any) -> str:
        name = f"{prefix}{len(self.env)}"
        self.env[name] = value
        return name

    def _step(self, on_error: Callable[[BaseException], None] | None) -> None:
        self.line(f"at = {len(self.on_error)}")
        self.on_error.append(on_error)

    def line(self, text: str) -> None:
        self.lines.append(self.indent + text)

    def add(self, texts: list[str]) -> None:
        for text in texts:
            self.line(text)

    def open_loop(self, header: list[str], index: str | None) -> None:
        """Open an inline loop: its header, then (indented) the storing of its index;
        the steps written until ``end_loop`` are its body."""
        self._step(None)  # a bad count raises its own RunError, as `loop` does
        for text in header:
            self.line(text)
        self.indent += "    "
        self.line("pass")  # an empty body is a body
        if index is not None:
            self._store(index, "i")

    def end_loop(self) -> None:
        self.indent = self.indent[:-4]

    def call(self, thunk: Thunk) -> None:
        """A control step: its closure, whose errors pass through unchanged."""
        self._step(None)
        self.line(f"{self._name('step', thunk)}()")

    def op(self, impl, ins: tuple[ir.Input, ...], kwargs: dict, outs: list[str], on_error) -> None:
        self._step(on_error)
        args = ["ctx"]
        for i in ins:
            args.append(f"L[{i.name!r}]" if isinstance(i, ir.BlobRef) else self._name("lit", i.value))
        if kwargs:
            args.append("**" + self._name("kw", kwargs))
        call = f"{self._name('op', impl)}({', '.join(args)})"
        if not outs:
            self.line(call)
            return
        self.line(f"r = {call}")
        if len(outs) == 1:
            self._store(outs[0], "r")
            return
        n = len(outs)
        self.add([
            f"if type(r) is not tuple or len(r) != {n}:",
            f"    r = results(r, {n})",
        ])
        targets = ", ".join(f"L[{name!r}]" for name in outs)
        if not self.private:
            self.line(f"{targets} = r")
            return
        # Usually none of them is global (a `read`'s batch): one check, then unpacked.
        outs_name = self._name("outs", tuple(outs))
        self.add([f"if G.keys().isdisjoint({outs_name}):", f"    {targets} = r", "else:"])
        for k, name in enumerate(outs):
            self._store(name, f"r[{k}]", indent="    ")

    def _store(self, name: str, value: str, indent: str = "") -> None:
        if not self.private:
            self.line(f"{indent}G[{name!r}] = {value}")
            return
        self.add([
            f"{indent}if {name!r} in G:",
            f"{indent}    G[{name!r}] = {value}",
            f"{indent}else:",
            f"{indent}    L[{name!r}] = {value}",
        ])

    def stop_if(self, name: str, truth: Callable[[Any], bool], on_error) -> None:
        self._step(on_error)
        self.add([
            f"v = L[{name!r}]",
            f"if v is True or (v is not False and v is not None and {self._name('truth', truth)}(v)):",
            "    break" if self.indent else "    raise StopBlock",  # ends an inline loop
        ])

    def source(self) -> str:
        body = "\n".join("        " + line for line in self.lines)
        return (
            "def run_block():\n"
            "    at = 0\n"
            "    try:\n"
            f"{body}\n"
            "    except PASS_THROUGH:\n"
            "        raise\n"
            "    except BaseException as e:\n"
            "        handle = on_error[at]\n"
            "        if handle is not None:\n"
            "            handle(e)\n"
            "        raise\n"
        )

    def function(self, filename: str) -> Thunk:
        if not self.lines:
            return _nothing
        source = self.source()
        # Tracebacks through a block show its source (a few hundred bytes per block).
        filename = f"{filename[:-1]} block {next(_block_numbers)}>"
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        exec(compile(source, filename, "exec"), self.env)
        return self.env["run_block"]


_block_numbers = itertools.count(1)


def _nothing() -> None:
    """An empty block."""


def _results(result: Any, n: int) -> tuple[Any, ...]:
    """An op's results for `n` outputs (a tuple or a list of n values), or why not."""
    if not isinstance(result, tuple | list):
        raise RunError(f"op returned 1 value(s) for {n} outputs")
    if len(result) != n:
        raise RunError(f"op returned {len(result)} value(s) for {n} outputs")
    return tuple(result)


def _bound(impl: Callable[..., Any], ctx: OpContext, kwargs: dict) -> tuple[Callable[..., Any], dict]:
    """An op's implementation for one call site, and the arguments left to pass it.

    An op with a ``bind(ctx, **kwargs)`` attribute may check its arguments once here and
    return a callable ``(ctx, *inputs)`` that skips those checks on every call (what
    `train.step` does). When it returns None, or raises, the op is called as usual, and
    raises its own error at run time, with the step's position.
    """
    bind = getattr(impl, "bind", None)
    if bind is None:
        return impl, kwargs
    try:
        fast = bind(ctx, **kwargs)
    except Exception:  # noqa: BLE001 - the unbound call raises it again, in context
        fast = None
    return (impl, kwargs) if fast is None else (fast, {})


def _as_int(n: Any, s: ir.Loop) -> int:
    if hasattr(n, "item") and getattr(n, "numel", lambda: 0)() == 1:
        n = n.item()
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise RunError(f"loop count is {n!r}, not a non-negative integer", s.pos)
    return n
