"""`make tune`'s engine: the sweep's `tune:` schema and its check before any job (sweep.py), each job's record
(job_record.py) and timing (timing.py), the report and autotuned profile (callback.py, report.py, profile.py), the
measured CPU precision (cpu_precision.py). The template hands in what a job builds (train/tune.py)."""
