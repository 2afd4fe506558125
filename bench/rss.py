#!/usr/bin/env python3
"""Worker memory over an epoch: peak RSS growth of each DataLoader worker from its first batch (target <= 5 %), and
beside it the growth of its USS (the pages it holds alone, which copy-on-read makes private) in MiB.

Metadata in numpy arrays (loadout) against the same dataset with its paths in a Python list (the copy-on-read
pattern of pytorch/pytorch#13246), both through real workers over the embedded dataset's three epochs.
"""

from __future__ import annotations

from common import host_batches, machine, pipeline, report

from loadout.errors import MIB
from loadout.observe.memory import worker_memory


class ListPaths:
    """loadout's ImageFolder with its paths moved into a Python list of str objects (for contrast)."""

    def __init__(self, dataset):
        self.dataset, self.paths = dataset, [p.decode() for p in dataset.paths]

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        _ = [len(p) for p in self.paths[::16]]  # touch the list, as code that reads metadata does
        return self.dataset[index]


def growth(list_paths: bool) -> tuple[float, float]:
    """(largest relative RSS growth of a worker, largest USS growth of a worker in MiB)."""
    data = pipeline("data.num_workers=2", "data.persistent_workers=true", "trainer.epochs=3", "data.batch_size=32")
    samples = data.samples[0]
    if list_paths:
        samples.source = ListPaths(samples.source)
    start: dict[int, tuple[int, int]] = {}
    peak: dict[int, tuple[int, int]] = {}
    for index, _ in enumerate(host_batches(data)):
        for pid, memory in worker_memory().items():
            if index >= 2:
                start.setdefault(pid, (memory.rss, memory.uss))
            rss, uss = peak.get(pid, (0, 0))
            peak[pid] = (max(rss, memory.rss), max(uss, memory.uss))
    rss = max((peak[pid][0] - start[pid][0]) / start[pid][0] for pid in start)
    uss = max(peak[pid][1] - start[pid][1] for pid in start) / MIB
    return rss, uss


if __name__ == "__main__":
    (ours, ours_uss), (lists, lists_uss) = growth(False), growth(True)
    report("worker peak RSS growth", 100 * ours, "<= 5 %", ours <= 0.05,
           f"numpy metadata {100 * ours:.1f} % (USS +{ours_uss:.1f} MiB), a Python list of paths {100 * lists:.1f} % "
           f"(USS +{lists_uss:.1f} MiB); 2 workers, 3 epochs; {machine()}")
