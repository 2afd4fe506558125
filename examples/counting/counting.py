"""A task of your own in one file: counting the bright squares in an image, a regression (examples/counting).

`Counting` is the task (train/task/base.py says what a task owns): mean squared error on the model's single
output, evaluation sums of |error| and exact counts (plain sums, so they add up over batches and ranks),
figures val_mae and val_exact, best.pt by the lowest val_mae. `Squares` is a source to train it on: 32x32 images
drawn from their index, 0-4 squares each, the count as target. Train it from outside the package with:

    PYTHONPATH=examples/counting python -m train hydra.searchpath=[file://examples/counting/conf] task=counting \
        dataset._target_=counting.Squares '~dataset.root'
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from loadout.observe.metrics import Metric
from train.task import Task


class Counting(Task):
    figures = (Metric("val_mae", "Mean absolute error of the counts", "loadout_val_mae", "mae {:.3f}"),
               Metric("val_exact", "Share of images whose rounded count is right", "loadout_val_exact",
                      "exact {:.3f}"))
    best = ("val_mae", "min")
    target_name, target_doc = "count", "an integer count"

    def check_target(self, target) -> None:
        int(target)

    def num_outputs(self, source) -> int:
        return 1

    def loss(self, outputs, targets: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(outputs.float().squeeze(1), targets.float())

    def eval_counts(self, outputs, targets: torch.Tensor) -> torch.Tensor:
        error = outputs.float().squeeze(1) - targets.float()
        return torch.stack([error.abs().sum(), (error.round() == 0).sum()]).double()

    def num_counts(self) -> int:
        return 2  # |error| and exact counts

    def figures_of(self, counts: Sequence[float], samples: int) -> dict[str, float]:
        absolute, exact = counts
        return {"val_mae": absolute / max(samples, 1), "val_exact": exact / max(samples, 1)}


class Squares:
    """`size` images a split, each with 0-4 bright 6x6 squares on a dark noisy ground, drawn from (split, index)."""

    def __init__(self, split: str = "train", size: int = 512):
        self.split, self.size = split, size if split == "train" else size // 4

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        rng = np.random.default_rng([index, self.split == "val"])
        image = rng.integers(0, 60, (3, 32, 32), dtype=np.uint8)
        count = int(rng.integers(0, 5))
        for cell in rng.choice(16, count, replace=False):  # one square per cell of a 4x4 grid: none overlap
            top, left = 8 * (cell // 4) + 1, 8 * (cell % 4) + 1
            image[:, top:top + 6, left:left + 6] = 220
        return torch.from_numpy(image), count
