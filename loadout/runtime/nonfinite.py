"""Divergence: non-finite losses noticed without syncing the host every step, and the error that stops the run."""

from __future__ import annotations

import torch

SCALE_FLOOR = 1.0  # fp16: a loss scale shrunk below this means the gradients overflow unscaled: divergence


class NonFiniteWatch:
    """Whether every loss since the start was finite, known on the host without waiting for the device: each
    `poll` starts a copy of the device flag to the host and returns the answer of an earlier copy once it has landed
    (a CUDA event, queried, never waited on); `confirm` waits (at a checkpoint, where a sync is due anyway)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.finite = torch.ones((), dtype=torch.bool, device=device)
        self.last_finite_loss = torch.full((), float("nan"), device=device)
        self._copy: tuple[torch.Tensor, torch.cuda.Event | None] | None = None

    def note(self, loss: torch.Tensor, flag: bool = True) -> None:
        """Keep the last finite loss (for the divergence line); with `flag`, a non-finite one marks the run."""
        finite = torch.isfinite(loss)
        if flag:
            self.finite &= finite
        self.last_finite_loss = torch.where(finite, loss.detach().float(), self.last_finite_loss)

    def poll(self) -> bool:
        """False once a non-finite loss is known on the host (maybe a step or two after it happened)."""
        known = True
        if self._copy is not None:
            host, event = self._copy
            if event is not None and not event.query():
                return True  # the earlier copy has not landed: ask again at the next step
            known = bool(host)
        cuda = self.device.type == "cuda"
        host = torch.empty((), dtype=torch.bool, pin_memory=cuda)
        host.copy_(self.finite, non_blocking=cuda)
        event = torch.cuda.Event() if cuda else None
        if event is not None:
            event.record()
        self._copy = (host, event)
        return known

    def confirm(self, model: torch.nn.Module) -> bool:
        """Every loss so far finite, and every weight and buffer (BatchNorm's statistics) finite now. Waits for the
        device: at a checkpoint, where a sync is due anyway. An update can make the weights non-finite a step before
        any loss shows it."""
        weights = torch.stack([t.isfinite().all() for t in model.state_dict().values() if t.is_floating_point()])
        return bool(self.finite & weights.all())
