"""task=classification (the default): one class per image, cross-entropy with label smoothing, top-1 and top-5
accuracy, best.pt by val_acc, MixUp/CutMix from the recipe."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from loadout.data.masks import as_mask
from train.task.base import Task


class Classification(Task):
    """`label_smoothing`: CrossEntropyLoss's. Top-5 is top-k with k = min(5, classes)."""

    best = ("val_acc", "max")
    source_needs = {"classes": "the class names"}
    target_name = "label"
    target_doc = "an integer label"

    def __init__(self, label_smoothing: float = 0.0):
        self.criterion = torch.nn.CrossEntropyLoss(label_smoothing=label_smoothing)

    @classmethod
    def metric_rows(cls) -> tuple:
        # imported here: loadout/observe/metrics.py names this default task's figures at its own import
        from loadout.observe.metrics import Metric

        return (Metric("val_acc", "Validation accuracy after the epoch", "loadout_val_accuracy", "val_acc {:.3f}"),
                Metric("val_top5", "Validation top-5 accuracy after the epoch", "loadout_val_top5_accuracy",
                       "top5 {:.3f}"))

    @property
    def figures(self) -> tuple:
        return self.metric_rows()

    def check_target(self, target: Any) -> None:
        if as_mask(target) is not None:
            raise TypeError("got a mask, not a label: a source of masks trains with task=segmentation")
        int(target)

    def batch_mix(self, recipe, source, seed: int):
        return recipe.batch_mix(self.num_outputs(source), seed)

    def loss(self, outputs: Any, targets: torch.Tensor) -> torch.Tensor:
        return self.criterion(self.logits(outputs).float(), targets)

    def eval_counts(self, outputs: Any, targets: torch.Tensor) -> torch.Tensor:
        logits = self.logits(outputs)
        hits = logits.topk(min(5, logits.shape[1]), dim=1).indices == targets[:, None]
        return torch.stack([hits[:, 0].sum(), hits.any(dim=1).sum()]).double()

    def num_counts(self) -> int:
        return 2  # top-1 and top-5 hits

    def figures_of(self, counts: Sequence[float], samples: int) -> dict[str, float]:
        correct, top5 = counts
        n = max(samples, 1)
        return {"val_acc": correct / n, "val_top5": top5 / n}
