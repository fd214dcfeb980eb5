"""The user's own code of plans/gan.yaml: the data (a ring of Gaussians), the GAN's
training step (two models, two optimizers), and a score of the generator.

`step` is written as in a hand-written loop: jobrun calls it with the models and
optimizers the plan built, and its backwards are synchronised over replicas by DDP's
hooks like `train.step`'s. Its noise comes from `generator`, the node's seeded stream
(saved in every checkpoint: a resumed run draws the very noise an uninterrupted one
draws), which is the same on every replica: the step draws the noise of the whole global
batch and keeps its own rows of it (`jobrun.batch_rows`), so that `--replicas 2` trains
the models one process trains.
"""

from __future__ import annotations

import math

import torch
from torch.nn import functional as F

from jobrun import batch_rows


def centers(modes: int = 8, radius: float = 2.0) -> torch.Tensor:
    """The means of the ring's Gaussians: `modes` points evenly spaced on a circle."""
    angle = torch.arange(modes, dtype=torch.float32) * (2 * math.pi / modes)
    return torch.stack([angle.cos(), angle.sin()], dim=1) * radius


def ring(n: int, modes: int = 8, radius: float = 2.0, std: float = 0.05, seed: int = 0) -> torch.Tensor:
    """`n` points [n, 2] of the ring: a mode drawn at random, plus Gaussian noise."""
    g = torch.Generator().manual_seed(seed)
    mode = torch.randint(modes, (n,), generator=g)
    return centers(modes, radius)[mode] + std * torch.randn(n, 2, generator=g)


def step(G, D, opt_g, opt_d, real, *, noise: int, generator):  # noqa: N803 - a GAN's names
    """One step of the discriminator, then one of the generator (the non-saturating loss);
    returns both losses."""
    total, rows = batch_rows(real)  # with replicas: this one's rows of the global batch
    z = torch.randn(total, noise, generator=generator)[rows].to(real.device)
    fake = G(z)
    opt_d.zero_grad(set_to_none=True)
    d_real, d_fake = D(real), D(fake.detach())
    loss_d = (F.binary_cross_entropy_with_logits(d_real, torch.ones_like(d_real))
              + F.binary_cross_entropy_with_logits(d_fake, torch.zeros_like(d_fake)))
    loss_d.backward()
    opt_d.step()
    opt_g.zero_grad(set_to_none=True)
    d_fake = D(fake)
    loss_g = F.binary_cross_entropy_with_logits(d_fake, torch.ones_like(d_fake))
    loss_g.backward()
    opt_g.step()
    return loss_d.detach(), loss_g.detach()


@torch.no_grad()
def score(G, *, noise: int, modes: int = 8, radius: float = 2.0, std: float = 0.05,  # noqa: N803
          n: int = 2000, seed: int = 1) -> tuple[int, float]:
    """How well `G` draws the ring, from `n` samples of fixed noise (the same every
    epoch): the share of samples within 3 std of a mode's center ("good"), and the modes
    that at least 2 % of the samples fall near (of `modes`)."""
    device = next(G.parameters()).device
    z = torch.randn(n, noise, generator=torch.Generator().manual_seed(seed))
    x = G(z.to(device)).float().cpu()
    distance, nearest = torch.cdist(x, centers(modes, radius)).min(dim=1)
    good = distance < 3 * std
    per_mode = torch.bincount(nearest[good], minlength=modes)
    return int((per_mode >= 0.02 * n).sum()), round(good.float().mean().item(), 4)
