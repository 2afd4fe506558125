"""logger=mlflow: an MLflow run (`pip install 'loadout[mlflow]'`) on the tracking server at `tracking_uri`
(default: $MLFLOW_TRACKING_URI, else a SQLite store in the run dir, `<run dir>/mlflow.db`: MLflow's own default is
`mlflow.db` and `mlruns/` in whatever directory the run was started from, the repository as often as not).

An http(s) server that takes no connection fails at start, before any worker, in one line: MLflow's client would
retry the run's first request for minutes and then end the run with a traceback."""

from __future__ import annotations

import logging
import socket
import time
import urllib.parse
import urllib.request
from pathlib import Path

from loadout.build import require_extra
from loadout.credentials import without_credentials
from loadout.errors import ConfigError, first_line
from loadout.observe.trackers import FAILED, FINISHED, Tracker

log = logging.getLogger(__name__)
STATUS = {FINISHED: "FINISHED", FAILED: "FAILED"}  # stopped by a signal: KILLED until a resume reopens it
BATCH = 100  # MLflow takes at most 100 params and 1000 metrics a request
MAX_PARAM = 6000  # characters of a param's value MLflow keeps
CONNECT_S = 10.0  # a tracking server that takes no connection in this long is not there


class MLflowTracker(Tracker):
    """Through MlflowClient (no global active run): the run named after the run dir, tagged with its path; a
    resumed run reopens the saved run id and sets it RUNNING again."""

    def __init__(self, run_dir: Path, tracking_uri: str | None = None, experiment: str = "loadout",
                 run_name: str | None = None):
        self.mlflow = require_extra("mlflow", "mlflow", "logger=mlflow")
        self.run_dir, self.tracking_uri, self.experiment = Path(run_dir), tracking_uri, experiment
        self.run_name = run_name or str(self.run_dir)
        self.client = self.run_id = None
        self.artifacts: str | None = None  # the experiment's artifact root, with the run dir's own store only
        if tracking_uri:
            check_reachable(tracking_uri)
        else:
            self.tracking_uri, self.artifacts = run_dir_store(self.run_dir)
            logging.getLogger("mlflow.store.db.utils").setLevel(logging.WARNING)  # "Creating ... tables": said here
            log.info("mlflow: no MLFLOW_TRACKING_URI: the run is kept in %s/mlflow.db (mlflow ui --backend-store-uri "
                     "%s)", self.run_dir, self.tracking_uri)

    def start(self, run_id: str | None, params: dict[str, str], step: int) -> str:
        from mlflow.entities import Param

        self.client = self.mlflow.MlflowClient(self.tracking_uri)
        if run_id is not None:
            self.client.update_run(run_id, status="RUNNING")
            self.run_id = run_id
            return run_id
        found = self.client.get_experiment_by_name(self.experiment)
        experiment_id = found.experiment_id if found else self.client.create_experiment(
            self.experiment, artifact_location=self.artifacts)
        run = self.client.create_run(experiment_id, run_name=self.run_name,
                                     tags={"loadout.run_dir": str(self.run_dir.resolve())})
        self.run_id = run.info.run_id
        items = [Param(key, value[:MAX_PARAM]) for key, value in params.items()]
        for i in range(0, len(items), BATCH):
            self.client.log_batch(self.run_id, params=items[i:i + BATCH])
        return self.run_id

    def log(self, step: int, scalars: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        if scalars:
            self.client.log_batch(self.run_id, metrics=[Metric(key, value, now, step)
                                                        for key, value in scalars.items()])

    def finish(self, status: str) -> None:
        self.client.set_terminated(self.run_id, status=STATUS.get(status, "KILLED"))


def run_dir_store(run_dir: Path) -> tuple[str, str]:
    """The tracking URI and artifact root of a store inside `run_dir` (absolute: a resume from elsewhere finds it)."""
    where = run_dir.resolve()
    where.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{where / 'mlflow.db'}", (where / "mlartifacts").as_uri()


def check_reachable(uri: str) -> None:
    """A ConfigError when the http(s) server at `uri` takes no TCP connection (not behind a proxy, which may reach
    what this machine cannot); credentials in `uri` are masked in the message."""
    parts = urllib.parse.urlsplit(uri)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return
    if urllib.request.getproxies().get(parts.scheme) and not urllib.request.proxy_bypass(parts.hostname):
        return
    try:
        socket.create_connection((parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)),
                                 timeout=CONNECT_S).close()
    except OSError as err:
        raise ConfigError(f"logger.mlflow.tracking_uri={without_credentials(uri)}: no server takes a connection there "
                          f"({type(err).__name__}: {first_line(err)}); start it, point MLFLOW_TRACKING_URI at it, or "
                          "leave mlflow out of logger=[...]") from err
