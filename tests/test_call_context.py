"""`call` passes the run's context to functions that name it: rank, world_size, device,
generator (the node's), step (the global step), epoch."""

from __future__ import annotations

import pytest
import torch

from jobrun.ops import core
from jobrun.ops.context import OpContext

HERE = __name__


def wants_all(x, *, rank, world_size, device, generator, step):
    return x, rank, world_size, device, generator, step


def wants_some(x, *, generator, device, scale=1):
    return x * scale, generator, device


def has_defaults(x, rank=1, device="mine", *, step=None):
    return x, rank, device, step


def step_first(step, x=None):
    return step, x


def variadic(*xs, rank):
    return xs, rank


def plain(x, y=0):
    return x + y


def test_a_function_gets_the_context_it_names():
    ctx = OpContext(rank=1, world_size=2, device="cpu")
    x, rank, world, device, gen, step = core.call(ctx, 5, fn=f"{HERE}:wants_all")
    assert (x, rank, world, device) == (5, 1, 2, "cpu")
    assert gen is ctx.generator and isinstance(gen, torch.Generator)
    assert step == getattr(ctx, "step", 0)


def test_the_executor_clock_is_the_step_a_call_sees():
    assert core.call(OpContext(), 5, fn=f"{HERE}:wants_all", _clock=40)[5] == 40


def test_plan_arguments_and_inputs_win_over_the_context():
    ctx = OpContext(device="cpu")
    assert core.call(ctx, 2, fn=f"{HERE}:wants_some", scale=3, device="mine") == (6, ctx.generator, "mine")
    # an input that fills the parameter positionally is not overridden
    assert core.call(ctx, 7, 8, fn=f"{HERE}:step_first") == (7, 8)
    assert core.call(ctx, fn=f"{HERE}:step_first", _clock=3) == (3, None)
    assert core.call(ctx, 1, 2, fn=f"{HERE}:variadic") == ((1, 2), 0)


def test_functions_that_do_not_ask_get_nothing_more():
    assert core.call(OpContext(), 1, fn=f"{HERE}:plain", y=2) == 3
    # a parameter with a default keeps its meaning (e.g. the rank a test helper kills)
    ctx = OpContext(rank=0, world_size=2)
    assert core.call(ctx, 1, fn=f"{HERE}:has_defaults", _clock=5) == (1, 1, "mine", None)
    assert core.call(OpContext(), -3, fn="builtins:abs") == 3


def test_generator_draws_follow_the_nodes_stream():
    def draw(ctx):
        return core.call(ctx, fn=f"{HERE}:wants_some", scale=0, x=0)[1]

    a, b = OpContext(seed=4), OpContext(seed=4)
    assert torch.equal(torch.rand(3, generator=draw(a)), torch.rand(3, generator=draw(b)))
    assert not torch.equal(torch.rand(3, generator=draw(a)),
                           torch.rand(3, generator=draw(OpContext(seed=5))))


@pytest.mark.parametrize("name", core.CONTEXT_ARGS)
def test_every_context_name_is_documented(name):
    from pathlib import Path

    doc = (Path(__file__).resolve().parent.parent / "docs" / "plan-language.md").read_text()
    assert f"`{name}`" in doc


def test_node_seed_gives_a_hand_loop_the_nodes_generator():
    """jobrun.node_seed is documented for hand loops (docs/plan-language.md section 12):
    a generator seeded with it draws what the node's generator draws."""
    import torch

    import jobrun
    from jobrun.ops.context import OpContext

    for seed, node in ((0, "local"), (7, "trainer-1")):
        ctx = OpContext(seed=seed, node=node)
        ours = torch.randint(1000, (8,), generator=ctx.generator)
        hand = torch.randint(1000, (8,), generator=torch.Generator().manual_seed(jobrun.node_seed(seed, node)))
        assert torch.equal(ours, hand)


def test_a_call_sees_the_epoch_running(tmp_path):
    """`epoch`: 0 in init, the epoch in the epoch group (after a resume too), the last
    one in exit: a KL weight warmed up over epochs needs no counter blob of its own."""
    import json

    from runner_util import jobrun

    (tmp_path / "warm.py").write_text("def beta(*, epoch):\n    return min(1.0, epoch / 4)\n")
    (tmp_path / "plan.yaml").write_text(
        "job: warm\nmax_epochs: 3\ncheckpoint: {keep: 5}\n"
        "init:\n  - task: setup\n    do:\n      - call: {fn: 'warm:beta', out: b0}\n"
        "epoch:\n  - task: train\n    do:\n      - call: {fn: 'warm:beta', out: b}\n"
        "    outputs: [b]\n"
        "exit:\n  - task: last\n    do:\n      - call: {fn: 'warm:beta', out: b1}\n"
        "      - log: {in: [b0, b1]}\n"
    )
    run = tmp_path / "run"

    def seen() -> tuple[list[float], list[dict]]:
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        per_epoch = [r["outputs"]["train"]["b"] for r in records if r.get("event") == "epoch"]
        return per_epoch, [r["values"] for r in records if r.get("task") == "last"]

    r = jobrun("train", tmp_path / "plan.yaml", "--run-dir", run)
    assert r.code == 0, r.text
    assert seen() == ([0.25, 0.5, 0.75], [{"b0": 0.0, "b1": 0.75}])
    r = jobrun("resume", run, "--epoch", "1")
    assert r.code == 0, r.text
    assert seen()[0] == [0.25, 0.5, 0.75]  # epochs 2 and 3 again, as numbered before


def sgd_step(model, opt, x):
    opt.zero_grad()
    model(x).sum().backward()
    opt.step()
    return x


def forward(model, x):
    return model(x)


def test_a_call_that_steps_an_optimizer_it_says_it_leaves_alone_is_stopped():
    """`mutates` (and `pure`) decide what checkpoints hold: a call that steps `opt` but
    leaves it (or the model it trains) out ran on, and a resume went on with the
    optimizer's state (Adam's moments) as init made it, silently off the uninterrupted run."""
    from jobrun.errors import RunError
    from jobrun.runner import clock

    clock.install()
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.ones(2, 3)
    names = ("model", "opt", "x")
    for said, left in ((["model"], "'opt'"), (["opt"], "'model'"), ([], "'model', 'opt'")):
        with pytest.raises(RunError, match=f"changed {left}, which the call's `mutates: \\[") as e:
            core.call(OpContext(), model, opt, x, fn=f"{HERE}:sgd_step", mutates=said, _names=names)
        assert e.value.hint == "list every input it changes: `mutates: [model, opt]`"
    with pytest.raises(RunError, match="`pure: true` leaves out"):
        core.call(OpContext(), model, opt, x, fn=f"{HERE}:sgd_step", pure=True, _names=names)
    # saying so, or not saying (every input that is no data counts as changed), is fine
    for said in (["model", "opt"], None):
        assert core.call(OpContext(), model, opt, x, fn=f"{HERE}:sgd_step", mutates=said, _names=names) is x
    # a call that steps no optimizer may leave its model out: a frozen teacher's forward
    assert core.call(OpContext(), model, x, fn=f"{HERE}:forward", pure=True, _names=("model", "x")).shape == (2, 1)


def test_a_call_outside_epoch_steps_may_leave_out_what_it_steps(tmp_path):
    """`mutates` decides what the checkpoints of epoch steps hold: init runs again on
    resume and download and exit are in no checkpoint, so a teacher pretrained in init by
    a call that says `mutates: [teacher]` and steps `opt_t` too was refused there, after
    the run directory was made, though nothing was lost. In an epoch step it still stops."""
    from runner_util import jobrun

    (tmp_path / "kd.py").write_text(
        "import torch\n\n"
        "def fit(model, opt, x):\n"
        "    opt.zero_grad()\n    model(x).square().mean().backward()\n    opt.step()\n"
        "    return model(x).detach().mean()\n")
    plan = (
        "job: kd\nmax_epochs: 1\n"
        "init:\n  - task: setup\n    do:\n"
        "      - randn: {out: x, shape: [4, 3]}\n"
        "      - model.mlp: {out: teacher, sizes: [3, 2]}\n"
        "      - optimizer: {in: teacher, out: opt_t, lr: 0.1}\n"
        "      - call: {fn: 'kd:fit', in: [teacher, opt_t, x], out: t0, mutates: [teacher]}\n"
        "      - model.mlp: {out: student, sizes: [3, 2]}\n"
        "      - optimizer: {in: student, out: opt, lr: 0.1}\n"
        "epoch:\n  - task: train\n    do:\n"
        "      - call: {fn: 'kd:fit', in: [student, opt, x], out: s, mutates: [student, opt]}\n"
        "      - log: {in: [s, t0]}\n"
        "exit:\n  - task: last\n    do:\n"
        "      - call: {fn: 'kd:fit', in: [teacher, opt_t, x], out: t1, pure: true}\n"
        "      - log: {in: [t1]}\n")
    (tmp_path / "plan.yaml").write_text(plan)
    r = jobrun("train", tmp_path / "plan.yaml", "--run-dir", tmp_path / "run")
    assert r.code == 0, r.text
    assert "Warning" not in r.err and "warning" not in r.err, r.err
    (tmp_path / "bad.yaml").write_text(plan.replace("mutates: [student, opt]", "mutates: [student]"))
    r = jobrun("train", tmp_path / "bad.yaml", "--run-dir", tmp_path / "bad")
    assert r.code != 0
    assert "bad.yaml:15:9: error: op `call` in task 'train'" in r.err and "changed 'opt', which the call's `mutates: [student]` leaves out" in r.err, r.err


def kd_step(student, teacher, opt, x):
    with torch.no_grad():
        target = teacher(x)
    opt.zero_grad()
    (student(x) - target).square().mean().backward()
    opt.step()
    return x


def test_a_model_left_out_whose_stepped_parameters_a_listed_input_holds_is_not_refused():
    """A teacher sharing a layer with its student (a frozen embedding, built once) is
    restored with the student's checkpoint, in place: a call that says `mutates:
    [student, opt]` and steps `opt`, which holds the shared layer, was refused as having
    changed 'teacher'. A parameter of the teacher's own that `opt` steps still is."""
    from jobrun.errors import RunError
    from jobrun.runner import clock

    clock.install()
    shared = torch.nn.Linear(3, 4).requires_grad_(False)
    teacher = torch.nn.Sequential(shared, torch.nn.Linear(4, 1))
    student = torch.nn.Sequential(shared, torch.nn.Linear(4, 1))
    x, names = torch.ones(2, 3), ("student", "teacher", "opt", "x")
    opt = torch.optim.SGD(student.parameters(), lr=0.1)
    assert core.call(OpContext(), student, teacher, opt, x, fn=f"{HERE}:kd_step", mutates=["student", "opt"],
                     _names=names, _site="epoch/train/call#1") is x
    opt = torch.optim.SGD([*student.parameters(), *teacher[1].parameters()], lr=0.1)
    with pytest.raises(RunError, match="changed 'teacher', which the call's `mutates: \\[student, opt\\]`"):
        core.call(OpContext(), student, teacher, opt, x, fn=f"{HERE}:kd_step", mutates=["student", "opt"],
                  _names=names, _site="epoch/train/call#1")


class _Tuner:
    """Not a module: its `parameters` wants an argument of its own (a search space's)."""

    def parameters(self, name):
        return {"lr": [0.1, 0.01]}[name]


def tuned_step(student, tuner, opt, x):
    opt.param_groups[0]["lr"] = tuner.parameters("lr")[0]
    opt.zero_grad()
    student(x).square().mean().backward()
    opt.step()
    return x


def test_an_input_whose_parameters_method_is_no_modules_is_left_alone():
    """The watch asked every input with a callable `parameters` for them: one of the
    user's own, taking an argument, stopped the step with its TypeError."""
    from jobrun.runner import clock

    clock.install()
    student = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(student.parameters(), lr=0.1)
    x, tuner = torch.ones(2, 3), _Tuner()
    got = core.call(OpContext(), student, tuner, opt, x, fn=f"{HERE}:tuned_step", mutates=["student", "opt"],
                    _names=("student", "tuner", "opt", "x"), _site="epoch/train/call#1")
    assert got is x and student.weight.grad is not None
