"""The `jobrun` command line: thin click commands.

This is the only place that prints errors and picks exit codes. Everything heavy (torch,
the runner, rich) is imported inside the command that needs it, so `jobrun --help`,
`print` and `analyze` start fast and never import torch.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from jobrun import signals

signals.defer()  # before any heavy import: see jobrun/signals.py

import click  # noqa: E402

from jobrun import __version__, hints  # noqa: E402
from jobrun.errors import SECONDS_SETTINGS, Interrupted, JobrunError, env_seconds  # noqa: E402


class _Group(click.Group):
    """Turns every JobrunError into one clear message and its exit code: no traceback."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (JobrunError, Interrupted) as e:
            click.echo(e.format_message(), err=True)
            ctx.exit(e.exit_code)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            ctx.exit(130)
        finally:
            signals.end_start_up()

    def resolve_command(self, ctx: click.Context, args: list[str]) -> Any:
        name = args[0] if args else ""
        if name not in self.commands and name.endswith((".yaml", ".yml")):  # `jobrun plan.yaml`
            raise click.UsageError(f"No such command {name!r}: the command comes first, then the plan, "
                                   f"e.g. `{hints.train_again(name, ())}` (or print, analyze)", ctx)
        return super().resolve_command(ctx, args)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="jobrun")
@click.pass_context
def main(ctx: click.Context) -> None:
    """Run PyTorch training jobs described by YAML plans.

    \b
    jobrun train plans/mlp.yaml      train in a new runs/<job>/<N> (checkpoints every epoch)
    jobrun resume [RUN_DIR]          continue a run (default: the latest) where it stopped
    jobrun runs [DIR]                list the runs: status, epochs, best value, overrides
    jobrun print plans/mlp.yaml      the plan as readable pseudo-code
    jobrun analyze plans/mlp.yaml    check the plan before running it
    """
    for name in SECONDS_SETTINGS:  # a bad one is refused now, before anything is written
        env_seconds(name)
    hints.act_on(None)  # a run is named to hints once the command picks one
    if ctx.invoked_subcommand in ("train", "resume"):
        # They check the plan, the overrides and the run directory before importing
        # torch; until they write, a signal ends them at once (jobrun/signals.py).
        signals.exit_at_once()
    else:
        signals.interruptible(phase="")  # "interrupted (SIGINT)": there is no start-up to speak of


_sets = click.option(
    "--set", "sets", multiple=True, metavar="KEY=VALUE",
    help="Override a plan value by dotted path (vars.lr=0.05, epoch.0.do.1.loop=20).",
)
class _EpochType(click.ParamType):
    """An epoch number, `latest` (the latest complete checkpoint) or `best` (the best
    epoch by the plan's checkpoint.best)."""

    name = "N|latest|best"

    def convert(self, value: Any, param: Any, ctx: Any) -> int | str:
        if isinstance(value, int) or value in ("best", "latest"):
            return value
        text = str(value).strip()
        if text.isascii() and text.isdigit():
            if len(text.lstrip("0")) > 9:  # no run has a billion epochs; int() of 5,000 digits raises
                self.fail(f"{text[:20]}{'...' if len(text) > 20 else ''} is not an epoch: "
                          "it has more than 9 digits", param, ctx)
            return int(text)
        self.fail(f"{value!r} is not an epoch: give a number >= 0, latest or best", param, ctx)


_EPOCH = _EpochType()
_max_restarts = click.option(
    "--max-restarts", type=click.IntRange(0, 1000),
    help="When a replica dies, restart every rank from the latest checkpoint, up to N times.",
)
_PROFILES = ("steps", "torch")
_profile = click.option(
    "--profile", type=click.Choice(_PROFILES), is_flag=False, flag_value="steps",
    help="Time every plan step (table at the end and in RUN_DIR/profile.txt); "
         "--profile torch also records a torch.profiler trace of a few steady-state steps.",
)
_profile_steps = click.option(
    "--profile-steps", type=click.IntRange(1, 1000), metavar="N",
    help="Trace N loop iterations with torch.profiler (implies --profile torch).",
)


class _Profiled(click.Command):
    """A command with `--profile [steps|torch]`: the option takes the word after it only
    when that is one of its values, so `--profile max_epochs=3` (or `--profile RUN_DIR`)
    times the steps and leaves the word to the command (click would take it as the value
    and refuse it)."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        args = list(args)
        for i, arg in enumerate(args):
            if arg == "--":
                break
            if arg == "--profile" and (i + 1 == len(args) or args[i + 1] not in _PROFILES):
                args[i] = "--profile=steps"
        return super().parse_args(ctx, args)


def _profile_level(profile: str | None, steps: int | None) -> int | None:
    """None: off; 0: step times; N: also a torch trace of N iterations."""
    from jobrun.runner.profile import TORCH_STEPS

    if steps is not None:
        return steps
    return None if profile is None else TORCH_STEPS if profile == "torch" else 0


_format = click.option(
    "--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True,
    help="json: machine-readable (= --json).",
)
_json = click.option("--json", "as_json", is_flag=True, help="Machine-readable output (JSON).")
_run_arg = click.argument("run_dir", required=False, type=click.Path(file_okay=False))


def _pick(run_dir: str | None) -> str:
    """The run a command works on: the one given, else the latest (it says which); its
    messages' hints name it (jobrun/hints.py)."""
    from jobrun.runner.runs import pick

    path = str(pick(run_dir))
    hints.act_on(path)
    return path


def _compile(plan: str, sets: tuple[str, ...] = ()):
    from jobrun.plans.compile import compile_file

    return compile_file(plan, sets)


@main.command("print")
@click.argument("plan", type=click.Path(dir_okay=False))
@click.argument("overrides", nargs=-1, metavar="[KEY=VALUE]...")
@click.option("--factor-prefixes", is_flag=True, help="Write enc/[w, b] for enc/w, enc/b.")
@_format
@_json
@_sets
def print_cmd(plan: str, overrides: tuple[str, ...], factor_prefixes: bool, fmt: str, as_json: bool,
              sets: tuple[str, ...]) -> None:
    """Show the whole job as readable pseudo-code (after KEY=VALUE overrides, as train)."""
    from jobrun.plans import printer

    fmt = "json" if as_json else fmt
    p = _compile(plan, _positional(sets, overrides))
    if fmt == "json":
        click.echo(json.dumps(printer.render_json(p), indent=2))
        return
    text = printer.render_text(p, factor_prefixes=factor_prefixes)
    if sys.stdout.isatty():
        from jobrun.plans.colour import print_rich

        print_rich(text)
    else:
        click.echo(text, nl=not text.endswith("\n"))


@main.command()
@click.argument("plan", type=click.Path(dir_okay=False))
@click.argument("overrides", nargs=-1, metavar="[KEY=VALUE]...")
@_format
@_json
@_sets
def analyze(plan: str, overrides: tuple[str, ...], fmt: str, as_json: bool, sets: tuple[str, ...]) -> None:
    """Check a plan: undefined blobs, races, unknown ops and arguments, stop conditions.

    Exit 0 when clean, 1 when errors were found, 2 when the file cannot be read as a plan.
    """
    from jobrun.plans.analyze import analyze as run_analysis

    fmt = "json" if as_json else fmt
    try:
        p = _compile(plan, _positional(sets, overrides))
    except JobrunError as e:
        if fmt == "json":
            click.echo(json.dumps({"diagnostics": [_error_json(e)], "errors": 1, "warnings": 0}, indent=2))
            sys.exit(e.exit_code)
        raise
    diags = run_analysis(p)
    errors = sum(d.severity == "error" for d in diags)
    warnings = len(diags) - errors
    if fmt == "json":
        from jobrun.plans.state import checkpointed

        held = {node: list(names) for node, names in checkpointed(p).items()} if p.checkpoint else None
        click.echo(json.dumps(
            {"diagnostics": [d.to_json() for d in diags], "errors": errors, "warnings": warnings,
             "checkpointed": held},
            indent=2,
        ))
    else:
        for d in diags:
            click.echo(d.format())
        summary = f"{plan}: {errors} error(s), {warnings} warning(s)" if diags else f"{plan}: ok"
        click.echo(summary, err=True)
    sys.exit(1 if errors else 0)


def _error_json(e: JobrunError) -> dict[str, Any]:
    pos = e.pos
    return {
        "severity": "error", "code": "plan", "message": e.message, "hint": e.hint,
        "file": pos.file if pos else None, "line": pos.line if pos else None,
        "col": pos.col if pos else None,
    }


@main.command()
@click.argument("name", required=False)
@_json
def ops(name: str | None, as_json: bool) -> None:
    """List the ops, or show one op's signature."""
    from jobrun.ops import describe

    if name is None:
        click.echo(describe.list_ops(as_json=as_json))
    else:
        click.echo(describe.show_op(name, as_json=as_json))


@main.command()
@click.argument("name", required=False)
@click.option("--from", "example", default="mlp", show_default=True, help="The example to start from.")
@click.option("--list", "show_list", is_flag=True, help="List the bundled examples.")
def new(name: str | None, example: str, show_list: bool) -> None:
    """Start a plan from a bundled example: NAME/plan.yaml (and its models/, data/)."""
    from jobrun import scaffold

    if show_list:
        click.echo(scaffold.list_text())
        return
    if name is None:
        raise _usage("give a NAME for the new plan", "e.g. `jobrun new my-job --from cnn`; "
                                                     "`jobrun new --list` shows the examples")
    dest = scaffold.create(name, example)
    click.echo(f"wrote {dest}/ from the {example!r} example; train it with `jobrun train {dest / 'plan.yaml'}`")


@main.command()
@click.option("-o", "--output", type=click.Path(dir_okay=False), help="Write to a file.")
def schema(output: str | None) -> None:
    """Print a JSON Schema of the plan format (for editor completion and checks)."""
    from jobrun.plans.schema import plan_schema

    text = json.dumps(plan_schema(), indent=2)
    if output:
        from jobrun import safefs

        try:
            safefs.write_atomic(Path(output), (text + "\n").encode(), durable=False)
        except OSError as e:
            raise _usage(f"cannot write {output}: {e.strerror or e}", "give another -o") from None
        click.echo(f"wrote {output}", err=True)
    else:
        click.echo(text)


@main.command(cls=_Profiled)
@click.argument("plan", type=click.Path(dir_okay=False))
@click.argument("overrides", nargs=-1, metavar="[KEY=VALUE]...")
@click.option("--run-dir", type=click.Path(file_okay=False),
              help="Train in this directory (refused if it holds checkpoints). Default: a new runs/<job>/<N>.")
@_sets
@click.option("--replicas", type=click.IntRange(1, 1024), help="Data-parallel processes on this host.")
@click.option("--device", help="auto, cpu, cuda or cuda:N (overrides the plan).")
@_max_restarts
@click.option("--overwrite", is_flag=True,
              help="Replace the run in --run-dir (checkpoints included) instead of refusing it.")
@_profile
@_profile_steps
def train(plan: str, overrides: tuple[str, ...], run_dir: str | None, sets: tuple[str, ...],
          replicas: int | None, device: str | None, max_restarts: int | None, overwrite: bool,
          profile: str | None, profile_steps: int | None) -> None:
    """Train a plan from scratch: init, checkpoint 0, epochs, download, exit.

    KEY=VALUE overrides after the plan mean what --set means (vars.lr=0.05 max_epochs=3).
    """
    from jobrun.plans.keys import DEVICE
    from jobrun.runner.launch import train as run_train

    if device is not None and not DEVICE.match(device):
        raise _usage(f"bad --device {device!r}", "use auto, cpu, cuda or cuda:N")
    sys.exit(run_train(plan, run_dir, _positional(sets, overrides), replicas, device, overwrite,
                       max_restarts, profile=_profile_level(profile, profile_steps)))


@main.command(cls=_Profiled)
@click.argument("args", nargs=-1, metavar="[RUN_DIR] [KEY=VALUE]...")
@click.option("--run-dir", type=click.Path(file_okay=False), hidden=True, help="= RUN_DIR.")
@click.option("--epoch", type=_EPOCH,
              help="Default: latest (the latest complete checkpoint); best: the best by checkpoint.best.")
@click.option("--replicas", type=click.IntRange(1, 1024),
              help="Go on with this many replicas (default: as many as the run had).")
@_max_restarts
@click.option("--force", is_flag=True,
              help="Resume although init built other data than when the run started.")
@_sets
@_profile
@_profile_steps
def resume(args: tuple[str, ...], run_dir: str | None, epoch: int | str | None,
           replicas: int | None, max_restarts: int | None, force: bool, sets: tuple[str, ...],
           profile: str | None, profile_steps: int | None) -> None:
    """Continue a run (default: the latest) from a checkpoint, exactly where it stopped.

    Overrides change the plan from here on: `jobrun resume max_epochs=20` extends a
    finished run; other changes are allowed with a warning (the result is no longer the
    one an uninterrupted run gives) and are recorded in run.json. `--replicas M` goes on
    with M replicas from a checkpoint of another number (docs/multi-host.md says what is kept).
    """
    from jobrun.runner.launch import resume as run_resume

    _positional(sets, ())  # a --set without its KEY=VALUE
    dirs = [a for a in args if "=" not in a]
    if len(dirs) > 1 or (dirs and run_dir):
        raise _usage(f"give one run directory, not {' and '.join([*([run_dir] if run_dir else []), *dirs])}",
                     "overrides are KEY=VALUE (e.g. max_epochs=20)")
    given = dirs[0] if dirs else run_dir
    path = given if given is not None or _under_torchrun() else _pick(None)
    overrides = tuple(a for a in args if "=" in a)
    options = [("--epoch", str(epoch)) if epoch not in (None, "latest") else (),
               ("--replicas", str(replicas)) if replicas is not None else (),
               ("--max-restarts", str(max_restarts)) if max_restarts is not None else (),
               ("--force",) if force else ()]
    hints.act_on(path, [*((s,) for s in sets + overrides), *filter(None, options)])
    sys.exit(run_resume(path, None if epoch == "latest" else epoch, sets + overrides, replicas,
                        max_restarts, force=force, profile=_profile_level(profile, profile_steps)))


def _under_torchrun() -> bool:
    from jobrun.runner.launch import under_torchrun

    return under_torchrun()


def _positional(sets: tuple[str, ...], overrides: tuple[str, ...]) -> tuple[str, ...]:
    """The --set values, then the KEY=VALUE arguments after the plan (Hydra's style), which
    mean what --set means. A --set given no value took the option after it as its value."""
    for item in sets:
        if item.startswith("--"):
            raise _usage(f"--set has no KEY=VALUE (it took {item!r}, the option after it)",
                         "write --set KEY=VALUE, e.g. --set max_epochs=3")
    for item in overrides:
        if "=" not in item:
            raise _usage(f"unexpected argument {item!r}",
                         "overrides are KEY=VALUE (e.g. max_epochs=3 vars.lr=0.05)")
    return sets + overrides


def _usage(message: str, hint: str | None = None):
    from jobrun.errors import UsageError

    return UsageError(message, hint=hint)


@main.command("plot")
@click.argument("run_dirs", nargs=-1, type=click.Path(file_okay=False), metavar="[RUN_DIR]...")
@click.option("-o", "--output", type=click.Path(dir_okay=False),
              help="A .png file. Default: RUN_DIR/metrics.png (one run), ./metrics.png (several).")
@click.option("--metric", "metrics", multiple=True, help="Only this metric (repeatable). Default: all.")
@click.option("--x", "x", type=click.Choice(["auto", "step", "epoch"]), default="auto", show_default=True,
              help="The x-axis: the global steps the values were logged at, or epochs "
                   "(auto: steps when the run took optimizer steps).")
def plot_cmd(run_dirs: tuple[str, ...], output: str | None, metrics: tuple[str, ...], x: str) -> None:
    """Draw the values runs logged against epochs or steps (default: the latest run; several: overlaid)."""
    from jobrun.runner.plot import plot

    click.echo(f"wrote {plot(list(run_dirs) or [_pick(None)], output, metrics, x)}")


@main.command("runs")
@click.argument("root", required=False, type=click.Path(exists=True, file_okay=False), metavar="[DIR]")
@_json
def runs_cmd(root: str | None, as_json: bool) -> None:
    """List the runs under DIR (default ./runs; DIR itself when it is a run): job, status,
    epochs, best monitored value, start, overrides."""
    from jobrun.runner.runs import ROOT, runs_text

    click.echo(runs_text(as_json, ROOT if root is None else Path(root)))


@main.group()
def ckpt() -> None:
    """Inspect the checkpoints of a run (default: the latest run)."""


@ckpt.command("list")
@_run_arg
@click.option("--verify", is_flag=True, help="Also check every file's checksums (reads everything).")
@_json
def ckpt_list(run_dir: str | None, verify: bool, as_json: bool) -> None:
    """Epochs, nodes, sizes, save times, and whether each checkpoint is valid."""
    from jobrun.runner import inspect

    click.echo(inspect.list_text(_pick(run_dir), verify=verify, as_json=as_json))


@ckpt.command("verify")
@_run_arg
@click.option("--epoch", type=_EPOCH, help="Only this epoch (N, latest or best). Default: every epoch.")
@_json
def ckpt_verify(run_dir: str | None, epoch: int | str | None, as_json: bool) -> None:
    """Read every checkpoint file and check its checksums. Exit 1 when one is damaged."""
    from jobrun.runner import inspect

    path = _pick(run_dir)
    rows = json.loads(inspect.list_text(path, verify=True, as_json=True))["checkpoints"]
    if epoch is not None:
        wanted = inspect.epoch_of(path, epoch)
        chosen = [r for r in rows if r["epoch"] == wanted]
        if not chosen:
            raise _usage(f"{path} has no checkpoint of epoch {wanted}",
                         inspect.present((r["epoch"] for r in rows), Path(path)))
        rows = chosen
    bad = [r for r in rows if not r["valid"] and not r["on_other_hosts"]]
    if as_json:
        click.echo(json.dumps({"run_dir": path, "checked": rows, "damaged": len(bad)}, indent=2))
    else:
        for r in rows:
            incomplete = bool(r["world_size"]) and r["ranks"] < r["world_size"]  # a rank never saved
            state = "ok" if r["valid"] else "on other hosts" if r["on_other_hosts"] else \
                f"{'INCOMPLETE' if incomplete else 'DAMAGED'}: {r['problem']}"
            click.echo(f"epoch {r['epoch']} node {r['node']}: {state}")
        click.echo(f"{path}: {len(rows) - len(bad)} of {len(rows)} checkpoint(s) intact", err=True)
    sys.exit(1 if bad else 0)


@ckpt.command("show")
@_run_arg
@click.option("--epoch", type=_EPOCH, default="latest", show_default=True,
              help="N, latest (complete) or best (by checkpoint.best).")
@click.option("--node", help="Default: every node.")
@click.option("--rank", type=click.IntRange(0), default=0, show_default=True)
@click.option("--blob", "blobs", multiple=True, help="Only these blobs (repeatable).")
@click.option("--values", is_flag=True, help="Also the values of tensors (default: dtype and shape).")
@click.option("--json", "as_json", is_flag=True,
              help="One JSON object: every value in full (tensors as nested lists), dtypes and shapes.")
def ckpt_show(run_dir: str | None, epoch: int | str, node: str | None, rank: int, blobs: tuple[str, ...],
              values: bool, as_json: bool) -> None:
    """Print the blobs of one checkpoint: tensors as dtype and shape, other values."""
    from jobrun.runner import inspect

    click.echo(inspect.show_text(_pick(run_dir), epoch, node, rank, blobs, as_json=as_json, values=values))


@main.command("export")
@_run_arg
@click.option("--epoch", type=_EPOCH, default="latest", show_default=True,
              help="N, latest (complete) or best (by checkpoint.best).")
@click.option("--best", is_flag=True, help="= --epoch best.")
@click.option("--node", help="Default: the job's first node.")
@click.option("--blob", "blobs", multiple=True, required=True, help="Blob to export (repeatable).")
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False),
              help="A .safetensors, .json or .pt file.")
def export_cmd(run_dir: str | None, epoch: int | str, best: bool, node: str | None,
               blobs: tuple[str, ...], output: str) -> None:
    """Write chosen blobs of one checkpoint to a file.

    One blob holding a module is written with the module's own state_dict keys (0.weight),
    for `model.load_state_dict(...)`; several blobs as blob.key (model.0.weight, ...).
    """
    from jobrun.runner import inspect

    if best and epoch not in ("best", "latest"):
        raise _usage(f"give --best or --epoch {epoch}, not both")
    path = inspect.export(_pick(run_dir), "best" if best else epoch, node, blobs, output)
    click.echo(f"wrote {path}")
