"""The code generator: a task's IR written as generated Python functions.

One code generator, a :class:`~jobrun.plans.visit.Visitor` over the task's steps (the
analyzer and the printer are the others), writes each section (init, do, exit) as one
Python function; control flow becomes Python's own::

    op call            r = op3_add(ctx, L['total'], L['i'])     (every function is f(L))
    loop: N / a blob   for i4 in range(n4): ...    (`as i`: the index is stored each time)
    loop: null         while True: ...
    stop_if: c         if <c is truthy>: break      (outside any loop: return True, which
                                                     ends the section; `exit` still runs)
    if/elif/else       if ...: / elif ...: / else:
    parallel           each branch a function, run in threads (run_concurrently); one that
                       stopped counts as a stop_if at the `parallel`
    report             its body a function, run every period by a thread of the
                       enclosing block's `with reports()`, and once more when it ends

Why generate code: between torch's kernels Python runs with cold caches, at several times
its micro-benchmark cost; one closure per op call, blob read and output cost about 8 us a
training step over a hand-written loop, the generated code about 4 us. Op functions,
literal inputs and arguments are globals of the generated module, never written as text;
blob names appear in it only as repr() literals. Each line ends with a ``# file:line op``
comment, linecache holds the source (tracebacks show it), and the line a failure comes
from finds the step it belongs to, which turns it into an error with the plan position
(the source writer: :mod:`jobrun.runner.codegen`).

Loops also keep the losses of their train.steps for the epoch mean, the clock of the global
step (`every:`, clocked ops) and the `max_steps` check; with --profile, op calls and
loops are written timed. The generated functions run in the workspaces of
:mod:`jobrun.runner.executor`, and their threads through :mod:`jobrun.runner.concurrency`.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import keyword
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from jobrun.errors import Interrupted, JobrunError, RunError, said
from jobrun.ops.context import STEP_COUNTER, OpContext
from jobrun.ops.core import truthy
from jobrun.ops.registry import bound_impl, registry, resolve_impl
from jobrun.plans import ir
from jobrun.plans.analyze_data import done_reads
from jobrun.plans.visit import Visitor, also_written, children, written
from jobrun.runner import clock
from jobrun.runner import codegen_runtime as runtime
from jobrun.runner.codegen import Handler, Source
from jobrun.runner.concurrency import Reports, Thunk, run_concurrently
from jobrun.runner.display import FOREVER

if TYPE_CHECKING:
    from jobrun.runner.profile import Profile


class OpFailed(RunError):
    """An op raised: carries the plan position, the task and the node; ``trace``: the
    user's own frames, when the error came from the user's code (shown under the line
    that names the op and the plan position, before the hint)."""

    trace: str | None = None

    def format_message(self) -> str:
        if not self.trace:
            return super().format_message()
        head = f"{self.pos}: error: {self.message}" if self.pos else f"error: {self.message}"
        body = "".join("    " + line + "\n" for line in self.trace.rstrip("\n").split("\n"))
        text = f"{head}\n  traceback of your code (most recent call last):\n{body.rstrip()}"
        return text + (f"\n  hint: {self.hint}" if self.hint else "")


def _op_error(message: str, pos: Any, hint: str | None, cause: BaseException) -> OpFailed:
    """An OpFailed for ``cause``, with the user's frames when it came from user code."""
    from jobrun.runner import usertrace

    error = OpFailed(message, pos, hint or usertrace.hint_for(cause))
    error.every_rank = getattr(cause, "every_rank", False)  # raised by every rank at once
    found = usertrace.of(cause)
    if found is not None:
        error.trace = found.text
        if not isinstance(cause, JobrunError):  # names the user's function; the trace ends
            head, newline, _rest = message.partition("\n")  # with all the text: said once
            error.message = f"{head}{' ...' if newline else ''} (in {found.function})"
    return error


def _stored(task: ir.Task) -> set[str]:
    """The blobs a task's generated code stores: what its ops write, and loop indices."""
    return written(task) | _indices(task)


def shared_names(plan: ir.Plan) -> dict[str, frozenset[str]]:
    """Per node, the blobs its global-workspace tasks (of any group) store: all that its
    global workspace can ever hold (a checkpoint restores a subset of them, see
    jobrun.plans.state), so a private task's store of any other name goes to its own."""
    out: dict[str, set[str]] = {node: set() for node in plan.nodes}
    for group in plan.groups:
        for task in group.tasks:
            if task.workspace == "global":
                out.setdefault(task.node, set()).update(_stored(task))
    return {node: frozenset(names) for node, names in out.items()}


def _indices(node: Any) -> set[str]:
    out: set[str] = set()
    for block in children(node):
        for step in block:
            if isinstance(step, ir.Loop) and step.index is not None:
                out.add(step.index.name)
            out |= _indices(step)
    return out


def _loop_written(node: Any) -> set[str]:
    """The blobs that steps inside the loops of ``node`` (a task) write."""
    out: set[str] = set()
    for block in children(node):
        for step in block:
            out |= written(step) if isinstance(step, ir.Loop) else _loop_written(step)
    return out


_module_numbers = itertools.count(1)
# Leave every generated function as they are: interruptions, never an op's failure.
_PASS_THROUGH = (KeyboardInterrupt, Interrupted)


class Generator(Visitor):
    """Writes one task's steps as Python (see the module docstring)."""

    def __init__(self, ctx: OpContext, g: dict, local: dict, task: ir.Task, node: str,
                 profile: Profile | None = None, max_steps: int | None = None,
                 shared: frozenset[str] | None = None):
        self.ctx = ctx
        # The names a global task of the node can write (`shared_names`; None: any): only
        # these can be in G when a private task stores, the rest go to L without a test.
        self.shared = shared
        # With a profile (train --profile) op calls and loops are written timed; without
        # one the code is what it always was: the profile costs nothing when off.
        self.profile = profile
        self.max_steps = max_steps
        self.clock: str | None = None  # the clock variable of the innermost loop being written
        self.every_number = 0  # steps with `every` written so far (each one's counter key)
        self.private = local is not g
        # What the task's steps store: a private workspace holds nothing else (it is empty
        # when the task starts), so any other name is read from G directly (_read).
        self.stored = _stored(task) if self.private else set()
        self.instance = False  # writing `do` of a task with instances: stores reach T too
        self.op_number = 0  # op calls written so far, in plan order
        self.task = task
        self.node = node
        self.done_reads = {id(r) for block in children(task) for r in done_reads(block)}
        self.ops = registry()
        self.reports = ""  # the `with reports()` variable of the block being written
        # The innermost loop's train.step outputs: name -> (losses, block sums) variables.
        self.means: dict[str, tuple[str, str]] | None = None
        self.reporting = False  # writing a `report`'s body (its loops are not the job's progress)
        progress = ctx.progress if ctx.progress is not None else {}
        self.code = Source({
            "ctx": ctx, "G": g, "T": local, "results": runtime.results,
            "truthy": truthy, "run_concurrently": run_concurrently, "reports": Reports,
            "partial": functools.partial,
            "PROGRESS": progress, "LOOPS": progress.setdefault("loops", {}), "FOREVER": FOREVER,
            "NOW": time.perf_counter,  # a loop's start, for the display
            "clock": time.perf_counter,  # --profile's timing
            "C": ctx._counters, "EVERY": clock.every, "MAX_STEPS": max_steps,
            "MEAN_BLOCK": runtime.MEAN_BLOCK, "LOSS_SUM": runtime.loss_sum, "LOSS_MEAN": runtime.loss_mean,
        }, pass_through=_PASS_THROUGH)
        if profile is not None and profile.sync is not None:
            self.code.env["sync"] = profile.sync

    def visit_Task(self, t: ir.Task) -> tuple[Thunk, Thunk, Thunk]:
        """The task's init, do and exit, as functions."""
        for section, steps in (("init", t.init), ("do", t.do), ("exit", t.exit)):
            self.instance = section == "do" and t.instances > 1
            with self.code.function(section, "L"):
                self.visit_block(steps)
        self.instance = False
        self.code.compile(f"<jobrun task {t.name!r} on node {self.node!r} #{next(_module_numbers)}>")
        return self.code.env["init"], self.code.env["do"], self.code.env["exit"]

    def visit_block(self, steps: tuple[ir.Step, ...]) -> None:
        first = next((s for s in steps if isinstance(s, ir.Report)), None)
        if first is None:
            for s in steps:
                self.visit_step(s)
            return
        outer, self.reports = self.reports, self.code.fresh("reports")
        with self.code.step(first.pos, "report"), self.code.block(f"with reports() as {self.reports}:"):
            for s in steps:
                self.visit_step(s)
        self.reports = outer

    def visit_step(self, s: ir.Step) -> None:
        """A step; with `every: N`, under the test of the clock it sees (see runner/clock.py)."""
        if s.every is None:
            self.visit(s)
            return
        self.every_number += 1
        site = f"every {self.task.group}/{self.task.name}#{self.every_number}"
        with self.code.step(s.pos, f"every {s.every}"), \
                self.code.block(f"if EVERY(C, {site!r}, {self._clock()}, {s.every}):"):
            self.visit(s)

    def _clock(self) -> str:
        """The global step as a step sees it: its loop's iteration began at, or now."""
        return self.clock if self.clock is not None else f"C.get({STEP_COUNTER!r}, 0)"

    def generic_visit(self, node: Any) -> None:
        raise RunError(f"cannot run step {type(node).__name__}", getattr(node, "pos", None))

    # -- op calls -------------------------------------------------------------------------
    def visit_OpCall(self, s: ir.OpCall) -> None:
        spec = self.ops.get(s.op)
        if spec is None:
            raise RunError(f"unknown op {s.op!r}", s.pos, "`jobrun ops` lists the ops")
        try:
            impl = resolve_impl(spec)
        except RunError as e:
            raise RunError(e.message, s.pos, e.hint) from e
        kwargs = dict(s.args)
        if getattr(impl, "wants_names", False):
            kwargs["_names"] = tuple(i.name if isinstance(i, ir.BlobRef) else repr(i.value) for i in s.ins)
        if getattr(impl, "wants_out_names", False):
            kwargs["_out_names"] = tuple(o.name for o in s.outs)
        if id(s) in self.done_reads:
            kwargs["_done_tested"] = True
        clocked = getattr(impl, "wants_clock", False)
        self.op_number += 1
        if getattr(impl, "wants_site", False):
            # A per-step counter's key: the step's place in the plan, by task and order (a
            # stored plan.yaml, laid out anew, has other line numbers than the user's file).
            kwargs["_site"] = f"{self.task.group}/{self.task.name}/{s.op}#{self.op_number}"
        code = self.code
        bound = None if clocked else bound_impl(spec, self.ctx, kwargs)
        if bound is not None:  # the op specialised to this call site's arguments
            impl, kwargs = bound, {}
        with code.step(s.pos, s.op, self._op_failure(s)):
            args = [] if bound is not None else ["ctx"]
            for i in s.ins:
                args.append(self._read(i.name) if isinstance(i, ir.BlobRef) else code.value("lit", i.value))
            # Arguments as keywords of the call (a name is an identifier: the op's own
            # parameter), each value a global: `**kw` built a dict at every call.
            rest = {k: v for k, v in kwargs.items() if not k.isidentifier() or keyword.iskeyword(k)}
            args += [f"{k}={code.value('kw', v)}" for k, v in kwargs.items() if k not in rest]
            if rest:
                args.append("**" + code.value("kw", rest))
            if clocked and self.clock is not None:
                args.append(f"_clock={self.clock}")
            call = f"{code.value('op', impl, s.op)}({', '.join(args)})"
            outs = [o.name for o in s.outs]
            with self._timed(s.pos, s.op):
                code.line(f"r = {call}" if outs else call)
            if outs:
                self._outputs(outs, counted=getattr(bound, "counted", False))
                for extra in also_written(s):  # train.step's <loss>_last
                    self._store(extra.name, "r")
                if s.op == "train.step" and self.means and outs[0] in self.means:
                    self._accumulate(outs[0])

    def _accumulate(self, name: str) -> None:
        """Keep a train.step loss for its loop's mean, as it is (a device tensor stays
        one: no sync per step); the loop's end stores the mean (_store_means). A list
        append, not a tensor add per step: a 0-d add is a TensorIterator (1 % of a tiny
        MLP's step, 10k instructions); torch sums the stacked losses once, at the end,
        and every MEAN_BLOCK steps so that a long loop does not keep every loss."""
        code = self.code
        losses, blocks = self.means[name]
        code.line(f"{losses}.append(r)")
        with code.block(f"if len({losses}) == MEAN_BLOCK:"):
            code.line(f"{blocks}.append(LOSS_SUM({losses})); {losses}.clear()")

    @contextlib.contextmanager
    def _timed(self, pos: Any, what: str) -> Iterator[None]:
        """With a profile: the lines written inside add their time to a slot of their own."""
        if self.profile is None:
            yield
            return
        code = self.code
        t = code.fresh("t")
        code.line(f"{t} = clock()")
        yield
        if "sync" in code.env:  # a GPU: the kernels the step launched are its time
            code.line("sync()")
        slot = code.value("slot", self.profile.slot(self.task.group, self.task.name,
                                                    f"{pos.file.rsplit('/', 1)[-1]}:{pos.line}", what))
        code.line(f"{slot}[0] += 1; {slot}[1] += clock() - {t}")

    def _outputs(self, outs: list[str], counted: bool = False) -> None:
        """Store an op's results; `counted`: the op returns one value per output."""
        code = self.code
        if len(outs) == 1:
            self._store(outs[0], "r")
            return
        n = len(outs)
        if not counted:
            with code.block(f"if type(r) is not tuple or len(r) != {n}:"):
                code.line(f"r = results(r, {n})")
        targets = ", ".join(f"L[{name!r}]" for name in outs)
        if not self.private and not self.instance:
            code.line(f"{targets} = r")
            return
        if self.instance:
            for k, name in enumerate(outs):
                self._store(name, f"r[{k}]")
            return
        if not any(self._may_be_global(name) for name in outs):  # a `read`'s batch, usually
            code.line(f"{targets} = r")
            return
        # One test, then unpacked (`in` tests: G.keys().isdisjoint() cost a view and a
        # call, 0.1 us more a step).
        with code.block(f"if {' and '.join(f'{name!r} not in G' for name in outs)}:"):
            code.line(f"{targets} = r")
        with code.block("else:"):
            for k, name in enumerate(outs):
                self._store(name, f"r[{k}]")

    def _store(self, name: str, value: str) -> None:
        """A write goes to the nearest workspace that has the name: G, T (an instance's
        task), else the workspace of the running function, L."""
        code = self.code
        if not self.private and not self.instance:
            code.line(f"G[{name!r}] = {value}")
            return
        tests = []
        if self._may_be_global(name):
            tests.append(("G", f"{name!r} in G"))
        if self.instance and self.private:
            tests.append(("T", f"{name!r} in T"))
        for k, (where, test) in enumerate(tests):
            with code.block(f"{'if' if k == 0 else 'elif'} {test}:"):
                code.line(f"{where}[{name!r}] = {value}")
        if not tests:
            code.line(f"L[{name!r}] = {value}")
            return
        with code.block("else:"):
            code.line(f"L[{name!r}] = {value}")

    def _may_be_global(self, name: str) -> bool:
        """Whether G can hold `name` when this task stores it (a private task's store goes
        to G when G has the name: a blob a global task wrote)."""
        return self.shared is None or name in self.shared

    def _op_failure(self, s: ir.OpCall) -> Handler:
        where = f"in task {self.task.name!r} on node {self.node!r}"
        if self.ctx.world_size > 1:
            where += f" (rank {self.ctx.rank})"

        inputs = {i.name for i in s.ins if isinstance(i, ir.BlobRef)}
        looped = inputs & _loop_written(self.task)

        def failed(e: BaseException) -> None:
            if isinstance(e, OpFailed):
                return
            tb = e.__traceback__
            if (
                isinstance(e, KeyError) and e.args and e.args[0] in inputs
                and tb is not None and tb.tb_next is None
            ):  # fmt: skip
                # Raised by the generated line itself (not from inside the op): a read.
                name = e.args[0]
                raise OpFailed(
                    f"op `{s.op}` {where}: blob {name!r} is not defined", s.pos,
                    f"{name!r} is made only inside a loop, where no step made it this time: e.g. "
                    "the loop's `read` ended at once, its reader having no pass left (`passes` is 1 "
                    "by default; `passes: 0` reads on in every epoch), or at the end of a pass where "
                    "max_steps ended the last epoch; or give it a value before the loop"
                    if name in looped else "define it earlier (e.g. in the init group)",
                ) from e
            from jobrun.ops.loader_failures import is_worker_death, worker_died

            if is_worker_death(e):  # raised by torch's SIGCHLD handler in whatever op ran
                e = worker_died(e)
            if isinstance(e, JobrunError):
                message = e.message.removeprefix(f"{s.op}: ")  # the op is named already
                raise _op_error(f"op `{s.op}` {where}: {message}", s.pos, e.hint, e) from e
            raise _op_error(f"op `{s.op}` {where} failed: {type(e).__name__}: {said(e)}", s.pos, None, e) from e

        return failed

    def _uses_clock(self, steps: tuple[ir.Step, ...]) -> bool:
        """Whether a loop body reads the clock of its iterations: a step with `every`, or an
        op that wants it (`log`, `call`), outside inner loops and the functions of parallel
        branches and reports."""
        for s in steps:
            if s.every is not None or (isinstance(s, ir.OpCall) and self._clocked(s.op)):
                return True
            if isinstance(s, ir.If) and (any(self._uses_clock(b.body) for b in s.branches)
                                         or self._uses_clock(s.orelse or ())):
                return True
        return False

    def _clocked(self, op: str) -> bool:
        spec = self.ops.get(op)
        try:
            return spec is not None and getattr(resolve_impl(spec), "wants_clock", False)
        except RunError:
            return False  # visit_OpCall says why

    def _read(self, name: str) -> str:
        """A blob read: G's when the task never stores the name (a private workspace's
        miss reads G through its __missing__: two lookups and a call more, 1k instructions
        a read of the model, optimizer or reader at every step), else the workspace's."""
        return f"G[{name!r}]" if self.private and name not in self.stored else f"L[{name!r}]"

    # -- conditions -----------------------------------------------------------------------
    def _test(self, ref: ir.BlobRef) -> str:
        """Python's test of blob `ref`'s truth: a bool without a call, False first."""
        return f"(v := {self._read(ref.name)}) is not False and (v is True or (v is not None and truthy(v)))"

    def _read_failure(self, ref: ir.BlobRef, what: str) -> Handler:
        """The handler of a line that reads blob `ref` (for `what`) and tests its truth."""

        def failed(e: BaseException) -> None:
            if isinstance(e, KeyError):
                raise RunError(
                    f"{what}: blob {ref.name!r} is not defined on node {self.node!r}",
                    ref.pos, "define it earlier (e.g. in the init group)",
                ) from None
            if isinstance(e, JobrunError):
                raise RunError(f"blob {ref.name!r}: {e.message}", ref.pos, e.hint) from None

        return failed

    def visit_StopIf(self, s: ir.StopIf) -> None:
        code = self.code
        handler = self._read_failure(s.cond, "stop_if")
        with code.step(s.pos, f"stop_if {s.cond.name}", handler), code.block(f"if {self._test(s.cond)}:"):
            code.line(code.stop())

    def visit_If(self, s: ir.If) -> None:
        code = self.code
        for k, branch in enumerate(s.branches):
            keyword = "if" if k == 0 else "elif"
            handler = self._read_failure(branch.cond, "if")
            with (
                code.step(branch.pos, f"{keyword} {branch.cond.name}", handler),
                code.block(f"{keyword} {self._test(branch.cond)}:"),
            ):
                self.visit_block(branch.body)
        if s.orelse is not None:
            with code.step(s.pos, "else"), code.block("else:"):
                self.visit_block(s.orelse)

    # -- loops ----------------------------------------------------------------------------
    def visit_Loop(self, s: ir.Loop) -> None:
        code = self.code
        i, n, it, shown, before = (code.fresh(x) for x in ("i", "n", "it", "shown", "before"))
        with code.step(s.pos, "loop"), self._timed(s.pos, "loop"):
            if isinstance(s.count, ir.BlobRef):
                with code.step(s.pos, "loop", self._read_failure(s.count, "loop count")):
                    code.line(f"{n} = {self._read(s.count.name)}")
                with code.block(f"if {n}.__class__ is not int or {n} < 0:"):
                    code.line(f"{n} = {code.value('as_int', functools.partial(runtime.as_int, s=s))}({n})")
            elif s.count is not None:
                code.env[n] = s.count
            outer, self.means = self.means, {}
            for name in _step_losses(s.body):
                self.means[name] = (code.fresh("losses"), code.fresh("blocks"))
                code.line(f"{self.means[name][0]} = []; {self.means[name][1]} = []")
            outer_clock, self.clock = self.clock, (code.fresh("clock") if self._uses_clock(s.body) else None)
            entry, now = code.fresh("entry"), code.fresh("now")
            if self.max_steps is not None:
                code.line(f"{entry} = C.get({STEP_COUNTER!r}, 0)")
            # The live display shows the innermost running loop: its iterator, which the
            # display asks how far it went (a statement less in every iteration).
            # A `report`'s loops run beside the job's in a thread: never shown.
            code.line(f"{it} = iter({'FOREVER' if s.count is None else f'range({n})'})")
            if not self.reporting:
                key = f"{self.task.name}/{shown}"  # the loop's, for the display's totals
                code.line(f"{shown} = ({key!r}, {it}, {'None' if s.count is None else n}, NOW())")
                code.line(f"{before} = PROGRESS.get('loop'); PROGRESS['loop'] = LOOPS[{key!r}] = {shown}")
            with code.loop(f"for {i} in {it}:"):
                if self.max_steps is not None:
                    # The epoch ends once the global step reaches max_steps: each loop that
                    # took optimizer steps stops there; one that takes none (an evaluation
                    # over a reader, after the training loop) runs to its end.
                    with code.block(f"if ({now} := C.get({STEP_COUNTER!r}, 0)) >= MAX_STEPS and {now} != {entry}:"):
                        code.line("break")
                if self.clock is not None:
                    code.line(f"{self.clock} = C.get({STEP_COUNTER!r}, 0)")
                trace = self.profile.trace if self.profile is not None else None
                if trace is not None and self.task.group == "epoch" and not _has_loop(s.body):
                    code.line(f"{code.value('trace_step', trace.step)}()")
                if s.index is not None:
                    self._store(s.index.name, i)
                self.visit_block(s.body)
            if not self.reporting:  # the loop shown before (enclosing, or a branch's) again
                with code.block(f"if {before} is not None and PROGRESS.get('loop') is {shown}:"):
                    code.line(f"PROGRESS['loop'] = {before}")
            self.clock = outer_clock
            means, self.means = self.means, outer
            self._store_means(means)

    def _store_means(self, means: dict[str, tuple[str, str]]) -> None:
        """After a loop of train.steps, its output holds the mean over the loop's steps
        (Lightning's on_epoch loss: what the epoch line, log and outputs show);
        `<name>_last` keeps the last step's value."""
        code = self.code
        for name, (losses, blocks) in means.items():
            with code.block(f"if {losses} or {blocks}:"):
                self._store(name, f"LOSS_MEAN({blocks}, {losses})")

    # -- concurrency ----------------------------------------------------------------------
    def visit_Parallel(self, s: ir.Parallel) -> None:
        code = self.code
        branches = []
        outer, self.means = self.means, None  # a function of its own: no loop's sums here
        outer_clock, self.clock = self.clock, None  # another function: the clock as it runs
        for b in s.branches:
            branches.append(code.fresh("branch", b.name or ""))
            with code.function(branches[-1], "L"):
                self.visit_block(b.body)
        self.means, self.clock = outer, outer_clock
        thunks = "".join(f"partial({b}, L), " for b in branches)
        call = f"run_concurrently(({thunks}), 'parallel')"
        with code.step(s.pos, "parallel"), code.block(f"if {call}:"):
            code.line(code.stop())

    def visit_Report(self, s: ir.Report) -> None:
        code = self.code
        body = code.fresh("report")
        outer, outer_clock, outer_reporting = self.means, self.clock, self.reporting
        self.means, self.clock, self.reporting = None, None, True
        with code.function(body, "L"):
            self.visit_block(s.body)
        self.means, self.clock, self.reporting = outer, outer_clock, outer_reporting
        with code.step(s.pos, f"report every {s.period_text}"):
            code.line(f"{self.reports}.start({code.value('period', s.period)}, partial({body}, L))")


def _step_losses(body: tuple[ir.Step, ...]) -> list[str]:
    """The outputs of the train.steps a loop runs itself (not in a loop, parallel or
    report of its own)."""
    out: list[str] = []
    for step in body:
        if isinstance(step, ir.OpCall):
            if step.op == "train.step" and step.outs and step.outs[0].name not in out:
                out.append(step.outs[0].name)
        elif not isinstance(step, ir.Loop | ir.Parallel | ir.Report):
            out += [n for block in children(step) for n in _step_losses(block) if n not in out]
    return out


def _has_loop(steps: tuple[ir.Step, ...]) -> bool:
    return any(isinstance(s, ir.Loop) or any(_has_loop(b) for b in children(s)) for s in steps)
