"""The model from the `model:` config group: any `_target_` that builds an nn.Module given `num_classes` (the
output size the task takes from the data: train/task/), optionally started from a state dict on disk
(model.weights), then moved to the device (+ channels_last). By name: torchvision's classifiers
(`torchvision_model`), torchvision's segmentation models (`torchvision_segmentation_model`), timm's (`timm_model`).
Weights are never downloaded."""

from __future__ import annotations

from pathlib import Path

import torch
import torchvision
from omegaconf import OmegaConf

from loadout.build import fitted_spec, instantiate, require_extra
from loadout.errors import ConfigError
from loadout.runtime.checkpoint import read_weights_only


def torchvision_model(name: str, num_classes: int) -> torch.nn.Module:
    if name in SEGMENTATION_MODELS:  # its backbone's ImageNet weights would be downloaded
        raise ConfigError(f"model.name={name!r}: a segmentation model; use model=segmentation model.name={name}")
    try:
        return torchvision.models.get_model(name, weights=None, num_classes=num_classes)
    except ValueError as err:
        raise ConfigError(f"model.name={name!r}: not a torchvision model ({err}); e.g. resnet18, resnet50, "
                          "mobilenet_v3_small") from err


SEGMENTATION_MODELS = frozenset(torchvision.models.list_models(module=torchvision.models.segmentation))


def torchvision_segmentation_model(name: str, num_classes: int, norm_momentum: float | None = None) -> torch.nn.Module:
    """model=segmentation: torchvision's segmentation models by name (fcn_resnet50, deeplabv3_mobilenet_v3_large,
    lraspp_mobilenet_v3_large, ...), untrained, backbone included; their forward returns {"out": logits}.
    `norm_momentum` (None: the model's own) is set on every BatchNorm: MobileNetV3's 0.01 is meant for ImageNet's
    long schedules; after a short run its running statistics are still mostly their initial (0, 1), and evaluation,
    which uses them, predicts one class everywhere (issue 45)."""
    if name not in SEGMENTATION_MODELS:
        raise ConfigError(f"model.name={name!r}: not a torchvision segmentation model; choose one of "
                          f"{', '.join(sorted(SEGMENTATION_MODELS))}")
    model = torchvision.models.get_model(name, weights=None, weights_backbone=None, num_classes=num_classes)
    if norm_momentum is not None:
        for module in model.modules():
            if isinstance(module, torch.nn.BatchNorm2d):
                module.momentum = norm_momentum
    return model


def timm_model(name: str, num_classes: int, **kwargs) -> torch.nn.Module:
    """model=timm: any of timm's models by name, untrained (pretrained=False: nothing is downloaded); other keys go
    to timm.create_model (`+model.drop_path_rate=0.1`)."""
    timm = require_extra("timm", "timm", "model=timm")
    if not timm.is_model(name):
        raise ConfigError(f"model.name={name!r}: not a timm model; list them with python -c \"import timm; "
                          f"print(timm.list_models('{name[:4]}*'))\" (e.g. resnet50, vit_small_patch16_224)")
    return timm.create_model(name, pretrained=False, num_classes=num_classes, **kwargs)


def build_model(model_cfg, num_classes: int, device: torch.device, *, channels_last: bool = False) -> torch.nn.Module:
    spec = OmegaConf.create(OmegaConf.to_container(model_cfg, resolve=True))
    weights = spec.pop("weights", None)
    spec = fitted_spec("model", spec, optional=("name", "norm_momentum"))
    model = instantiate("model", spec, num_classes=num_classes)
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"model._target_={spec._target_}: built a {type(model).__name__}, not a torch.nn.Module")
    if weights is not None:
        load_weights(model, Path(weights))
    model = model.to(device)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    return model


def load_weights(model: torch.nn.Module, path: Path) -> None:
    """model.weights: a state dict (or a loadout checkpoint, whose `model` entry is one) loaded strictly."""
    if not path.is_file():
        raise ConfigError(f"model.weights={str(path)!r}: no such file; point it at a saved state dict (.pt)")
    state = read_weights_only(path, "model.weights")
    if isinstance(state, dict) and "model" in state and "format" in state:
        state = state["model"]
    try:
        model.load_state_dict(state)
    except (RuntimeError, TypeError, AttributeError) as err:
        raise ConfigError(f"model.weights={str(path)!r}: does not fit this model ({str(err).splitlines()[0]})") \
            from err
