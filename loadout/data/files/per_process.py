"""A handle (an h5py file, an LMDB environment) opened by the process that reads through it, never inherited.

h5py and LMDB both break when a handle crosses a fork: HDF5's library state is copied half-way (reads return garbage
or crash), and LMDB forbids using an environment in a forked child. So a source opens its handle on its first read,
in whichever process reads; every handle open in a process is closed just before that process forks (the DataLoader
forking its workers), and a handle found in another process's memory, or in a pickle, is never used: each worker
opens its own after the fork.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")

_OPEN: weakref.WeakSet[PerProcess] = weakref.WeakSet()


class PerProcess(Generic[T]):
    """`get()`: the handle `opener()` makes, opened once in each process that asks; `close(handle)` ends it."""

    def __init__(self, opener: Callable[[], T], close: Callable[[T], None]):
        self.opener, self._close = opener, close
        self._handle: T | None = None
        self._pid = -1

    def get(self) -> T:
        if self._handle is None or self._pid != os.getpid():
            self._handle, self._pid = self.opener(), os.getpid()
            _OPEN.add(self)
        return self._handle

    def close(self) -> None:
        """Close this process's handle (the next `get` opens it again)."""
        handle, self._handle = self._handle, None
        if handle is not None and self._pid == os.getpid():
            self._close(handle)

    def __getstate__(self) -> dict:  # a pickle (spawn, forkserver) carries how to open, never the handle
        return {**self.__dict__, "_handle": None, "_pid": -1}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)


def _close_all_before_fork() -> None:
    for handle in list(_OPEN):
        handle.close()


os.register_at_fork(before=_close_all_before_fork)
