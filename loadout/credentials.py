"""A URL's credentials (`https://user:token@host`, in a data.root or a tracking URI) kept out of the run's log, its
messages, Hydra's copy of the config in the run dir and the trackers' copy."""

from __future__ import annotations

import logging
import re
from pathlib import Path

URL_CREDENTIALS = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://)[^/@\s]+@")


def without_credentials(text: str) -> str:
    """`scheme://user:password@host/...` as `scheme://***@host/...`."""
    return URL_CREDENTIALS.sub(r"\1***@", text)


def mask_credentials_in_logs() -> None:
    """Every handler of the root logger (Hydra's console and file) masks them in whatever any logger says; forked
    DataLoader workers inherit the handlers."""

    def mask(record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if URL_CREDENTIALS.search(message):
            record.msg, record.args = without_credentials(message), ()
        return True

    for handler in logging.getLogger().handlers:
        handler.addFilter(mask)


def mask_credentials_in_files(folder: Path) -> None:
    """Hydra's record of the run (`.hydra/config.yaml`, `overrides.yaml`, `hydra.yaml`), written before the run
    starts, holds a URL as typed on the command line."""
    for path in folder.glob("*.yaml"):
        text = path.read_text()
        if URL_CREDENTIALS.search(text):
            path.write_text(without_credentials(text))
