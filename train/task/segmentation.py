"""task=segmentation: a class per pixel. Targets are uint8 (N, H, W) class maps, `ignore_index` (255) where no class
is scored; cross-entropy skips those pixels. Evaluation sums a classes x classes confusion matrix (rows: true
class, columns: predicted) on the device, all-reduced once per validation: mIoU (over the classes that occur in
the targets or predictions) and pixel accuracy, as pytorch/vision's references/segmentation compute them. best.pt
follows val_miou. Neither the loss nor the confusion matrix has a shape that depends on the pixels' values, so
neither waits for the device (a boolean-mask index or bincount would, twice a slice)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from loadout.data.masks import as_mask
from loadout.observe.metrics import Metric
from train.task.base import Task

FIGURES = (
    Metric("val_miou", "Validation mean intersection over union after the epoch", "loadout_val_miou",
           "miou {:.3f}"),
    Metric("val_pixel_acc", "Validation pixel accuracy (ignored pixels left out) after the epoch",
           "loadout_val_pixel_accuracy", "pixel_acc {:.3f}"),
)


class Segmentation(Task):
    figures = FIGURES
    best = ("val_miou", "max")
    source_needs = {"classes": "the class names, index 0 first"}
    target_name = "mask"
    target_doc = "a uint8 (H, W) mask of class indices"
    mask_targets = True

    def __init__(self, num_classes: int | None = None, ignore_index: int = 255):
        """`num_classes`: the model's outputs, fixed by `bind`; `ignore_index`: the mask value scored nowhere."""
        self.num_classes, self.ignore_index = num_classes, ignore_index

    def check_target(self, target: Any) -> None:
        if as_mask(target) is None:  # ValueError for a mask of the wrong kind
            raise TypeError(f"got {type(target).__name__}, not a mask: train on a source of masks (dataset=voc, "
                            "shards with .png members, parquet with dataset.mask_column, a packed VOC folder)")

    def num_outputs(self, source) -> int:
        self.num_classes = super().num_outputs(source)
        return self.num_classes

    def loss(self, outputs: Any, targets: torch.Tensor) -> torch.Tensor:
        """The mean cross-entropy over the scored pixels; 0, not NaN (a mean of nothing), for a slice of ignored
        pixels alone, which would otherwise stop the run as diverged."""
        targets = targets.long()
        summed = torch.nn.functional.cross_entropy(self.logits(outputs).float(), targets,
                                                   ignore_index=self.ignore_index, reduction="sum")
        return summed / (targets != self.ignore_index).sum().clamp_min(1)

    def confusion(self, predicted: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The classes x classes confusion counts of one slice (int64, on its device; ignored pixels left out)."""
        n = self.num_classes
        targets = targets.long()
        cells = torch.where(targets != self.ignore_index, targets * n + predicted, n * n).flatten()  # n*n: ignored
        counts = torch.zeros(n * n + 1, dtype=torch.int64, device=cells.device)
        return counts.index_add_(0, cells, torch.ones_like(cells))[:n * n].reshape(n, n)

    def eval_counts(self, outputs: Any, targets: torch.Tensor) -> torch.Tensor:
        logits = self.logits(outputs)
        if self.num_classes is None:
            self.num_classes = logits.shape[1]
        return self.confusion(logits.argmax(dim=1), targets).flatten().double()

    def num_counts(self) -> int:
        if self.num_classes is None:
            raise ValueError("Segmentation: the number of classes is unknown: pass num_classes or call num_outputs")
        return self.num_classes ** 2  # the confusion matrix, flattened

    def figures_of(self, counts: Sequence[float], samples: int) -> dict[str, float]:
        return scores(np.asarray(counts, dtype=np.float64).reshape(self.num_classes, self.num_classes))


def scores(confusion: np.ndarray) -> dict[str, float]:
    """mIoU and pixel accuracy of a confusion matrix (rows true, columns predicted). A class absent from both the
    targets and the predictions has no IoU and is left out of the mean; no scored pixel at all gives 0."""
    hits = np.diag(confusion)
    union = confusion.sum(axis=0) + confusion.sum(axis=1) - hits
    present = union > 0
    total = confusion.sum()
    return {"val_miou": float((hits[present] / union[present]).mean()) if present.any() else 0.0,
            "val_pixel_acc": float(hits.sum() / total) if total else 0.0}
