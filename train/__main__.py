"""`python -m train [overrides]`: check the command line, compose the config with Hydra, train (train/job.py).

`--help` answers before torch or Hydra is imported: loadout's groups and the keys people change, one line each
(Hydra's own page, `--hydra-help`, lists its flags). Bad overrides fail in one line before Hydra starts (so they write
nothing), and `trainer.resume=auto hydra.run.dir=<run dir>` replays that run's own overrides under the command
line's (loadout/run/resume_run.py). Under torchrun every rank runs this file; ranks > 0 get quiet Hydra overrides and
share rank 0's run dir (loadout/run/run_dir.py).
Exit status: 0 done, 2 bad input (one line naming the key), 3 out of memory, 4 diverged (each one line; a retry of the
same config in the same run dir exits at once: loadout/run/no_retry.py), 69 a collective failed (a node or link lost:
one line naming the rank), 74 a checkpoint could not be written (make room, then resume), 75 stopped by a signal with a
checkpoint to resume.
"""

from __future__ import annotations

import gc
import sys

from train import CONF

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


def help_text() -> str:
    width = max(map(len, [*GROUPS, *KEYS]))
    lines = [USAGE, "", "Groups (group=option):"]
    for group, what in GROUPS.items():
        options = sorted(path.stem for path in (CONF / group).glob("*.yaml"))
        lines.append(f"  {group:<{width}}  {what}; options: {', '.join(options)}")
    lines += ["", "Most used keys (key=value; every key, resolved for this machine: python -m train --cfg job; "
              "data.num_workers=auto becomes a count at start, saved in <run dir>/plan.json):"]
    lines += [f"  {key:<{width}}  {what}" for key, what in KEYS.items()]
    lines += ["", "Examples:",
              "  python -m train hardware=cpu trainer.epochs=1",
              "  python -m train debug=default",
              "  python -m train trainer.resume=auto hydra.run.dir=outputs/<date>/<time>   (continue a run)",
              "", "A new argument for a class of your own takes a leading +: +model.my_arg=3."]
    return "\n".join(lines)


def task(cfg) -> None:
    """Hydra's job (imported here, so `--help` never waits for torch)."""
    from train.job import main

    # The ~350 k objects the imports made (torch, torchvision, Hydra) live as long as the process: freezing them keeps
    # every full collection, and the one at exit (over a second), from walking them again, and keeps forked workers
    # from copying their pages (the gc module's documented use before fork). Once: a sweep's later jobs (-m) would
    # freeze what the earlier ones left to the collector.
    if not gc.get_freeze_count():
        gc.freeze()
    main(cfg)


def launch(argv: list[str]) -> None:
    if any(arg in ("--help", "-h") for arg in argv):
        print(help_text())
        return
    import hydra

    from loadout.run.command_line import prepare
    from train.config import SCHEMA

    sys.argv = [sys.argv[0], *prepare(argv, SCHEMA)]
    hydra.main(version_base="1.3", config_path=str(CONF), config_name="config")(task)()


if __name__ == "__main__":
    launch(sys.argv[1:])
