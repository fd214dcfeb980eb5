"""`train.step: {in: [model, opt, batch], loss: model}`: a dict batch, model(**batch), as
Hugging Face models take it; every option of train.step works with it, and it trains bit
for bit as the same model given (x, y)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from runner_util import jobrun, logged
from torch import nn

from jobrun.errors import RunError
from jobrun.ops import train
from jobrun.ops.context import OpContext
from jobrun.ops.reader import reader_op
from jobrun.ops.split import global_records

VOCAB, T = 11, 6


class DictLM(nn.Module):
    """A model that computes its loss, with Hugging Face's argument names."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, 8)
        self.head = nn.Linear(8, VOCAB)

    def forward(self, input_ids, labels=None, attention_mask=None):
        logits = self.head(self.emb(input_ids))
        if attention_mask is not None:
            logits = logits * attention_mask[..., None]
        if labels is None:
            return logits, None
        return {"logits": logits, "loss": F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))}


def _data(n: int = 24):
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, VOCAB, (n, T), generator=g)
    return x, torch.roll(x, -1, dims=1)


def _steps(model: nn.Module, batches, **options) -> list[torch.Tensor]:
    ctx = OpContext()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    return [train.train_step(ctx, model, opt, *b, loss="model", **options) for b in batches]


@pytest.mark.parametrize("options", [
    {}, {"clip_grad_norm": 0.5}, {"accumulate": 3}, {"amp": "bf16"}, {"amp": "fp16", "accumulate": 2},
])
def test_a_dict_batch_trains_bit_for_bit_as_x_and_y(options):
    x, y = _data()
    pairs = [(x[i:i + 8], y[i:i + 8]) for i in range(0, 24, 8)]
    dicts = [({"input_ids": xb, "labels": yb},) for xb, yb in pairs]
    by_dict, by_pair = DictLM(), DictLM()
    got = _steps(by_dict, dicts, **options)
    assert got == _steps(by_pair, pairs, **options)  # model(x, labels=y): the same calls
    assert all(v.dtype == torch.float32 and v.dim() == 0 for v in got)
    for a, b in zip(by_dict.parameters(), by_pair.parameters()):
        assert torch.equal(a, b)
    assert not torch.equal(by_dict.head.weight, DictLM().head.weight)  # it trained


def test_accumulate_splits_every_tensor_of_a_dict_batch_and_passes_the_rest_whole():
    seen = []

    class Spy(DictLM):
        def forward(self, input_ids, labels=None, attention_mask=None, note=None):  # type: ignore[override]
            seen.append((input_ids.shape[0], attention_mask.shape[0], note))
            return super().forward(input_ids, labels, attention_mask)

    x, y = _data(8)
    batch = {"input_ids": x, "labels": y, "attention_mask": torch.ones(8, T), "note": "whole"}
    model = Spy()
    train.train_step(OpContext(), model, torch.optim.SGD(model.parameters(), lr=0.1), batch,
                     loss="model", accumulate=2)
    assert seen == [(4, 4, "whole"), (4, 4, "whole")]
    batch["attention_mask"] = torch.ones(5, T)
    with pytest.raises(RunError, match="attention_mask has 5 records, the first tensor has 8"):
        train.train_step(OpContext(), model, torch.optim.SGD(model.parameters(), lr=0.1), batch,
                         loss="model", accumulate=2)


def test_a_dataset_of_dicts_reads_dict_batches_tagged_with_the_global_batch():
    """Collated as a DataLoader collates (a dict of stacked tensors); under replicas every
    tensor of a rank's part carries the records of the whole batch, which train.step
    weights its loss by."""
    x, y = _data(10)
    pairs = torch.utils.data.StackDataset(input_ids=x, labels=y)
    batch, done = reader_op(OpContext(), pairs, batch_size=4).read()
    assert not done and set(batch) == {"input_ids", "labels"}
    assert torch.equal(batch["input_ids"], x[:4]) and torch.equal(batch["labels"], y[:4])
    ctx = OpContext(rank=1, world_size=2)
    part, _ = reader_op(ctx, pairs, batch_size=4).read()
    assert torch.equal(part["input_ids"], x[2:4])
    assert global_records(part["input_ids"]) == global_records(part["labels"]) == 4


# ------------------------------------------------------------------------ bad inputs


def _one(batch, y=None, *, loss="model", model=None):
    model = model or DictLM()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    args = (batch,) if y is None else (batch, y)
    return train.train_step(OpContext(), model, opt, *args, loss=loss)


def test_a_dict_batch_without_loss_model_is_one_clear_error():
    x, y = _data(8)
    with pytest.raises(RunError, match="a dict batch needs `loss: model`") as e:
        _one({"input_ids": x, "labels": y}, y, loss="cross_entropy")
    assert "add `loss: model`" in e.value.hint
    with pytest.raises(RunError, match="x is a dict batch .* and y a Tensor besides"):
        _one({"input_ids": x, "labels": y}, y)


def test_three_inputs_whose_batch_is_not_a_mapping_is_one_clear_error():
    x, _ = _data(8)
    with pytest.raises(RunError, match="3 inputs trains on one dict batch.*is a Tensor, not a mapping") as e:
        _one(x)
    assert "in: [model, opt, xb, yb]" in e.value.hint
    with pytest.raises(RunError, match="train.step input batch is null"):
        _one(None)  # a `read` at the end of its pass
    with pytest.raises(RunError, match="counted by its first tensor of records; its values are note: str"):
        _one({"note": "x"})
    model = DictLM()  # four inputs, y null: the error of a finished read, not of a dict batch
    with pytest.raises(RunError, match="train.step input y is null"):
        train.train_step(OpContext(), model, torch.optim.SGD(model.parameters(), lr=0.1), x, None)


def test_a_key_the_forward_does_not_take_names_the_key_and_the_parameters():
    x, y = _data(8)
    with pytest.raises(RunError, match="the batch's key 'label' is not a parameter of DictLM.forward") as e:
        _one({"input_ids": x, "label": y})
    assert "did you mean 'labels'" in e.value.hint
    assert "the forward's parameters: input_ids, labels, attention_mask" in e.value.hint
    with pytest.raises(RunError, match="DictLM.forward needs 'input_ids', which the batch lacks"):
        _one({"labels": y})


def test_a_model_output_without_a_loss_is_one_clear_error():
    x, _ = _data(8)
    with pytest.raises(RunError, match="the model's loss is None, not a scalar tensor") as e:
        _one({"input_ids": x})
    assert "a dict batch holds `labels`" in e.value.hint


def test_a_misspelled_key_a_forwards_kwargs_swallow_is_named_when_no_loss_comes():
    """Hugging Face's forwards take **kwargs: `label` is accepted and ignored, the output
    has no loss; the hint names the key."""

    class Kwargs(DictLM):
        def forward(self, input_ids, labels=None, **kwargs):  # type: ignore[override]
            return super().forward(input_ids, labels)

    x, y = _data(8)
    with pytest.raises(RunError, match="the model's loss is None") as e:
        _one({"input_ids": x, "label": y}, model=Kwargs())
    assert "did you mean 'labels'" in e.value.hint and "the batch's keys: input_ids, label" in e.value.hint


# ---------------------------------------------------------------------------- plans

PLAN = """\
job: dicts
seed: 0
max_epochs: 2
init:
  - task: setup
    do:
      - call: {fn: "dict_batch_data:pairs", out: pairs, n: 24}
      - reader: {in: pairs, out: data, batch_size: 8, passes: 0}
      - build: {out: model, target: "test_dict_batch:DictLM"}
      - optimizer: {in: model, out: opt, lr: 0.1}
epoch:
  - task: train
    do:
      - loop: 3
        do:
          - read: {in: data, out: [batch, end]}
          - if: end
            then: [{read: {in: data, out: [batch, end]}}]
          - train.step: {in: [model, opt, BATCH], out: loss, LOSS}
      - log: {in: [loss]}
"""


def _plan(tmp_path: Path, batch: str = "batch", loss: str = "loss: model") -> Path:
    (tmp_path / "dict_batch_data.py").write_text(
        "import torch\n\n"
        "def pairs(n):\n"
        "    g = torch.Generator().manual_seed(1)\n"
        "    x = torch.randint(0, 11, (n, 6), generator=g)\n"
        "    return torch.utils.data.StackDataset(input_ids=x, labels=torch.roll(x, -1, dims=1))\n\n\n"
        "def tokens(n):\n"
        "    return pairs(n).datasets['input_ids']\n")
    plan = tmp_path / "plan.yaml"
    plan.write_text(PLAN.replace("BATCH", batch).replace("LOSS", loss))
    return plan


@pytest.fixture
def importable(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    return tmp_path


def test_a_plan_trains_on_dict_batches_and_print_shows_the_three_inputs(importable):
    plan = _plan(importable)
    printed = jobrun("print", plan)
    assert printed.code == 0 and 'loss = train.step(model, opt, batch, loss="model")' in printed.out
    r = jobrun("train", plan, "--run-dir", importable / "run")
    assert r.code == 0, r.text
    losses = [row["loss"] for row in logged(importable / "run")]
    assert len(losses) == 2 and losses[1] < losses[0]


def test_analyze_refuses_three_inputs_without_loss_model_at_the_plan_line(importable):
    plan = _plan(importable, loss="clip_grad_norm: 1.0")
    r = jobrun("analyze", plan)
    assert r.code == 1 and "plan.yaml:19:" in r.out, r.out
    assert "with 3 inputs trains on one dict batch" in r.out and "add `loss: model`" in r.out
    plan.write_text(plan.read_text().replace("clip_grad_norm: 1.0", "loss: mse"))
    r = jobrun("analyze", plan)
    assert r.code == 1 and "plan.yaml:19:" in r.out and "its loss is 'mse'" in r.out, r.out


def test_a_third_input_that_is_no_mapping_fails_at_the_plan_line(importable):
    plan = _plan(importable)
    plan.write_text(plan.read_text().replace(
        '"dict_batch_data:pairs", out: pairs', '"dict_batch_data:pairs", out: ds').replace(
        "in: pairs,", "in: [xs],").replace(
        "      - reader:", "      - data.synthetic: {out: [xs, ys], task: classification, n: 24, features: 6, classes: 3}\n"
        "      - reader:"))
    r = jobrun("train", plan, "--run-dir", importable / "run")
    assert r.code != 0 and "plan.yaml:20:" in r.text, r.text
    assert "its third input is a Tensor, not a mapping" in r.text and "Traceback" not in r.text


# ----------------------------------------------------------------- readers with keys


def test_a_reader_with_keys_gives_one_dict_per_batch_as_a_dataset_of_dicts_does():
    x, y = _data(10)
    ctx = OpContext()
    keyed = reader_op(ctx, x, y, batch_size=4, shuffle=True, keys=["input_ids", "labels"])
    plain = reader_op(ctx, x, y, batch_size=4, shuffle=True)
    plain.seed = keyed.seed  # the same permutation (seeds differ by creation order)
    for _ in range(4):  # 3 batches, then the end of the pass: (None, True)
        got, want = keyed.read(), plain.read()
        if want[-1]:
            assert got == (None, True)
            continue
        assert set(got[0]) == {"input_ids", "labels"} and got[1] is False
        assert torch.equal(got[0]["input_ids"], want[0]) and torch.equal(got[0]["labels"], want[1])
    assert keyed.state_dict() == plain.state_dict()
    whole = [b for (b,) in keyed.full_pass()]
    assert torch.equal(torch.cat([b["labels"] for b in whole]), y)
    rank1 = reader_op(OpContext(rank=1, world_size=2), x, y, batch_size=4, keys=["input_ids", "labels"])
    part, _ = rank1.read()
    assert torch.equal(part["input_ids"], x[2:4]) and global_records(part["labels"]) == 4


def test_evaluate_on_dict_batches_equals_x_and_y_and_needs_loss_model():
    x, y = _data(10)
    ctx = OpContext()
    keyed = reader_op(ctx, x, y, batch_size=4, keys=["input_ids", "labels"])
    got = train.evaluate(ctx, DictLM(), keyed, loss="model")
    assert got == train.evaluate(ctx, DictLM(), reader_op(ctx, x, y, batch_size=4), loss="model")
    with pytest.raises(RunError, match="a reader with keys gives dict batches.*need `loss: model`"):
        train.evaluate(ctx, DictLM(), keyed)


def test_bad_keys_are_one_clear_error():
    x, y = _data(10)
    for keys in (["input_ids"], ["a", "a"], "input_ids"):
        with pytest.raises(RunError, match="keys must name each of its 2 fields once"):
            reader_op(OpContext(), x, y, batch_size=4, keys=keys)
    with pytest.raises(RunError, match="a DatasetReader reads a Dataset, whose items give their own keys"):
        reader_op(OpContext(), torch.utils.data.StackDataset(input_ids=x), batch_size=4, keys=["input_ids"])


# ------------------------------------------------------------------------- replicas

REPLICAS_PLAN = """\
job: dict-ddp
seed: 3
max_epochs: 2
checkpoint: {dir: ckpt}
init:
  - task: setup
    do:
      - call: {fn: "jobrun_test_helpers:count_host_reads"}
      - call: {fn: "dict_batch_data:pairs", out: pairs, n: 45}
      - reader: {in: pairs, out: data, batch_size: 8, shuffle: true, passes: 0}
      - call: {fn: "dict_batch_data:tokens", out: x, n: 45}
      - reader: {in: [x, x], out: keyed, keys: [input_ids, labels], batch_size: 8, passes: 0}
      - build: {out: model, target: "test_dict_batch:DictLM"}
      - optimizer: {in: model, out: opt, lr: 0.1, momentum: 0.9}
epoch:
  - task: train
    do:
      # 6 steps over 45 records in batches of 8: the last batch (5) splits 3 + 2
      - loop: 6
        do:
          - read: {in: data, out: [batch, end]}
          - if: end
            then: [{read: {in: data, out: [batch, end]}}]
          - train.step: {in: [model, opt, batch], out: loss, loss: model}
      # a Dataset reader reads its indices on the host (DataLoader); from here on only steps
      - call: {fn: "jobrun_test_helpers:host_reads", out: between}
      - loop: 6
        do:
          - read: {in: keyed, out: [kb, kend]}
          - if: kend
            then: [{read: {in: keyed, out: [kb, kend]}}]
          - train.step: {in: [model, opt, kb], out: kloss, loss: model, accumulate: 2, clip_grad_norm: 1.0}
      - call: {fn: "jobrun_test_helpers:host_reads", out: reads}
      - log: {in: [loss, kloss, reads, between]}
"""


@pytest.mark.slow
def test_two_replicas_train_dict_batches_as_one_process_reading_nothing_to_the_host(tmp_path):
    """Each rank's part of a short global batch (3 + 2 of 5) is weighted by its share,
    told by the reader's tag on the dict's tensors: the losses and parameters equal one
    process's, and a steady-state epoch reads no tensor value to the host."""
    from runner_util import ckpt_values, close, jobrun_proc

    _plan(tmp_path)  # writes dict_batch_data.py (pairs, tokens)
    (tmp_path / "plan.yaml").write_text(REPLICAS_PLAN)
    for n in ("1", "2"):
        r = jobrun_proc("train", tmp_path / "plan.yaml", "--run-dir", tmp_path / f"r{n}",
                        "--replicas", n, cwd=tmp_path)
        assert r.code == 0, r.text
    one, two = logged(tmp_path / "r1"), logged(tmp_path / "r2")
    for key in ("loss", "kloss"):
        assert all(close(a[key], b[key], 1e-5) for a, b in zip(one, two)), key
    assert [r["reads"] for r in one] == [r["reads"] for r in two] == [0, 0]
    assert two[1]["between"] > 0  # the counter counts
    w1, w2 = ckpt_values(tmp_path / "r1", 2)["model"]["state"], ckpt_values(tmp_path / "r2", 2)["model"]["state"]
    assert w1.keys() == w2.keys() and all(close(w1[k], w2[k], 1e-5) for k in w1)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("amp", [None, "bf16", "fp16"])
def test_on_a_gpu_dict_batches_move_and_train_as_x_and_y_without_a_sync(amp):
    """A keyed reader and a Dataset of dicts move every tensor of the batch to the GPU;
    train.step on them equals the (x, y) form and (but for fp16's GradScaler) never waits
    for the device."""
    x, y = _data(24)
    ctx = OpContext(device="cuda")
    keyed = reader_op(ctx, x, y, batch_size=8, keys=["input_ids", "labels"])
    dataset = reader_op(ctx, torch.utils.data.StackDataset(input_ids=x, labels=y), batch_size=8)
    plain = reader_op(ctx, x, y, batch_size=8)
    models = [DictLM().cuda() for _ in range(3)]
    opts = [torch.optim.AdamW(m.parameters(), lr=0.01) for m in models]
    for _ in range(3):
        batches = [(keyed.read()[0],), (dataset.read()[0],), plain.read()[:2]]
        assert all(t.is_cuda for b in batches[:2] for t in b[0].values())
        torch.cuda.set_sync_debug_mode("default" if amp == "fp16" else "error")  # GradScaler.step reads
        try:
            losses = [train.train_step(ctx, m, o, *b, loss="model", amp=amp, clip_grad_norm=1.0)
                      for m, o, b in zip(models, opts, batches)]
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert torch.equal(losses[0], losses[2]) and torch.equal(losses[1], losses[2])
    for a, b in zip(models[0].parameters(), models[2].parameters()):
        assert torch.equal(a, b)


def test_resume_of_dict_batches_is_bit_exact(importable):
    """The readers of dict batches (a Dataset of dicts, a reader with keys) keep their
    positions and shuffled orders in checkpoints, as every reader does."""
    import shutil

    from runner_util import ckpt_values

    plan = _plan(importable)
    plan.write_text(plan.read_text().replace("max_epochs: 2", "max_epochs: 3\ncheckpoint: {dir: ckpt}")
                    .replace("batch_size: 8, passes: 0}", "batch_size: 8, shuffle: true, passes: 0}\n"
                             "      - call: {fn: \"dict_batch_data:tokens\", out: x, n: 20}\n"
                             "      - reader: {in: [x, x], out: keyed, keys: [input_ids, labels], "
                             "batch_size: 6, shuffle: true, passes: 0}")
                    .replace("      - log: {in: [loss]}",
                             "          - read: {in: keyed, out: [kb, kend]}\n"
                             "          - if: kend\n"
                             "            then: [{read: {in: keyed, out: [kb, kend]}}]\n"
                             "          - train.step: {in: [model, opt, kb], out: kloss, loss: model}\n"
                             "      - log: {in: [loss, kloss]}"))
    run = importable / "run"
    r = jobrun("train", plan, "--run-dir", run)
    assert r.code == 0, r.text
    want = ckpt_values(run, 3)
    again = importable / "again"
    shutil.copytree(run, again)
    r = jobrun("resume", "--run-dir", again, "--epoch", "1")
    assert r.code == 0 and "resumed from checkpoint epoch 1" in r.out, r.text
    assert ckpt_values(again, 3) == want
    assert [row["kloss"] for row in logged(again)] == [row["kloss"] for row in logged(run)]


def test_a_reader_over_one_mapping_of_fields_gives_dict_batches_of_its_keys():
    x, y = _data(10)
    ctx = OpContext()
    mapping = reader_op(ctx, {"input_ids": x, "labels": y}, batch_size=4)
    keyed = reader_op(ctx, x, y, batch_size=4, keys=["input_ids", "labels"])
    for _ in range(4):
        a, b = mapping.read(), keyed.read()
        assert a[1] == b[1] and (a[0] is None) == (b[0] is None)
        if a[0] is not None:
            assert list(a[0]) == ["input_ids", "labels"]
            assert all(torch.equal(a[0][k], b[0][k]) for k in a[0])
    with pytest.raises(RunError, match="reader inputs have different lengths"):
        reader_op(ctx, {"input_ids": x, "labels": y[:5]}, batch_size=4)


def test_read_with_one_output_gives_the_dict_batch_itself_and_runs_on_past_a_pass():
    """`read: {in: data, out: batch}` (no `done`): the batch alone, not a 1-tuple, and the
    read that meets a pass's end starts the next pass (train.step got a tuple)."""
    from jobrun.ops.reader import read_op

    x, y = _data(8)
    keyed = reader_op(OpContext(), x, y, batch_size=4, keys=["input_ids", "labels"], passes=0)
    got = [read_op(None, keyed, ("batch",)) for _ in range(3)]  # 2 batches a pass
    assert all(isinstance(b, dict) for b in got)
    assert torch.equal(got[2]["input_ids"], x[:4]) and keyed.pass_index == 1
    single = reader_op(OpContext(), x, batch_size=4, passes=0)
    assert torch.equal(read_op(None, single, ("xb",)), x[:4])


# ------------------------------------------------- one rule for a dict batch's records


class Texts(torch.utils.data.Dataset):
    """Items of Hugging Face's shape with a string first: {text, input_ids, labels}."""

    def __init__(self, n: int) -> None:
        self.x, self.y = _data(n)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"text": f"record {i}", "input_ids": self.x[i], "labels": self.y[i]}


class TextStream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(Texts(10)[i] for i in range(10))


class TextLM(DictLM):
    def forward(self, text, input_ids, labels=None):  # type: ignore[override]
        assert len(text) == input_ids.shape[0]  # the strings of the batch's records
        return super().forward(input_ids, labels)


def test_a_dict_batch_whose_first_value_is_no_tensor_is_counted_by_its_first_tensor_everywhere():
    """train.step's weight, the throughput feed (samples/s, tokens/s), evaluate and the
    split of a stream's batch over replicas count the records of a collated batch
    {text: [5 strings], input_ids, labels} by one rule (jobrun.ops.batches): 5, not one
    list (the feed counted 1 record and no tokens)."""
    from collections import UserDict

    from jobrun.ops.batches import counter, counts, records

    ctx = OpContext()
    reader = reader_op(ctx, Texts(10), batch_size=5)
    batch, done = reader.read()
    assert not done and list(batch) == ["text", "input_ids", "labels"] and len(batch["text"]) == 5
    assert counter(batch) is batch["input_ids"] and records(batch) == 5
    assert reader.tally[:2] == [5, 5 * T]  # the feed's records and tokens of the read
    assert counts((UserDict(batch),)) == (5, 5 * T)  # any mapping (Hugging Face's BatchEncoding)
    # one rule's corners: a 0-d value beside batched ones counts nothing; a single record
    # (unbatched, batch_size 1) counts one; lists of strings alone count by their length
    flagged = {"scale": torch.tensor(0.5), "input_ids": batch["input_ids"]}
    assert counter(flagged) is batch["input_ids"] and records(flagged) == 5
    assert records({"text": "one", "label": torch.tensor(2)}) == 1 and records({"text": ["a", "b"]}) == 2
    # train.step trains on it as on the same batch without its strings
    model, plain = TextLM(), DictLM()
    got = _steps(model, [(batch,)])
    want = _steps(plain, [({"input_ids": batch["input_ids"], "labels": batch["labels"]},)])
    assert got == want and torch.equal(model.head.weight, plain.head.weight)
    assert train.evaluate(ctx, model, reader_op(ctx, Texts(10), batch_size=4), loss="model") == \
        train.evaluate(ctx, plain, reader_op(ctx, *_data(10), batch_size=4, keys=["input_ids", "labels"]),
                       loss="model")
    # a stream's global batch of 5 over 2 replicas: rank 1 reads records 3..4 of every
    # value, each tensor tagged with the 5 records train.step weights rank 1's loss by
    part, _ = reader_op(OpContext(rank=1, world_size=2), TextStream(), batch_size=5).read()
    assert part["text"] == ["record 3", "record 4"] and torch.equal(part["labels"], _data(10)[1][3:5])
    assert global_records(counter(part)) == 5
