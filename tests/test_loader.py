"""`reader` over torch Datasets: the tensor reader's rules, through a DataLoader with workers.

What must hold: the samples (and their random transforms) of every batch are a function of
(seed, pass, batch), whatever the number of workers, persistent or not, and after a
resume at any position; replicas read disjoint parts whose union is the global batch;
failures name the sample or the dead worker.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from runner_util import ckpt_values, jobrun, jobrun_proc
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from jobrun.errors import RunError
from jobrun.ops.context import OpContext
from jobrun.ops.reader import read_op, reader_op
from jobrun.ops.train import evaluate


class Noisy(Dataset):
    """Sample i is (i, draws from torch, numpy and random): a random transform."""

    def __init__(self, n: int = 23, fail_at: int | None = None, kill_at: int | None = None):
        self.n, self.fail_at, self.kill_at = n, fail_at, kill_at

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if i == self.kill_at and get_worker_info() is not None:
            os.kill(os.getpid(), signal.SIGKILL)
        if i == self.fail_at:
            raise ValueError("bad pixel")
        noise = torch.tensor([torch.rand(()).item(), np.random.rand(), random.random()])
        return noise, i


def _reader(dataset=None, seed=0, rank=0, world=1, **args):
    ctx = OpContext(seed=seed, rank=rank, world_size=world)
    return reader_op(ctx, Noisy() if dataset is None else dataset, **args)


def _reads(reader, n: int) -> list:
    """n reads: ("done") or (the sample indices, the random draws) of each batch."""
    out = []
    for _ in range(n):
        *fields, done = read_op(None, reader)
        out.append("done" if done else (fields[1].tolist(), fields[0].tolist()))
    return out


def _indices(reads: list) -> list:
    return [r if r == "done" else r[0] for r in reads]


def test_batches_follow_the_tensor_readers_order():
    """Same pass orders, short last batch, `done` once a pass, as over tensors."""
    args = dict(batch_size=5, shuffle=True, passes=2)
    tensors = reader_op(OpContext(), torch.arange(23), **args)
    expected = []
    for _ in range(14):
        batch, done = read_op(None, tensors)
        expected.append("done" if done else batch.tolist())
    assert _indices(_reads(_reader(**args), 14)) == expected
    assert expected.count("done") == 4  # after the last pass, done stays true


def test_random_transforms_do_not_depend_on_workers_or_resume():
    """1 or 2 workers, persistent or not, resumed mid-pass: the very same batches."""
    args = dict(batch_size=4, shuffle=True, passes=0, seed=3)
    whole = _reads(_reader(num_workers=2, **args), 16)
    assert _reads(_reader(num_workers=1, **args), 16) == whole
    assert _reads(_reader(num_workers=2, persistent_workers=True, **args), 16) == whole
    first = _reader(num_workers=2, **args)
    _reads(first, 9)  # into the second pass
    state = first.state_dict()
    again = _reader(num_workers=2, persistent_workers=True, **args)
    again.load_state_dict(state)
    assert _reads(again, 7) == whole[9:]


def test_without_workers_transforms_draw_from_the_job_streams():
    """num_workers: 0 fetches in this process: the draws are the job's (checkpointed)."""
    args = dict(batch_size=4, shuffle=True, seed=3)
    torch.manual_seed(0), np.random.seed(0), random.seed(0)
    a = _reads(_reader(**args), 3)
    torch.manual_seed(0), np.random.seed(0), random.seed(0)
    assert _reads(_reader(**args), 3) == a
    assert _indices(_reads(_reader(num_workers=1, **args), 3)) == _indices(a)


@pytest.mark.parametrize("world", [2, 3])
def test_replicas_read_disjoint_parts_of_every_global_batch(world):
    args = dict(dataset=Noisy(11), batch_size=4, shuffle=True, passes=1, seed=1)
    whole = _indices(_reads(_reader(**args), 4))
    parts = [_indices(_reads(_reader(rank=r, world=world, **args), 4)) for r in range(world)]
    for step, batch in enumerate(whole[:-1]):
        got = [p[step] for p in parts]
        assert sum(got, []) == batch  # in rank order: the global batch, split
    assert all(p[-1] == "done" for p in parts)


def test_batch_size_one_reads_unbatched_records():
    r = _reader(batch_size=1)
    noise, index, done = read_op(None, r)
    assert index == 0 and noise.shape == (3,) and done is False


def test_collate_fn_by_dotted_path(tmp_path, monkeypatch):
    (tmp_path / "mycollate.py").write_text(
        "import torch\n"
        "def pairs(samples):\n"
        "    return torch.stack([s[0] for s in samples]), torch.tensor([s[1] * 10 for s in samples])\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    r = _reader(batch_size=3, collate_fn="mycollate:pairs")
    assert _indices(_reads(r, 1)) == [[0, 10, 20]]


def test_evaluate_reads_a_full_pass_without_moving_the_position():
    class Points(Dataset):
        def __len__(self):
            return 10

        def __getitem__(self, i):
            return torch.tensor([float(i % 2), 1.0]), i % 2

    model = torch.nn.Linear(2, 2)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[-1.0, 0.5], [1.0, 0.0]]))
        model.bias.zero_()
    r = reader_op(OpContext(), Points(), batch_size=4, num_workers=1)
    read_op(None, r)
    loss, accuracy = evaluate(OpContext(), model, r)
    assert accuracy == 1.0 and loss > 0 and r.state_dict()["position"] == 4


def test_the_field_count_is_checkpointed_and_known_before_a_first_batch():
    # A pass's end met before any batch was read here: a state without "fields" (a pass
    # without a batch, drop_last with fewer records than a batch, is refused).
    with pytest.raises(RunError, match="drop_last drops all 23 records, fewer than batch_size 30"):
        _reader(batch_size=30, drop_last=True)
    r = _reader(batch_size=4)
    r.load_state_dict({"pass": 0, "position": 23, "seed": 0, "length": 23})
    assert read_op(None, r) == (None, None, True)
    assert r.state_dict()["fields"] == 2


@pytest.mark.parametrize("workers", [0, 2])
def test_a_failing_sample_is_named(workers):
    r = _reader(Noisy(fail_at=13), batch_size=4, num_workers=workers)
    with pytest.raises(RunError, match=r"dataset Noisy: sample 13: ValueError: bad pixel \(at .*test_loader.py:\d+ in __getitem__\)"):
        _reads(r, 5)


def test_a_dead_worker_stops_the_reader_with_a_message():
    r = _reader(Noisy(kill_at=9), batch_size=4, num_workers=2)
    with pytest.raises(RunError, match="DataLoader worker of the reader over Noisy died") as e:
        _reads(r, 5)
    assert "jobrun resume" in e.value.hint


def test_a_worker_killed_while_its_batch_is_taken_is_a_dead_worker():
    """A worker killed while the main process took its batch's shared memory ends the
    connection (EOFError) before torch says the worker exited: that was an IndexError of
    jobrun's own (an error with no text), which CI met once in the test above."""
    from jobrun.ops.loader_failures import _failure

    r = _reader(Noisy(), batch_size=4, num_workers=2)
    died = _failure(r, EOFError())
    assert "a DataLoader worker of the reader over Noisy died: EOFError while taking its batch" in died.message
    assert "jobrun resume" in died.hint
    plain = _failure(_reader(Noisy(), batch_size=4), ValueError())  # no text, no workers
    assert plain.message == "the reader over Noisy failed: ValueError"


def test_arguments_that_need_a_dataset_or_workers_are_refused():
    with pytest.raises(RunError, match="num_workers need.* a torch Dataset"):
        reader_op(OpContext(), torch.arange(4), num_workers=2)
    # without workers they do nothing: `vars.workers=0` needs no other change (refused, it
    # broke plans/digits.yaml's own "Try" line)
    assert _reader(prefetch_factor=2, persistent_workers=True).options.persistent_workers is False
    with pytest.raises(RunError, match="is empty"):
        _reader(Noisy(0))
    with pytest.raises(RunError, match="only input"):
        reader_op(OpContext(), Noisy(), torch.arange(23))


class Lambda(Dataset):
    """A dataset holding a lambda: forked workers share it, spawned ones are sent it pickled."""

    def __init__(self):
        self.transform = lambda t: t

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int):
        return self.transform(torch.tensor([float(i)]))


@pytest.fixture
def spawned():
    """Workers started as on macOS (spawn) and on Linux from Python 3.14 (forkserver)."""
    import multiprocessing

    before = multiprocessing.get_start_method()
    multiprocessing.set_start_method("spawn", force=True)
    yield
    multiprocessing.set_start_method(before, force=True)


def test_workers_that_cannot_be_sent_the_dataset_are_one_message_naming_why(spawned, recwarn):
    """A lambda in the dataset was torch's UserWarning, then multiprocessing's frames shown
    as 'traceback of your code' under the op."""
    r = _reader(Lambda(), batch_size=4, num_workers=2)
    said = r"the reader over Lambda cannot start its workers: they start by 'spawn', .*pickle"
    with pytest.raises(RunError, match=said) as e:
        read_op(None, r)
    assert "not a lambda" in e.value.hint and e.value.__cause__ is None
    with pytest.raises(RunError, match=said):  # evaluate's pass starts workers of its own
        next(r.full_pass())
    stream = Stream()
    stream.transform = lambda t: t
    with pytest.raises(RunError, match="the reader over Stream cannot start its workers"):
        read_op(None, _reader(stream, batch_size=2, num_workers=2))
    assert not [w for w in recwarn if "pickle" in str(w.message)]


def test_a_read_naming_other_fields_than_the_datasets_says_what_the_reader_gives():
    """A dataset returning a tensor alone, read into [xb, yb, end], was 'op returned 2
    value(s) for 3 outputs' with a hint about every op."""
    r = _reader(Lambda(), batch_size=4, passes=0)
    with pytest.raises(RunError, match=r"the reader gives 1 field\(s\) a batch, then `done`, and `out` names 3: xb, yb, end") as e:
        read_op(None, r, ("xb", "yb", "end"))
    assert "__getitem__" in e.value.hint
    xb, end = read_op(None, r, ("xb", "end"))
    assert xb.tolist() == [[4.0], [5.0], [6.0], [7.0]] and end is False
    assert read_op(None, r, ("xb",)).tolist() == [[0.0], [1.0], [2.0], [3.0]]  # rolled over the pass's end


class Stream(IterableDataset):
    """0..n-1 split over the workers, each value with a draw from the worker's torch RNG."""

    def __init__(self, n: int = 10):
        self.n = n

    def __iter__(self):
        info = get_worker_info()
        first, step = (info.id, info.num_workers) if info else (0, 1)
        for i in range(first, self.n, step):
            yield torch.rand(()).item(), i


def test_an_iterable_dataset_is_read_pass_by_pass():
    r = _reader(Stream(), batch_size=3, passes=2)
    assert _indices(_reads(r, 11)) == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9], "done"] * 2 + ["done"]
    with pytest.raises(RunError, match="shuffle applies to map-style"):
        _reader(Stream(), shuffle=True)


def test_a_stream_with_a_pass_of_no_batch_is_refused():
    # A loop reading a `passes: 0` reader to its `done` takes a step in every pass
    # (analyze counts on it): a pass that gives nothing is an error, not an empty epoch.
    class Once(Stream):
        def __iter__(self):
            yield from super().__iter__() if self.n else ()
            self.n = 0

    r = _reader(Once(3), batch_size=2, passes=0)
    assert _indices(_reads(r, 3)) == [[0, 1], [2], "done"]
    with pytest.raises(RunError, match="the stream Once ended before its first batch of pass 2"):
        _reads(r, 1)
    with pytest.raises(RunError, match=r"the stream Stream ended before its first batch\n") as e:
        _reads(_reader(Stream(3), batch_size=4, drop_last=True), 1)
    assert "with `drop_last: true`, fewer than 4 records make no batch" in e.value.hint


def test_an_iterable_dataset_resumes_exactly_with_workers():
    args = dict(dataset=Stream(), batch_size=2, passes=0, num_workers=2, seed=5)
    whole = _reads(_reader(**args), 12)
    first = _reader(**args)
    _reads(first, 8)
    again = _reader(**args)
    again.load_state_dict(first.state_dict())
    assert _reads(again, 4) == whole[8:]


def test_an_iterable_dataset_is_split_over_replicas():
    parts = [_indices(_reads(_reader(Stream(), rank=r, world=2, batch_size=3), 5)) for r in (0, 1)]
    assert parts == [[[0, 1], [3, 4], [6, 7], [9], "done"], [[2], [5], [8], [], "done"]]


# -- in a job: the op, the plan position and the sample; a dead worker; resume ----------

JOB = """
job: flaky
max_epochs: 3
checkpoint: {dir: ckpt}
init:
  - task: setup
    do:
      - build: {out: data, target: "flaky:Flaky"}
      - reader: {in: data, out: r, batch_size: 4, shuffle: true, passes: 0, num_workers: 2}
      - const: {out: seen, value: 0}
epoch:
  - task: train
    do:
      - loop: null
        do:
          - read: {in: r, out: [xb, yb, end]}
          - stop_if: end
          - add: {in: [seen, 1], out: seen}
      - log: {in: [seen]}
"""

FLAKY = '''
import os, signal
from pathlib import Path
import torch

class Flaky(torch.utils.data.Dataset):
    """Sample 5 fails (raises, or kills its worker) while a marker file says so."""

    def __len__(self):
        return 12

    def __getitem__(self, i):
        here = Path(__file__).parent
        if i == 5 and (here / "raise").exists():
            raise ValueError("unreadable image")
        if i == 5 and (here / "kill").exists() and (here / "epoch2").exists():
            os.kill(os.getpid(), signal.SIGKILL)
        if i == 5 and (here / "odd").exists():
            return torch.tensor([float(i)]), i, "extra"
        return torch.tensor([float(i)]), i
'''


@pytest.fixture
def flaky(tmp_path):
    import sys

    (tmp_path / "plan.yaml").write_text(JOB)
    (tmp_path / "flaky.py").write_text(FLAKY)
    sys.modules.pop("flaky", None)  # in this process, an earlier test's (its markers) was imported
    return tmp_path


@pytest.mark.parametrize("workers", [2, 0])
def test_in_a_job_a_failing_sample_is_named_with_the_op_and_its_position(flaky, workers):
    (flaky / "raise").touch()
    r = jobrun("train", flaky / "plan.yaml", "--run-dir", flaky / "run", f"init.setup.reader.num_workers={workers}")
    assert r.code == 1
    line = JOB.splitlines().index("          - read: {in: r, out: [xb, yb, end]}") + 1
    assert f"plan.yaml:{line}:13: error: op `read` in task 'train' on node 'local': dataset " \
        "Flaky: sample 5: ValueError: unreadable image (at " in r.err
    raised = FLAKY.splitlines().index('            raise ValueError("unreadable image")') + 1
    assert f"flaky.py:{raised} in __getitem__)" in r.err
    # Neither torch's worker traceback (text in its exception) nor jobrun's SampleError:
    # in this process, the user's own frame and exception, as for any code of theirs.
    assert "torch/utils/data" not in r.err and "SampleError" not in r.err and "jobrun/" not in r.err, r.err
    if workers == 0:
        assert "traceback of your code" in r.err and r.err.rstrip().splitlines()[-2].strip() == \
            "ValueError: unreadable image"


@pytest.mark.parametrize("workers", [2, 0])
def test_in_a_job_a_batch_that_cannot_be_collated_names_its_samples_and_the_odd_one(flaky, workers):
    # torch said "each element in list of batch should be of equal size", of no sample,
    # with the hint to check the dataset, and in a worker its traceback as text.
    (flaky / "odd").touch()
    r = jobrun("train", flaky / "plan.yaml", "--run-dir", flaky / "run", f"init.setup.reader.num_workers={workers}")
    assert r.code == 1 and "Traceback" not in r.err and "torch/utils/data" not in r.err, r.err
    assert "dataset Flaky: samples [" in r.err and "] could not be collated: RuntimeError: each element" in r.err
    assert "; sample 5 is a tuple of 3 (tensor [1], int, str), sample " in r.err and "a tuple of 2 (tensor [1], int)" in r.err
    assert "make every sample of a batch alike" in r.err


def test_in_a_job_a_read_whose_tested_done_gets_a_field_says_what_the_reader_gives(flaky):
    """Flaky's two fields read into [xb, end]: `end` got yb, and `stop_if: end` said 'a
    tensor of shape (4,) has no single truth value'."""
    plan = JOB.replace("out: [xb, yb, end]", "out: [xb, end]")
    (flaky / "plan.yaml").write_text(plan)
    r = jobrun("train", flaky / "plan.yaml", "--run-dir", flaky / "run")
    assert r.code == 1 and "truth value" not in r.err, r.err
    line = plan.splitlines().index("          - read: {in: r, out: [xb, end]}") + 1
    assert f"plan.yaml:{line}:13: error: op `read` in task 'train' on node 'local': the reader gives 2 " \
        "field(s) a batch, then `done`, and `out` names 1 before `end`: `end` gets field 2, though a " \
        "`stop_if` tests it as `done`" in r.err
    assert "hint: name 2 field(s), then `done`" in r.err and "__getitem__" in r.err


@pytest.mark.slow
def test_in_a_job_a_dead_worker_stops_it_and_the_run_resumes(flaky):
    (flaky / "kill").touch()
    first = jobrun_proc("train", flaky / "plan.yaml", "--run-dir", flaky / "run", "--set", "max_epochs=1")
    assert first.code == 0, first.text
    (flaky / "epoch2").touch()  # from now on, the worker fetching sample 5 dies
    r = jobrun_proc("resume", "--run-dir", flaky / "run", "max_epochs=3")
    assert r.code == 1
    # `read` names the reader; torch may also raise it from its SIGCHLD handler in the
    # op that runs when the worker dies (test_a_dead_worker_reported_in_another_op...)
    assert (("error: op `read` in task 'train' on node 'local': a DataLoader worker of the reader "
             "over Flaky died: DataLoader worker (pid" in r.err)
            or ("in task 'train' on node 'local': a DataLoader worker died: DataLoader worker (pid" in r.err)), r.err
    assert "Traceback" not in r.err
    assert "jobrun resume" in r.err
    (flaky / "kill").unlink()
    r = jobrun_proc("resume", "--run-dir", flaky / "run")
    assert r.code == 0, r.text
    assert ckpt_values(flaky / "run", 3)["seen"] == 9  # three passes of three batches


def test_a_reader_with_workers_leaves_nothing_for_its_first_next_to_import(tmp_path):
    # DataLoader's next() enters torch's record_function, whose first entry imports a
    # module inside a try that logs errors with a traceback. A worker dying then (torch
    # raises from its SIGCHLD handler) printed one in CI. The reader enters it first.
    script = tmp_path / "first.py"
    script.write_text(
        "import sys, torch\n"
        "from jobrun.ops.loader import Options\n"
        "o = Options('d', {'batch_size': 2}, num_workers=1, pin_memory=False, prefetch_factor=None,\n"
        "            persistent_workers=False, collate_fn=None, timeout=0)\n"
        "o.loader(list(range(4)))\n"
        "before = set(sys.modules)\n"
        "with torch.autograd.profiler.record_function('x'):\n"
        "    pass\n"
        "print(sorted(set(sys.modules) - before))\n"
    )
    out = subprocess.run([sys.executable, script], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def _worker_killed() -> None:
    raise RuntimeError("DataLoader worker (pid 4242) is killed by signal: Killed. ")


def test_a_dead_worker_reported_in_another_op_gets_the_same_message(tmp_path, monkeypatch):
    # torch raises a dead worker's error from its SIGCHLD handler, in whatever the main
    # thread runs then: here a `call` raises it as train.step would have.
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "dying.py").write_text("from test_loader import _worker_killed as killed\n")
    monkeypatch.syspath_prepend(os.path.dirname(__file__))
    plan = tmp_path / "plan.yaml"
    plan.write_text("job: dying\nmax_epochs: 1\nepoch:\n  - task: train\n    do:\n"
                    "      - call: {fn: \"dying:killed\"}\n")
    r = jobrun("train", plan, "--run-dir", tmp_path / "run")
    assert r.code == 1
    assert ("plan.yaml:6:9: error: op `call` in task 'train' on node 'local': a DataLoader worker "
            "died: DataLoader worker (pid 4242) is killed by signal: Killed.") in r.err
    assert "fewer num_workers" in r.err and "jobrun resume" in r.err
    assert "Traceback" not in r.err and "traceback of your code" not in r.err


def test_a_dead_worker_reported_between_ops_gets_the_same_message_and_keeps_the_checkpoints(
        tmp_path, monkeypatch):
    # ... or in the runner's own work between epochs: here the save after epoch 1.
    from jobrun.runner.job import JobRunner

    save = JobRunner._save

    def dying_save(self, epoch, **kw):
        if epoch == 1:
            _worker_killed()
        return save(self, epoch, **kw)

    monkeypatch.setattr(JobRunner, "_save", dying_save)
    plan = tmp_path / "plan.yaml"
    plan.write_text("job: dying\nmax_epochs: 2\ncheckpoint: {dir: ckpt}\nepoch:\n  - task: train\n"
                    "    do:\n      - const: {out: k, value: 1}\n")
    r = jobrun("train", plan, "--run-dir", tmp_path / "run")
    assert r.code == 1
    assert ("error: a DataLoader worker died: DataLoader worker (pid 4242) is killed by signal: "
            "Killed.") in r.err, r.err
    assert "fewer num_workers" in r.err and "jobrun resume" in r.err and "Traceback" not in r.err
    assert ckpt_values(tmp_path / "run", 0) == {}  # checkpoint 0 is still there
    assert json.loads((tmp_path / "run" / "run.json").read_text())["status"] == "failed"


SLOW = '''
import time
from pathlib import Path
import torch

class Slow(torch.utils.data.Dataset):
    """12 samples, each 20 ms to fetch; the first fetch of epoch 2's pass leaves a marker."""

    def __len__(self):
        return 12

    def __getitem__(self, i):
        time.sleep(0.02)
        if torch.utils.data.get_worker_info() is not None and (Path(__file__).parent / "run" / "ckpt" / "local.1").exists():
            (Path(__file__).parent / "fetching").touch()
        return torch.tensor([float(i)]), i
'''


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_a_signal_to_the_process_group_stops_a_job_with_workers_cleanly(tmp_path, sig):
    """SLURM's `--signal=USR1@90` and `scancel`, `kill -- -PGID`, docker stop: the job's
    DataLoader workers get the signal too. A worker ran the job's own SIGUSR1 handler
    (inherited through fork) and exited 1, one killed by SIGTERM made torch raise from its
    SIGCHLD handler: a traceback and exit 1, so SLURM's requeue on 138/143 never came."""
    (tmp_path / "plan.yaml").write_text(JOB.replace("flaky:Flaky", "slow:Slow").replace("max_epochs: 3", "max_epochs: 50"))
    (tmp_path / "slow.py").write_text(SLOW)
    p = subprocess.Popen([sys.executable, "-m", "jobrun", "train", "plan.yaml", "--run-dir", "run"], cwd=tmp_path,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        for _ in range(3000):  # workers are fetching epoch 2's batches
            if (tmp_path / "fetching").exists() or p.poll() is not None:
                break
            time.sleep(0.01)
        os.killpg(p.pid, sig)
        out, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert p.returncode == 128 + sig, err
    assert "Traceback" not in err and "exited unexpectedly" not in err and "killed by signal" not in err, err
    assert f"stopped by {signal.Signals(sig).name}" in err
    assert json.loads((tmp_path / "run" / "run.json").read_text())["status"] == "interrupted"


def test_a_jobs_persistent_workers_stop_when_it_ends(flaky):
    """Left to the atexit hook, a spawned rank's exit (multiprocessing's, which runs
    first) terminated them, and torch raised their deaths: "replica rank 1 failed (exit
    code 1)", with a `jobrun resume` to do, on a run whose run.json said finished."""
    import multiprocessing

    plan = (flaky / "plan.yaml").read_text().replace("num_workers: 2}", "num_workers: 2, persistent_workers: true}")
    (flaky / "plan.yaml").write_text(plan)
    before = set(multiprocessing.active_children())
    r = jobrun("train", flaky / "plan.yaml", "--run-dir", flaky / "run", "max_epochs=2")
    assert r.code == 0, r.text
    assert set(multiprocessing.active_children()) - before == set()


def test_a_workers_broken_fd_handshake_prints_no_traceback(capsys):
    """A worker's fd-sharing thread (multiprocessing's resource_sharer) prints a handshake
    that broke when the job stopped taking batches: the job reports why it stopped."""
    import functools
    import sys

    from jobrun.ops.loader import _sharing_broke

    def raised(filename: str, error: str):
        try:
            exec(compile(f"raise {error}", filename, "exec"))
        except BaseException:
            return sys.exc_info()

    hook = functools.partial(_sharing_broke, sys.__excepthook__)
    hook(*raised("/usr/lib/python3.11/multiprocessing/resource_sharer.py", "ConnectionResetError(104, 'reset')"))
    hook(*raised("/usr/lib/python3.11/multiprocessing/resource_sharer.py", "EOFError()"))
    assert capsys.readouterr().err == ""
    hook(*raised("/usr/lib/python3.11/multiprocessing/resource_sharer.py", "ValueError('other')"))
    hook(*raised("/data/my_dataset.py", "ConnectionResetError(104, 'reset')"))
    err = capsys.readouterr().err
    assert err.count("Traceback") == 2 and "ValueError: other" in err and "my_dataset.py" in err
