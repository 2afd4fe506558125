"""trainer.micro_batch_size: the slice of the optimizer's batch one forward/backward runs, and running out of memory.

Out of memory is more than torch.OutOfMemoryError: cuDNN and cuBLAS allocate their workspaces outside PyTorch's
caching allocator and report a failed allocation as a plain RuntimeError, so those messages count too (as Lightning's
`is_oom_error` counts them): cuDNN 9's CUDNN_STATUS_INTERNAL_ERROR_{HOST,DEVICE}_ALLOCATION_FAILED (cuDNN 8's
CUDNN_STATUS_ALLOC_FAILED is gone from its messages), cuBLAS's CUBLAS_STATUS_ALLOC_FAILED. torch's cuDNN convolution
skips every plan whose workspace does not fit and then says it was "unable to find an engine"; a broken cuDNN says
the same, so that counts only with the GPU nearly full.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from loadout.errors import OutOfDeviceMemory

log = logging.getLogger(__name__)

OUT_OF_MEMORY_TEXTS = ("CUDA out of memory", "CUDA error: out of memory",
                       "CUDNN_STATUS_INTERNAL_ERROR_HOST_ALLOCATION_FAILED",
                       "CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED", "CUDNN_STATUS_ALLOC_FAILED",
                       "CUBLAS_STATUS_ALLOC_FAILED")
NO_ENGINE_TEXT = "unable to find an engine to execute this computation"  # FIND / GET (cudnn.benchmark or not)
NEARLY_FULL = 0.1  # the share of the GPU's memory free (or cached, unused) under which no engine means no memory


def is_out_of_memory(err: BaseException) -> bool:
    """torch's own out-of-memory error, a CUDA library's failed allocation, or cuDNN finding no engine whose
    workspace fits on a nearly full GPU."""
    if isinstance(err, torch.OutOfMemoryError):
        return True
    if not isinstance(err, RuntimeError):
        return False
    text = str(err)
    return any(marker in text for marker in OUT_OF_MEMORY_TEXTS) or (NO_ENGINE_TEXT in text and gpu_nearly_full())


def gpu_nearly_full() -> bool:
    """Under NEARLY_FULL of the current GPU's memory free, counting what torch's allocator holds unused as free."""
    if not torch.cuda.is_available():
        return False
    free, total = torch.cuda.mem_get_info()
    unused = torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
    return free + unused < NEARLY_FULL * total


class OutOfMemory(OutOfDeviceMemory):
    """The run ran out of device memory and could not go on: in a step with no smaller micro-batch or mid gradient
    sync, or `during` another stage (evaluation, a batch's way onto the device), where micro-batches do not shrink."""

    def __init__(self, device: torch.device, batch_size: int, micro_batch_size: int, auto: bool, during: str = ""):
        self.device, self.batch_size, self.micro_batch_size = device, batch_size, micro_batch_size
        if device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(device) / 2**30
            reserved = torch.cuda.memory_reserved(device) / 2**30
            total = torch.cuda.get_device_properties(device).total_memory / 2**30
            memory = f"peak {peak:.1f} GiB allocated, {reserved:.1f} GiB reserved of {total:.1f} GiB on {device}"
        else:
            memory = f"on {device}"
        fix = ("lower data.batch_size (per GPU) or the model's size" if auto and (micro_batch_size == 1 or during)
               else "set trainer.micro_batch_size=auto (the same optimizer batch, run in slices that fit) or lower "
               "data.batch_size")
        super().__init__(f"out of memory{during}: data.batch_size={batch_size}, micro-batch {micro_batch_size}, "
                         f"{memory}; {fix}")


class MicroBatch:
    """trainer.micro_batch_size as a Stateful part: the slice size reached goes into the checkpoint, so a resumed
    run starts at the size that fit. `smallest`: 2 for a model with BatchNorm, which cannot train on one sample."""

    def __init__(self, setting: int | str | None, batch_size: int, smallest: int = 1):
        self.auto = setting == "auto"
        self.batch_size, self.smallest = batch_size, min(smallest, batch_size)
        self.size = batch_size if setting in (None, "auto") else min(int(setting), batch_size)
        if self.size < self.smallest:
            log.info("trainer.micro_batch_size=%s: slices of %d samples (BatchNorm cannot train on one)", setting,
                     self.smallest)
            self.size = self.smallest

    def halve(self) -> bool:
        """Halve the slice for the next try; False when it is the smallest already."""
        if self.size <= self.smallest:
            return False
        self.size = max(self.smallest, self.size // 2)
        return True

    def agree(self, size: int) -> None:
        """The smallest slice any rank reached (the loop's control all-reduce)."""
        if 1 <= size < self.size:
            log.info("trainer.micro_batch_size=auto: %d samples per slice (another rank ran out of memory)", size)
            self.size = size

    def recover(self, device: torch.device, batch_size: int, optimizer: torch.optim.Optimizer, mid_sync: bool) -> None:
        """After a step ran out of memory: with auto free the step's state and halve the slice, so the caller runs the
        batch again; otherwise (or `mid_sync`, where other ranks already wait in the gradient all-reduce) raise
        `OutOfMemory`, one line with the sizes and the fix. The gradients so far are dropped: with
        trainer.grad_accum_steps > 1 the window's earlier batches do not count in its update (the window is not
        restarted, so every rank's stays in step)."""
        if not self.auto or mid_sync or not self.halve():
            raise OutOfMemory(device, batch_size, self.size, self.auto) from None
        optimizer.zero_grad(set_to_none=True)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        log.warning("out of memory with micro-batches of %d: trying %d (trainer.micro_batch_size=auto)",
                    self.size * 2, self.size)

    def state_dict(self) -> dict:
        return {"size": self.size}

    def load_state_dict(self, state: dict) -> None:
        if self.auto and state.get("size"):
            self.size = max(self.smallest, min(int(state["size"]), self.batch_size))


@contextmanager
def said_in_one_line(micro: MicroBatch, device: torch.device, during: str) -> Iterator[None]:
    """Out of memory `during` (" in evaluation") becomes `OutOfMemory`: a step's one line and exit status."""
    try:
        yield
    except RuntimeError as err:
        if not is_out_of_memory(err):
            raise
        raise OutOfMemory(device, micro.batch_size, micro.size, micro.auto, during) from err
