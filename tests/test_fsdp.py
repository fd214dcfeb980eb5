"""`parallel: fsdp`: models sharded with FSDP2 over 2 gloo ranks train as ddp does, save
sharded checkpoints (each rank its part), resume exactly, go to another number of ranks,
and export or save the whole model."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from runner_util import HANG_S, ckpt_values, close, jobrun, jobrun_proc, logged

from jobrun import store
from jobrun.store.shards import SavedShard

PLAN = """
job: fs
seed: 7
max_epochs: 3
parallel: fsdp
device: cpu  # gloo ranks on the CPU even where a GPU is (benchmarks/gpu.sh runs this file there)
checkpoint: {dir: ckpt}
init:
  - task: setup
    do:
      - data.synthetic: {out: [x, y], task: classification, n: 150, features: 10, classes: 3, noise: 1.0}
      - reader: {in: [x, y], out: data, batch_size: 20, shuffle: true, passes: 0}
      - model.mlp: {out: model, sizes: [10, 33, 17, 3]}
      - optimizer: {in: model, out: opt, target: torch.optim.Adam, lr: 0.01}
epoch:
  - task: train
    do:
      - loop: 6
        do:
          - read: {in: data, out: [xb, yb, end]}
          - if: end
            then: [{read: {in: data, out: [xb, yb, end]}}]
          - train.step: {in: [model, opt, xb, yb], out: loss, clip_grad_norm: 1.0}
      - log: {in: [loss]}
download:
  - task: gather
    workspace: global
    do:
      - model.gather: {in: model, out: full}
exit:
  - task: save
    do:
      - save: {in: [model], path: model.safetensors}
"""


def test_parallel_must_be_ddp_or_fsdp(tmp_path):
    plan = tmp_path / "p.yaml"
    plan.write_text(PLAN.replace("parallel: fsdp", "parallel: zero3"))
    r = jobrun("analyze", plan)
    assert r.code == 2
    assert "p.yaml:5:11" in r.err and "parallel must be ddp or fsdp, not 'zero3'" in r.err
    r = jobrun("print", plan, "parallel=fsdp")
    assert r.code == 0 and "parallel: fsdp" in r.out


def test_fsdp_layers_is_a_list_of_classes(tmp_path):
    plan = tmp_path / "p.yaml"
    plan.write_text(PLAN.replace("parallel: fsdp", "parallel: fsdp\nfsdp_layers: 3"))
    r = jobrun("analyze", plan)
    assert r.code == 2 and "p.yaml:6:14" in r.err
    assert "fsdp_layers must be a list of module classes, not the number 3" in r.err
    plan.write_text(PLAN.replace("parallel: fsdp", "parallel: fsdp\nfsdp_layers: [torch.nn.Linear]"))
    r = jobrun("print", plan)
    assert r.code == 0 and "fsdp_layers: [torch.nn.Linear]" in r.out


def test_layers_that_share_a_parameter_are_left_to_the_root():
    """Tied weights (an LM's head is its embedding): FSDP manages a parameter in one unit
    only, so the units holding a shared one are not sharded apart (their parameters are
    gathered with the root's); the others are, and a unit inside another is no tie."""
    import torch
    from jobrun_test_helpers import TiedLM

    from jobrun.ops.fsdp import layers, layers_of_types, untied

    lm = TiedLM()
    assert layers(lm) == [lm.emb, lm.mix, lm.head]
    assert untied(lm, layers(lm)) == [lm.mix]
    outer = torch.nn.Sequential(lm, torch.nn.Linear(11, 2))  # the tie one level down
    assert untied(outer, layers_of_types(outer, ("torch.nn.Embedding", "torch.nn.Linear"))) == [
        outer[1], lm.mix]
    enc = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(8, 2, 16), 2)
    nested = layers_of_types(enc, ("torch.nn.TransformerEncoderLayer", "torch.nn.Linear"))
    assert len(nested) == 2 * 4 and untied(enc, nested) == nested  # a layer, its 3 Linears


def test_a_hugging_face_lm_with_tied_embeddings_keeps_its_blocks_sharded():
    transformers = pytest.importorskip("transformers")
    from jobrun.ops.fsdp import layers, layers_of_types, untied

    config = transformers.GPT2Config(vocab_size=11, n_positions=6, n_embd=8, n_layer=2, n_head=2)
    model = transformers.GPT2LMHeadModel(config)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert untied(model, layers(model)) == []  # transformer and lm_head share wte
    blocks = layers_of_types(model, ("transformers.models.gpt2.modeling_gpt2.GPT2Block",))
    assert len(blocks) == 2 and untied(model, blocks) == blocks


# -- precision: FSDP's MixedPrecisionPolicy follows train.step's amp --------------------

AMP = "epoch.train.train.step.amp="


@pytest.mark.parametrize("sets, want", [
    ([AMP + "bf16"], "bf16"), ([AMP + "fp16"], "fp16"), ([], None),
    ([AMP + "bf16", "parallel=ddp"], None),  # ddp shards nothing: autocast alone
])
def test_fsdp_gathers_parameters_in_the_amp_of_every_train_step(tmp_path, sets, want):
    from jobrun.plans import precision
    from jobrun.plans.compile import compile_text

    plan = compile_text(PLAN, "p.yaml", sets)
    assert precision.fsdp_amp(plan) == want
    path = tmp_path / "p.yaml"
    path.write_text(PLAN)
    r = jobrun("print", path, *sets)
    assert r.code == 0, r.text
    line = next((ln for ln in r.out.splitlines() if ln.startswith("fsdp precision:")), None)
    if "parallel=ddp" in sets:
        assert line is None
    elif want:
        assert line == (f"fsdp precision: parameters gathered in {want} (train.step amp), "
                        "gradients reduced in float32")
    else:
        assert line == "fsdp precision: float32"
    r = jobrun("print", path, "--format", "json", *sets)
    assert json.loads(r.out)["fsdp_amp"] == want


def test_train_steps_that_disagree_on_amp_gather_in_float32_with_a_warning(tmp_path):
    from jobrun.plans import precision
    from jobrun.plans.compile import compile_text

    text = PLAN.replace("clip_grad_norm: 1.0}", "clip_grad_norm: 1.0, amp: bf16}").replace(
        "      - log: {in: [loss]}",
        "      - train.step: {in: [model, opt, xb, yb], out: loss}\n      - log: {in: [loss]}")
    path = tmp_path / "p.yaml"
    path.write_text(text)
    assert precision.fsdp_amp(compile_text(text)) is None
    r = jobrun("analyze", path)
    assert r.code == 0, r.text  # a warning: the job runs, in float32
    line = text.splitlines().index("      - train.step: {in: [model, opt, xb, yb], out: loss}") + 1
    first = next(i for i, ln in enumerate(text.splitlines(), 1) if "amp: bf16" in ln)
    assert (f"p.yaml:{line}:9: warning: under parallel: fsdp this train.step has amp null, the one "
            f"at line {first} has bf16: parameters are gathered in float32") in r.out
    assert "give every train.step the same amp" in r.out
    r = jobrun("analyze", path, "parallel=ddp")  # autocast alone: nothing to warn about
    assert r.code == 0 and "fsdp" not in r.out


@pytest.mark.slow
@pytest.mark.parametrize("amp, dtype", [("bf16", "torch.bfloat16"), ("fp16", "torch.float16"),
                                        (None, "torch.float32")])
def test_the_policy_gathers_parameters_in_the_amp_dtype(tmp_path, amp, dtype):
    # One gloo rank (in a process of its own, so this one keeps no process group).
    script = f"""
import json, torch, torch.distributed as dist
from jobrun.ops import fsdp
dist.init_process_group("gloo", init_method="file://{tmp_path}/store", rank=0, world_size=1)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
seen = []
model[0].register_forward_pre_hook(lambda m, args: seen.append((str(m.weight.dtype), str(args[0].dtype))))
fsdp.shard(model, (), {amp!r})
out = model(torch.randn(3, 4))
out.sum().backward()
print(json.dumps({{"seen": seen, "out": str(out.dtype),
                   "params": sorted({{str(p.dtype) for p in model.parameters()}}),
                   "grads": sorted({{str(p.grad.dtype) for p in model.parameters()}})}}))
dist.destroy_process_group()
"""
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=HANG_S)
    assert p.returncode == 0, p.stderr
    got = json.loads(p.stdout.splitlines()[-1])
    assert got["seen"] == [[dtype, dtype]]  # the layer computes with gathered amp parameters
    assert got["out"] == "torch.float32"  # the loss gets float32 outputs
    assert got["params"] == got["grads"] == ["torch.float32"]  # shards and optimizer: float32


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp")
    (root / "plan.yaml").write_text(PLAN)
    for name, sets in (("fsdp", []), ("ddp", ["parallel=ddp"])):
        r = jobrun_proc("train", root / "plan.yaml", "--run-dir", root / name, "--replicas", "2", *sets,
                        timeout=HANG_S)
        assert r.code == 0, r.text
        assert "Warning" not in r.err, r.err  # e.g. torch 2.13 deprecating a collective StepTotals used
    return root


def _model(run, epoch=3):
    return ckpt_values(run, epoch)["model"]["state"]


@pytest.mark.slow
def test_fsdp_trains_as_ddp(runs):
    # ckpt show makes the sharded model whole from both ranks' files.
    fs, dd = _model(runs / "fsdp"), _model(runs / "ddp")
    assert fs.keys() == dd.keys() == {f"{i}.{p}" for i in (0, 2, 4) for p in ("weight", "bias")}
    for key in fs:
        assert close(fs[key], dd[key], 1e-6), key
    lf = [r["loss"] for r in logged(runs / "fsdp")]
    ld = [r["loss"] for r in logged(runs / "ddp")]
    assert len(lf) == len(ld) == 3 and all(close(a, b, 1e-5) for a, b in zip(lf, ld))


@pytest.mark.slow
def test_each_rank_saves_its_shards(runs):
    sizes = []
    for rank in (0, 1):
        blobs, _ = store.load(runs / "fsdp" / "ckpt", "local", 3, rank=rank)
        w = blobs["model"].state["0.weight"]
        assert isinstance(w, SavedShard) and w.shape == (33, 10) and w.mesh == 2
        sizes.append(w.local.shape[0])
        exp_avg = blobs["opt"].state["state"][0]["exp_avg"]  # the optimizer's state too
        assert isinstance(exp_avg, SavedShard) and exp_avg.local.shape == w.local.shape
    assert sizes == [17, 16]  # torch.chunk of 33 rows over 2 ranks


@pytest.mark.slow
def test_saved_and_exported_models_are_whole(runs, tmp_path):
    from safetensors.numpy import load_file

    out = tmp_path / "m.safetensors"
    r = jobrun("export", runs / "fsdp", "--epoch", "3", "--blob", "model", "-o", out)
    assert r.code == 0, r.text
    exported = load_file(out)
    saved = load_file(runs / "fsdp" / "model.safetensors")  # the exit task's save, on rank 0
    assert exported["0.weight"].shape == (33, 10)
    assert all((saved[f"model.{k}"] == v).all() for k, v in exported.items())


@pytest.mark.slow
def test_fsdp_resume_is_exact(runs, tmp_path):
    run = tmp_path / "fsdp"
    shutil.copytree(runs / "fsdp", run)
    r = jobrun_proc("resume", "--run-dir", run, "--epoch", "1", timeout=HANG_S)
    assert r.code == 0, r.text
    assert _model(run) == _model(runs / "fsdp")


@pytest.mark.slow
@pytest.mark.parametrize("to", ["1"])
def test_fsdp_resume_with_another_number_of_ranks(runs, tmp_path, to):
    run = tmp_path / "fsdp"
    shutil.copytree(runs / "fsdp", run)
    r = jobrun("resume", "--run-dir", run, "--epoch", "1", "--replicas", to)  # one replica: in this process
    assert r.code == 0, r.text
    assert "resuming with 1 replica from a checkpoint of 2" in r.err
    want = _model(runs / "fsdp")
    got = _model(run)
    for key in want:
        assert close(got[key], want[key], 1e-5), key
    # And back to 2 ranks: the whole model of 1 rank is sharded again.
    r = jobrun_proc("resume", "--run-dir", run, "--epoch", "2", "--replicas", "2", timeout=HANG_S)
    assert r.code == 0, r.text
    again = _model(run)
    for key in want:
        assert close(again[key], want[key], 1e-5), key


@pytest.mark.slow
def test_char_lm_trains_the_same_with_fsdp_and_ddp(tmp_path):
    # A transformer: its blocks (a ModuleList) are sharded one by one.
    from pathlib import Path

    plan = Path(__file__).parent.parent / "plans" / "charlm.yaml"
    losses = {}
    layers = "fsdp_layers=[torch.nn.TransformerEncoderLayer, torch.nn.Embedding]"
    for name, sets in (("ddp", ["parallel=ddp"]), ("fsdp", ["parallel=fsdp"]),
                       ("typed", ["parallel=fsdp", layers])):
        # one block, a quarter of the windows (stride 64), a narrower model: what sharding
        # blocks one by one computes does not depend on the sizes
        r = jobrun_proc("train", plan, "--run-dir", tmp_path / name, "--replicas", "2", "max_epochs=1",
                        "vars.layers=1", "vars.stride=64", "vars.d_model=32", "device=cpu", *sets,
                        timeout=HANG_S)
        assert r.code == 0, r.text
        losses[name] = logged(tmp_path / name)[0]
    for name in ("fsdp", "typed"):
        for key in ("loss", "val_loss"):
            assert close(losses[name][key], losses["ddp"][key], 1e-5), (name, key)


@pytest.mark.slow
def test_fsdp_layers_the_model_lacks_is_one_clear_error(tmp_path):
    plan = tmp_path / "plan.yaml"
    plan.write_text(PLAN.replace("parallel: fsdp", "parallel: fsdp\nfsdp_layers: [torch.nn.Conv2d]"))
    r = jobrun_proc("train", plan, "--run-dir", tmp_path / "run", "--replicas", "2", timeout=HANG_S)
    assert r.code == 1
    assert "fsdp_layers: the model has no torch.nn.Conv2d" in r.err
    assert "its modules are: Linear, ReLU" in r.err and "Traceback" not in r.err


@pytest.mark.slow
def test_a_killed_fsdp_rank_restarts_and_ends_as_an_uninterrupted_run(runs, tmp_path):
    # Rank 1 is SIGKILLed at step 3 of epoch 2 (once); the elastic agent restarts both
    # ranks, which resume from epoch 1's sharded checkpoint.
    text = PLAN.replace("      - loop: 6\n        do:", "      - add: {in: [epoch_no, 1], out: epoch_no}\n"
                        "      - loop: 6\n        as: i\n        do:")
    text = text.replace("          - train.step:", '          - call: {fn: "jobrun_test_helpers:die_once", '
                        f'in: [epoch_no, i], path: "{tmp_path / "deaths"}", at: 2, at_step: 3}}\n'
                        "          - train.step:")
    text = text.replace("      - optimizer:", "      - const: {out: epoch_no, value: 0}\n      - optimizer:")
    plan = tmp_path / "plan.yaml"
    plan.write_text(text)
    r = jobrun_proc("train", plan, "--run-dir", tmp_path / "run", "--replicas", "2", "--max-restarts", "1",
                    timeout=HANG_S)
    assert r.code == 0, r.text
    assert (tmp_path / "deaths").read_text().count("\n") == 1
    assert "restart 1: rank 1 died" in r.out + r.err
    got, want = _model(tmp_path / "run"), _model(runs / "fsdp")
    assert got == want


# A script's ranks leave without the interpreter's teardown: with sharded models still
# alive there, a rank aborted in it (SIGABRT, "terminate called without an active
# exception") after its work was done in 3-4 of 20 runs of this script, with or without
# StepTotals; jobrun's workers (15 runs of 3 ranks) and scripts that exit this way did not.
_EXIT = """
import os, sys
sys.stdout.flush()
os._exit(0)
"""

_TOTALS = """
import json, sys, torch, torch.distributed as dist
from jobrun.ops import fsdp
from jobrun.ops.context import OpContext
from jobrun.ops.split import mark_records
from jobrun.ops.train import train_step
rank, world, store = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=world)
torch.manual_seed(0)
x, y = torch.randn(3, 17, 6), torch.randint(0, 3, (3, 17))
sizes = [7, 10, 0]  # records per rank in each global batch of 17: rank 2's slice is empty
lo = sum(sizes[:rank])
calls = []
real = dist.all_reduce
def all_reduce(*a, **k):  # counts the blocking ones (the stop flags' is asynchronous)
    if not k.get("async_op"):
        calls.append(1)
    return real(*a, **k)
dist.all_reduce = all_reduce
reads = []
for name in ("item", "tolist", "__float__", "__bool__"):
    def counted(self, *a, _real=getattr(torch.Tensor, name), **k):
        reads.append(1)
        return _real(self, *a, **k)
    setattr(torch.Tensor, name, counted)
out = {}
for carry, tagged in ((True, False), (False, False), (True, True), (False, True)):
    torch.manual_seed(1)
    model = fsdp.shard(torch.nn.Sequential(torch.nn.Linear(6, 9), torch.nn.ReLU(), torch.nn.Linear(9, 3)))
    if not carry:  # as a model sharded without the carrier: the vector is all-reduced
        model._jobrun_totals = None
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ctx = OpContext(rank=rank, world_size=world, parallel="fsdp")
    calls.clear(), reads.clear()
    losses = []
    for s in range(3):
        xs, ys = x[s, lo:lo + sizes[rank]], y[s, lo:lo + sizes[rank]]
        if tagged:  # as a reader splits a batch: its global records known, no count to carry
            mark_records((xs, ys), 17)
        losses.append(train_step(ctx, model, opt, xs, ys))
    read = len(reads)
    losses = [v.item() for v in losses]
    weights = {k: v.full_tensor().tolist() for k, v in model.state_dict().items()}
    out[f"{carry}-{tagged}"] = {"losses": losses, "all_reduces": len(calls), "reads": read, "weights": weights}
if rank == 0:  # the same steps in one process, on the whole global batch
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(6, 9), torch.nn.ReLU(), torch.nn.Linear(9, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out["one"] = [train_step(OpContext(), model, opt, x[s], y[s]).item() for s in range(3)]
print(json.dumps(out))
dist.destroy_process_group()
""" + _EXIT


@pytest.mark.slow
def test_step_totals_ride_in_fsdps_reduce_scatter(tmp_path):
    # 3 ranks (sums of 3 floats depend on their order) and an empty slice: the losses (and
    # the records of batches no reader split) travel in FSDP's reduce-scatter (no
    # all-reduce, no read from the device), every rank gets the same loss, and the
    # numbers equal those of a separate all-reduce and of one process.
    script = tmp_path / "totals.py"
    script.write_text(_TOTALS)
    procs = [subprocess.Popen([sys.executable, str(script), str(r), "3", str(tmp_path / "store")],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(3)]
    got = []
    for p in procs:
        out, err = p.communicate(timeout=HANG_S)
        assert p.returncode == 0, err
        assert "Warning" not in err, err  # e.g. torch's deprecation of a collective
        got.append(json.loads(out.splitlines()[-1]))
    for g in got:
        for tagged in ("False", "True"):  # cut by the script, or split by a reader
            carried, alone = g[f"True-{tagged}"], g[f"False-{tagged}"]
            assert carried["all_reduces"] == 0  # carried
            assert alone["all_reduces"] == 3  # one a step without the carrier
            assert carried["reads"] == alone["reads"] == 0  # the loss stays on the device
            assert carried["losses"] == alone["losses"] == got[0][f"True-{tagged}"]["losses"]
            assert carried["weights"] == alone["weights"]
    one = got[0]["one"]
    for key in ("True-False", "True-True"):
        assert all(close(a, b, 1e-6) for a, b in zip(got[0][key]["losses"], one))
    assert one[2] < one[0]  # it trained


_ACCUMULATE = """
import json, sys, torch, torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule
rank, world, store = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
scatters = []
for name in ("reduce_scatter_single", "reduce_scatter_tensor"):  # before jobrun takes one
    if hasattr(dist, name):
        def counted(*a, _real=getattr(dist, name), **k):
            scatters.append(1)
            return _real(*a, **k)
        setattr(dist, name, counted)
from jobrun.ops import fsdp
from jobrun.ops.context import OpContext
from jobrun.ops.split import mark_records
from jobrun.ops.train import train_step
dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=world)
torch.manual_seed(0)
K, n = 4, 13
x, y = torch.randn(1, n, 6).repeat(3, 1, 1), torch.randint(0, 3, (1, n)).repeat(3, 1)  # one batch
lo, size = (0, 10) if rank == 0 else (10, 3)  # rank 1: 3 records, an empty 4th micro-batch
def sharded(amp):
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(6, 9), torch.nn.ReLU(), torch.nn.Linear(9, 3))
    model = fsdp.shard(model, (), amp)  # two units (the Linears); the root holds none
    return model, torch.optim.SGD(model.parameters(), lr=0.1)
out = {}
for amp in (None, "bf16"):
    model, opt = sharded(amp)
    ctx = OpContext(rank=rank, world_size=world, parallel="fsdp")
    jobrun = {"losses": [], "scatters": []}
    for s in range(3):
        xs, ys = mark_records((x[s, lo:lo + size], y[s, lo:lo + size]), n)
        scatters.clear()
        jobrun["losses"].append(train_step(ctx, model, opt, xs, ys, accumulate=K, amp=amp).item())
        jobrun["scatters"].append(len(scatters))
    jobrun["weights"] = {k: v.full_tensor().tolist() for k, v in model.state_dict().items()}
    # torch's FSDP2 accumulation loop as torchtitan writes it: every backward reduce-scatters
    # (summed, as train.step's losses weighted by each rank's share are)
    model, opt = sharded(amp)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
    hand = {"scatters": []}
    for s in range(3):
        scatters.clear()
        opt.zero_grad(set_to_none=True)
        for i, (xb, yb) in enumerate(zip(x[s, lo:lo + size].tensor_split(K), y[s, lo:lo + size].tensor_split(K))):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp is not None):
                loss = F.cross_entropy(model(xb), yb) * (len(yb) / n) if len(yb) else model(xb).sum() * 0.0
            loss.backward()
        opt.step()
        hand["scatters"].append(len(scatters))
    hand["weights"] = {k: v.full_tensor().tolist() for k, v in model.state_dict().items()}
    out[str(amp)] = {"jobrun": jobrun, "hand": hand}
print(json.dumps(out))
dist.destroy_process_group()
""" + _EXIT


@pytest.fixture(scope="module")
def accumulated(tmp_path_factory):
    """`train.step` with accumulate 4 and a hand FSDP2 loop on 2 ranks, float32 and bf16:
    what each rank printed."""
    root = tmp_path_factory.mktemp("accumulate")
    (root / "accumulate.py").write_text(_ACCUMULATE)
    procs = [subprocess.Popen([sys.executable, str(root / "accumulate.py"), str(r), "2", str(root / "store")],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    got = []
    for p in procs:
        out, err = p.communicate(timeout=HANG_S)
        assert p.returncode == 0, err
        got.append(json.loads(out.splitlines()[-1]))
    return got


@pytest.mark.slow
def test_accumulate_trains_what_a_hand_written_fsdp2_loop_does(accumulated):
    """FSDP2's default accumulation, as torchtitan's loop: every micro-batch's backward
    reduce-scatters to the slices (one per unit: 4 micro-batches x 2 units), bit for bit
    the hand loop's weights in float32 and bf16 (a rank's empty micro-batch included)."""
    for got in accumulated:
        for amp in ("None", "bf16"):
            assert got[amp]["jobrun"]["scatters"] == got[amp]["hand"]["scatters"] == [8, 8, 8], amp
            assert got[amp]["jobrun"]["weights"] == got[amp]["hand"]["weights"], amp
            assert got[amp]["jobrun"]["losses"] == accumulated[0][amp]["jobrun"]["losses"]
    assert accumulated[0]["None"]["jobrun"]["losses"][2] < accumulated[0]["None"]["jobrun"]["losses"][0]


def test_a_misspelt_fsdp_layers_class_is_refused_at_its_line_before_the_run(tmp_path):
    """It passed analyze and the import check, made a run directory, started both ranks,
    and each said it at the `build` line, with a `jobrun resume` that could not help."""
    (tmp_path / "plan.yaml").write_text(PLAN.replace("parallel: fsdp\n", "parallel: fsdp\nfsdp_layers: [torch.nn.Linearr]\n"))
    r = jobrun("train", tmp_path / "plan.yaml", "--run-dir", tmp_path / "run", "--replicas", "2")
    assert r.code == 2 and "plan.yaml:6:14: error: fsdp_layers: class 'torch.nn.Linearr' cannot be imported" in r.err, r.text
    assert "did you mean 'Linear'?" in r.err and "resume" not in r.err
    assert not (tmp_path / "run").exists()


def test_a_sharded_checkpoint_resumed_without_fsdp_says_how_to_resume_it():
    """`resume parallel=ddp` of an fsdp run: the store said "resume an fsdp run with 2
    replicas", and the restore replaced it with "the checkpoint is damaged ... or an
    override changed what init builds", neither of which was true."""
    from types import SimpleNamespace

    import torch

    from jobrun.errors import CheckpointError
    from jobrun.runner import restore
    from jobrun.store.codec import SavedState

    live = torch.nn.Linear(4, 2)
    shard = SavedShard(torch.zeros(1, 4), (2, 4), (4, 1), ("S0",), 2)
    saved = SavedState("torch.nn.modules.linear.Linear", {"weight": shard, "bias": torch.zeros(2)})
    node = SimpleNamespace(name="local", globals={"model": live})
    with pytest.raises(CheckpointError) as e:
        restore._blob(node, "model", saved, 3)
    assert "sharded over 2 ranks" in e.value.message
    assert e.value.hint.startswith("resume an fsdp run with 2 replicas"), e.value.hint


def test_fsdp_layers_without_parallel_fsdp_is_warned_at_the_key():
    """It was ignored without a word: the user meant the model to be sharded."""
    from jobrun.plans.analyze import analyze
    from jobrun.plans.compile import compile_text

    text = PLAN.replace("parallel: fsdp\n", "fsdp_layers: [torch.nn.Linear]\n")
    found = [(d.code, d.pos.line, d.message) for d in analyze(compile_text(text, "plan.yaml"))
             if d.code == "fsdp-layers"]
    line = text.splitlines().index("fsdp_layers: [torch.nn.Linear]") + 1
    assert found == [("fsdp-layers", line, "fsdp_layers does nothing without `parallel: fsdp`: no model is sharded")]
    assert not [d for d in analyze(compile_text(PLAN.replace("parallel: fsdp\n", "parallel: fsdp\nfsdp_layers: "
                                                             "[torch.nn.Linear]\n"), "plan.yaml"))
                if d.code == "fsdp-layers"]


@pytest.mark.slow
def test_a_call_steps_gradients_are_the_ranks_mean_as_under_ddp(tmp_path):
    # FSDP summed every backward's gradients over ranks, which train.step's (weighted by
    # each rank's share) needs: a `call`'s step, whose loss is the rank's mean, as DDP
    # averages it, got the ranks' sum, twice the gradient on 2 replicas.
    plan = (PLAN.replace("optimizer: {in: model, out: opt, target: torch.optim.Adam, lr: 0.01}",
                         "optimizer: {in: model, out: opt, lr: 0.1}")
            .replace("train.step: {in: [model, opt, xb, yb], out: loss, clip_grad_norm: 1.0}",
                     'call: {fn: "jobrun_test_helpers:mean_step", in: [model, opt, xb, yb], out: loss, '
                     "mutates: [model, opt]}"))
    assert "mean_step" in plan and "lr: 0.1}" in plan
    (tmp_path / "plan.yaml").write_text(plan)
    for name in ("ddp", "fsdp"):
        r = jobrun_proc("train", tmp_path / "plan.yaml", "--run-dir", tmp_path / name, "--replicas", "2",
                        f"parallel={name}", "max_epochs=1", timeout=HANG_S)
        assert r.code == 0, r.text
    fs, dd = _model(tmp_path / "fsdp", 1), _model(tmp_path / "ddp", 1)
    assert fs.keys() == dd.keys()
    for key in fs:
        assert close(fs[key], dd[key], 1e-6), key


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["fsdp", "ddp"])
def test_a_model_no_step_changes_is_fingerprinted_as_one_process_built_it(tmp_path, parallel):
    # A model init builds and no step changes (a frozen teacher, one only evaluated) is in
    # no checkpoint, so its fingerprint is: sharded, it stopped every rank after init with
    # torch's ".numpy() is not supported for tensor subclasses" and a hint to resume; and
    # `resume --replicas 1` refused a run of 2, the model's class being FSDPSequential or
    # DDPSequential then, Sequential now.
    plan = PLAN.replace(
        "      - optimizer: {in: model, out: opt",
        "      - model.mlp: {out: frozen, sizes: [10, 8, 3]}\n"
        "      - reader: {in: [x, y], out: val, batch_size: 50}\n"
        "      - optimizer: {in: model, out: opt").replace(
        "      - log: {in: [loss]}", "      - evaluate: {in: [frozen, val], out: [frozen_loss, frozen_acc]}\n"
                                     "      - log: {in: [loss, frozen_loss]}")
    assert "frozen_loss]" in plan
    (tmp_path / "plan.yaml").write_text(plan)
    run = tmp_path / "run"
    r = jobrun_proc("train", tmp_path / "plan.yaml", "--run-dir", run, "--replicas", "2", "max_epochs=2",
                    f"parallel={parallel}", timeout=HANG_S)
    assert r.code == 0, r.text
    assert "frozen" not in ckpt_values(run, 2)  # in no checkpoint: fingerprinted
    # the whole tensors: the same fingerprint on another number of ranks
    r = jobrun_proc("resume", run, "--epoch", "1", "--replicas", "1", timeout=HANG_S)
    assert r.code == 0, r.text
    assert "init built other things" not in r.err, r.err
    losses = [v["frozen_loss"] for v in logged(run)]
    assert len(losses) == 2 and close(losses[0], losses[1], 1e-6)  # the same frozen model (2 ranks, then 1)
