"""`optimizer`: a torch.optim class by name and parameter groups by rule, equal to
nanoGPT's configure_optimizers (same groups, same order, same training to the bit)."""

from __future__ import annotations

import pytest
import torch
from runner_util import jobrun
from torch import nn

from jobrun.errors import RunError
from jobrun.ops import models
from jobrun.ops.context import OpContext


class Tied(nn.Module):
    """Embedding, a norm and a head sharing the embedding's weight (as GPT-2 does)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.wte = nn.Embedding(10, 8)
        self.ln = nn.LayerNorm(8)
        self.fc = nn.Linear(8, 8)
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, x):
        return self.head(torch.relu(self.fc(self.ln(self.wte(x)))))


def nanogpt_optimizer(model: nn.Module, weight_decay: float, lr: float, betas) -> torch.optim.AdamW:
    """nanoGPT's GPT.configure_optimizers, line for line (CPU: no fused)."""
    param_dict = {pn: p for pn, p in model.named_parameters()}
    param_dict = {pn: p for pn, p in param_dict.items() if p.requires_grad}
    decay_params = [p for n, p in param_dict.items() if p.dim() >= 2]
    nodecay_params = [p for n, p in param_dict.items() if p.dim() < 2]
    optim_groups = [
        {"params": decay_params, "weight_decay": weight_decay},
        {"params": nodecay_params, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(optim_groups, lr=lr, betas=betas)


RULE = [{"ndim_below": 2, "weight_decay": 0.0}]


def test_groups_equal_nanogpts_configure_optimizers_bit_for_bit():
    ours, theirs = Tied(), Tied()
    opt = models.optimizer(OpContext(), ours, **{"class": "AdamW"}, lr=0.01, weight_decay=0.1,
                           betas=[0.9, 0.95], groups=RULE)
    ref = nanogpt_optimizer(theirs, 0.1, 0.01, (0.9, 0.95))
    names = {id(p): n for n, p in ours.named_parameters()}
    ref_names = {id(p): n for n, p in theirs.named_parameters()}
    assert [[names[id(p)] for p in g["params"]] for g in opt.param_groups] == \
           [[ref_names[id(p)] for p in g["params"]] for g in ref.param_groups] == \
           [["wte.weight", "fc.weight"], ["ln.weight", "ln.bias", "fc.bias"]]
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    x = torch.randint(0, 10, (16,), generator=torch.Generator().manual_seed(3))
    for model, o in ((ours, opt), (theirs, ref)):
        for _ in range(3):
            o.zero_grad()
            nn.functional.cross_entropy(model(x), x).backward()
            o.step()
    for a, b in zip(ours.parameters(), theirs.parameters()):
        assert torch.equal(a, b)


def test_names_select_by_pattern_first_rule_wins_and_empty_groups_are_left_out():
    model = Tied()
    opt = models.optimizer(OpContext(), model, **{"class": "SGD"}, lr=0.1, groups=[
        {"names": ["*.bias"], "lr": 0.5},
        {"ndim_below": 2, "lr": 0.2},        # ln.weight only: the biases went to the first rule
        {"ndim_at_least": 3, "lr": 9.0},      # nothing: left out
    ])
    names = {id(p): n for n, p in model.named_parameters()}
    assert [([names[id(p)] for p in g["params"]], g["lr"]) for g in opt.param_groups] == [
        (["wte.weight", "fc.weight"], 0.1), (["ln.bias", "fc.bias"], 0.5), (["ln.weight"], 0.2)]


def test_target_and_the_default_still_work():
    model = Tied()
    assert type(models.optimizer(OpContext(), model, lr=0.1)) is torch.optim.SGD
    opt = models.optimizer(OpContext(), model, target="torch.optim.Adam", lr=0.1)
    assert type(opt) is torch.optim.Adam and len(opt.param_groups) == 1


def test_a_rules_options_are_its_optimizers_constructors_less_params():
    """The options a rule may set, also in the list an unknown one is answered with: Adam's
    decoupled_weight_decay, not `params` (a rule cannot set it); LBFGS takes no weight_decay."""
    from jobrun.ops import optim

    assert "decoupled_weight_decay" in optim.group_options(torch.optim.Adam)
    assert "params" not in optim.group_options(torch.optim.AdamW)
    assert "lr" in optim.group_options(torch.optim.LBFGS) and "weight_decay" not in optim.group_options(torch.optim.LBFGS)
    with pytest.raises(RunError) as info:
        models.optimizer(OpContext(), Tied(), **{"class": "LBFGS"}, groups=[{"ndim_below": 2, "weight_decay": 0.0}])
    assert "'weight_decay' is neither a selector nor an option of LBFGS" in info.value.message
    assert "options of LBFGS: history_size, line_search_fn, lr, max_eval, max_iter," in info.value.hint


@pytest.mark.parametrize(
    ("kwargs", "message", "hint"),
    [
        ({"class": "Adamw"}, "torch.optim has no optimizer 'Adamw'", "did you mean 'AdamW'"),
        ({"class": "AdamW", "target": "torch.optim.SGD"}, "`class` or `target`, not both", "class: AdamW"),
        ({"class": "AdamW", "groups": [{"ndim_below": 2, "weight_decy": 0.0}]},
         "'weight_decy' is neither a selector nor an option", "did you mean 'weight_decay'"),
        ({"class": "AdamW", "groups": [{"weight_decay": 0.0}]}, "selects no parameters", "ndim_below"),
        ({"class": "AdamW", "groups": [{"ndim_below": "2"}]}, "ndim_below is a number", ""),
        ({"class": "AdamW", "groups": [{"names": "*.bias"}]}, "names is a list of patterns", "shell"),
        ({"class": "AdamW", "groups": {"ndim_below": 2}}, "a list of rules", "ndim_below: 2"),
        # Hugging Face's no_decay list as patterns: they match whole names, so nothing (the
        # rule was dropped without a word, and weight decay went on every parameter)
        ({"class": "AdamW", "groups": [{"names": ["bias"], "weight_decay": 0.0}]},
         "groups[0]: names pattern 'bias' matches no parameter", "names like it: ln.bias, fc.bias"),
        ({"class": "AdamW", "groups": [{"names": ["*.bias", "*LN.weight"], "weight_decay": 0.0}]},
         "names pattern '*LN.weight' matches no parameter", "case and all"),
        # a specific rule after a broader one: every parameter it selects went to the
        # broader rule, and its lr applied to nothing, without a word
        ({"class": "AdamW", "groups": [{"ndim_below": 2, "weight_decay": 0.0}, {"names": ["ln.*"], "lr": 0.5}]},
         "groups[1] gets no parameter: all 2 it selects (ln.weight, ln.bias) went to groups[0]",
         "put the more specific rule first (groups[1] before groups[0])"),
        ({"class": "AdamW", "groups": [{"names": ["*.bias"]}, {"names": ["ln.*"]}, {"names": ["ln.bias"], "lr": 0.5}]},
         "groups[2] gets no parameter: all 1 it selects (ln.bias) went to groups[0]", "remove groups[2]"),
        ({"class": "AdamW", "groups": [{"names": ["ln.*"]}, {"names": ["*.bias"]}, {"ndim_below": 2, "lr": 0.5}]},
         "went to groups[0] and groups[1], earlier rules that select them too", "(groups[2] before groups[0])"),
    ],
)
def test_bad_optimizer_arguments_are_one_clear_error(kwargs, message, hint):
    with pytest.raises(RunError) as info:
        models.optimizer(OpContext(), Tied(), lr=0.1, **kwargs)
    assert message in info.value.message and hint in (info.value.hint or "")


def test_analyze_knows_class_and_groups(tmp_path):
    plan = tmp_path / "p.yaml"
    plan.write_text(
        "job: o\nmax_epochs: 1\ninit:\n  - task: s\n    do:\n"
        "      - model.mlp: {out: model, sizes: [4, 2]}\n"
        "      - optimizer: {in: model, out: opt, class: AdamW, lr: 0.1, group: []}\n"
        "epoch:\n  - task: t\n    do: []\n")
    # `group` passes through to torch (extra keys do), so analyze is clean ...
    assert jobrun("analyze", plan).code == 0
    plan.write_text(plan.read_text().replace("class: AdamW", "class: Adamm"))
    r = jobrun("analyze", plan)
    assert r.code == 1 and "p.yaml:7:" in r.out and "'AdamW'" in r.out
    printed = jobrun("print", plan.with_name("p.yaml")).out
    assert 'optimizer(model, class="Adamm"' in printed
