"""The core ops of PLAN_LANGUAGE.md §3, run through real plans."""

from __future__ import annotations

import json

import pytest
from runner_util import ckpt_values, jobrun, logged


def run(plan_file, tmp_path, body: str, init: str = "", extra: str = "") -> tuple:
    text = f"""
job: ops
max_epochs: 1
checkpoint: {{}}
{extra}
init:
  - task: setup
    do:
      - const: {{out: zero, value: 0}}
{init}
epoch:
  - task: t
    workspace: global
    do:
{body}
"""
    run_dir = tmp_path / "run"
    r = jobrun("train", plan_file(text), "--run-dir", run_dir)
    return r, run_dir


def test_arithmetic_comparisons_and_logic(plan_file, tmp_path):
    body = """
      - const: {out: a, value: 7}
      - const: {out: b, value: 2}
      - add: {in: [a, b, 1], out: s}
      - sub: {in: [a, b], out: d}
      - mul: {in: [a, b, 3], out: m}
      - div: {in: [a, b], out: q}
      - ge: {in: [a, b], out: ge_}
      - lt: {in: [a, b], out: lt_}
      - eq: {in: [b, 2], out: eq_}
      - ne: {in: [b, 2], out: ne_}
      - and: {in: [ge_, eq_], out: both}
      - or: {in: [lt_, ne_], out: either}
      - not: {in: either, out: neither}
"""
    r, run_dir = run(plan_file, tmp_path, body)
    assert r.code == 0, r.text
    v = ckpt_values(run_dir, 1)
    assert (v["s"], v["d"], v["m"], v["q"]) == (10, 5, 42, 3.5)
    assert (v["ge_"], v["lt_"], v["eq_"], v["ne_"]) == (True, False, True, False)
    assert (v["both"], v["either"], v["neither"]) == (True, False, True)


def test_tensors_const_fill_randn_copy(plan_file, tmp_path):
    body = """
      - const: {out: v, value: [1.0, 2.0, 3.0]}
      - fill: {out: f, shape: [2, 2], value: 1.5}
      - fill: {out: i, shape: [3], value: 4, dtype: int64}
      - randn: {out: r, shape: [1000], mean: 5.0, std: 0.5}
      - copy: {in: v, out: c}
      - add: {in: [v, c], out: twice}
      - mul: {in: [v, 2], out: doubled}
      - gt: {in: [v, 1.5], out: mask}
"""
    r, run_dir = run(plan_file, tmp_path, body)
    assert r.code == 0, r.text
    v = ckpt_values(run_dir, 1)
    assert v["v"] == [1.0, 2.0, 3.0] and v["twice"] == [2.0, 4.0, 6.0] == v["doubled"]
    assert v["f"] == [[1.5, 1.5], [1.5, 1.5]] and v["i"] == [4, 4, 4]
    assert v["mask"] == [False, True, True]
    mean = sum(v["r"]) / len(v["r"])
    assert 4.9 < mean < 5.1


def test_save_and_load_json_safetensors_pt(plan_file, tmp_path):
    body = """
      - const: {out: n, value: 3}
      - const: {out: w, value: [[1.0, 2.0], [3.0, 4.0]]}
      - model.mlp: {out: net, sizes: [2, 3]}
      - save: {in: [n, w], path: out/values.json}
      - save: {in: [w, net], path: out/tensors.safetensors}
      - save: {in: [w, net], path: out/all.pt}
"""
    r, run_dir = run(plan_file, tmp_path, body)
    assert r.code == 0, r.text
    data = json.loads((run_dir / "out" / "values.json").read_text())
    assert data == {"n": 3, "w": [[1.0, 2.0], [3.0, 4.0]]}
    from safetensors.numpy import load_file

    st = load_file(run_dir / "out" / "tensors.safetensors")
    assert sorted(st) == ["net.0.bias", "net.0.weight", "w"]
    assert st["w"].tolist() == [[1.0, 2.0], [3.0, 4.0]]

    # load reads relative to the plan's directory
    for name in ("values.json", "tensors.safetensors", "all.pt"):
        (tmp_path / name).write_bytes((run_dir / "out" / name).read_bytes())
    body2 = """
      - load: {out: w, path: tensors.safetensors}
      - load: {out: [n], path: values.json}
      - load: {out: [w2], path: all.pt}
"""
    body2 = body2.replace("[w2], path: all.pt", "[w], path: all.pt")
    r2 = jobrun("train", _write(tmp_path, "load.yaml", body2), "--run-dir", tmp_path / "run2")
    assert r2.code == 0, r2.text
    v = ckpt_values(tmp_path / "run2", 1)
    assert v["n"] == 3 and v["w"] == [[1.0, 2.0], [3.0, 4.0]]


def _write(tmp_path, name: str, body: str):
    path = tmp_path / name
    path.write_text(f"""
job: loads
max_epochs: 1
checkpoint: {{}}
epoch:
  - task: t
    workspace: global
    do:
{body}
""")
    return path


def test_load_missing_blob_names_what_is_there(plan_file, tmp_path):
    (tmp_path / "v.json").write_text('{"a": 1}')
    r = jobrun("train", _write(tmp_path, "p.yaml", "      - load: {out: [b], path: v.json}\n"),
               "--run-dir", tmp_path / "run")
    assert r.code == 1
    assert "v.json has no b" in r.err and "it holds: a" in r.err


def test_save_refuses_unknown_suffix(plan_file, tmp_path):
    r, _ = run(plan_file, tmp_path, "      - save: {in: [zero], path: x.txt}\n")
    assert r.code == 2 and "unknown file type '.txt'" in r.err and ".json, .safetensors or .pt" in r.err


def test_div_by_zero_is_a_clear_error(plan_file, tmp_path):
    r, _ = run(plan_file, tmp_path, "      - div: {in: [zero, zero], out: x}\n")
    assert r.code == 1 and "division by zero" in r.err and "plan.yaml:15:9" in r.err and "div: div" not in r.err


def test_call_passes_positional_inputs_and_keyword_args(plan_file, tmp_path):
    body = """
      - call: {fn: "builtins:max", in: [zero, 5, 3], out: biggest}
      - call: {fn: "builtins:round", in: [3.14159], ndigits: 2, out: rounded}
      - log: {in: [biggest, rounded], msg: called}
"""
    r, run_dir = run(plan_file, tmp_path, body)
    assert r.code == 0, r.text
    (row,) = logged(run_dir, "called")
    assert row["biggest"] == 5 and row["rounded"] == 3.14


@pytest.mark.parametrize("fn,words", [
    ("nosuchmodule_xyz:f", ["fn 'nosuchmodule_xyz:f' cannot be imported",
                            "No module named 'nosuchmodule_xyz'", "hint: check the spelling"]),
    ("json:nosuchfunction", ["'json' has no attribute 'nosuchfunction'"]),
    ("json:dumpz", ["'json' has no attribute 'dumpz'", "hint: did you mean 'dump'?"]),
    ("json.decoder.NaN", ["fn 'json.decoder.NaN' is a float, not something callable"]),
])
def test_call_bad_function(plan_file, tmp_path, fn, words):
    r, run_dir = run(plan_file, tmp_path, f'      - call: {{fn: "{fn}", out: x}}\n')
    # Refused before the run directory is made (tests/test_train_early.py), at the fn.
    assert r.code == 2 and "Traceback" not in r.text and not run_dir.exists()
    assert "plan.yaml:15:20: error: call: fn" in r.err
    assert all(w in r.err for w in words), r.err


def test_reader_and_read_in_a_plan(plan_file, tmp_path):
    init = """
      - const: {out: data, value: [10, 20, 30, 40, 50]}
      - reader: {in: data, out: r, batch_size: 2, passes: 2}
      - call: {fn: "jobrun_test_helpers:new_list", out: seen}
"""
    body = """
      - loop: null
        do:
          - read: {in: r, out: [b, end]}
          - if: end
            then: [{call: {fn: "jobrun_test_helpers:append", in: [seen, -1]}}]
            else: [{call: {fn: "builtins:len", in: [b], out: n}}, {call: {fn: "jobrun_test_helpers:append", in: [seen, n]}}]
          - call: {fn: "jobrun_test_helpers:length", in: [seen], out: k}
          - ge: {in: [k, 8], out: enough}
          - stop_if: enough
      - log: {in: [seen]}
"""
    r, run_dir = run(plan_file, tmp_path, body, init=init)
    assert r.code == 0, r.text
    # two passes of batches 2, 2, 1, each pass ended by one `done`
    assert logged(run_dir)[0]["seen"] == [2, 2, 1, -1, 2, 2, 1, -1]


def test_save_writes_tied_weights_under_each_name(tmp_path):
    """A model whose two modules share a weight (a GPT's lm_head and token embedding):
    safetensors refuses tensors that share memory, so `save` failed after the whole run
    had trained; each name now gets its tensor, and the file loads with strict=True."""
    import torch
    from safetensors.torch import load_file

    from jobrun.ops.context import OpContext
    from jobrun.ops.core import save

    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = torch.nn.Embedding(5, 3)
            self.head = torch.nn.Linear(3, 5, bias=False)
            self.head.weight = self.wte.weight

    model = Tied()
    save(OpContext(run_dir=tmp_path), model, path="model.safetensors", _names=("model",))
    state = load_file(tmp_path / "model.safetensors")
    assert sorted(state) == ["model.head.weight", "model.wte.weight"]
    assert torch.equal(state["model.head.weight"], model.wte.weight.detach())
    again = Tied()
    again.load_state_dict({k.removeprefix("model."): v for k, v in state.items()}, strict=True)
    assert torch.equal(again.head.weight, model.head.weight)
