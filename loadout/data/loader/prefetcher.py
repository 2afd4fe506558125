"""Device prefetcher: the next batch copied to the device on a side CUDA stream while the current one computes.

Batches arrive as uint8 (pinned by the loader when data.pin_memory=true), NHWC in memory when the images were
(decoded JPEGs); the copy is non_blocking on a side stream, then the layout the model wants (trainer.channels_last),
the float conversion and Normalize run on the device. On CPU the same code runs without streams, and beside
DataLoader workers on one torch thread: its parallel regions would wait for cores the workers hold. Modelled on
timm's PrefetchLoader, and like it applied alike to the training and the validation loader.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import nullcontext

import torch

from loadout.data.loader.batch import Batch
from loadout.data.loader.stages import COPY, MainStages
from loadout.data.loader.workers import one_torch_thread
from loadout.data.transforms import DeviceNormalize


class DevicePrefetcher:
    """Yields each Batch of `loader` with images and targets on `device`, float and normalized, one batch ahead
    on CUDA. The indices stay on the host and the position rides along, so a batch's loader state reaches the loop
    with that batch, whatever this prefetcher has drawn ahead.

    `beside_workers`: the loader's worker processes hold the cores, so on CPU each batch is converted on one torch
    thread (the model keeps its threads). `decoder` (data.decode=device): decodes a batch of encoded files on the
    device first (encoded.DeviceDecoder), on the same side stream."""

    def __init__(self, loader: Iterable, device: torch.device, *, normalize: bool, channels_last: bool,
                 non_blocking: bool = True, beside_workers: bool = False, decoder: Callable | None = None):
        self.loader, self.decoder = loader, decoder
        self.device = device
        self.one_thread = beside_workers and device.type == "cpu"
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format
        self.non_blocking = non_blocking and device.type == "cuda"
        self.normalizer = DeviceNormalize(device) if normalize else None
        self.stages: MainStages | None = None  # set by the TrainStream: the copy's time goes there (stages.py)

    def __len__(self) -> int:
        return len(self.loader)

    def _to_device(self, batch: Batch) -> Batch:
        if batch.encoded is not None:
            batch = self._decoded(batch)
        images = batch.images.to(self.device, non_blocking=self.non_blocking)
        targets = batch.targets.to(self.device, non_blocking=self.non_blocking)
        if images.dim() == 4:  # the loader's batches come in the images' own layout (channels_last for JPEGs)
            images = images.contiguous(memory_format=self.memory_format)
        if self.normalizer is not None and images.numel():
            images = self.normalizer(images)
        return dataclasses.replace(batch, images=images, targets=targets)

    def _decoded(self, batch: Batch) -> Batch:
        """An encoded batch decoded on the device; a file no decoder could read is dropped and counted as bad."""
        images, fallbacks, unreadable = self.decoder(batch.encoded)
        targets, indices = batch.targets, batch.indices
        if unreadable:
            keep = torch.ones(len(targets), dtype=torch.bool)
            keep[unreadable] = False
            targets, indices = targets[keep], None if indices is None else indices[keep]
        return dataclasses.replace(batch, images=images, targets=targets, indices=indices, encoded=None,
                                   bad=batch.bad + len(unreadable), decode_fallbacks=fallbacks)

    def __iter__(self) -> Iterator[Batch]:
        if self.device.type != "cuda":
            for batch in self.loader:
                start = time.perf_counter_ns()
                with one_torch_thread() if self.one_thread else nullcontext():
                    ready = self._to_device(batch)
                if self.stages is not None:
                    self.stages.add(COPY, time.perf_counter_ns() - start)
                yield ready  # outside the one-thread block: the loop's model runs on all its threads
            return
        stream = torch.cuda.Stream(device=self.device)
        pending = None
        for batch in self.loader:
            with torch.cuda.stream(stream):
                timed = self.stages is not None
                if timed:
                    began, ended = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    began.record(stream)
                ready = self._to_device(batch)
                if timed:
                    ended.record(stream)
                    self.stages.add_events(began, ended)
            if pending is not None:
                yield pending
            torch.cuda.current_stream(self.device).wait_stream(stream)
            for tensor in (ready.images, ready.targets):
                tensor.record_stream(torch.cuda.current_stream(self.device))
            pending = ready
        if pending is not None:
            yield pending
