"""What a task is: everything the loop, the step and the data checks ask of "what is being learned", in one object
(composer's `ComposerModel.loss` / `update_metric`, torchtitan's loss and validator components).

The loop hands a task the model's outputs and the batch's targets (`batch.targets`: whatever the source's samples
give as target, stacked) and never looks inside either: the task computes the loss, the per-batch evaluation sums
(one float64 device tensor of a width the task knows; evaluation adds them over the epoch and all-reduces them once
per validation), the figures those sums give, and which figure picks best.pt. A task of your own subclasses `Task`
in one file and is named by one YAML in conf/task/ (`_target_`); examples/counting shows one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from loadout.errors import ConfigError


class Task:
    """The defaults here fit most tasks; a subclass sets `figures`, `best`, `source_needs`, `target_doc` and
    implements `loss`, `eval_counts`, `num_counts` and `figures_of`."""

    figures: Sequence = ()  # observe/metrics.py Metric rows of the figures `figures_of` returns (besides val_loss)
    best: tuple[str, str] = ("val_loss", "min")  # the figure best.pt follows, and max | min
    source_needs: Mapping[str, str] = {}  # attributes every split must have, the same on both: name -> what it is
    target_name: str = "target"  # what dataset[i][1] is called in an error
    target_doc: str = "a target"  # what it must be, as an error says it
    mask_targets: bool = False  # targets are uint8 (H, W) masks of their images' size: the loader's ring holds them

    def check_target(self, target: Any) -> None:
        """Raise TypeError or ValueError when a sample's target is not what this task trains on."""

    def num_outputs(self, source) -> int:
        """The model's output size (its `num_classes` argument) for this task on the training `source`."""
        classes = getattr(source, "classes", None)
        if classes is None:
            raise ConfigError(f"task._target_={type(self).__module__}.{type(self).__name__}: define num_outputs "
                              "(the model's output size): the source has no `classes`")
        return len(classes)

    def batch_mix(self, recipe, source, seed: int):
        """A callable (images, targets, epoch, batch) -> (images, targets) mixing whole batches on the device, or
        None. MixUp/CutMix mix class labels: a task without them refuses the recipe's alphas in one line."""
        if getattr(recipe, "mixup_alpha", 0) or getattr(recipe, "cutmix_alpha", 0):
            raise ConfigError(f"augment.mixup_alpha / augment.cutmix_alpha: MixUp and CutMix mix class labels, "
                              f"which {type(self).__name__} does not train on: set both to 0")
        return None

    @staticmethod
    def logits(outputs: Any) -> torch.Tensor:
        """The model's prediction tensor: torchvision's segmentation models return {"out": ..., "aux": ...}."""
        return outputs["out"] if isinstance(outputs, Mapping) else outputs

    def loss(self, outputs: Any, targets: torch.Tensor) -> torch.Tensor:
        """The mean loss of a (non-empty) slice of a batch, a scalar tensor."""
        raise NotImplementedError

    @staticmethod
    def zero_loss(outputs: Any) -> torch.Tensor:
        """A zero loss whose backward still reaches every output (a batch with no readable sample under DDP: every
        gradient is all-reduced all the same)."""
        tensors = outputs.values() if isinstance(outputs, Mapping) else (outputs,)
        return sum(t.float().sum() for t in tensors) * 0.0

    def eval_counts(self, outputs: Any, targets: torch.Tensor) -> torch.Tensor:
        """What evaluation sums over a validation slice besides the loss: a 1-D float64 tensor on the device."""
        raise NotImplementedError

    def num_counts(self) -> int:
        """How many numbers `eval_counts` returns (known once `num_outputs` has run): a rank with no validation
        sample joins the one reduction with that many zeros."""
        raise NotImplementedError

    def eval_sums(self, outputs: Any, targets: torch.Tensor) -> torch.Tensor:
        """(summed loss, *eval_counts) over one slice, one float64 device tensor evaluation adds up without a sync."""
        loss = self.loss(outputs, targets).detach().double() * targets.shape[0]
        return torch.cat([loss.reshape(1), self.eval_counts(outputs, targets).double()])

    def figures_of(self, counts: Sequence[float], samples: int) -> dict[str, float]:
        """The task's figures from `eval_counts` summed over every rank and batch, and the samples counted."""
        raise NotImplementedError

    def evaluation(self, sums: Sequence[float], samples: int) -> dict[str, float]:
        """val_loss and the task's figures from `eval_sums` summed over every rank and batch; zeros when no rank
        had a readable validation sample (every count is 0)."""
        if not samples:
            return {"val_loss": 0.0, **{metric.key: 0.0 for metric in self.figures}}
        return {"val_loss": sums[0] / samples, **self.figures_of(sums[1:], samples)}

    def better(self, value: float, best: float | None) -> bool:
        """Whether `value` of the `best` figure beats the best so far (None: none yet)."""
        if best is None:
            return value == value  # a NaN figure never becomes the best
        return value > best if self.best[1] == "max" else value < best
