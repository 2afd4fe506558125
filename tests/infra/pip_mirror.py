"""Serve this machine's local pip mirrors over HTTP so `docker build` (and a chroot) can use them.

The host's pip configuration (``pip config list``: /etc/pip.conf plus PIP_* variables) may point at local
directories -- ``file:///opt/pypi/simple`` indexes, ``/opt/wheels`` find-links -- that a build container
cannot see. This helper:

* reads the host's pip settings with ``python3 -m pip config list``;
* links the parent directory of every local index / find-links directory into a temporary folder, so the
  relative links of a PEP 503 index (``../../files/x.whl``) keep working;
* writes a pip.conf (``--conf-out``) that reproduces the host's settings with each local path rewritten to
  ``http://127.0.0.1:PORT/...`` and ``trusted-host = 127.0.0.1``;
* serves that folder on 127.0.0.1 only, read-only, until killed.

Builds reach it through ``--network host``. Used by tests/infra/build_base_image.sh and tests/infra/test_container.sh;
only needed for the offline stand-in image, never for a real registry base image.
"""

from __future__ import annotations

import argparse
import functools
import http.server
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from urllib.parse import urlparse

LIST_KEYS = ("index-url", "extra-index-url", "find-links")
COPY_KEYS = ("cert", "default-timeout", "disable-pip-version-check", "timeout", "retries")


def host_pip_settings() -> dict[str, str]:
    """Return the host's effective pip settings, key without section -> value (env beats files)."""
    out = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], check=True, capture_output=True, text=True
    ).stdout
    files: dict[str, str] = {}
    env: dict[str, str] = {}
    for line in out.splitlines():
        key, sep, value = line.partition("=")
        if not sep:
            continue
        value = value.strip().strip("'\"")
        section, _, name = key.rpartition(".")
        (env if section.startswith(":env:") else files)[name] = value
    return {**files, **env}


def local_dir(location: str) -> Path | None:
    """The local directory a pip location names (file:// URL or plain path), or None for remote URLs."""
    parsed = urlparse(location)
    if parsed.scheme == "file":
        return Path(parsed.path)
    if parsed.scheme == "" and location.startswith("/"):
        return Path(location)
    return None


def build_config(settings: dict[str, str], root: Path, port: int) -> str:
    """Link local mirror dirs under root and return the rewritten pip.conf text."""
    links: dict[Path, str] = {}
    lines = ["[global]"]
    for key in LIST_KEYS:
        if key not in settings:
            continue
        rewritten = []
        for loc in shlex.split(settings[key]):
            path = local_dir(loc)
            if path is None:
                rewritten.append(loc)
                continue
            if not path.is_dir():
                print(f"[pip_mirror] skipping {loc}: not a directory", file=sys.stderr)
                continue
            parent = path.resolve().parent
            if parent not in links:
                links[parent] = f"m{len(links)}"
                (root / links[parent]).symlink_to(parent, target_is_directory=True)
            rewritten.append(f"http://127.0.0.1:{port}/{links[parent]}/{path.resolve().name}/")
        if rewritten:
            lines.append(f"{key} = {' '.join(rewritten)}")
    for key in COPY_KEYS:
        if key in settings:
            lines.append(f"{key} = {settings[key]}")
    if links:
        lines.append("trusted-host = 127.0.0.1")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=int(os.environ.get("PIP_MIRROR_PORT", "38111")))
    parser.add_argument("--conf-out", type=Path, required=True, help="where to write the rewritten pip.conf")
    parser.add_argument("--no-serve", action="store_true", help="only write the config")
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="pip-mirror-"))
    config = build_config(host_pip_settings(), root, args.port)
    if args.no_serve:
        args.conf_out.write_text(config)
        return

    class QuietHandler(http.server.SimpleHTTPRequestHandler):
        def log_message(self, format: str, *a: object) -> None:  # noqa: A002 - stdlib signature
            pass

    handler = functools.partial(QuietHandler, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", args.port), handler)
    # The config appears only once the port is bound: its existence tells callers the mirror is ready.
    tmp = args.conf_out.with_name(args.conf_out.name + ".tmp")
    tmp.write_text(config)
    tmp.replace(args.conf_out)
    print(f"[pip_mirror] serving {root} on 127.0.0.1:{args.port}", file=sys.stderr, flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
