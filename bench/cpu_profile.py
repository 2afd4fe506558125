#!/usr/bin/env python3
"""The cpu profile's precision and layout against plain fp32 channels_first: ResNet-18 training steps (forward,
backward, SGD) on the same real batch, at the cpu profile's 64 px and at 224 px, measured in the same rounds.

The profile takes channels_last and, where the CPU has native bf16 (avx512_bf16 or AMX), bf16 autocast for
ResNet-18 (make tune measures bf16 against fp32 on the model: loadout/tune/cpu_precision.py; ResNet-18
keeps bf16); on other CPUs it is fp32 channels_last. Target: new / old >= 1.1 at
64 px on a CPU with native bf16 (reported for reference elsewhere).
"""

from __future__ import annotations

import time

import torch
from common import interleaved_samples, machine, pipeline, report, spread

from loadout.runtime import precision
from train.loop.model import torchvision_model

BATCH, STEPS, ROUNDS, TARGET = 32, 6, 3, 1.1


def step_rate(images: torch.Tensor, targets: torch.Tensor, channels_last: bool, bf16: bool) -> float:
    """Images/s of STEPS training steps after one warm-up step, on a fresh model in this layout and precision."""
    torch.manual_seed(0)
    memory_format = torch.channels_last if channels_last else torch.contiguous_format
    model = torchvision_model("resnet18", 10).to(memory_format=memory_format)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    images = images.contiguous(memory_format=memory_format)
    autocast = precision.autocast(torch.device("cpu"), "bf16" if bf16 else "fp32")
    for step in range(STEPS + 1):
        if step == 1:
            start = time.perf_counter()
        with autocast:
            loss = torch.nn.functional.cross_entropy(model(images), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return STEPS * images.shape[0] / (time.perf_counter() - start)


def one_batch(image_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A real normalized batch from the embedded dataset, as the loop receives it."""
    with pipeline("data.num_workers=0", "data.persistent_workers=false", f"data.batch_size={BATCH}",
                  f"data.image_size={image_size}") as data:
        data.set_epoch(0)
        batch = next(iter(data.train))
        images, targets = batch.images, batch.targets
    return images.float(), targets


if __name__ == "__main__":
    bf16 = precision.resolve("auto", torch.device("cpu")) == "bf16"
    flags = [flag for flag in precision.NATIVE_BF16_FLAGS if flag in precision.cpu_flags()]
    profile = f"channels_last + {'bf16' if bf16 else 'fp32'}"
    for image_size in (64, 224):
        batch = one_batch(image_size)
        new, old = interleaved_samples(lambda batch=batch: step_rate(*batch, True, bf16),
                                       lambda batch=batch: step_rate(*batch, False, False), ROUNDS)
        ratio = max(new) / max(old)
        detail = (f"{max(new):.0f} vs {max(old):.0f} img/s (new {spread(new)}, old {spread(old)}); ResNet-18, batch "
                  f"{BATCH}; native bf16 flags: {', '.join(flags) or 'none'}; {machine()}")
        name = f"cpu profile ({profile}) / fp32 channels_first, {image_size} px"
        if image_size == 64 and bf16:
            report(name, ratio, f">= {TARGET:g}", ratio >= TARGET, detail)
        else:
            print(f"{name}: {ratio:.2f} (reference) [{detail}]")
