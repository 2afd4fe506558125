"""torchvision classifier factory (+ channels_last, torch.compile). Weights are never downloaded."""

from __future__ import annotations

import torch
import torchvision

from train.config import ConfigError


def build_model(name: str, num_classes: int, device: torch.device, *, channels_last: bool = False) -> torch.nn.Module:
    try:
        model = torchvision.models.get_model(name, weights=None, num_classes=num_classes)
    except ValueError as err:
        raise ConfigError(f"model.name={name!r}: not a torchvision model ({err}); e.g. resnet18, resnet50, "
                          "mobilenet_v3_small") from err
    model = model.to(device)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    return model
