"""Which rank was lost when a collective fails. A collective that times out (a node gone, a link down) says only
"Timed out waiting ... for recv", so each rank bumps a counter in torchrun's store (MASTER_ADDR:MASTER_PORT) every
few seconds from a thread; after a failure the counters that stand still name the lost ranks and their hosts, and a
store this rank cannot reach says that this node is the one cut off.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import threading
import time
from datetime import timedelta

import torch.distributed as torch_dist

from loadout.dist import DistEnv
from loadout.errors import first_line

log = logging.getLogger(__name__)

BEAT_S = 2.0
STORE_TIMEOUT = timedelta(seconds=5)
LOST_DEADLINE_S = 3 * BEAT_S + 10
# How gloo's failures read (it raises a plain RuntimeError; NCCL's are torch.distributed.DistError).
GLOO_FAILURES = ("Timed out waiting", "Connection closed by peer", "Connection reset by peer", "Broken pipe")


def cut_off() -> str:
    where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
    return f"contact with torchrun's store at {where} too: this node ({socket.gethostname()}) is cut off"


class Heartbeat:
    """This rank's pulse in torchrun's store, while the run lasts (a daemon thread; `stop` ends it)."""

    def __init__(self, env: DistEnv):
        self.env = env
        run = os.environ.get("TORCHELASTIC_RUN_ID", "run")
        self.prefix = f"loadout/{run}/{env.restart_count}"
        self.store = _client()
        self._stop = threading.Event()
        if self.store is None:
            return
        try:
            self.store.set(f"{self.prefix}/host/{env.rank}", socket.gethostname())
        except Exception:  # the store went away: no diagnosis, never a failure of its own
            self.store = None
            return
        threading.Thread(target=self._beat, daemon=True, name="loadout-heartbeat").start()

    def _beat(self) -> None:
        while not self._stop.wait(BEAT_S):
            try:
                self.store.add(f"{self.prefix}/beat/{self.env.rank}", 1)
            except Exception:
                return

    def stop(self) -> None:
        self._stop.set()

    def lost(self) -> str:
        """Who stopped beating, read twice a few beats apart: 'rank 1 (host b)', or why it cannot be told. Never
        longer than LOST_DEADLINE_S: a store behind a dead link can block a call past its own timeout."""
        answer: list[str] = []
        reader = threading.Thread(target=lambda: answer.append(self._silent()), daemon=True, name="loadout-lost")
        reader.start()
        reader.join(LOST_DEADLINE_S)
        return answer[0] if answer else cut_off()

    def _silent(self) -> str:
        if self.store is None:
            return "the other ranks (no store to ask)"
        ranks = range(self.env.world_size)
        try:
            before = [self._count(rank) for rank in ranks]
            time.sleep(3 * BEAT_S)
            after = [self._count(rank) for rank in ranks]
            silent = [rank for rank in ranks if rank != self.env.rank and after[rank] == before[rank]]
            hosts = {rank: self.store.get(f"{self.prefix}/host/{rank}").decode() for rank in silent}
        except Exception:
            return cut_off()
        if not silent:
            return "no rank (all still beat: a rank stuck or slow rather than gone)"
        return ", ".join(f"rank {rank} (host {hosts[rank]})" for rank in silent)

    def _count(self, rank: int) -> int:
        return self.store.add(f"{self.prefix}/beat/{rank}", 0)


def _client() -> torch_dist.TCPStore | None:
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not (host and port):
        return None
    try:
        return torch_dist.TCPStore(host, int(port), is_master=False, timeout=STORE_TIMEOUT, wait_for_workers=False)
    except Exception:
        log.info("no heartbeat: torchrun's store at %s:%s did not answer", host, port)
        return None


def is_collective_failure(err: BaseException) -> bool:
    return isinstance(err, torch_dist.DistError) or any(text in str(err) for text in GLOO_FAILURES)


def collective_error(err: BaseException) -> str:
    """The error's first line without the C++ source location gloo and c10d put in front."""
    return re.sub(r"^\[[^\]]*\]\s*", "", first_line(err))
