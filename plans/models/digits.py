"""scikit-learn's handwritten digits as a torch Dataset, for plans/digits.yaml.

`load_digits` gives 1,797 real 8x8 grey images of the digits 0-9 (16 grey levels), which
ship inside scikit-learn: nothing is downloaded. `Digits` splits them once, by a seeded
permutation, into a training and a validation part, and turns each sample into a float
image [1, 8, 8] in [0, 1] and its label. The training part can shift each image by up to
one pixel at random (a padded random crop): the random draws come from torch's default
generator, which jobrun seeds for every batch a DataLoader worker fetches, so a resumed
run sees the very shifts an uninterrupted one sees.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.nn import functional as F
from torch.utils.data import Dataset

try:
    from sklearn.datasets import load_digits
except ModuleNotFoundError as e:  # the message a user sees through `build`
    raise ModuleNotFoundError(
        "the digits example needs scikit-learn: pip install -e \".[examples]\" (or scikit-learn)"
    ) from e


class Digits(Dataset):
    """The `split` ("train" or "val") of the digits; `augment` shifts training images."""

    def __init__(self, split: str = "train", val_fraction: float = 0.2, seed: int = 0,
                 augment: bool = False) -> None:
        if split not in ("train", "val"):
            raise ValueError(f"split is 'train' or 'val', not {split!r}")
        data = load_digits()
        order = np.random.default_rng(seed).permutation(len(data.target))
        n_val = int(len(order) * val_fraction)
        keep = order[n_val:] if split == "train" else order[:n_val]
        self.images = torch.from_numpy(data.images[keep]).float().div_(16.0).unsqueeze(1)
        self.labels = torch.from_numpy(data.target[keep]).long()
        self.augment = augment

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        image = self.images[index]
        if self.augment:
            dy, dx = torch.randint(0, 3, (2,)).tolist()  # a crop of the image padded by 1
            image = F.pad(image, (1, 1, 1, 1))[:, dy : dy + 8, dx : dx + 8]
        return image, self.labels[index]
