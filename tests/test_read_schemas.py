"""Every file jobrun reads back, damaged and hostile: run.json, metrics.jsonl lines,
checkpoint manifests and their meta, values.json (module flags, numpy scalars) and the
facts of a sharded tensor. Each variant gives one clear error (a JobrunError naming the
file and the field; through the CLI: a message, a non-zero exit, no traceback) or a
record whose every field has its schema's type, and changes nothing on disk."""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import zlib
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jobrun_test_helpers import mlp_plan
from runner_util import jobrun

from jobrun import records_schema, store
from jobrun.errors import CheckpointError, UsageError
from jobrun.records_schema import RUN_INFO
from jobrun.runner.plot import series
from jobrun.runner.rundir import RunDir
from jobrun.store import shards
from jobrun.store.codec import decode

FEW = settings(max_examples=40, deadline=None,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                      HealthCheck.data_too_large])

PLAN = mlp_plan("small", "seed: 0\nvars: {hidden: 8}\nmax_epochs: 2\n"
                "checkpoint: {dir: ckpt, best: {monitor: loss, mode: min}}", batch=32, hidden='"${hidden}"',
                init=["const: {out: loss, value: 0.0}"], epoch=["log: {in: [loss]}"], outputs="[loss]")

DEEP = "[" * 100_000 + "]" * 100_000

# Values an attacker puts where a field was: each is wrong for some field of some file.
hostile = st.one_of(
    st.sampled_from([float("nan"), float("inf"), -float("inf"), 10**400, -(10**30), 2**64, 1e308,
                     "3", "", "x" * 70_000, True, None, [], {}, [[[[1]]]], {"a": {"b": {}}}]),
    st.integers(), st.floats(), st.text(max_size=20),
    st.recursive(st.none() | st.integers() | st.text(max_size=5),
                 lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=3), kids, max_size=3),
                 max_leaves=8),
)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("schemas")
    (root / "plan.yaml").write_text(PLAN)
    r = jobrun("train", root / "plan.yaml", "--run-dir", root / "run")
    assert r.code == 0, r.text
    return root / "run"


@pytest.fixture
def run(trained, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(trained, copy)
    return copy


def fresh(run: Path, trained: Path) -> Path:
    """The trained run again (hypothesis runs every example in the same fixture)."""
    shutil.rmtree(run)
    shutil.copytree(trained, run)
    return run


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def dumps(value) -> str:
    """JSON as Python writes it, NaN and 400-digit integers included (an attacker's file)."""
    return json.dumps(value)


def _nested(text: str) -> None:
    """Strings of the error are short: one line, no traceback."""
    assert "Traceback" not in text and len(text) < 2000, text


# ---------------------------------------------------------------------------- run.json


@FEW
@given(field=st.sampled_from(sorted(RUN_INFO.fields)), value=hostile)
def test_a_hostile_run_json_field_is_refused_naming_it_or_read_with_its_type(trained, field, value):
    info = json.loads((trained / "run.json").read_text())
    raw = dumps({**info, field: value}).encode()
    try:
        got = records_schema.run_info(raw, "RUN/run.json", UsageError)
    except UsageError as e:
        assert "RUN/run.json" in e.message
        _nested(e.message)
        return
    # Accepted: then every field is what its schema says (a number is finite, an int is one).
    assert records_schema.check(got.record, RUN_INFO) == got.record
    v = getattr(got, field)
    assert not (isinstance(v, float) and not math.isfinite(v))


@FEW
@given(cut=st.integers(0, 400), junk=st.binary(max_size=40))
def test_a_damaged_run_json_is_refused_by_the_cli_and_left_as_it_is(run, trained, cut, junk):
    raw = (fresh(run, trained) / "run.json").read_bytes()
    (run / "run.json").write_bytes(raw[:cut] + junk)
    before = snapshot(run)
    try:
        RunDir(run).info()
    except UsageError as e:
        assert "run.json" in e.message
    else:
        return  # the cut left a valid record (junk made no difference)
    r = jobrun("ckpt", "list", run)
    assert r.code != 0 and "run.json" in r.err
    _nested(r.text)
    assert snapshot(run) == before


@pytest.mark.parametrize("change", [
    lambda t: t.replace('"replicas": 1', '"replicas": NaN'),
    lambda t: t.replace('"replicas": 1', '"replicas": "one"'),
    lambda t: t.replace('"replicas": 1', '"replicas": ' + "9" * 5000),
    lambda t: t.replace('"sets": []', '"sets": ' + DEEP),
])
def test_resume_refuses_a_hostile_run_json_with_one_message(run, change):
    text = (run / "run.json").read_text()
    (run / "run.json").write_text(change(text))
    before = snapshot(run)
    r = jobrun("resume", "--run-dir", run, "--epoch", "1")
    assert r.code == 2 and "run.json is damaged" in r.err, r.text
    _nested(r.text)
    assert snapshot(run) == before


def test_a_source_naming_a_huge_file_is_not_read_whole(run, tmp_path):
    huge = tmp_path / "huge.yaml"
    with open(huge, "wb") as f:
        f.truncate(3 << 30)  # sparse: 3 GiB that use no disk
    info = json.loads((run / "run.json").read_text())
    (run / "run.json").write_text(json.dumps({**info, "source": str(huge)}))
    rd = RunDir(run)
    assert rd.source_changed()  # bounded read: the stored plan copy is used instead
    assert rd.plan().job == "small"


# ------------------------------------------------------------------------ metrics.jsonl

metric_line = st.one_of(
    st.builds(lambda name, v: dumps({"epoch": 1, "group": "epoch", "values": {name: v}}),
              st.text(max_size=8), hostile),
    st.builds(lambda k, v: dumps({"epoch": 1, k: v}),
              st.sampled_from(["epoch", "group", "event", "values", "outputs", "step", "time"]), hostile),
    st.just('{"epoch": 1, "x": ' + DEEP + "}"),
    st.text(max_size=30),
)


@FEW
@given(lines=st.lists(metric_line, min_size=1, max_size=3))
def test_hostile_metrics_lines_are_refused_naming_the_line_or_plotted_as_numbers(run, trained, lines):
    path = fresh(run, trained) / "metrics.jsonl"
    original = path.read_bytes()
    path.write_bytes(original + "".join(line.replace("\n", " ") + "\n" for line in lines).encode())
    before = snapshot(run)
    try:
        got = series(RunDir(run))
    except UsageError as e:
        assert "metrics.jsonl:" in e.message and "line of" in (e.hint or "")
        _nested(e.message)
    else:
        for points in got.values():
            assert all(math.isfinite(x) and math.isfinite(y) for x, y in points)
    assert snapshot(run) == before


@pytest.mark.parametrize("line", [
    '{"epoch": 1, "group": "epoch", "values": {"loss": ' + str(10**400) + "}}",
    '{"epoch": 1, "group": "epoch", "values": {"loss": ' + str(10**30) + "}}",
    '{"epoch": 1, "group": "epoch", "values": ' + DEEP + "}",
])
def test_plot_refuses_a_hostile_metrics_line_with_its_file_and_line(run, line):
    n = len((run / "metrics.jsonl").read_text().splitlines()) + 1
    with open(run / "metrics.jsonl", "a") as f:
        f.write(line + "\n")
    r = jobrun("plot", run)
    assert r.code == 2 and f"metrics.jsonl:{n}" in r.err, r.text
    _nested(r.text)
    assert not (run / "metrics.png").exists()


def test_a_line_cut_by_a_kill_is_left_out_and_nan_losses_are_read(run):
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"epoch": 2, "group": "epoch", "values": {"loss": NaN}}\n{"epoch": 2, "gro')
    got = series(RunDir(run))
    assert set(got) == {"loss"} and all(math.isfinite(y) for _, y in got["loss"])


@pytest.mark.parametrize("name", ["$\\undefinedmacro$", "\\undefinedmacro", "$x^$", "a$b"])
def test_plot_draws_a_metric_named_like_mathtext_as_plain_text(run, name):
    pytest.importorskip("matplotlib")
    with open(run / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"epoch": 2, "group": "epoch", "values": {name: 1.5}}) + "\n")
    r = jobrun("plot", run, "-o", run / "out.png")
    assert r.code == 0, r.text
    assert (run / "out.png").read_bytes()[:4] == b"\x89PNG"


# ------------------------------------------------------------------- manifests and meta


def reseal(rdir: Path, change_manifest=None, change_values=None) -> None:
    """Change a rank's files as an attacker can: the checksums and COMMIT made to match."""
    m = json.loads((rdir / "MANIFEST.json").read_text())
    if change_values is not None:
        v = json.loads((rdir / "values.json").read_text())
        change_values(v)
        data = json.dumps(v).encode()
        (rdir / "values.json").write_bytes(data)
        e = m["files"]["values.json"]
        e["size"], c = len(data), e["chunk_bytes"]
        e["crc32_chunks"] = [f"{zlib.crc32(data[i:i + c]):08x}" for i in range(0, max(len(data), 1), c)]
    if change_manifest is not None:
        change_manifest(m)
    raw = json.dumps(m).encode()
    (rdir / "MANIFEST.json").write_bytes(raw)
    commit = json.loads((rdir / "COMMIT").read_text())
    commit["manifest_sha256"] = hashlib.sha256(raw).hexdigest()
    (rdir / "COMMIT").write_text(json.dumps(commit))


MANIFEST_PATHS = [("world_size",), ("rank",), ("node",), ("epoch",), ("created",), ("files", "values.json", "size"),
                  ("files", "tensors.safetensors", "chunk_bytes"), ("meta",), ("meta", "best", "value"),
                  ("meta", "best", "monitor"), ("meta", "epoch"), ("meta", "world_size"), ("meta", "outputs"),
                  ("meta", "init"), ("meta", "stop")]


def _set(tree: dict, path: tuple[str, ...], value) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


@FEW
@given(path=st.sampled_from(MANIFEST_PATHS), value=hostile)
def test_a_hostile_manifest_or_meta_field_makes_the_epoch_invalid_naming_it(run, trained, path, value):
    rdir = fresh(run, trained) / "ckpt" / "local.2" / "rank-0"
    reseal(rdir, change_manifest=lambda m: _set(m, path, value))
    before = snapshot(run)
    try:
        m = store.read.check_commit(rdir)
    except CheckpointError as e:
        assert "MANIFEST.json" in e.message or "COMMIT" in e.message, e.message
        _nested(e.message)
        infos = store.list_checkpoints(run / "ckpt")
        assert [i.nodes["local"].ok for i in infos if i.epoch == 2] == [False]
    else:
        assert records_schema.check(m, records_schema.MANIFEST) == m
    assert snapshot(run) == before


def test_resume_best_passes_over_an_epoch_whose_best_value_is_huge(run):
    reseal(run / "ckpt" / "local.2" / "rank-0",
           change_manifest=lambda m: _set(m, ("meta", "best", "value"), 10**300))
    r = jobrun("ckpt", "list", run)
    assert r.code == 0 and "field meta.best.value" in r.out, r.text
    row = next(line for line in r.out.splitlines() if line.split()[0] == "2")
    assert "INVALID" in row


@FEW
@given(flags=hostile | st.fixed_dictionaries({"training": st.booleans(), "flipped": hostile, "frozen": hostile}))
def test_hostile_module_flags_are_refused_before_the_model_changes(flags):
    import torch

    from jobrun.store.modules import apply_module_flags

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout())
    try:
        records_schema.check(flags, records_schema.MODULE_FLAGS)
        valid = True
    except records_schema.Invalid:
        valid = False
    if valid:
        return  # a well-formed (maybe unknown-submodule) flag set is the restore tests' business
    with pytest.raises(CheckpointError, match="malformed"):
        apply_module_flags(model, flags, "Sequential")
    assert model.training and all(p.requires_grad for p in model.parameters())


@pytest.mark.parametrize(("dtype", "v"), [("|i1", 1000), ("<u2", -1), ("<i8", 10**30), ("<f4", "x")])
def test_a_numpy_scalar_out_of_range_is_a_damaged_checkpoint(dtype, v):
    with pytest.raises(CheckpointError, match="values.json is malformed"):
        decode({"b": {"__jobrun__": "np_scalar", "dtype": dtype, "v": v}}, {})


def test_resume_refuses_unhashable_module_flags_in_one_message(run):
    def frozen(v):
        v["blobs"]["model"]["module"]["frozen"] = [["a"]]

    reseal(run / "ckpt" / "local.2" / "rank-0", change_values=frozen)
    r = jobrun("resume", "--run-dir", run, "--epoch", "2", "max_epochs=3")
    assert r.code == 1 and "frozen[0]: a string expected" in r.err, r.text
    _nested(r.text)


# ------------------------------------------------------------------------- shard facts

shard_facts = st.fixed_dictionaries({
    "shape": st.one_of(st.lists(st.integers(0, 9), max_size=3), hostile),
    "stride": st.one_of(st.lists(st.integers(0, 9), max_size=3), hostile),
    "placements": st.one_of(st.lists(st.sampled_from(["S0", "S1", "S5", "R", "S", "X"]), max_size=2), hostile),
    "mesh": st.one_of(st.integers(0, 5), hostile),
})


@FEW
@given(facts=shard_facts, local_shape=st.lists(st.integers(0, 6), max_size=3))
def test_hostile_shard_facts_are_refused_or_describe_the_local_shard(facts, local_shape):
    local = np.zeros(local_shape, dtype=np.float32)
    try:
        s = shards.saved(local, facts)
    except CheckpointError as e:
        _nested(e.message)
        return
    assert len(s.shape) == len(s.stride) == local.ndim
    if s.placements == ("R",):
        assert tuple(local.shape) == s.shape
    else:
        dim = int(s.placements[0][1:])
        assert dim < len(s.shape) and local.shape[dim] <= -(-s.shape[dim] // s.mesh)


def test_a_placement_on_axis_5_of_a_2d_tensor_is_refused():
    with pytest.raises(CheckpointError, match="dimension 5, but its shape"):
        shards.saved(np.zeros((2, 3), np.float32), {"shape": [4, 3], "stride": [3, 1], "placements": ["S5"], "mesh": 2})


def test_export_never_assembles_a_tensor_of_the_wrong_shape():
    """A replicated placement whose local tensor is not the global shape, and ranks that
    disagree on the placement, are refused (export wrote them without a word)."""
    with pytest.raises(CheckpointError, match="no part of a tensor of shape"):
        shards.saved(np.zeros((2, 3), np.float32), {"shape": [4, 3], "stride": [3, 1], "placements": ["R"], "mesh": 2})
    a = shards.saved(np.zeros((2, 3), np.float32), {"shape": [4, 3], "stride": [3, 1], "placements": ["S0"], "mesh": 2})
    b = shards.saved(np.zeros((4, 3), np.float32), {"shape": [4, 3], "stride": [3, 1], "placements": ["R"], "mesh": 2})
    with pytest.raises(CheckpointError, match="rank 1's shard"):
        shards.assemble([a, b])
    whole = shards.assemble([a, a])
    assert whole.shape == (4, 3)


# ----------------------------------------------------------------------- command line


def test_an_epoch_of_5000_digits_is_a_usage_error(run):
    r = jobrun("ckpt", "show", run, "--epoch", "1" * 5000)
    assert r.code == 2 and "more than 9 digits" in r.err
    _nested(r.text)


def test_export_to_a_read_only_file_system_says_it_cannot_write(run, monkeypatch):
    """A read-only file system refuses the temporary file every export writes through
    (safefs.write_with), and torch.save fails its own way (a RuntimeError): each is one
    message, and nothing is left at the target."""
    import torch

    from jobrun import safefs

    def refuse(*args, **kwargs):
        raise OSError(30, "Read-only file system")

    with monkeypatch.context() as m:
        m.setattr(safefs, "create_new", refuse)
        for suffix in ("safetensors", "pt", "json"):
            r = jobrun("export", run, "--epoch", "2", "--blob", "model", "-o", run / f"m.{suffix}")
            assert r.code == 2 and f"cannot write {run / f'm.{suffix}'}" in r.err and "Read-only" in r.err, r.text
            _nested(r.text)
            assert not (run / f"m.{suffix}").exists()
    monkeypatch.setattr(torch, "save", lambda *a, **k: (_ for _ in ()).throw(
        RuntimeError("open file failed with strerror: Read-only file system")))
    r = jobrun("export", run, "--epoch", "2", "--blob", "model", "-o", run / "m.pt")
    assert r.code == 2 and f"cannot write {run / 'm.pt'}" in r.err and "Read-only" in r.err, r.text
    assert not (run / "m.pt").exists() and not list(run.glob(".m.pt.tmp-*"))


def test_the_schema_layer_raises_its_own_errors():
    """Invalid for a value out of its schema, Malformed for text no jobrun write makes."""
    with pytest.raises(records_schema.Invalid, match="out of range"):
        records_schema.check({"epoch": 10**30}, records_schema.METRICS_LINE)
    with pytest.raises(records_schema.Malformed):
        records_schema.parse_json(DEEP)
    with pytest.raises(records_schema.Malformed):
        records_schema.parse_json("9" * 5000)


def test_run_info_has_a_typed_field_for_every_field_of_the_schema():
    import dataclasses

    from jobrun.records_schema import RunInfo

    assert {f.name for f in dataclasses.fields(RunInfo)} - {"record"} == set(RUN_INFO.fields)
    info = records_schema.run_info(b'{"job": "j", "replicas": 2, "x": [1]}', "run.json", UsageError)
    assert (info.job, info.replicas, info.status, "x" in info) == ("j", 2, None, True)


tags = st.sampled_from(["float", "tuple", "dict", "odict", "bytes", "np_scalar", "tensor", "ndarray", "state", "x"])
tagged = st.recursive(
    hostile,
    lambda kids: st.one_of(
        st.builds(lambda t, extra: {"__jobrun__": t, **extra}, tags,
                  st.dictionaries(st.sampled_from(["v", "items", "meta", "b64", "dtype", "key", "type", "state",
                                                   "module", "shard", "complex", "param"]), kids, max_size=3)),
        st.lists(kids, max_size=3)),
    max_leaves=10)


@FEW
@given(tree=st.dictionaries(st.text(max_size=3), tagged, max_size=3))
def test_hostile_values_json_trees_decode_or_give_one_checkpoint_error(tree):
    """values.json, re-sealed by an attacker: any tree decodes or is a CheckpointError."""
    tensors = {"t": np.zeros(2, np.float32)}
    try:
        decode(tree, tensors)
    except CheckpointError as e:
        _nested(e.message)


def test_a_huge_error_message_is_recorded_shortened_and_run_json_stays_readable(run):
    from jobrun.errors import RunError

    RunDir(run).record_end("failed", RunError("x" * (2 << 20)))
    info = RunDir(run).info()
    assert info.status == "failed" and 0 < len(info.error) <= 1 << 14
