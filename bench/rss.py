#!/usr/bin/env python3
"""Worker memory over an epoch: peak USS growth of each DataLoader worker from its first batch (target <= 5 %).

USS counts the pages a worker holds alone: what copy-on-read refcount writes to a Python list make private.

Metadata in numpy arrays (the kit) against the same dataset with its paths in a Python list (the copy-on-read
pattern of pytorch/pytorch#13246), both through real workers over the embedded dataset's three epochs.
"""

from __future__ import annotations

from common import host_batches, machine, pipeline, report, workers_uss_mb


class ListPaths:
    """The kit's ImageFolder with its paths moved into a Python list of str objects (for contrast)."""

    def __init__(self, dataset):
        self.dataset, self.paths = dataset, [p.decode() for p in dataset.paths]

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        _ = [len(p) for p in self.paths[::16]]  # touch the list, as code that reads metadata does
        return self.dataset[index]


def growth(list_paths: bool) -> float:
    data = pipeline("data.num_workers=2", "data.persistent_workers=true", "trainer.epochs=3", "data.batch_size=32")
    seeded = data.train.loader.dataset
    if list_paths:
        seeded.dataset = ListPaths(seeded.dataset)
    start: dict[int, float] = {}
    peak: dict[int, float] = {}
    for index, _ in enumerate(host_batches(data)):
        uss = workers_uss_mb()
        for pid, mb in uss.items():
            start.setdefault(pid, mb) if index >= 2 else None
            peak[pid] = max(peak.get(pid, 0.0), mb)
    return max((peak[pid] - start[pid]) / start[pid] for pid in start)


if __name__ == "__main__":
    ours, lists = growth(False), growth(True)
    report("worker peak USS growth", 100 * ours, "<= 5 %", ours <= 0.05,
           f"numpy metadata {100 * ours:.1f} %, a Python list of paths {100 * lists:.1f} %; 2 workers, 3 epochs; "
           f"{machine()}")
