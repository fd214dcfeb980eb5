"""plans/gpt.yaml written by hand: nanoGPT's train.py loop, plain torch, the same numbers.

The same model (plans/models/gpt.py), token files, random windows, AdamW with
configure_optimizers' two groups, get_lr's warmup and cosine, gradient clipping and an
estimate of the validation loss every `eval_every` steps over `eval_batches` random
batches, as karpathy/nanoGPT train.py does them. tests/test_gpt.py checks that the plan
and this loop give the same losses and parameters to the last bit; bench_gpt.py times
them against each other.

Two things come from the plan's conventions rather than nanoGPT's: windows are drawn
from a generator of their own, the one jobrun gives the node (seeded from the plan's seed
and the node's name: the same on every replica and untouched by dropout), and an
iteration's eval happens before its batch is drawn (the plan's order).

    python benchmarks/gpt_loop.py [--steps 300]
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

PLANS = Path(__file__).resolve().parent.parent / "plans"
# plans/gpt.yaml's vars and arguments
CONFIG = dict(block=32, batch=16, lr=0.001, steps=300, eval_every=50, eval_batches=10,
              min_lr=0.0001, weight_decay=0.1, betas=(0.9, 0.99), grad_clip=1.0, vocab=64,
              n_layer=2, n_head=4, n_embd=64, seed=0)


def get_lr(it: int, c: dict) -> float:
    """nanoGPT's learning rate schedule: linear warmup, cosine decay to min_lr (the plan's
    warmup is a tenth of its steps)."""
    if it < c["warmup"]:
        return c["lr"] * (it + 1) / (c["warmup"] + 1)
    if it > c["steps"]:
        return c["min_lr"]
    decay_ratio = (it - c["warmup"]) / (c["steps"] - c["warmup"])
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
    return c["min_lr"] + coeff * (c["lr"] - c["min_lr"])


class GPTLoop:
    """The training loop, one iteration at a time (`step`), so a benchmark can interleave it."""

    def __init__(self, **overrides) -> None:
        sys.path.insert(0, str(PLANS))
        from models.gpt import GPT

        from jobrun.ops.context import node_seed

        c = self.c = {**CONFIG, **overrides}
        c["warmup"] = c["steps"] // 10
        torch.manual_seed(c["seed"])
        self.train_data = np.memmap(PLANS / "data" / "gpt_train.bin", dtype=np.uint16, mode="r")
        self.val_data = np.memmap(PLANS / "data" / "gpt_val.bin", dtype=np.uint16, mode="r")
        self.gen = torch.Generator().manual_seed(node_seed(c["seed"], "local"))
        self.model = GPT(c["vocab"], block_size=c["block"], n_layer=c["n_layer"], n_head=c["n_head"],
                         n_embd=c["n_embd"])
        # configure_optimizers: 2-D and larger tensors decay, biases and norms do not
        params = [p for _, p in self.model.named_parameters() if p.requires_grad]
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": c["weight_decay"]},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        self.opt = torch.optim.AdamW(groups, lr=c["lr"], betas=c["betas"])
        self.iter_num = 0
        self.losses: list[tuple[int, float]] = []  # (step, loss) of every step
        self.val_losses: list[tuple[int, float]] = []

    def get_batch(self, split: str) -> tuple[torch.Tensor, torch.Tensor]:
        data = self.train_data if split == "train" else self.val_data
        block = self.c["block"]
        ix = torch.randint(len(data) - block, (self.c["batch"],), generator=self.gen)
        x = torch.stack([torch.from_numpy(data[i:i + block].astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + block].astype(np.int64)) for i in ix])
        return x, y

    @torch.no_grad()
    def estimate_loss(self) -> float:
        self.model.eval()
        losses = torch.zeros(self.c["eval_batches"])
        for k in range(self.c["eval_batches"]):
            x, y = self.get_batch("val")
            _, loss = self.model(x, y)
            losses[k] = loss.item()
        self.model.train()
        return losses.mean().item()

    def step(self) -> None:
        """One iteration of nanoGPT's loop."""
        c, model, opt = self.c, self.model, self.opt
        lr = get_lr(self.iter_num, c)
        for param_group in opt.param_groups:
            param_group["lr"] = lr
        if self.iter_num % c["eval_every"] == 0:
            self.val_losses.append((self.iter_num, self.estimate_loss()))
        x, y = self.get_batch("train")
        opt.zero_grad(set_to_none=True)
        _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), c["grad_clip"])
        opt.step()
        self.losses.append((self.iter_num, loss.item()))
        self.iter_num += 1

    def finish(self) -> None:
        """After the last step: the final estimate (the plan's exit)."""
        self.val_losses.append((self.iter_num, self.estimate_loss()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=CONFIG["steps"])
    args = ap.parse_args()
    torch.set_num_threads(1)
    loop = GPTLoop(steps=args.steps)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        loop.step()
        if loop.iter_num % 10 == 1:
            print(f"iter {loop.iter_num - 1}: loss {loop.losses[-1][1]:.4f}")
    loop.finish()
    seconds = time.perf_counter() - t0
    print(f"val loss {loop.val_losses[-1][1]:.4f}; {args.steps / seconds:.2f} steps/s")


if __name__ == "__main__":
    main()
