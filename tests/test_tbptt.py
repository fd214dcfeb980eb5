"""Truncated backprop through time, as plan-language.md §12 ports it: an LSTM whose hidden
state a `call` carries from window to window (PyTorch's word_language_model), made in
`init` so that it is carried over from epoch to epoch and saved. The plan's losses and
weights equal the hand loop's to the last bit, also after a resume from epoch 1 (the
tuple state and dropout's stream restored), with the token stream excluded from the
checkpoints as §12 says."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from runner_util import jobrun
from safetensors.torch import load_file

MODULE = '''\
import torch
import torch.nn.functional as F
from torch import nn


class LM(nn.Module):
    def __init__(self, vocab, emb=8, hid=16, layers=2, dropout=0.2):
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.enc = nn.Embedding(vocab, emb)
        self.rnn = nn.LSTM(emb, hid, layers, dropout=dropout)
        self.dec = nn.Linear(hid, vocab)
        self.shape = (layers, hid)

    def forward(self, x, hidden):
        out, hidden = self.rnn(self.drop(self.enc(x)), hidden)
        return self.dec(self.drop(out)).flatten(0, 1), hidden

    def init_hidden(self, bsz):
        w = next(self.parameters())
        return (w.new_zeros(self.shape[0], bsz, self.shape[1]), w.new_zeros(self.shape[0], bsz, self.shape[1]))


def stream(*, n, vocab, bsz):
    ids = torch.randint(vocab, (n,), generator=torch.Generator().manual_seed(1))
    return ids[: n // bsz * bsz].view(bsz, -1).t().contiguous()


def windows(source, *, bptt):
    return len(range(0, source.size(0) - 1, bptt))


def zero_hidden(model, *, bsz):
    return model.init_hidden(bsz)


def get_batch(source, i, bptt):
    n = min(bptt, len(source) - 1 - i)
    return source[i : i + n], source[i + 1 : i + 1 + n].reshape(-1)


def step(model, opt, source, hidden, k, *, bptt):
    x, y = get_batch(source, k * bptt, bptt)
    hidden = tuple(h.detach() for h in hidden)
    opt.zero_grad()
    out, hidden = model(x, hidden)
    loss = F.cross_entropy(out, y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
    opt.step()
    return loss.detach(), hidden
'''

PLAN = """\
job: tbptt
seed: 0
device: cpu
max_epochs: 2
checkpoint: {exclude: [data]}
init:
  - task: setup
    do:
      - call: {fn: "tbptt_lm:stream", out: data, n: 300, vocab: 12, bsz: 4, pure: true}
      - call: {fn: "tbptt_lm:windows", in: [data], out: nwin, bptt: 7, pure: true}
      - build: {in: [12], out: model, target: "tbptt_lm:LM"}
      - optimizer: {in: model, out: opt, lr: 2.0}
      - call: {fn: "tbptt_lm:zero_hidden", in: [model], out: hidden, bsz: 4, pure: true}
epoch:
  - task: train
    do:
      - loop: nwin
        as: k
        do:
          - call: {fn: "tbptt_lm:step", in: [model, opt, data, hidden, k], out: [loss, hidden],
                   mutates: [model, opt], bptt: 7}
          - log: {in: [loss]}
exit:
  - task: save
    do: [{save: {in: [model], path: model.safetensors}}]
"""


def _hand(lm) -> tuple[list[float], dict[str, torch.Tensor]]:
    """word_language_model's loop, the hidden state made once (carried over epochs)."""
    torch.manual_seed(0)
    data = lm.stream(n=300, vocab=12, bsz=4)
    model = lm.LM(12)
    opt = torch.optim.SGD(model.parameters(), lr=2.0)
    hidden, losses = model.init_hidden(4), []
    for _ in range(2):
        for i in range(0, data.size(0) - 1, 7):
            x, y = lm.get_batch(data, i, 7)
            hidden = tuple(h.detach() for h in hidden)
            opt.zero_grad()
            out, hidden = model(x, hidden)
            loss = F.cross_entropy(out, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
            opt.step()
            losses.append(loss.item())
    return losses, {f"model.{k}": v for k, v in model.state_dict().items()}


def _losses(run: Path) -> list[float]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [r["values"]["loss"] for r in map(json.loads, lines) if "loss" in r.get("values", {})]


def test_a_hidden_state_carried_by_a_call_trains_and_resumes_as_the_hand_loop(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("JOBRUN_THREADS", "1")
    (tmp_path / "tbptt_lm.py").write_text(MODULE)
    (tmp_path / "plan.yaml").write_text(PLAN)
    run = tmp_path / "run"
    r = jobrun("train", tmp_path / "plan.yaml", "--run-dir", run)
    assert r.code == 0, r.text
    shown = jobrun("ckpt", "show", run, "--epoch", "1")
    assert "hidden.0 = tensor float32 [2, 4, 16]" in shown.out and "data" not in shown.out, shown.out
    first = load_file(run / "model.safetensors")
    r = jobrun("resume", run, "--epoch", "1")  # epoch 2 again, from epoch 1's hidden state
    assert r.code == 0, r.text
    again = load_file(run / "model.safetensors")

    monkeypatch.syspath_prepend(str(tmp_path))
    import tbptt_lm

    try:
        torch.set_num_threads(1)
        losses, weights = _hand(tbptt_lm)
    finally:
        sys.modules.pop("tbptt_lm", None)
    assert len(losses) == 2 * 11 and _losses(run) == losses
    assert sorted(first) == sorted(weights)
    assert all(torch.equal(first[k], weights[k]) and torch.equal(again[k], weights[k]) for k in weights)
