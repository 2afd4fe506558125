"""What runs inside DataLoader workers: per-worker seeds, deafness to the stop signals, one torch thread."""

from __future__ import annotations

import os
import random
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch
from torch.utils.data import get_worker_info


@contextmanager
def one_torch_thread() -> Iterator[None]:
    """Run the block on one torch intra-op thread, as a DataLoader worker runs (`torch.set_num_threads(1)`), then
    give the process its thread count back. For the main process's share of the data work: a parallel region's
    barrier waits for every thread, and with workers on the cores a thread waits for one."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def init_worker(worker_id: int) -> None:
    """worker_init_fn: the worker's own seeds, and deaf to the stop signals.

    The DataLoader sets each worker's torch seed to base_seed + worker_id, with base_seed drawn from the loader's
    generator (seeded per rank by seeds.loader_seed), so every (seed, rank, worker) gets its own augmentation stream;
    numpy and random get it here. Slurm signals every process of a job step and Ctrl-C the whole process group,
    workers included; a worker that died of it would be reported as failed while the main process stops cleanly
    and saves its checkpoint (loadout/runtime/stop.py). So workers ignore SIGINT and SIGUSR1, and take SIGTERM only from
    their parent, which is how DataLoader ends a worker that does not exit when asked.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the main process's stop handler, inherited by fork
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # threads started from here on inherit the mask
    threading.Thread(target=_die_on_sigterm_from, args=(os.getppid(),), daemon=True, name="sigterm").start()
    info = get_worker_info()
    seed = info.seed if info is not None else torch.initial_seed()
    np.random.seed(seed % 2**32)
    random.seed(seed)


def _die_on_sigterm_from(parent: int) -> None:
    """Wait for SIGTERMs; die of the first one `parent` sends, as if SIGTERM had never been blocked (the disposition
    is the default one; only this thread unblocks it, so the signal sent again lands here and ends the process)."""
    while signal.sigwaitinfo({signal.SIGTERM}).si_pid != parent:
        pass
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    os.kill(os.getpid(), signal.SIGTERM)
