"""`jobrun export` for plain PyTorch, and `jobrun ckpt show` of tensors (dtype and shape)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from runner_util import jobrun
from torch import nn

from jobrun import store

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def mlp_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bundled MLP example, one epoch."""
    run = tmp_path_factory.mktemp("export") / "run"
    mp = pytest.MonkeyPatch()
    mp.setenv("JOBRUN_THREADS", "1")
    threads = torch.get_num_threads()
    try:
        # the data too (init builds it; checkpoints hold it only when asked to)
        r = jobrun("train", ROOT / "plans" / "mlp.yaml", "--run-dir", run, "max_epochs=1",
                   "checkpoint.include=[x, y]")
    finally:
        mp.undo()
        torch.set_num_threads(threads)
    assert r.code == 0, r.text
    return run


def mlp() -> nn.Module:
    """The example's model as a user writes it in plain PyTorch (sizes [16, 64, 64, 4])."""
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_one_module_blob_loads_into_plain_pytorch(mlp_run: Path, tmp_path: Path, suffix: str) -> None:
    out = tmp_path / f"model{suffix}"
    r = jobrun("export", mlp_run, "--epoch", "1", "--blob", "model", "-o", out)
    assert r.code == 0, r.text
    if suffix == ".safetensors":
        from safetensors.torch import load_file

        state = load_file(out)
    else:
        state = torch.load(out, weights_only=True)
    assert sorted(state) == ["0.bias", "0.weight", "2.bias", "2.weight", "4.bias", "4.weight"]
    model = mlp()
    model.load_state_dict(state)  # strict: every key matches
    # the trained weights, not an initialisation: the same as the checkpoint holds
    shown = json.loads(jobrun("ckpt", "show", mlp_run, "--epoch", "1", "--blob", "model", "--json").out)
    saved = shown["nodes"]["local"]["model"]["state"]["4.bias"]
    assert model[4].bias.tolist() == saved


def test_several_blobs_keep_their_names_as_prefixes(mlp_run: Path, tmp_path: Path) -> None:
    from safetensors.numpy import load_file

    out = tmp_path / "both.safetensors"
    r = jobrun("export", mlp_run, "--epoch", "1", "--blob", "model", "--blob", "y", "-o", out)
    assert r.code == 0, r.text
    assert sorted(load_file(out)) == ["model.0.bias", "model.0.weight", "model.2.bias", "model.2.weight",
                                      "model.4.bias", "model.4.weight", "y"]
    # with an optimizer: .pt only (below), as `blob.key` when it is not alone
    out = tmp_path / "both.pt"
    r = jobrun("export", mlp_run, "--epoch", "1", "--blob", "model", "--blob", "opt", "-o", out)
    assert r.code == 0, r.text
    keys = sorted(torch.load(out, weights_only=True))
    assert keys[:7] == ["model.0.bias", "model.0.weight", "model.2.bias", "model.2.weight", "model.4.bias",
                        "model.4.weight", "opt.param_groups"]
    assert keys[7:] and all(k.startswith("opt.state.") for k in keys[7:])


def test_an_exported_optimizer_loads_into_plain_pytorch_as_resume_restores_it(tmp_path: Path) -> None:
    """`export --blob opt -o opt.pt` writes the optimizer's own state_dict (int keys,
    param_groups, Adam's step tensors), so a hand loop goes on from it; a .safetensors or
    .json file, which would lose part of it, is refused, naming .pt."""
    plan = tmp_path / "adamw.yaml"
    plan.write_text("""\
job: adamw
seed: 0
max_epochs: 2
checkpoint: {}
init:
  - task: setup
    do:
      - data.synthetic: {out: [x, y], task: classification, n: 128, features: 8, classes: 3, seed: 0}
      - reader: {in: [x, y], out: data, batch_size: 32, shuffle: true, passes: 0}
      - model.mlp: {out: model, sizes: [8, 16, 3]}
      - optimizer: {in: model, out: opt, target: torch.optim.AdamW, lr: 0.01}
epoch:
  - task: train
    do:
      - loop: null
        do:
          - read: {in: data, out: [xb, yb, end]}
          - stop_if: end
          - train.step: {in: [model, opt, xb, yb], out: loss}
""")
    run = tmp_path / "run"
    assert jobrun("train", plan, "--run-dir", run).code == 0
    out = tmp_path / "opt.pt"
    r = jobrun("export", run, "--blob", "opt", "-o", out)
    assert r.code == 0, r.text

    def fresh() -> torch.optim.AdamW:
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
        return torch.optim.AdamW(model.parameters(), lr=0.01)

    exported = fresh()
    exported.load_state_dict(torch.load(out, weights_only=True))
    resumed = fresh()  # what `jobrun resume` loads into the optimizer init built again
    store.restore(resumed, store.load(run / "checkpoints", "local", 2)[0]["opt"])
    got, want = exported.state_dict(), resumed.state_dict()
    assert got["param_groups"] == want["param_groups"] and sorted(got["state"]) == [0, 1, 2, 3]
    for i, state in want["state"].items():
        assert sorted(got["state"][i]) == ["exp_avg", "exp_avg_sq", "step"]
        assert all(torch.equal(got["state"][i][k], v) for k, v in state.items())
    assert got["state"][0]["step"] == 8  # 2 epochs of 4 steps: trained, not a fresh state
    for suffix in (".safetensors", ".json"):
        r = jobrun("export", run, "--blob", "opt", "-o", tmp_path / f"opt{suffix}")
        assert r.code == 2 and "Traceback" not in r.text
        assert f"blob 'opt' holds the state of a torch.optim.adamw.AdamW: a {suffix} file would lose" in r.err
        assert f"export it alone to a .pt file: `jobrun export {run} --blob opt -o opt.pt`" in r.err
        assert not (tmp_path / f"opt{suffix}").exists()


def test_ckpt_show_gives_dtypes_and_shapes_and_values_on_request(mlp_run: Path) -> None:
    r = jobrun("ckpt", "show", mlp_run, "--epoch", "1")
    assert r.code == 0, r.text
    lines = r.out.splitlines()
    assert "  model = state of torch.nn.modules.container.Sequential" in lines
    assert "      0.weight = tensor float32 [64, 16]" in lines
    assert "      state.0.momentum_buffer = tensor float32 [64, 16]" in lines
    assert "  x = tensor float32 [2048, 16]" in lines and "  y = tensor int64 [2048]" in lines
    assert any(line.startswith("  loss = tensor float32 []: 0.") for line in lines)  # a 0-d tensor shows its value
    assert len(r.out) < 5000  # no tensor values: 2048 x 16 floats would be far more
    r = jobrun("ckpt", "show", mlp_run, "--epoch", "1", "--blob", "model", "--values")
    line = next(line for line in r.out.splitlines() if "4.bias" in line)
    assert line.startswith("      4.bias = tensor float32 [4]: [") and line.endswith("]")
    assert "...<+len=" in next(line for line in r.out.splitlines() if "0.weight" in line)


def test_ckpt_show_json_keeps_values_and_adds_dtypes_and_shapes(mlp_run: Path) -> None:
    r = jobrun("ckpt", "show", mlp_run, "--epoch", "1", "--blob", "model", "--blob", "y", "--json")
    data = json.loads(r.out)
    assert len(data["nodes"]["local"]["y"]) == 2048  # values in full
    assert data["tensors"]["local"]["model.0.weight"] == {"dtype": "float32", "shape": [64, 16]}
    assert data["tensors"]["local"]["y"] == {"dtype": "int64", "shape": [2048]}


def test_an_exported_module_loads_back_into_a_plan(mlp_run: Path, tmp_path: Path) -> None:
    """`load` of a file `export` wrote for one module gives its state dict under the one
    output's name, and `build`'s module takes it (a fine-tune starting from it)."""
    out = tmp_path / "model.safetensors"
    assert jobrun("export", mlp_run, "--epoch", "1", "--blob", "model", "-o", out).code == 0
    plan = tmp_path / "finetune.yaml"
    plan.write_text(f"""\
job: finetune
max_epochs: 1
init:
  - task: setup
    do:
      - model.mlp: {{out: model, sizes: [16, 64, 64, 4]}}
      - load: {{out: [pretrained], path: {out}}}
      - call: {{fn: "torch.nn.Module.load_state_dict", in: [model, pretrained]}}
epoch:
  - task: t
    do: [{{save: {{in: [model], path: again.safetensors}}}}]
""")
    r = jobrun("train", plan, "--run-dir", tmp_path / "run")
    assert r.code == 0, r.text
    from safetensors.torch import load_file

    again = load_file(tmp_path / "run" / "again.safetensors")
    assert torch.equal(again["model.4.bias"], load_file(out)["4.bias"])


def test_a_tuple_of_tensors_shows_and_exports_tensor_by_tensor(tmp_path: Path) -> None:
    """A blob that is a tuple of tensors (an LSTM's hidden state carried across epochs) is
    saved as blob.0, blob.1: `ckpt show` gives each one's dtype and shape, not its values,
    and `export` writes them, to .safetensors as to .pt."""
    plan = tmp_path / "pair.yaml"
    plan.write_text("""\
job: pair
max_epochs: 1
checkpoint: {}
init:
  - task: setup
    do:
      - fill: {out: w, shape: [4, 3], value: 0.5}
      - call: {fn: "torch.chunk", in: [w, 2], out: pair}
epoch:
  - task: t
    do: [{call: {fn: "torch.chunk", in: [w, 2], out: pair}}]
""")
    run = tmp_path / "run"
    assert jobrun("train", plan, "--run-dir", run).code == 0
    r = jobrun("ckpt", "show", run, "--blob", "pair")
    assert r.code == 0, r.text
    assert r.out.splitlines()[2:] == ["  pair.0 = tensor float32 [2, 3]", "  pair.1 = tensor float32 [2, 3]"]
    shown = json.loads(jobrun("ckpt", "show", run, "--blob", "pair", "--json").out)
    assert shown["tensors"]["local"]["pair.1"] == {"dtype": "float32", "shape": [2, 3]}
    assert shown["nodes"]["local"]["pair"] == [[[0.5] * 3] * 2] * 2  # values in full, as before
    from safetensors.torch import load_file

    for out, load in [(tmp_path / "pair.safetensors", load_file),
                      (tmp_path / "pair.pt", lambda p: torch.load(p, weights_only=True))]:
        r = jobrun("export", run, "--blob", "pair", "-o", out)
        assert r.code == 0, r.text
        state = load(out)
        assert sorted(state) == ["pair.0", "pair.1"] and torch.equal(state["pair.1"], torch.full((2, 3), 0.5))
