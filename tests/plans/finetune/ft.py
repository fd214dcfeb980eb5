"""A small transformer classifier, fine-tuned from a pretrained backbone (plan.yaml and
tests/test_finetune_port.py's hand loop)."""

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

TOKENS, WIDTH = 8, 4          # a sample is 8 tokens of 4 features


class Backbone(nn.Module):
    def __init__(self, d: int = 16):
        super().__init__()
        self.embed = nn.Linear(WIDTH, d)
        layer = nn.TransformerEncoderLayer(d, nhead=2, dim_feedforward=32, dropout=0.1,
                                           batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=1, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        h = self.encoder(self.embed(x.view(len(x), TOKENS, WIDTH)))
        return self.norm(h.mean(1))


class Classifier(nn.Module):
    def __init__(self, classes: int, d: int = 16, pretrained: str | None = None):
        super().__init__()
        self.backbone = Backbone(d)
        if pretrained:
            state = load_file(pretrained)
            # `jobrun export --blob model` keys: backbone.*; `save`'s: model.backbone.*
            state = {k.removeprefix("model."): v for k, v in state.items()}
            self.backbone.load_state_dict({k.removeprefix("backbone."): v for k, v in state.items()
                                           if k.startswith("backbone.")})
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        return self.head(self.backbone(x))


def make_data(*, n: int, classes: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(TOKENS * WIDTH, classes, generator=g)
    def draw(m):
        x = torch.randn(m, TOKENS * WIDTH, generator=g)
        y = (x @ w + 0.5 * torch.randn(m, classes, generator=g)).argmax(1)
        return x, y
    x, y = draw(n)
    vx, vy = draw(n // 4)
    return x, y, vx, vy


def smooth_ce(pred, y):
    return F.cross_entropy(pred, y, label_smoothing=0.1)


def set_trainable(model, *, freeze_epochs: int, epoch):
    """Train only the head for the first `freeze_epochs` epochs."""
    for p in model.backbone.parameters():
        p.requires_grad_(epoch > freeze_epochs)

