"""The sweep's report: gather each job's result.json, then a terminal table, results.csv, results.json and a plot."""

from __future__ import annotations

import csv
import importlib.util
import json
import logging
import os
import platform
from collections import defaultdict
from pathlib import Path

import psutil
import torch

from loadout.data.loader.plan import usable_cores

log = logging.getLogger(__name__)

CSV_FIELDS = ("job", "status", "num_workers", "pin_memory", "persistent_workers", "prefetch_factor", "batch_size",
              "image_size", "images_per_s", "images_per_s_min", "images_per_s_max", "images_per_s_spread",
              "first_batch_s", "peak_pss_mb", "peak_shm_mb", "data_stall_frac", "duplicate_of", "overrides", "error")


def machine_info() -> dict:
    """What the numbers were measured on."""
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] \
        if torch.cuda.is_available() else []
    return {"host": platform.node(), "cpu": platform.processor() or platform.machine(),
            "usable_cores": usable_cores(), "logical_cores": os.cpu_count(),
            "memory_gib": round(psutil.virtual_memory().total / 2**30, 1), "gpus": gpus,
            "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version()}


def describe_machine(machine: dict) -> str:
    gpu = ", ".join(machine["gpus"]) or "no GPU"
    return (f"{machine['host']}: {machine['usable_cores']} usable cores, {machine['memory_gib']} GiB, {gpu}; "
            f"torch {machine['torch']}")


def gather(sweep_dir: Path) -> list[dict]:
    """Every job's result.json under sweep_dir, by job number; a duplicate carries its twin's numbers."""
    results = [json.loads(p.read_text()) for p in sweep_dir.glob("*/result.json")]
    results.sort(key=lambda r: r["job"])
    by_job = {r["job"]: r for r in results}
    for result in results:
        twin = by_job.get(result.get("duplicate_of"))
        if result["status"] == "duplicate" and twin is not None:
            measured = {k: v for k, v in twin.items() if k not in ("job", "overrides", "status", "notes")}
            result.update({**measured, "settings": result["settings"]})
    return results


def flat_row(result: dict) -> dict:
    """One CSV/table row: the knobs that vary, then the measurements."""
    data = result.get("settings", {}).get("data", {})
    row = {key: data.get(key) for key in ("num_workers", "pin_memory", "persistent_workers", "prefetch_factor",
                                          "batch_size", "image_size")}
    row.update({key: result.get(key) for key in CSV_FIELDS if key not in row})
    row["overrides"] = " ".join(result.get("overrides", []))
    if row["first_batch_s"] is not None:
        row["first_batch_s"] = " ".join(f"{s:.4f}" for s in row["first_batch_s"])
    return row


def write_csv(rows: list[dict], path: Path) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        writer.writeheader()
        writer.writerows(rows)


def _fmt(value, spec: str) -> str:
    """`value` in `spec`; None as a "-" of the same width, so the columns stay aligned."""
    if isinstance(value, bool):
        value = str(value).lower()
    return format("-", spec.split(".")[0]) if value is None else format(value, spec)


TABLE_KEYS = ("data.num_workers", "data.pin_memory", "data.persistent_workers", "data.prefetch_factor")


def swept_elsewhere(results: list[dict]) -> dict[int, str]:
    """Per job, its overrides of the keys that vary across the sweep and have no column of their own (e.g.
    data.device_transforms=true,false), so rows that differ only there can be told apart."""
    values: dict[str, set[str]] = defaultdict(set)
    parsed = {}
    for r in results:
        parsed[r["job"]] = dict(o.split("=", 1) for o in r.get("overrides", []) if "=" in o)
        for key, value in parsed[r["job"]].items():
            values[key].add(value)
    varying = [key for key, seen in values.items() if key not in TABLE_KEYS and (
        len(seen) > 1 or sum(key in overrides for overrides in parsed.values()) < len(parsed))]
    return {job: " ".join(f"{key}={overrides[key]}" for key in varying if key in overrides)
            for job, overrides in parsed.items()}


def table(results: list[dict], best_job: int | None = None) -> str:
    """A fixed-width table of the sweep; the chosen job is starred. Keys swept beside the columns' own follow the
    status."""
    head = f"{'':1}{'job':>4} {'workers':>7} {'pin':>5} {'persist':>7} {'prefetch':>8} {'img/s':>9} {'spread':>7} " \
           f"{'first batch s (per epoch)':<26} {'peak PSS MiB':>12} {'shm MiB':>8} {'stall':>6}  status"
    lines = [head, "-" * len(head)]
    also = swept_elsewhere(results)
    for r in results:
        d = r.get("settings", {}).get("data", {})
        first = " ".join(f"{s:.3f}" for s in r.get("first_batch_s") or []) or "-"
        spread = "-" if r.get("images_per_s_spread") is None else f"{100 * r['images_per_s_spread']:.0f}%"
        stall = "-" if r.get("data_stall_frac") is None else f"{100 * r['data_stall_frac']:.0f}%"
        status = r["status"] + (f" (= job {r['duplicate_of']})" if r["status"] == "duplicate" else "")
        if r["status"] == "failed":
            status += f": {r.get('error', '')[:60]}"
        lines.append(
            f"{'*' if r['job'] == best_job else ' '}{r['job']:>4} {_fmt(d.get('num_workers'), '>7')} "
            f"{_fmt(d.get('pin_memory'), '>5')} {_fmt(d.get('persistent_workers'), '>7')} "
            f"{_fmt(d.get('prefetch_factor'), '>8')} {_fmt(r.get('images_per_s'), '>9.1f')} {spread:>7} "
            f"{first:<26} {_fmt(r.get('peak_pss_mb'), '>12.0f')} {_fmt(r.get('peak_shm_mb'), '>8.1f')} {stall:>6}"
            f"  {status}" + (f"  [{also[r['job']]}]" if also.get(r["job"]) else ""))
    return "\n".join(lines)


PLOT_LINES = ("pin_memory", "persistent_workers", "prefetch_factor")  # one line per combination swept


def _plot_groups(results: list[dict]) -> dict[tuple, list[dict]]:
    """Measured rows per (pin_memory, persistent_workers, prefetch_factor); the num_workers=0 rows (no workers to
    persist or prefetch) start every line with the same pin_memory."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    measured = [r for r in results if r["status"] == "ok"]
    for r in measured:
        d = r["settings"]["data"]
        if d["num_workers"] > 0:
            groups[tuple(d.get(key) for key in PLOT_LINES)].append(r)
    for r in measured:
        d = r["settings"]["data"]
        if d["num_workers"] == 0:
            keys = [key for key in groups if key[0] == d["pin_memory"]] or [(d["pin_memory"], False, None)]
            for key in keys:
                groups[key].append(r)
    return groups


def plot(results: list[dict], path: Path, title: str) -> None:
    """Throughput, first-batch latency per epoch, peak PSS (and data stall) against num_workers, one line per
    (pin_memory, persistent_workers, prefetch_factor)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    groups = _plot_groups(results)
    with_stall = any(r.get("data_stall_frac") is not None for rs in groups.values() for r in rs)
    ncols = 4 if with_stall else 3
    fig, axes = plt.subplots(1, ncols, figsize=(5 * ncols, 4.2), squeeze=False)
    axes = axes[0]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, ((pin, persistent, prefetch), rows) in enumerate(sorted(groups.items(), key=lambda kv: str(kv[0]))):
        rows.sort(key=lambda r: r["settings"]["data"]["num_workers"])
        x = [r["settings"]["data"]["num_workers"] for r in rows]
        color = colors[i % len(colors)]
        label = f"pin={pin} persistent={persistent} prefetch={prefetch or 2}"
        y = [r["images_per_s"] for r in rows]
        err = [[v - r["images_per_s_min"] for v, r in zip(y, rows, strict=True)],
               [r["images_per_s_max"] - v for v, r in zip(y, rows, strict=True)]]
        axes[0].errorbar(x, y, yerr=err, marker="o", capsize=3, color=color, label=label)
        for epoch in range(len(rows[0]["first_batch_s"])):
            axes[1].plot(x, [r["first_batch_s"][epoch] for r in rows], marker="o", color=color,
                         linestyle="-" if epoch == 0 else "--", alpha=1.0 if epoch == 0 else 0.6,
                         label=label if epoch == 0 else None)
        axes[2].plot(x, [r["peak_pss_mb"] for r in rows], marker="o", color=color, label=label)
        if with_stall:
            axes[3].plot(x, [100 * r["data_stall_frac"] for r in rows], marker="o", color=color, label=label)
    titles = ["images/s (median, min-max over epochs)", "first-batch latency s (solid: epoch 1, dashed: later)",
              "peak PSS MiB (main + workers)", "data stall % of step time"]
    for ax, name in zip(axes, titles, strict=False):
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("num_workers")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(sweep_dir: Path, results: list[dict], machine: dict, extra: dict, draw: bool = True) -> dict:
    """results.json, results.csv and (draw=True) tune.png in sweep_dir; returns the paths written."""
    paths = {"json": sweep_dir / "results.json", "csv": sweep_dir / "results.csv"}
    dataset = next((r["dataset"] for r in results if r.get("dataset")), None)
    payload = {"machine": machine, "dataset": dataset, **extra, "results": results}
    paths["json"].write_text(json.dumps(payload, indent=2) + "\n")
    write_csv([flat_row(r) for r in results], paths["csv"])
    if draw and any(r["status"] == "ok" for r in results) and importlib.util.find_spec("matplotlib") is None:
        log.info("tune.png not drawn: matplotlib is not installed (pip install 'loadout[plots]')")
    elif draw and any(r["status"] == "ok" for r in results):
        paths["png"] = sweep_dir / "tune.png"
        name = f"{dataset['name']} at {dataset['root']}" if dataset else "?"
        plot(results, paths["png"], f"{describe_machine(machine)} | dataset {name}")
    return paths
