"""A small VAE (tests/test_vae_port.py) on generated 8x8 'images' (blobs), its training step and its data."""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import nn

from jobrun import batch_rows


def make_images(*, n: int, side: int = 8, seed: int = 123) -> torch.Tensor:
    """n images of one Gaussian blob each, flattened to [n, side*side], in [0, 1].
    Drawn from a generator of its own: nothing of torch's global stream is taken."""
    g = torch.Generator().manual_seed(seed)
    c = torch.rand(n, 2, generator=g) * (side - 1)
    w = 0.8 + torch.rand(n, 1, generator=g) * 1.5
    ax = torch.arange(side, dtype=torch.float32)
    yy, xx = torch.meshgrid(ax, ax, indexing="ij")
    d2 = (xx.reshape(1, -1) - c[:, :1]) ** 2 + (yy.reshape(1, -1) - c[:, 1:]) ** 2
    return torch.exp(-d2 / (2 * w ** 2)).float()


class VAE(nn.Module):
    def __init__(self, pixels: int = 64, hidden: int = 32, latent: int = 4) -> None:
        super().__init__()
        self.latent = latent
        self.enc = nn.Sequential(nn.Linear(pixels, hidden), nn.ReLU(), nn.Linear(hidden, 2 * latent))
        self.dec = nn.Sequential(nn.Linear(latent, hidden), nn.ReLU(), nn.Linear(hidden, pixels))

    def forward(self, x: torch.Tensor, eps: torch.Tensor):
        mu, logvar = self.enc(x).chunk(2, dim=1)
        z = mu + eps * torch.exp(0.5 * logvar)          # the reparameterisation trick
        return self.dec(z), mu, logvar


def terms(model, x, eps):
    """(recon, kl): each the mean over the rows of x, in float32."""
    logits, mu, logvar = model(x, eps)
    recon = F.binary_cross_entropy_with_logits(logits.float(), x, reduction="none").sum(1).mean()
    kl = (-0.5 * (1 + logvar.float() - mu.float() ** 2 - logvar.float().exp()).sum(1)).mean()
    return recon, kl


def beta_at(step: int, warmup: int) -> float:
    return min(1.0, step / warmup)


def step(model, opt, xb, *, generator, step, kl_warmup, accumulate=2, amp=True, sleep=0.0):
    """One optimizer step over xb in `accumulate` micro-batches, bf16 autocast on CPU.
    Returns (loss, recon, kl) of the batch, each the rows-weighted mean of the parts."""
    if sleep:
        time.sleep(sleep)
    total, rows = batch_rows(xb)
    eps = torch.randn(total, model.latent, generator=generator)[rows].to(xb.device)
    beta = beta_at(step, kl_warmup)
    opt.zero_grad(set_to_none=True)
    n = xb.shape[0]
    loss_sum = recon_sum = kl_sum = torch.zeros((), dtype=torch.float32)
    for xm, em in zip(xb.tensor_split(accumulate), eps.tensor_split(accumulate)):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            recon, kl = terms(model, xm, em)
        w = xm.shape[0] / n
        loss = (recon + beta * kl) * w
        loss.backward()
        loss_sum = loss_sum + loss.detach()
        recon_sum = recon_sum + recon.detach() * w
        kl_sum = kl_sum + kl.detach() * w
    opt.step()
    return loss_sum, recon_sum, kl_sum


@torch.no_grad()
def elbo(model, x):
    """Validation: recon + KL with eps = 0 (the posterior mean), float32."""
    recon, kl = terms(model, x, torch.zeros(x.shape[0], model.latent))
    return recon + kl


@torch.no_grad()
def samples(model, *, n, generator):
    """n images decoded from the prior (drawn from the node's generator)."""
    z = torch.randn(n, model.latent, generator=generator)
    return torch.sigmoid(model.dec(z))
