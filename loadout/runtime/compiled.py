"""trainer.compile: the model through torch.compile with static shapes, one graph for training and one for
evaluation at the micro-batch size (shorter slices run eager: train/loop/step.py).

When trainer.micro_batch_size=auto halves the slice (or the ranks agree on a smaller one), the graphs of the old size
are dropped (`torch.compiler.reset`) before the new size compiles: Dynamo keeps at most `recompile_limit` (8) graphs
per frame and past it runs that frame eager for the rest of the run (one warning in the log), which a run halving
256 -> 4 would reach.

compile_mode=reduce-overhead and max-autotune add CUDA graphs, which cudagraph trees skip for a graph that mutates
its inputs: BatchNorm's running statistics in training do, so ResNet-type models train without them. max-autotune
also autotunes for minutes on the first step, which under DDP must end within trainer.dist_timeout_s.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)


class CompiledModel:
    """`module` compiled with trainer.compile_mode; called only with full micro-batches."""

    def __init__(self, module: torch.nn.Module, mode: str):
        self.module = torch.compile(module, mode=None if mode == "default" else mode, dynamic=False)
        self.size: int | None = None  # the micro-batch size the graphs were compiled for

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        size = images.shape[0]
        if size != self.size:
            if self.size is not None:
                torch.compiler.reset()
                log.info("trainer.compile: micro-batches of %d now (were %d): the model compiles again", size,
                         self.size)
            self.size = size
        return self.module(images)
