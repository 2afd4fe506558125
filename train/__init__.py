"""The loadout training template: the part of the project a forker owns and edits. The loader and run machinery it
builds on is the library `loadout` (loadout/__init__.py draws its map); loadout never imports this package.

Where to look:
- __main__.py the command line; job.py the composition root: every part built once from its config section
- config.py   the schema, composed from each section's own (loadout/data/config.py, loop/config.py)
- task/       what is learned: the loss, the evaluation sums and figures, which epoch is best (base.py: your own)
- loop/       the epoch loop with resume and trainer.mode=validate (engine.py), the step (step.py), evaluation
              (evaluate.py), the ranks' agreement to stop (agreement.py), the model and schedule builders
- augment.py  the augmentation recipes (the segmentation recipe is loadout/data/seg_augment.py)
- tune.py     python -m train.tune: one sweep job over the template's data path and step
"""

from pathlib import Path

from loadout.runtime.process import idle_threads_sleep

CONF = Path(__file__).resolve().parents[1] / "conf"  # config.yaml, tune.yaml and a folder per config group

# `python -m train` and `python -m train.tune` import this package first, before torch loads its OpenMP runtime
idle_threads_sleep()
