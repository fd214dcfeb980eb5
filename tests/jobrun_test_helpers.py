"""Functions that test plans reach through `call`, and the small MLP plan many tests
train (tests/ is on sys.path under pytest)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence

_lock = threading.Lock()


def append(items: list, value) -> list:
    with _lock:
        items.append(value)
    return items


def new_list() -> list:
    return []


DISPLAY = None  # a test's jobrun.runner.display.Display, for shown_step


def shown_step(items: list) -> None:
    """Append the step the display would show now: (steps begun, loop length)."""
    items.append(DISPLAY._step())


def length(items: list) -> int:
    return len(items)


def sleep(seconds: float) -> None:
    time.sleep(seconds)


def fail(message: str = "boom") -> None:
    raise ValueError(message)


def touch(path: str) -> None:
    with open(path, "a"):
        pass


def pid() -> int:
    return os.getpid()


def die_on_rank(epoch: int, rank: int = 1, at: int = 2) -> None:
    """SIGKILL this process when it is replica `rank` reaching epoch `at` (a dying rank)."""
    import signal

    if int(os.environ.get("RANK", 0)) == rank and epoch == at and not os.environ.get("JOBRUN_TEST_NO_DIE"):
        os.kill(os.getpid(), signal.SIGKILL)


def die_later(epoch: int, rank: int = 1, at: int = 2, delay: float = 0.3) -> None:
    """As die_on_rank, `delay` seconds later: the other ranks go on to their next step's
    collective and wait in it for this one, which dies meanwhile. (A timer thread that
    killed it while it went on let a fast run finish first; killed as it waited for its
    launcher's word to exit, it hung torch's agent in multiprocessing's Condition.notify.)"""
    import signal

    if int(os.environ.get("RANK", 0)) == rank and epoch == at:
        time.sleep(delay)
        os.kill(os.getpid(), signal.SIGKILL)


def fail_once(path: str, message: str = "bad luck") -> None:
    """Raise the first time (leaving `path` behind), pass every later time."""
    if not os.path.exists(path):
        touch(path)
        raise ValueError(message)


def last_lr(scheduler) -> float:
    return float(scheduler.get_last_lr()[0])


def die_once(epoch: int, step: int, path: str, rank: int = 1, at: int = 3, at_step: int = 4,
             times: int = 1) -> None:
    """SIGKILL replica `rank` at step `at_step` of epoch `at`, `times` times in all: each
    death is a line in `path` (the time it happened), so a restarted rank goes on.
    No `path`: never."""
    import signal

    if not path or int(os.environ.get("RANK", 0)) != rank or int(epoch) != at or int(step) != at_step:
        return
    try:
        with open(path) as f:
            deaths = len(f.readlines())
    except FileNotFoundError:
        deaths = 0
    if deaths >= times:
        return
    with open(path, "a") as f:
        f.write(f"{time.time()}\n")
        f.flush()
        os.fsync(f.fileno())
    os.kill(os.getpid(), signal.SIGKILL)


def record_ids(ids, epoch: int, path: str) -> None:
    """Append the record ids this rank read, as one JSON line {rank, world, epoch, ids}."""
    import json

    line = json.dumps({"rank": int(os.environ.get("RANK", 0)), "world": int(os.environ.get("WORLD_SIZE", 1)),
                       "epoch": int(epoch), "ids": [int(i) for i in ids]})
    with _lock, open(path, "a") as f:
        f.write(line + "\n")


def fail_saves_on_rank(rank: int = 1, at: int = 2, full: str = "") -> None:
    """Make replica `rank`'s checkpoint save of epoch `at` fail as a full disk does (this
    process's `jobrun.store.write` raises ENOSPC for that epoch); with `full`, a path:
    only while that file exists (the disk is full until a test removes it)."""
    import errno

    from jobrun import store

    if int(os.environ.get("RANK", 0)) != rank or getattr(store.write, "failing", False):
        return
    write = store.write

    def failing(prepared, ckpt_dir, node, epoch, *args, **kwargs):
        if epoch == at and (not full or os.path.exists(full)):
            raise OSError(errno.ENOSPC, "No space left on device")
        return write(prepared, ckpt_dir, node, epoch, *args, **kwargs)

    failing.failing = True
    store.write = failing


def record_threads(path: str) -> None:
    """Write torch's CPU thread count of this rank to `path`.RANK."""
    import torch

    with open(f"{path}.{os.environ.get('RANK', '0')}", "w") as f:
        f.write(str(torch.get_num_threads()))


# -- data parallel: a GAN's step written as a `call`, and reads of tensor values --------

def gan_data(n: int):
    import torch

    g = torch.Generator().manual_seed(7)
    return torch.randn(n, 2, generator=g), torch.randn(n, 4, generator=g) * 0.5 + 1.0


def gan_step(G, D, opt_g, opt_d, z, real):
    """A GAN's two optimizer steps, as user code writes them: no jobrun op inside."""
    import torch
    import torch.nn.functional as F

    fake = G(z)
    opt_d.zero_grad()
    d_real, d_fake = D(real), D(fake.detach())
    loss_d = F.binary_cross_entropy_with_logits(d_real, torch.ones_like(d_real)) \
        + F.binary_cross_entropy_with_logits(d_fake, torch.zeros_like(d_fake))
    loss_d.backward()
    opt_d.step()
    opt_g.zero_grad()
    d_fake = D(fake)
    loss_g = F.binary_cross_entropy_with_logits(d_fake, torch.ones_like(d_fake))
    loss_g.backward()
    opt_g.step()
    return loss_d.detach(), loss_g.detach()


_HOST_READS = ("item", "tolist", "__float__", "__int__", "__bool__", "__index__", "__format__")
_reads = [0]


def count_host_reads() -> None:
    """Count the calls that read a tensor's value to the host, in this process."""
    import torch

    if getattr(torch.Tensor, "_jobrun_counted", False):
        return
    for name in _HOST_READS:
        real = getattr(torch.Tensor, name)

        def counted(self, *args, _real=real, **kwargs):
            _reads[0] += 1
            return _real(self, *args, **kwargs)

        setattr(torch.Tensor, name, counted)
    torch.Tensor._jobrun_counted = True


def host_reads() -> int:
    """The reads counted since the last call."""
    n, _reads[0] = _reads[0], 0
    return n


def own_step(model, opt) -> None:
    """A hand-written optimizer step (the global step counts it too)."""
    opt.zero_grad()
    sum(p.sum() for p in model.parameters()).backward()
    opt.step()


def the_step(step: int) -> int:
    """The global step, as a `call` gets it (a parameter named `step`)."""
    return step


def WithUnusedHead():  # noqa: N802 - a `build` target, named like the class it makes
    """A model whose second head no forward uses (DDP needs every parameter's gradient)."""
    from torch import nn

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body, self.unused = nn.Linear(4, 2), nn.Linear(4, 2)

        def forward(self, x):
            return self.body(x)

    return Model()


# -- the small MLP plan that tests train --------------------------------------------------

def mlp_plan(job: str, top: str, *, n: int = 64, batch: int = 8, hidden: int | str = 8, lr: float | str = 0.1,
             init: Sequence[str] = (), step: Sequence[str] = (), epoch: Sequence[str] = (),
             outputs: str = "") -> str:
    """The text of a plan that trains a small MLP on every batch of each pass: job `job`,
    the top-level lines `top` (max_epochs, checkpoint, vars...); an init task `setup` that
    makes `n` classification records (4 features, 2 classes, seed 0), reads them in
    batches of `batch`, builds an MLP 4-`hidden`-2 and SGD at `lr`, then runs the ops
    `init`; an epoch task `train` whose loop reads and trains until the pass ends (the ops
    `step` after each train.step), then the ops `epoch`, and its `outputs` (a YAML list)
    if any. An op is the YAML of one list item, without its dash: "log: {in: [loss]}".
    The text is the same from test to test but for these, line for line (tests name
    its lines in expected messages)."""
    lines = [
        f"job: {job}", *top.strip().splitlines(),
        "init:",
        "  - task: setup",
        "    do:",
        f"      - data.synthetic: {{out: [x, y], task: classification, n: {n}, features: 4, classes: 2, seed: 0}}",
        f"      - reader: {{in: [x, y], out: data, batch_size: {batch}, passes: 0}}",
        f"      - model.mlp: {{out: model, sizes: [4, {hidden}, 2]}}",
        f"      - optimizer: {{in: model, out: opt, lr: {lr}}}",
        *(f"      - {op}" for op in init),
        "epoch:",
        "  - task: train",
        "    do:",
        "      - loop: null",
        "        do:",
        "          - read: {in: data, out: [xb, yb, end]}",
        "          - stop_if: end",
        "          - train.step: {in: [model, opt, xb, yb], out: loss}",
        *(f"          - {op}" for op in step),
        *(f"      - {op}" for op in epoch),
    ]
    if outputs:
        lines.append(f"    outputs: {outputs}")
    return "\n".join(lines) + "\n"


# The collectives jobrun issues itself (FSDP's all-gathers and reduce-scatters go through
# other functions; DDP's buckets and the stop flags are asynchronous): blocking ones are
# what a step would wait for, besides its gradients.
_COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_object", "barrier")
_blocking = [0]


def count_collectives() -> None:
    """Count the blocking calls of torch.distributed's collectives above, in this process."""
    import torch.distributed as dist

    if getattr(dist, "_jobrun_counted", False):
        return
    for name in _COLLECTIVES:
        real = getattr(dist, name)

        def counted(*args, _real=real, **kwargs):
            if not kwargs.get("async_op", False):
                _blocking[0] += 1
            return _real(*args, **kwargs)

        setattr(dist, name, counted)
    dist._jobrun_counted = True


def collectives() -> int:
    """The blocking collectives counted since the last call."""
    n, _blocking[0] = _blocking[0], 0
    return n


def rank_batch(x, y, step: int, rank: int, world_size: int, batch: int):
    """This rank's part of global batch `step` (in order, cycling), cut by user code: no
    reader tagged it with the global batch's records. The last batch of a pass is short."""
    import torch

    starts = list(range(0, x.shape[0], batch))
    lo = starts[step % len(starts)]
    idx = torch.arange(lo, min(lo + batch, x.shape[0])).tensor_split(world_size)[rank]
    return x[idx].clone(), y[idx].clone()


def plain_mlp(sizes: list[int]):
    """A model made by user code (not `build`): jobrun does not wrap it."""
    import torch
    from torch import nn

    torch.manual_seed(11)  # the same weights on every rank
    layers: list = []
    for a, b in zip(sizes, sizes[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def tokens(n: int, vocab: int = 11, length: int = 6):
    """``n`` sequences of ``length`` token ids below ``vocab`` (seeded)."""
    import torch

    return torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(5))


def TiedLM(vocab: int = 11, width: int = 8):  # noqa: N802 - a `build` target, named like the class it makes
    """A model of Hugging Face's shape: called as model(input_ids=..., labels=...), it
    computes its own loss (next-token cross entropy) and returns a dict; its head's weight
    is its input embedding (tied, as GPT-2's), with a layer of its own between them."""
    import torch.nn.functional as F
    from torch import nn

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.mix = nn.Embedding(vocab, width), nn.Linear(width, width)
            self.head = nn.Linear(width, vocab, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, input_ids, labels):
            logits = self.head(self.mix(self.emb(input_ids)).tanh())
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, vocab), labels[:, 1:].reshape(-1))
            return {"loss": loss, "logits": logits}

    return Model()


def wait_while(path: str, seconds: float = 120) -> None:
    """Sleep while the file ``path`` exists (at most ``seconds``)."""
    deadline = time.monotonic() + seconds
    while os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.02)


def start_method() -> str:
    """How this process starts child processes, a DataLoader's workers among them."""
    import multiprocessing

    return multiprocessing.get_start_method()


def ema_update(ema, model) -> None:
    """An EMA's step, as a script writes it: ``AveragedModel.update_parameters``."""
    ema.update_parameters(model)


def frozen_teacher(model, x):
    """A distillation's teacher: a frozen copy of the model, run where gradients are on
    (the student's loss is computed beside it); the sum of its outputs."""
    import copy

    teacher = copy.deepcopy(model).requires_grad_(False)
    return teacher(x).sum().item()



def spoil_own_checkpoint(rank: int, world_size: int, ckpt: str = "", which: int = 0, on: int = 1) -> None:
    """On rank `on`: flip the last byte of its own tensor files of checkpoint `which` (their
    checksums then fail when they are read)."""
    from pathlib import Path

    if rank != on:
        return
    for path in Path(ckpt).glob(f"*.{which}/rank-{on}/*.safetensors"):
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))


def record_draws(epoch: int, path: str) -> None:
    """Draw from the global streams (torch's, numpy's, Python's), as dropout and a user's
    own code do, and append them as one JSON line {rank, world, epoch, torch, numpy, python}."""
    import json
    import random

    import numpy as np
    import torch

    line = json.dumps({"rank": int(os.environ.get("RANK", 0)), "world": int(os.environ.get("WORLD_SIZE", 1)),
                       "epoch": int(epoch), "torch": torch.rand(3).tolist(), "numpy": np.random.rand(2).tolist(),
                       "python": random.random()})
    with _lock, open(path, "a") as f:
        f.write(line + "\n")


def dropout_data(*, n: int):
    """`n` records of 4 features and 3 classes from a generator of their own (no draw from
    the global streams), for tests/test_hand_ddp.py."""
    import torch

    g = torch.Generator().manual_seed(11)
    x = torch.randn(n, 4, generator=g)
    return x, (x.sum(1) > 0).long() + (x[:, 0] > 1).long()


def dropout_mlp():
    """An MLP with dropout, built from torch's global stream as a hand loop builds it."""
    import torch

    return torch.nn.Sequential(torch.nn.Linear(4, 32), torch.nn.ReLU(), torch.nn.Dropout(0.3),
                               torch.nn.Linear(32, 3))


def record_loss(loss, *, path: str, rank: int) -> None:
    """Append {rank, loss} (the loss as the float it is) as one JSON line."""
    import json

    with _lock, open(path, "a") as f:
        f.write(json.dumps({"rank": rank, "loss": float(loss)}) + "\n")


def save_rank(model, *, path: str, rank: int) -> None:
    """Save this rank's state_dict to `path.RANK`."""
    import torch

    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, f"{path}.{rank}")


def mean_step(model, opt, x, y):
    """A training step of the user's own, its loss the mean over this rank's rows: DDP and
    FSDP give the mean of the ranks' gradients, as a hand-written DDP loop does."""
    import torch.nn.functional as F

    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return loss.detach()
