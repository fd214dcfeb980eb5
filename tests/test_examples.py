"""The example plans in plans/ analyze clean, train, learn, save a loadable model, resume
exactly after kill -9, and export.

Training runs use small `--set` overrides so that the whole module stays well under a
minute and a half on a 2-core machine; each plan trains once per session (module
fixtures) and several tests look at the result.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from runner_util import HANG_S, ckpt_values, jobrun, jobrun_proc, logged
from safetensors.torch import load_file
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
PLANS = ROOT / "plans"
EXAMPLES = ["mlp", "cnn", "charlm", "digits"]

# Overrides that keep each training run short. cnn: 3 of up to 10 epochs (the full run
# stops at ~0.95 accuracy after 5); charlm: 2 epochs over half as many windows; digits:
# the whole run (about 8 epochs of 0.3 s), which stops at the accuracy the README states.
SETS = {
    "mlp": [],
    "cnn": ["max_epochs=3"],
    "charlm": ["vars.epochs=2", "vars.stride=32"],
    "digits": [],
    "gan": ["max_epochs=12"],  # not in EXAMPLES: a GAN has no falling loss (its own tests below)
}
# What the runs above must reach (they reach 0.94, 0.87 and 0.97).
MIN_ACCURACY = {"mlp": 0.9, "cnn": 0.8, "digits": 0.97}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread in the runs of this module (the runner reads JOBRUN_THREADS):
    on a small shared machine two threads that wait for each other cost more than
    they give. The in-process runs set torch's thread count: restore it after."""
    mp = pytest.MonkeyPatch()
    mp.setenv("JOBRUN_THREADS", "1")
    threads = torch.get_num_threads()
    yield
    mp.undo()
    torch.set_num_threads(threads)


def _train(root: Path, name: str, *sets: str, plan: Path | None = None) -> Path:
    run = root / name
    args = [a for s in sets for a in ("--set", s)]
    r = jobrun("train", plan or PLANS / f"{name}.yaml", "--run-dir", run, *args)
    assert r.code == 0, r.text
    return run


class _Runs(dict):
    """name -> run directory; a plan trains the first time a test asks for it."""

    def __init__(self, root: Path) -> None:
        super().__init__()
        self.root = root

    def __missing__(self, name: str) -> Path:
        self[name] = _train(self.root, name, *SETS[name])
        return self[name]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, one_thread) -> _Runs:
    return _Runs(tmp_path_factory.mktemp("examples"))


def _import_plan_models() -> None:
    # The runner puts a plan's directory on sys.path while it runs; the tests import
    # the same user code (plans/models/charlm.py) directly.
    if str(PLANS) not in sys.path:
        sys.path.insert(0, str(PLANS))


def _epoch_logs(run: Path) -> list[dict]:
    """The `log` records of the epoch task `train` (not those of init or exit)."""
    return [r for r in logged(run) if r["_task"] == "train"]


def _last_epoch(run: Path) -> int:
    return _epoch_logs(run)[-1]["_epoch"]


def _ckpt_model_state(run: Path) -> dict[str, torch.Tensor]:
    model = ckpt_values(run, _last_epoch(run))["model"]
    return {k: torch.tensor(v) for k, v in model["state"].items()}


# -- analyze ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", [*EXAMPLES, "gan"])
def test_analyze_is_clean(name: str) -> None:
    r = jobrun("analyze", PLANS / f"{name}.yaml", "--format", "json")
    assert r.code == 0, r.text
    report = json.loads(r.out)
    assert report["errors"] == 0 and report["warnings"] == 0, report["diagnostics"]


def test_export_plan_is_clean() -> None:
    r = jobrun("analyze", ROOT / "tests" / "plans" / "mlp_export.yaml")
    assert r.code == 0 and r.text.strip().endswith(": ok"), r.text


# -- train: the loss falls, the accuracy rises --------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("name", EXAMPLES)
def test_training_loss_falls(runs, name: str) -> None:
    records = _epoch_logs(runs[name])
    epochs = [r["_epoch"] for r in records]
    assert epochs == list(range(1, len(records) + 1)) and len(records) >= 2, epochs
    first, last = records[0]["loss"], records[-1]["loss"]
    assert math.isfinite(first) and math.isfinite(last)
    assert last < first, f"{name}: training loss went from {first} to {last}"


@pytest.mark.parametrize("name", sorted(MIN_ACCURACY))
def test_accuracy_rises_above_threshold(runs, name: str) -> None:
    records = _epoch_logs(runs[name])
    first, last = records[0]["accuracy"], records[-1]["accuracy"]
    assert last > first or last >= 0.99, f"{name}: accuracy went from {first} to {last}"
    assert last >= MIN_ACCURACY[name], f"{name}: accuracy {last} < {MIN_ACCURACY[name]}"


def test_charlm_validation_loss_beats_guessing(runs) -> None:
    _import_plan_models()
    from models.charlm import char_dataset

    records = _epoch_logs(runs["charlm"])
    vocab = char_dataset(str(PLANS / "data" / "tiny.txt"), 8)[4]
    assert records[-1]["val_loss"] < records[0]["val_loss"]
    # A uniform guess over the vocabulary costs log(V) nats per character.
    assert records[-1]["val_loss"] < 0.75 * math.log(vocab)
    samples = logged(runs["charlm"], "sample")
    assert len(samples) == 1 and samples[0]["text"].startswith("The ")
    assert len(samples[0]["text"]) == len("The ") + 200


# -- checkpoints hold the state training changes, not the data ---------------------------


def test_the_cnn_checkpoint_holds_its_state_not_its_data(runs) -> None:
    """cnn.yaml's data (1.9 MB) is rebuilt by init; a checkpoint is about the size of
    the model's and the optimizer's state dicts (at most 1.1 times)."""
    import io

    from jobrun import store

    run = runs["cnn"]
    last = _last_epoch(run)
    assert set(ckpt_values(run, last)) == {"train_data", "model", "opt"}
    rank = run / "checkpoints" / f"local.{last}" / "rank-0"
    size = sum(f.stat().st_size for f in rank.iterdir())
    saved, _ = store.load(run / "checkpoints", "local", last, blobs=["model", "opt", "jobrun:rng"])
    # the random streams: cnn.yaml draws nothing after init (listed, not saved)
    assert saved["jobrun:rng"]["unchanged"] == ["python", "numpy", "torch", "node"]
    torch_save = 0
    for blob in ("model", "opt"):
        buffer = io.BytesIO()
        torch.save(saved[blob].state, buffer)
        torch_save += len(buffer.getvalue())
    raw = sum(t.numel() * t.element_size() for t in saved["model"].state.values())
    raw += sum(t.numel() * t.element_size() for s in saved["opt"].state["state"].values() for t in s.values())
    assert size <= 1.1 * torch_save and size <= 1.1 * raw, (size, torch_save, raw)


# -- the exit group's model.safetensors -----------------------------------------------------


def _fresh_model(name: str, run: Path) -> nn.Module:
    """The model of each plan, built again from scratch (with the test's own code)."""
    if name == "mlp":
        return nn.Sequential(
            nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4)
        )
    if name == "cnn":
        return nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(512, 4),
        )  # fmt: skip
    if name == "digits":
        return nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
            nn.MaxPool2d(2), nn.Flatten(), nn.Linear(512, 10),
        )  # fmt: skip
    _import_plan_models()
    from models.charlm import CharLM

    vocab = ckpt_values(run, _last_epoch(run))["vocab_size"]
    return CharLM(vocab, d_model=64, heads=4, layers=2, context=64)


@pytest.mark.slow
@pytest.mark.parametrize("name", EXAMPLES)
def test_saved_model_loads_and_equals_the_last_checkpoint(runs, name: str) -> None:
    run = runs[name]
    saved = load_file(run / "model.safetensors")
    assert saved and all(k.startswith("model.") for k in saved), list(saved)
    model = _fresh_model(name, run)
    model.load_state_dict({k.removeprefix("model."): v for k, v in saved.items()}, strict=True)
    want = _ckpt_model_state(run)
    got = model.state_dict()
    assert sorted(got) == sorted(want)
    for key, value in got.items():
        assert torch.equal(value, want[key].to(value.dtype)), f"{name}: {key} differs"
    if name == "cnn":  # and it works: the saved CNN classifies the validation images
        import numpy as np

        data = np.load(PLANS / "data" / "shapes.npz")
        x = torch.from_numpy(data["x_val"]).float() / 255.0
        y = torch.from_numpy(data["y_val"])
        with torch.no_grad():
            accuracy = (model(x).argmax(dim=1) == y).float().mean().item()
        assert accuracy == pytest.approx(_epoch_logs(run)[-1]["accuracy"], abs=1e-6)


# -- kill -9 in the middle of a run, resume: bit for bit the uninterrupted result ----------

# Per example: overrides that make epochs long enough for the kill to land inside one
# (smaller batches, more steps) and keep the run going (no early stop), the checkpoint
# after which it is killed, and the epochs of the whole run.
KILLS = {
    "gan": (["max_epochs=4"], 2, 4),
    "mlp": (["vars.batch=8", "vars.lr=0.02"], 3, 8),
    "cnn": (["vars.batch=8", "max_epochs=4", "vars.target_accuracy=2.0"], 2, 4),
    "charlm": (["vars.epochs=3", "vars.stride=48"], 1, 3),
    "digits": (["vars.batch=16", "max_epochs=4", "vars.target_accuracy=2.0"], 2, 4),
}


def _checkpointed(run: Path) -> set[int]:
    path = run / "metrics.jsonl"
    if not path.exists():
        return set()
    epochs = set()
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line being written
            continue
        if record.get("event") == "checkpoint_save":
            epochs.add(record["epoch"])
    return epochs


@pytest.mark.slow
@pytest.mark.parametrize("name", [*EXAMPLES, "gan"])
def test_kill_9_mid_run_then_resume_is_bit_exact(tmp_path, name: str) -> None:
    plan = PLANS / f"{name}.yaml"
    overrides, kill_after, last = KILLS[name]
    sets = [a for s in overrides for a in ("--set", s)]
    reference = _train(tmp_path, "reference", *overrides, plan=plan)

    run = tmp_path / "killed"
    cmd = [sys.executable, "-m", "jobrun", "train", str(plan), "--run-dir", str(run), *sets]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + HANG_S
        while kill_after not in _checkpointed(run):
            assert proc.poll() is None, f"the run ended before the kill: {proc.stderr.read()}"
            assert time.monotonic() < deadline, "no checkpoint after 90 s"
            time.sleep(0.005)
        time.sleep(0.05)  # into the next epoch (0.15 s long, or more)
    finally:
        proc.kill()
        proc.wait()
        proc.stderr.close()
    assert proc.returncode == -9, "the run ended before the kill: make its epochs longer"
    killed_at = max(_checkpointed(run))
    assert killed_at < last, "the run finished before the kill"

    # A new process, as a real resume is: init then imports what it imported when the run
    # started (sklearn.datasets draws from Python's random stream as it is imported).
    r = jobrun_proc("resume", "--run-dir", run)
    assert r.code == 0, r.text
    assert f"resumed from checkpoint epoch {killed_at}" in r.out
    assert _last_epoch(run) == _last_epoch(reference) == last
    assert ckpt_values(run, last) == ckpt_values(reference, last)
    # metrics.jsonl: one training log per epoch, none lost or repeated by the kill
    assert [x["_epoch"] for x in _epoch_logs(run)] == list(range(1, last + 1))
    assert logged(run) == logged(reference)


# -- plans/gan.yaml: a training step of the user's own ---------------------------------------


@pytest.mark.slow
def test_the_gan_learns_the_ring_and_saves_its_generator(runs) -> None:
    _import_plan_models()
    from models.gan import score

    records = _epoch_logs(runs["gan"])
    assert [r["_epoch"] for r in records] == list(range(1, 13))
    first, last = records[0], records[-1]
    assert first["good"] < 0.05 and last["good"] >= 0.4 and last["modes"] >= 5, (first, last)
    saved = load_file(runs["gan"] / "generator.safetensors")
    G = nn.Sequential(nn.Linear(8, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 2))
    G.load_state_dict({k.removeprefix("G."): v for k, v in saved.items()}, strict=True)
    assert score(G, noise=8) == (last["modes"], last["good"])  # the model the last epoch scored


def test_the_gan_plan_is_its_hand_written_loop_to_the_last_bit(tmp_path) -> None:
    """Two epochs of plans/gan.yaml against the same training written as a plain loop
    around the same `step`: the same weights and Adam states, bit for bit."""
    _import_plan_models()
    from models.gan import ring, step

    from benchmarks.common import reader_order
    from jobrun import store
    from jobrun.ops.context import OpContext
    from jobrun.ops.models import model_mlp

    run = _train(tmp_path, "gan", "max_epochs=2", plan=PLANS / "gan.yaml")
    # The loop: the job's seeded node generator builds the models (as model.mlp does) and
    # draws the noise; the reader's shuffle of each pass gives the batches.
    ctx = OpContext(node="local", seed=0, device="cpu")
    points = ring(8192)
    G, D = model_mlp(ctx, sizes=[8, 128, 128, 2]), model_mlp(ctx, sizes=[2, 128, 128, 1])
    opt_g = torch.optim.Adam(G.parameters(), lr=0.002, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(D.parameters(), lr=0.002, betas=(0.5, 0.999))
    for epoch in range(2):
        order = reader_order(len(points), epoch)
        for start in range(0, len(points), 128):
            step(G, D, opt_g, opt_d, points[order[start:start + 128]], noise=8, generator=ctx.generator)
    saved, _ = store.load(run / "checkpoints", "local", 2, blobs=["G", "D", "opt_g", "opt_d"])
    for name, module in (("G", G), ("D", D)):
        assert saved[name].state.keys() == module.state_dict().keys()
        for key, value in module.state_dict().items():
            assert torch.equal(saved[name].state[key], value), (name, key)
    for name, opt in (("opt_g", opt_g), ("opt_d", opt_d)):
        want = opt.state_dict()["state"]
        got = saved[name].state["state"]
        assert len(got) == len(want) == 6
        for i, state in want.items():
            for key, value in state.items():
                assert torch.equal(got[i][key], value), (name, i, key)


@pytest.mark.slow
def test_the_gan_on_two_replicas_trains_the_models_of_one_process(tmp_path) -> None:
    """The step's noise is drawn for the global batch and cut to each replica's rows
    (`jobrun.batch_rows`), and DDP averages its two backwards: 2 replicas, 1 process."""
    from jobrun import store

    runs = {}
    for n in ("1", "2"):
        r = jobrun_proc("train", PLANS / "gan.yaml", "--run-dir", tmp_path / n, "--replicas", n,
                        "--set", "max_epochs=1")
        assert r.code == 0, r.text
        runs[n], _ = store.load(tmp_path / n / "checkpoints", "local", 1, blobs=["G", "D"])
    for name in ("G", "D"):
        for key, value in runs["1"][name].state.items():
            assert torch.allclose(runs["2"][name].state[key], value, rtol=0, atol=1e-5), (name, key)
    scores = [[(r["modes"], r["good"]) for r in _epoch_logs(tmp_path / n)] for n in ("1", "2")]
    assert scores[0] == scores[1]


# -- export: a torch.export program that computes what the trained model computes ----------


def test_export_round_trip(tmp_path) -> None:
    run = _train(tmp_path, "export", plan=ROOT / "tests" / "plans" / "mlp_export.yaml")
    assert logged(run, "exported")[0]["exported"] == str(run / "model.pt2")
    program = torch.export.load(run / "model.pt2")
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    model.load_state_dict(_ckpt_model_state(run))
    model.eval()
    exported = program.module()
    gen = torch.Generator().manual_seed(0)
    for batch in (8, 3, 50):  # the example had 8 rows; the batch dimension is dynamic
        x = torch.randn(batch, 16, generator=gen)
        with torch.no_grad():
            torch.testing.assert_close(exported(x), model(x), rtol=1e-6, atol=1e-6)
