"""The examples of docs/plan-language.md are true.

Every ```yaml block of the page is checked, and a failure names the line of the block:

- a whole plan (a mapping with `job:`) compiles and analyzes clean (no error, no warning);
- a block whose first line is `# error: TEXT` must fail to compile or analyze with TEXT
  in the message (the page shows what is refused);
- a list of steps, a list of tasks or a few top-level keys is wrapped into a minimal
  plan, which must compile; `analyze` may only miss blobs the snippet takes as given.

Messages give the page's line numbers (a snippet's columns are shifted by the wrapper's
indentation).

A ```text block of `$ jobrun ...` commands runs them on the plan it shows (the plan its
output names, else the nearest whole plan above it) in a temporary directory, and
compares what they print with the page: durations and checkpoint sizes are masked,
floats may differ in their last digits, and a `...` line stands for any lines. The line
`train` prints to name the new run directory (runs/<job>/<N>) is not shown on the page.
"""

from __future__ import annotations

import functools
import json
import math
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from runner_util import jobrun

from jobrun.errors import JobrunError
from jobrun.plans.analyze import analyze
from jobrun.plans.compile import compile_text

DOC = Path(__file__).resolve().parent.parent / "docs" / "plan-language.md"
SHOWN = "docs/plan-language.md"
# What a snippet may leave undefined: the blobs and outputs it takes as given.
SNIPPET_GAPS = {"undefined-blob", "undefined-output", "stop-when"}


@dataclass(frozen=True)
class Block:
    lang: str
    line: int  # of the opening fence, 1-based
    text: str

    @property
    def where(self) -> str:
        return f"{SHOWN}:{self.line}"


def _blocks(text: str) -> list[Block]:
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        m = re.match(r"```(\w*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        start, i = i, i + 1
        while i < len(lines) and lines[i].rstrip() != "```":
            i += 1
        assert i < len(lines), f"{SHOWN}:{start + 1}: code block is never closed"
        blocks.append(Block(m.group(1), start + 1, "\n".join(lines[start + 1 : i]) + "\n"))
        i += 1
    return blocks


@functools.cache
def _schema() -> dict:
    """The plan format as `jobrun schema` gives it to users: the keys there are."""
    r = jobrun("schema")
    assert r.code == 0, r.text
    return json.loads(r.out)


BLOCKS = _blocks(DOC.read_text(encoding="utf-8"))
YAML_BLOCKS = [b for b in BLOCKS if b.lang == "yaml"]
RUN_BLOCKS = [b for b in BLOCKS if b.lang == "text" and b.text.startswith("$ jobrun ")]


def _data(block: Block):
    try:
        return yaml.safe_load(block.text)
    except yaml.YAMLError:
        return None  # an `# error:` block may be bad YAML on purpose


def _is_plan(block: Block) -> bool:
    data = _data(block)
    return isinstance(data, dict) and "job" in data


def _expected_error(block: Block) -> str | None:
    m = re.match(r"# error: (.+)", block.text)
    return m.group(1).strip() if m else None


def _wrap(block: Block) -> str:
    """A minimal plan around a snippet, whose lines stay where they are on the page."""
    data = _data(block)
    head = "job: doc-snippet\nmax_epochs: 1\n"
    if isinstance(data, list) and all(isinstance(s, dict) and "task" in s for s in data):
        return _at_line(block, head + "epoch:\n", _indent(block.text, 2))
    if isinstance(data, list):
        return _at_line(block, head + "epoch:\n  - task: snippet\n    do:\n", _indent(block.text, 6))
    if isinstance(data, dict) and set(data) <= set(_schema()["properties"]) - {"job", "max_epochs"}:
        body = "" if "epoch" in data else "epoch:\n  - task: snippet\n    do: [{log: {}}]\n"
        return _at_line(block, head + body, block.text)
    pytest.fail(f"{block.where}: a yaml block must be a plan, a list of steps or tasks, or top-level keys")


def _at_line(block: Block, head: str, body: str) -> str:
    """`head` then `body`, with `body` starting on the line after the block's fence:
    messages then give the page's own line numbers (blank lines are nothing in YAML)."""
    assert head.count("\n") <= block.line
    return "\n" * (block.line - head.count("\n")) + head + body


def _indent(text: str, n: int) -> str:
    return "".join(" " * n + line if line.strip() else line for line in text.splitlines(True))


def _diagnostics(block: Block, text: str):
    try:
        plan = compile_text(text, filename=SHOWN)
    except JobrunError as e:
        return e.format_message(), []
    return None, analyze(plan)


@pytest.mark.parametrize("block", YAML_BLOCKS, ids=[f"line{b.line}" for b in YAML_BLOCKS])
def test_yaml_example(block: Block) -> None:
    wanted = _expected_error(block)
    if wanted is not None:
        failure, diags = _diagnostics(block, _at_line(block, "", block.text))
        messages = [failure] if failure else [d.format() for d in diags if d.severity == "error"]
        assert any(wanted in m for m in messages), (
            f"{block.where}: the page says this plan fails with {wanted!r}; got {messages or 'no error'}"
        )
        return
    if _is_plan(block):
        failure, diags = _diagnostics(block, _at_line(block, "", block.text))
        assert failure is None, f"{block.where}: the plan does not compile:\n{failure}"
        assert not diags, f"{block.where}: analyze is not clean:\n" + "\n".join(d.format() for d in diags)
        return
    failure, diags = _diagnostics(block, _wrap(block))
    assert failure is None, f"{block.where}: the snippet does not compile in a minimal plan:\n{failure}"
    bad = [d.format() for d in diags if d.severity == "error" and d.code not in SNIPPET_GAPS]
    assert not bad, f"{block.where}: analyze finds errors in the snippet:\n" + "\n".join(bad)


# -- commands and their output -------------------------------------------------------------


def _plan_for(run: Block) -> Block:
    named = re.search(r"^job: (\S+)$|^job '([^']+)' finished", run.text, re.M)
    plans = [b for b in YAML_BLOCKS if _is_plan(b) and _expected_error(b) is None]
    if named:
        job = named.group(1) or named.group(2)
        found = [b for b in plans if _data(b)["job"] == job]
        assert found, f"{run.where}: the output names job {job!r}, which no plan on the page has"
        return found[0]
    above = [b for b in plans if b.line < run.line]
    assert above, f"{run.where}: no plan above these commands"
    return above[-1]


def _commands(run: Block) -> list[tuple[list[str], list[str]]]:
    """(argv after `jobrun`, expected output lines) for each `$ jobrun` line."""
    out: list[tuple[list[str], list[str]]] = []
    for line in run.text.splitlines():
        if line.startswith("$ "):
            argv = shlex.split(line[2:])
            assert argv[0] == "jobrun" and argv[1] in ("train", "print", "analyze"), (
                f"{run.where}: cannot run {line!r} here"
            )
            out.append((argv[1:], []))
        else:
            out[-1][1].append(line)
    return out


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:e[-+]?\d+)?")


def _masked(line: str) -> str:
    line = re.sub(r"\b\d+\.\d\ds\b", "<time>", line.rstrip())
    # Throughput and peak memory depend on the machine: a page may leave them out.
    line = re.sub(r"(  \S+ (?:samples|tokens)/s)?(  data \d+%)?  peak \d+(?:\.\d)? [KMGT]?B", "", line)
    return re.sub(r"\bckpt .*$", "ckpt <saved>", line)


def _same_line(shown: str, got: str) -> bool:
    shown, got = _masked(shown), _masked(got)
    if _NUMBER.sub("#", shown) != _NUMBER.sub("#", got):
        return False
    for a, b in zip(_NUMBER.findall(shown), _NUMBER.findall(got), strict=True):
        if "." not in a + b and "e" not in a + b:
            if a != b:
                return False
        elif not math.isclose(float(a), float(b), rel_tol=0.02, abs_tol=0.005):
            return False
    return True


def _matches(shown: list[str], got: list[str]) -> bool:
    """`got` is `shown`, where a `...` line of `shown` stands for any lines."""
    if not shown:
        return not got
    if shown[0] == "...":
        return any(_matches(shown[1:], got[k:]) for k in range(len(got) + 1))
    return bool(got) and _same_line(shown[0], got[0]) and _matches(shown[1:], got[1:])


@pytest.fixture
def one_thread(monkeypatch):
    """Train with one torch thread: the machine is shared, and results do not depend on
    it here; the process's own count is restored for the tests that follow."""
    import torch

    threads = torch.get_num_threads()
    monkeypatch.setenv("JOBRUN_THREADS", "1")
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("run", RUN_BLOCKS, ids=[f"line{b.line}" for b in RUN_BLOCKS])
def test_shown_output(run: Block, tmp_path, monkeypatch, one_thread) -> None:
    plan = _plan_for(run)
    (tmp_path / "plan.yaml").write_text(plan.text)
    monkeypatch.chdir(tmp_path)
    for argv, shown in _commands(run):
        r = jobrun(*argv)
        got = [g for g in (r.out + r.err).splitlines() if not g.startswith("run directory runs/")]
        assert r.code == 0, f"{run.where}: `jobrun {' '.join(argv)}` failed:\n{r.text}"
        assert _matches([s.rstrip() for s in shown], [g.rstrip() for g in got]), (
            f"{run.where}: `jobrun {' '.join(argv)}` on the plan at line {plan.line} prints\n"
            + "\n".join(got) + "\n-- the page shows --\n" + "\n".join(shown)
        )


# -- coverage of the language --------------------------------------------------------------


def test_every_op_and_key_is_documented() -> None:
    """A new op (of jobrun's own) or a new plan key fails here until the page has it."""
    text = DOC.read_text(encoding="utf-8")
    table = text.split("### 7.1 The op table", 1)[1].split("### 7.2", 1)[0]
    r = jobrun("ops", "--json")
    assert r.code == 0, r.text
    ops = [op["name"] for op in json.loads(r.out) if op["category"] != "user"]
    missing = [name for name in ops if f"`{name}`" not in table]
    assert not missing, f"{SHOWN}: the op table lacks {missing}"
    defs = _schema()["$defs"]
    keys = {*_schema()["properties"], *defs["task"]["properties"], *defs["checkpoint"]["properties"]}
    for step in ("loop", "stop_if", "if", "parallel", "report"):
        keys |= set(defs[step]["properties"])
    missing = sorted(k for k in keys if f"`{k}`" not in text and f"{k}:" not in text)
    assert not missing, f"{SHOWN}: nothing documents the keys {missing}"


def test_every_example_kind_is_present() -> None:
    """The checks above run on something: plans, errors, snippets and shown runs."""
    plans = [b for b in YAML_BLOCKS if _is_plan(b) and _expected_error(b) is None]
    errors = [b for b in YAML_BLOCKS if _expected_error(b) is not None]
    snippets = [b for b in YAML_BLOCKS if not _is_plan(b) and _expected_error(b) is None]
    trained = [r for r in RUN_BLOCKS if "$ jobrun train" in r.text]
    assert len(plans) >= 6 and len(errors) >= 2 and len(snippets) >= 5 and len(trained) >= 5
    assert "../shared" not in DOC.read_text(encoding="utf-8")


# -- the README and docs/ as a user's guide --------------------------------------------------

ROOT = DOC.parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]


def test_readme_starts_with_install_and_run_then_the_tests() -> None:
    text = README.read_text(encoding="utf-8")
    first = _blocks(text)[0]
    lines = first.text.splitlines()
    assert first.lang == "bash" and len(lines) == 2
    assert "torch==2.13.0" in lines[0] and lines[0].endswith("jobrun train plans/mlp.yaml")
    assert "download.pytorch.org/whl/cpu" in lines[0]  # the CPU build where PyPI's is CUDA's
    assert lines[1] == 'pip install -e ".[test]" && python -m pytest -q -n 2 --dist loadfile'
    assert len(text.splitlines()) <= 320, "the README is a guide: reference material goes to docs/"


def test_every_link_in_the_readme_and_docs_leads_somewhere() -> None:
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text(encoding="utf-8")):
            if "://" in target:
                continue
            assert (page.parent / target).exists(), f"{page.relative_to(ROOT)} links to {target}, which is not there"
    linked = set(re.findall(r"\]\(docs/([^)#]+)", README.read_text(encoding="utf-8")))
    missing = sorted(p.name for p in (ROOT / "docs").glob("*.md") if p.name not in linked)
    assert not missing, f"the README does not lead to {missing}"


def test_commands_shown_in_the_readme_and_docs_exist() -> None:
    """Every `jobrun CMD --opt` in a code block names a command and options it has."""
    from jobrun.cli import main

    def options(cmd) -> set[str]:
        return {o for p in cmd.params for o in getattr(p, "opts", []) if o.startswith("-")}

    shown = 0
    for page in PAGES:
        for block in _blocks(page.read_text(encoding="utf-8")):
            for line in block.text.splitlines():
                m = re.search(r"(?:^\$ |^|&& |srun )jobrun ((?:[a-z]+)(?: [a-z]+)?)(.*)", line.split("#")[0])
                if not m or block.lang not in ("bash", "text", ""):
                    continue
                words = m.group(1).split()
                cmd = main.commands.get(words[0])
                assert cmd is not None, f"{page.name}:{block.line}: no command {words[0]!r}: {line}"
                if len(words) > 1 and hasattr(cmd, "commands") and words[1] in cmd.commands:
                    cmd = cmd.commands[words[1]]
                for opt in re.findall(r"(?<![\w-])(--?[a-z][a-z-]*)", m.group(2)):
                    shown += 1
                    assert opt in options(cmd), f"{page.name}:{block.line}: `jobrun {m.group(1)}` has no {opt}"
    assert shown > 20


def test_the_readme_plan_analyzes_clean_but_for_what_it_says_it_leaves_out() -> None:
    """The README's plan, copied as it is, gets no warning: it once left out the
    `const` that defines `loss` before the loop, and analyze warned twice."""
    plans = [b for b in _blocks(README.read_text(encoding="utf-8")) if b.lang == "yaml" and _is_plan(b)]
    assert plans, "the README shows a plan"
    for block in plans:
        diags = analyze(compile_text(_at_line(block, "", block.text), filename="README.md"))
        # `(vx, vy made likewise)`: the one thing the shortened plan says it leaves out
        left = [d.format() for d in diags
                if not (d.code == "undefined-blob" and any(f"'{n}'" in d.message for n in ("vx", "vy")))]
        assert not left, "\n".join(left)


def test_the_readmes_example_table_names_every_bundled_example() -> None:
    """`jobrun new --list` offers every plans/*.yaml; the README's table named only five of
    the seven (not plans/gpt.yaml, the nanoGPT-shaped one)."""
    text = README.read_text(encoding="utf-8")
    missing = [p.name for p in sorted((ROOT / "plans").glob("*.yaml")) if f"| `plans/{p.name}` |" not in text]
    assert not missing, f"the README's example table leaves out {missing}"


def test_no_text_file_holds_a_merge_conflict() -> None:
    # A merge once left both sides of two op-table rows in plan-language.md, markers and all.
    marker = re.compile(r"^(<{7}|={7}|>{7})( |$)", re.M)
    suffixes = {".md", ".py", ".yaml", ".yml", ".toml", ".txt", ".sh", ".cfg"}
    found = []
    for path in sorted(ROOT.rglob("*")):
        parts = path.relative_to(ROOT).parts
        if path.suffix in suffixes and not any(p.startswith(".") or p in ("runs", "build") for p in parts):
            text = path.read_text(encoding="utf-8", errors="replace")
            found += [f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}"
                      for m in marker.finditer(text)]
    assert not found, f"merge conflict markers at {found}"


# -- docs/commands.md against the CLI --------------------------------------------------------

COMMANDS = ROOT / "docs" / "commands.md"
# Options commands.md documents beside its synopsis rather than in it: the older spelling
# of --json (`--format text|json` of `print` and `analyze`).
OUTSIDE_SYNOPSIS = {"--format"}


def test_every_command_and_option_is_in_the_synopsis_of_commands_md() -> None:
    """The reverse of the check above: a command or option that `--help` shows fails here
    until docs/commands.md's synopsis (its first code block) shows it too."""
    from jobrun.cli import main

    text = COMMANDS.read_text(encoding="utf-8")
    synopsis = _blocks(text)[0].text
    lines = {m.group(1): line for line in synopsis.splitlines()
             if (m := re.match(r"jobrun ((?:ckpt )?[a-z]+)\b", line))}
    commands = [(name, cmd) for name, cmd in main.commands.items() if not hasattr(cmd, "commands")]
    commands += [(f"{name} {sub}", c) for name, cmd in main.commands.items()
                 for sub, c in getattr(cmd, "commands", {}).items()]
    missing = [f"jobrun {name}" for name, _ in commands if name not in lines]
    for name, cmd in commands:
        for p in cmd.params:
            opts = [o for o in getattr(p, "opts", []) if o.startswith("-")]
            if not opts or getattr(p, "hidden", False) or name not in lines:
                continue
            if set(opts) & OUTSIDE_SYNOPSIS:
                assert f"`{opts[0]}" in text, f"docs/commands.md does not mention {opts[0]} of jobrun {name}"
            elif not any(re.search(rf"(?<![\w-]){re.escape(o)}(?![\w-])", lines[name]) for o in opts):
                missing.append(f"jobrun {name} {opts[0]}")
    if "jobrun --version" not in synopsis:
        missing.append("jobrun --version")
    assert not missing, f"docs/commands.md's synopsis lacks {missing}"


def test_print_output_shown_in_the_docs_is_what_it_prints(monkeypatch) -> None:
    """A ```text block `$ jobrun print plans/X.yaml` (or `analyze`) of a bundled plan, in
    the README or docs/, shows what the command prints today, line for line (`...` stands
    for any lines). commands.md once showed an older printer's lines."""
    monkeypatch.chdir(ROOT)
    shown = 0
    for page in PAGES:
        for block in _blocks(page.read_text(encoding="utf-8")):
            lines = block.text.splitlines()
            if block.lang != "text" or not re.fullmatch(r"\$ jobrun (print|analyze) plans/\S+\.yaml", lines[0]):
                continue
            r = jobrun(*shlex.split(lines[0])[2:])
            got = [g.rstrip() for g in (r.out + r.err).splitlines()]
            want = [s.rstrip() for s in lines[1:]]
            assert r.code == 0 and _matches(want, got), (
                f"{page.name}:{block.line}: `{lines[0][2:]}` prints\n" + "\n".join(got)
                + "\n-- the page shows --\n" + "\n".join(want))
            shown += 1
    assert shown >= 1
