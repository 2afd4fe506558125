"""`python -m train --help`: loadout's groups and the keys people change, one line each, printed before torch or
Hydra is imported (Hydra's own page, `--hydra-help`, lists its flags)."""

from __future__ import annotations

from pathlib import Path

CONF = Path(__file__).resolve().parents[2] / "conf"

GROUPS = {
    "hardware": "a machine's loader and trainer settings (auto: from this machine)",
    "dataset": "what to train on (or dataset._target_=your.module.Class)",
    "model": "the network (model.name picks it; or model._target_=...)",
    "optimizer": "the optimizer (optimizer.lr, optimizer.weight_decay)",
    "scheduler": "the learning-rate schedule",
    "augment": "the training augmentation recipe",
    "logger": "experiment trackers, a list (logger=[tensorboard,csv]; logger=[] for none)",
    "experiment": "a complete recipe (dataset, model, epochs) on top of the rest",
    "debug": "a quick check of the setup (default: main process only, 20 steps)",
}

KEYS = {
    "data.root": "where the dataset lives (`make dataset` makes data/synthetic)",
    "data.batch_size": "images per step per process (under torchrun: x processes)",
    "data.num_workers": "loader worker processes; auto = 0.75 x usable cores / processes on this node",
    "data.image_size": "the training crop's side in pixels",
    "data.pin_memory": "page-locked host batches for faster copies to the GPU",
    "data.prefetch_factor": "batches each worker keeps ready (null: 2)",
    "trainer.epochs": "passes over the training set",
    "trainer.max_steps": "stop after this many optimizer steps (a short smoke run)",
    "trainer.device": "auto | cpu | cuda | cuda:N",
    "trainer.precision": "auto | bf16 | fp16 | fp32 (auto: bf16 on a GPU that runs it natively, else fp16; "
                         "on a CPU with native bf16 the faster of bf16 and fp32, measured; else fp32)",
    "trainer.resume": "auto (this run dir's newest checkpoint; with hydra.run.dir=<run dir>) | a .pt path | null",
    "trainer.compile": "torch.compile the model",
    "trainer.seed": "the seed every random draw derives from",
    "hydra.run.dir": "the run dir (default outputs/<date>/<time>); give a run's dir to resume it",
}

USAGE = "usage: python -m train [group=option ...] [key=value ...] [--cfg job] [--hydra-help]"


def wants_help(argv: list[str]) -> bool:
    return any(arg in ("--help", "-h") for arg in argv)


def options(group: str) -> list[str]:
    """The options of a config group: conf/<group>/*.yaml."""
    return sorted(path.stem for path in (CONF / group).glob("*.yaml"))


def text() -> str:
    width = max(map(len, [*GROUPS, *KEYS]))
    lines = [USAGE, "", "Groups (group=option):"]
    for group, what in GROUPS.items():
        lines.append(f"  {group:<{width}}  {what}; options: {', '.join(options(group))}")
    lines += ["", "Most used keys (key=value; every key, resolved for this machine: python -m train --cfg job; "
              "data.num_workers=auto becomes a count at start, saved in <run dir>/plan.json):"]
    lines += [f"  {key:<{width}}  {what}" for key, what in KEYS.items()]
    lines += ["", "Examples:",
              "  python -m train hardware=cpu trainer.epochs=1",
              "  python -m train debug=default",
              "  python -m train trainer.resume=auto hydra.run.dir=outputs/<date>/<time>   (continue a run)",
              "", "A new argument for a class of your own takes a leading +: +model.my_arg=3."]
    return "\n".join(lines)
