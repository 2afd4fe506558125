"""`python -m train.tune -m data.num_workers=0,2,4 ...`: measure the data loader on this machine, one Hydra job per
setting (measure.py); the sweep's callback (callback.py) checks the sweep first, then writes the report (report.py)
and, with tune.autotune=true, a hardware profile (profile.py).
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from loadout.data.loader.samplers import explain_loader_error
from loadout.errors import ConfigError
from train.tune.config import register_tune
from train.tune.measure import RESULT_FILE, measure

log = logging.getLogger("train.tune")
register_tune()


def run_job(cfg: DictConfig) -> dict:
    """Measure one configuration and write its result.json into the job dir; a failed run is a result too."""
    hydra_cfg = HydraConfig.get()
    job_dir = Path(hydra_cfg.runtime.output_dir)
    job = OmegaConf.select(hydra_cfg, "job.num", default=0, throw_on_missing=False) or 0
    try:
        record = measure(cfg, job_dir, job)
    except (RuntimeError, OSError) as err:  # a killed worker, /dev/shm full, out of memory: keep sweeping
        explained = explain_loader_error(err) or err
        log.error("job %d failed: %s", job, explained)
        record = {"job": job, "overrides": list(hydra_cfg.overrides.task), "status": "failed",
                  "error": str(explained)}
    (job_dir / RESULT_FILE).write_text(json.dumps(record, indent=2) + "\n")
    return record


@hydra.main(version_base="1.3", config_path=str(Path(__file__).resolve().parents[2] / "conf"), config_name="tune")
def main(cfg: DictConfig) -> None:
    try:
        OmegaConf.resolve(cfg)
        run_job(cfg)
    except ConfigError as err:
        log.error("%s", err)
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
