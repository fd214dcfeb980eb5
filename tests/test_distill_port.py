"""A knowledge-distillation script ported to a plan, against its hand-written loop to the
last bit: a frozen teacher loaded from an exported file (`build` of the user's loader), the
student's step in a `call` (KL at temperature T plus cross-entropy, clipping), AdamW with
weight decay under the plan's warmup + cosine `scheduler` (which a `call` that steps the
optimizer sets as `train.step` does), `evaluate` each epoch as plan-language.md section 12
says it averages, early stopping, and `checkpoint.load` of the best epoch in `exit`. Then
`resume --epoch 2` gives the same bits."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from runner_util import jobrun, logged
from safetensors.torch import load_file, save_file
from torch import nn
from torch.nn import functional as F

import jobrun as jr

HERE = __name__
LR, WD, T, ALPHA, CLIP, WARMUP, EPOCHS, MIN_LR, B = 0.1, 0.05, 4.0, 0.7, 1.0, 5, 8, 0.001, 64
STEPS, TEACHER_STEPS = EPOCHS * 8, 10  # 512 records in batches of 64

PLAN = f"""
job: distill
seed: 0
device: cpu
max_epochs: {EPOCHS}
early_stop: {{monitor: val_loss, mode: min, patience: 1}}
checkpoint: {{best: {{monitor: val_loss, mode: min}}}}
init:
  - task: setup
    do:
      - data.load: {{out: [x, y, vx, vy], path: data.npz, keys: [x, y, vx, vy]}}
      - reader: {{in: [x, y], out: train_data, batch_size: {B}, shuffle: true, passes: 0}}
      - reader: {{in: [vx, vy], out: val_data, batch_size: 96}}
      - build: {{out: teacher, target: "{HERE}:load_teacher", path: "${{plan_dir}}/teacher.safetensors"}}
      - build: {{out: student, target: "{HERE}:mlp", sizes: [8, 16, 3]}}
      - optimizer: {{in: student, out: opt, class: AdamW, lr: {LR}, weight_decay: {WD}}}
      - scheduler: {{in: opt, out: sched, warmup: {WARMUP}, decay: cosine, steps: {STEPS}, min_lr: {MIN_LR}}}
epoch:
  - task: train
    do:
      - loop: null
        do:
          - read: {{in: train_data, out: [xb, yb, end]}}
          - stop_if: end
          - call: {{fn: "{HERE}:kd_step", in: [student, teacher, opt, xb, yb], out: loss,
                   mutates: [student, opt], T: {T}, alpha: {ALPHA}, clip: {CLIP}}}
      - evaluate: {{in: [student, val_data], out: [val_loss, accuracy]}}
      - log: {{in: [loss, val_loss, accuracy]}}
    outputs: [val_loss]
exit:
  - task: save
    do:
      - checkpoint.load: {{in: student, epoch: best}}
      - save: {{in: [student], path: student.safetensors}}
"""


def mlp(sizes: list[int]) -> nn.Module:
    layers: list[nn.Module] = []
    for a, b in zip(sizes[:-1], sizes[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def load_teacher(path: str) -> nn.Module:
    """The teacher as `jobrun export` wrote it (the module's own keys), frozen."""
    teacher = mlp([8, 64, 64, 3])
    teacher.load_state_dict(load_file(path))
    return teacher.eval().requires_grad_(False)


def kd_step(student, teacher, opt, xb, yb, *, T: float, alpha: float, clip: float):  # noqa: N803
    """alpha * KL(teacher || student) at temperature T, times T^2, + (1 - alpha) * CE."""
    with torch.no_grad():
        t = teacher(xb)
    opt.zero_grad(set_to_none=True)
    s = student(xb)
    soft = F.kl_div(F.log_softmax(s / T, dim=1), F.softmax(t / T, dim=1), reduction="batchmean") * (T * T)
    loss = alpha * soft + (1 - alpha) * F.cross_entropy(s, yb)
    loss.backward()
    nn.utils.clip_grad_norm_(student.parameters(), clip)
    opt.step()
    return loss.detach()


def _data(where) -> dict[str, torch.Tensor]:
    rng = np.random.default_rng(0)
    centers = rng.normal(size=(3, 8))
    arrays = {}
    for x, y, n in (("x", "y", 512), ("vx", "vy", 192)):
        labels = rng.integers(0, 3, size=n)
        arrays[x] = (centers[labels] + rng.normal(size=(n, 8)) * 1.5).astype(np.float32)
        arrays[y] = labels.astype(np.int64)
    np.savez(where / "data.npz", **arrays)
    d = {k: torch.from_numpy(v) for k, v in arrays.items()}
    torch.manual_seed(7)  # stage 1, short: a teacher trained by full-batch Adam
    teacher = mlp([8, 64, 64, 3])
    opt = torch.optim.Adam(teacher.parameters(), lr=0.01)
    for _ in range(TEACHER_STEPS):
        opt.zero_grad()
        F.cross_entropy(teacher(d["x"]), d["y"]).backward()
        opt.step()
    save_file(teacher.state_dict(), where / "teacher.safetensors")
    return d


def _lr(it: int) -> float:  # nanoGPT's get_lr, as the plan's scheduler computes it
    if it < WARMUP:
        return LR * (it + 1) / (WARMUP + 1)
    if it > STEPS:
        return MIN_LR
    return MIN_LR + 0.5 * (1.0 + math.cos(math.pi * (it - WARMUP) / (STEPS - WARMUP))) * (LR - MIN_LR)


def _hand_loop(where, d: dict[str, torch.Tensor]) -> tuple[list[tuple], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    teacher = load_teacher(str(where / "teacher.safetensors"))
    student = mlp([8, 16, 3])
    opt = torch.optim.AdamW(student.parameters(), lr=LR, weight_decay=WD)
    it, best, best_state, logs = 0, math.inf, None, []
    for epoch in range(EPOCHS):
        order = jr.reader_order(len(d["x"]), epoch, seed=0, reader=0)
        for i in range(0, len(order), B):
            xb, yb = d["x"][order[i:i + B]], d["y"][order[i:i + B]]
            for group in opt.param_groups:
                group["lr"] = _lr(it)
            loss = kd_step(student, teacher, opt, xb, yb, T=T, alpha=ALPHA, clip=CLIP)
            it += 1
        student.eval()  # evaluate: each batch's float32 mean times its records, summed in float64
        total, hits = 0.0, 0
        with torch.no_grad():
            for i in range(0, len(d["vx"]), 96):
                out = student(d["vx"][i:i + 96])
                total += F.cross_entropy(out, d["vy"][i:i + 96]).item() * len(out)
                hits += int((out.argmax(1) == d["vy"][i:i + 96]).sum())
        student.train()
        val_loss = total / len(d["vx"])
        logs.append((loss.item(), val_loss, hits / len(d["vx"])))
        if val_loss < best:
            best, best_state = val_loss, copy.deepcopy(student.state_dict())
        elif len(logs) > 1:  # patience 1: the first epoch without an improvement stops
            break
    return logs, best_state


def _run_gives(run, logs: list[tuple], best: dict[str, torch.Tensor]) -> None:
    got = [(v["loss"], v["val_loss"], v["accuracy"]) for v in logged(run) if v["_task"] == "train"]
    assert got == logs
    saved = load_file(run / "student.safetensors")
    assert saved.keys() == {f"student.{k}" for k in best}
    for k, v in best.items():
        assert torch.equal(saved[f"student.{k}"], v), k


def test_a_distillation_plan_is_its_hand_loop_to_the_last_bit_and_resumes_so(tmp_path, monkeypatch):
    monkeypatch.setenv("JOBRUN_THREADS", "1")
    threads = torch.get_num_threads()
    try:
        d = _data(tmp_path)
        (tmp_path / "plan.yaml").write_text(PLAN)
        run = tmp_path / "run"
        r = jobrun("train", tmp_path / "plan.yaml", "--run-dir", run)
        assert r.code == 0, r.text
        torch.set_num_threads(1)
        logs, best = _hand_loop(tmp_path, d)
        assert 2 < len(logs) < EPOCHS, "early stopping no longer stops this run before its last epoch"
        assert logs[-1][1] > min(v for _, v, _ in logs), "the best epoch is the last: pick other settings"
        _run_gives(run, logs, best)
        r = jobrun("resume", run, "--epoch", "2")
        assert r.code == 0, r.text
        _run_gives(run, logs, best)
    finally:
        torch.set_num_threads(threads)


def _saying(said: str) -> str:
    """The plan with the KD step saying `said` of what it changes (and no checkpoint.load of
    the student, which analyze refuses when no step is said to change it)."""
    plan = PLAN.replace("mutates: [student, opt]", said)
    return plan.replace("      - checkpoint.load: {in: student, epoch: best}\n", "")


@pytest.mark.parametrize("said", ["mutates: [student]", "pure: true"])
def test_a_kd_step_that_leaves_its_optimizer_out_of_mutates_stops_at_its_line(tmp_path, said):
    _data(tmp_path)
    (tmp_path / "plan.yaml").write_text(_saying(said))
    r = jobrun("train", tmp_path / "plan.yaml", "--run-dir", tmp_path / "run")
    assert r.code == 1, r.text
    assert f"plan.yaml:{PLAN.splitlines().index(next(line for line in PLAN.splitlines() if 'kd_step' in line)) + 1}:" in r.err
    assert f"which the call's `{said}` leaves out" in r.err
    assert "hint: list every input it changes: `mutates: [student, opt]`" in r.err


@pytest.mark.slow
def test_with_replicas_the_step_left_out_of_mutates_is_the_jobs_error_said_once(tmp_path):
    # Every replica takes the step: each said the error, then the launcher added "replica
    # rank 1 failed ... continue with `jobrun resume`", which fails the same way.
    from runner_util import jobrun_proc  # (conftest puts tests/, this module, on PYTHONPATH)

    _data(tmp_path)
    (tmp_path / "plan.yaml").write_text(_saying("mutates: [student]"))
    r = jobrun_proc("train", tmp_path / "plan.yaml", "--run-dir", tmp_path / "run", "--replicas", "2",
                    "max_epochs=1", cwd=tmp_path, timeout=240)
    assert r.code == 1, r.text
    assert r.err.count("which the call's `mutates: [student]` leaves out") == 1, r.err
    assert "replica rank" not in r.err and "jobrun resume" not in r.err, r.err
