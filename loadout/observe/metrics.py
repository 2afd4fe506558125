"""What a run measures, defined once: the names of every figure, data wait, throughput. The Trainer, the monitoring
sinks, tune and bench all read these.

The vocabulary (`WINDOW`, `TOTALS`, `EPOCH`, `MEMORY`) is where a figure gets its names: its key in metrics.jsonl
and in TensorBoard (`<section>/<key>`), its Prometheus name, and its place in the epoch's log line. The task's own
evaluation figures (train/task/) join `EPOCH` after val_loss when the task is built (`use_task_figures`), before any
sink reads it; the vocabulary itself knows no task.

The meter that measures them is loadout/observe/meter.py.

Memory is loadout/observe/memory.py's: PSS, each page counted once, sampled off the step loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from loadout.errors import ConfigError
from loadout.observe.memory import MemorySampler


@dataclass(frozen=True)
class Metric:
    """One figure: `key` (metrics.jsonl, TensorBoard `<section>/<key>`), `doc`, `prometheus` (its name on /metrics,
    in base units; None: not exported) and `shown` (its format in the epoch log line; None: not shown)."""

    key: str
    doc: str
    prometheus: str | None = None
    shown: str | None = None
    shown_when_zero: bool = True


def _table(*metrics: Metric) -> dict[str, Metric]:
    return {metric.key: metric for metric in metrics}


# A window of steps, flushed every few seconds: TensorBoard `train/<key>`, Prometheus gauges.
WINDOW = _table(
    Metric("step", "Optimizer steps taken", "loadout_step"),
    Metric("loss", "Training loss over the last window", "loadout_train_loss"),
    Metric("images_per_s", "Training images/s over the last window", "loadout_images_per_second"),
    Metric("data_wait_frac", "Share of the last window spent waiting for data", "loadout_data_wait_ratio"),
    Metric("first_batch_s", "Latency of this epoch's first batch", "loadout_first_batch_seconds"),
    Metric("lr", "Learning rate after the last step", "loadout_learning_rate"),
    Metric("grad_norm", "Mean total gradient norm of the window's optimizer steps (before clipping)",
           "loadout_grad_norm"),
)
# Running totals: Prometheus counters (rate() gives throughput and data wait over any range).
TOTALS = _table(
    Metric("images", "Training images processed", "loadout_images"),
    Metric("data_wait_s", "Seconds the training loop waited for data", "loadout_data_wait_seconds"),
    Metric("elapsed_s", "Seconds spent in the training loop", "loadout_train_seconds"),
    Metric("bad_samples", "Samples skipped as unreadable", "loadout_bad_samples"),
)
# One row of metrics.jsonl an epoch: TensorBoard `epoch/<key>`, the log line, a few Prometheus gauges.
EPOCH = _table(
    Metric("epoch", "Epochs completed", "loadout_epoch"),
    Metric("train_loss", "Mean training loss of the epoch", shown="train_loss {:.4f}"),
    Metric("val_loss", "Validation loss after the epoch", "loadout_val_loss", "val_loss {:.4f}"),
    Metric("val_samples", "Validation samples counted (each once over all ranks)"),
    Metric("lr", "Learning rate the epoch's last optimizer step used", shown="lr {:.3g}"),
    Metric("grad_norm", "Mean total gradient norm of the epoch's optimizer steps (before clipping)",
           shown="grad_norm {:.3g}"),
    Metric("images_per_s", "Training images/s over the epoch, all ranks", shown="{:.0f} img/s"),
    Metric("data_wait_frac", "Share of the epoch spent waiting for data (slowest rank)", shown="data_wait {:.1%}"),
    Metric("first_batch_s", "Latency of the epoch's first batch", shown="first_batch {:.2f}s"),
    Metric("epoch_s", "Wall time of the epoch's training", shown="epoch {:.1f}s"),
    Metric("peak_pss_mb", "Peak PSS of main + workers (MiB)", shown="peak_pss {:.0f} MiB"),
    Metric("gpu_peak_mb", "Peak CUDA memory in tensors (MiB)", shown="gpu_peak {:.0f} MiB"),
    Metric("gpu_reserved_mb", "Peak CUDA memory held by the allocator (MiB)", shown="gpu_reserved {:.0f} MiB"),
    Metric("gpu_util", "Mean share of time a kernel ran (NVML)", shown="gpu_util {:.0%}"),
    Metric("bad_samples", "Samples skipped as unreadable", shown="bad_samples {}", shown_when_zero=False),
    Metric("decode_fallbacks", "Files the device decoder refused, decoded on the CPU (data.decode=device)",
           shown="decode_fallbacks {}", shown_when_zero=False),
    Metric("skipped_steps", "Optimizer steps skipped (non-finite gradients)", shown="skipped_steps {}",
           shown_when_zero=False),
    Metric("images", "Training images in the epoch, all ranks"),
    # where a sample's time went (loadout/observe/doctor.py; this rank's): each stage's share of a sample's time
    *(Metric(f"{stage}_share", f"Share of a sample's time in {doc} (rank 0)", f"loadout_stage_{stage}_ratio")
      for stage, doc in (("read", "reading or fetching it"), ("decode", "decoding"),
                         ("augment", "the per-sample augmentation"), ("collate", "the workers' collate"),
                         ("handoff", "the main process receiving its batch"),
                         ("copy", "the host-to-device copy"), ("wait", "the loop's wait for data"),
                         ("compute", "the loop's step"))),
    Metric("bound", "What bounded the epoch's pace (loadout/observe/doctor.py): compute, keeps up, read/fetch, decode, "
           "augment, hand-off or copy", shown="bound {}"),
    Metric("source_samples", "dataset=mix: the training samples each source gave in the epoch, all ranks "
           "({name: count})"),
    Metric("epoch_complete", "False when trainer.max_steps cut the epoch short"),
)
# Memory at a moment (bytes): TensorBoard `memory/<key>` at each window, Prometheus at each scrape.
MEMORY = _table(
    Metric("main_pss_bytes", "PSS of the training process", "loadout_main_pss_bytes"),
    Metric("main_uss_bytes", "USS of the training process", "loadout_main_uss_bytes"),
    Metric("workers_pss_bytes", "PSS of the DataLoader workers together"),
    Metric("workers_uss_bytes", "USS of the DataLoader workers together"),
    Metric("workers", "Live DataLoader worker processes", "loadout_workers"),
    Metric("peak_pss_bytes", "Peak PSS of main + workers", "loadout_peak_pss_bytes"),
    Metric("shm_used_bytes", "/dev/shm bytes in use", "loadout_shm_used_bytes"),
    Metric("shm_size_bytes", "/dev/shm size", "loadout_shm_size_bytes"),
    Metric("gpu_allocated_bytes", "CUDA memory in tensors", "loadout_gpu_memory_allocated_bytes"),
    Metric("gpu_peak_bytes", "Peak CUDA memory in tensors", "loadout_gpu_memory_peak_bytes"),
    Metric("gpu_reserved_bytes", "CUDA memory held by the caching allocator", "loadout_gpu_memory_reserved_bytes"),
    Metric("gpu_utilization_ratio", "Share of the last NVML sample period a kernel ran",
           "loadout_gpu_utilization_ratio"),
)
# Per worker (labelled by pid) on /metrics.
WORKER_MEMORY = _table(
    Metric("pss", "PSS of each DataLoader worker", "loadout_worker_pss_bytes"),
    Metric("uss", "USS of each DataLoader worker", "loadout_worker_uss_bytes"),
)


_task_keys: list[str] = []  # the figures the current task added to EPOCH


def use_task_figures(figures: Sequence[Metric]) -> None:
    """Put a task's evaluation figures into `EPOCH` right after val_loss (their place in the log line), in place of
    the previous task's: every sink that reads the vocabulary afterwards takes them as any other figure."""
    rows = [(key, metric) for key, metric in EPOCH.items() if key not in _task_keys]
    at = next(i for i, (key, _) in enumerate(rows) if key == "val_loss") + 1
    clash = [metric.key for metric in figures if metric.key in dict(rows)]
    if clash:
        raise ConfigError(f"task._target_: the task's figures {clash} are already loadout's own: name them otherwise")
    rows[at:at] = [(metric.key, metric) for metric in figures]
    EPOCH.clear()
    EPOCH.update(rows)
    _task_keys[:] = [metric.key for metric in figures]


def memory_figures(sampler: MemorySampler, sample) -> dict[str, float | None]:
    """`MEMORY`'s figures from one MemorySample (None where this machine has no such figure)."""
    workers = sample.workers.values()
    return {
        "main_pss_bytes": sample.main.pss, "main_uss_bytes": sample.main.uss,
        "workers_pss_bytes": sum(w.pss for w in workers), "workers_uss_bytes": sum(w.uss for w in workers),
        "workers": len(sample.workers), "peak_pss_bytes": sampler.peak_pss,
        "shm_used_bytes": sample.shm_used, "shm_size_bytes": sample.shm_total,
        "gpu_allocated_bytes": sample.gpu_allocated, "gpu_peak_bytes": sample.gpu_peak,
        "gpu_reserved_bytes": sample.gpu_reserved,
        "gpu_utilization_ratio": sample.gpu_util / 100 if sample.gpu_util is not None else None,
    }


def epoch_line(record: dict, epochs: int, max_steps: int | None = None) -> str:
    """The epoch's log line: each `EPOCH` figure with a format, in the table's order, those in `record`; an epoch
    that trainer.max_steps cut short says so, or its figures read as a whole epoch's."""
    shown = [metric.shown.format(record[key]) for key, metric in EPOCH.items() if metric.shown and key in record
             and (metric.shown_when_zero or record[key])]
    cut = ""
    if record.get("epoch_complete") is False:
        cut = f" (cut at max_steps={max_steps})" if max_steps else " (cut short by trainer.max_steps)"
    return f"epoch {record['epoch']}/{epochs}{cut}  " + "  ".join(shown)

