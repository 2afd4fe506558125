"""Memory, each page counted once: the training process, its DataLoader workers, /dev/shm and the GPU.

PSS (proportional set size) shares a page among the processes that map it, so the shared-memory batch ring, the
sample cache and a memory-mapped dataset count once for main + workers, where summed RSS counted them once per
worker. USS is what a process alone holds (what ending it frees). Reading PSS walks each process's page tables, so
it is sampled on a background thread, never in the step loop.
"""

from __future__ import annotations

import shutil
import threading
import time
import weakref
from dataclasses import dataclass, field

import psutil
import torch

from loadout.data.loader.shm import SHM_PATH


@dataclass
class ProcessMemory:
    """Bytes: resident, proportional (shared pages split among their sharers) and unique to the process."""

    rss: int
    pss: int
    uss: int

    @classmethod
    def of(cls, process: psutil.Process) -> ProcessMemory:
        try:
            info = process.memory_full_info()  # /proc/<pid>/smaps_rollup on Linux
            return cls(info.rss, getattr(info, "pss", info.rss), info.uss)
        except psutil.AccessDenied:
            rss = process.memory_info().rss
            return cls(rss, rss, rss)


@dataclass
class MemorySample:
    """This process, each DataLoader worker (child pid -> memory), /dev/shm, CUDA memory on the device."""

    main: ProcessMemory
    workers: dict[int, ProcessMemory]
    shm_used: int | None = None
    shm_total: int | None = None
    gpu_allocated: int | None = None
    gpu_peak: int | None = None
    gpu_reserved: int | None = None
    gpu_util: float | None = None  # percent of the last sample period a kernel ran (NVML), None without NVML
    taken: float = field(default_factory=time.perf_counter)  # the clock EpochMeter times with

    @property
    def total_pss(self) -> int:
        """Main + workers, each page once."""
        return self.main.pss + sum(worker.pss for worker in self.workers.values())


def gpu_utilization(device: torch.device) -> float | None:
    """NVML's utilisation of `device` (percent), through torch (which maps CUDA_VISIBLE_DEVICES to NVML's indices);
    None where NVML (nvidia-ml-py, the driver's libnvidia-ml) is missing."""
    try:
        return float(torch.cuda.utilization(device))
    except Exception:  # ModuleNotFoundError without nvidia-ml-py, NVML's own errors without its library
        return None


def worker_memory() -> dict[int, ProcessMemory]:
    """Each child process (the DataLoader workers), by pid; children that just exited are left out."""
    memory = {}
    for child in psutil.Process().children(recursive=True):
        try:
            memory[child.pid] = ProcessMemory.of(child)
        except psutil.NoSuchProcess:
            continue
    return memory


def shm_used_bytes() -> int | None:
    try:
        return shutil.disk_usage(SHM_PATH).used
    except OSError:  # no /dev/shm (macOS, Windows)
        return None


@dataclass
class MemorySampler:
    """Samples memory on demand, or every `interval_s` on a thread of its own (`start`), and keeps the peaks: main +
    workers PSS (overall, and since the last `take_peak`), and /dev/shm use above `shm_base`."""

    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    peak_pss: int = 0
    peak_shm: int = 0
    shm_base: int = field(default_factory=lambda: shm_used_bytes() or 0)
    latest: MemorySample | None = None
    _window_peak: int = 0
    _util_sum: float = 0.0
    _util_count: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self, interval_s: float) -> MemorySampler:
        """Sample every `interval_s` until `stop()` or until nothing refers to this sampler any more (a daemon
        thread holding only a weak reference: it never keeps a process or a finished run's sampler alive)."""
        ref, stop = weakref.ref(self), self._stop

        def run() -> None:
            while not stop.wait(interval_s):
                sampler = ref()
                if sampler is None:
                    return
                sampler.sample()
                del sampler

        if self._thread is None:
            self._thread = threading.Thread(target=run, daemon=True, name="memory-sampler")
            self._thread.start()
        return self

    def stop(self) -> None:
        """End the thread, with a last sample."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.sample()

    def take_peak(self) -> int:
        """Peak main + workers PSS since the last call (bytes); sampled now if nothing was since."""
        if self._window_peak == 0:
            self.sample()
        peak, self._window_peak = self._window_peak, 0
        return peak

    def take_gpu_util(self) -> float | None:
        """Mean GPU utilisation (percent) over the samples since the last call; None without samples or NVML."""
        if self._util_count == 0:
            return None
        mean, self._util_sum, self._util_count = self._util_sum / self._util_count, 0.0, 0
        return mean

    def sample(self) -> MemorySample:
        sample = MemorySample(main=ProcessMemory.of(psutil.Process()), workers=worker_memory())
        try:
            shm = shutil.disk_usage(SHM_PATH)
            sample.shm_used, sample.shm_total = shm.used, shm.total
            self.peak_shm = max(self.peak_shm, shm.used - self.shm_base)
        except OSError:
            pass
        if self.device.type == "cuda":
            sample.gpu_allocated = torch.cuda.memory_allocated(self.device)
            sample.gpu_peak = torch.cuda.max_memory_allocated(self.device)
            sample.gpu_reserved = torch.cuda.memory_reserved(self.device)
            sample.gpu_util = gpu_utilization(self.device)
            if sample.gpu_util is not None:
                self._util_sum, self._util_count = self._util_sum + sample.gpu_util, self._util_count + 1
        self.peak_pss = max(self.peak_pss, sample.total_pss)
        self._window_peak = max(self._window_peak, sample.total_pss)
        self.latest = sample
        return sample
