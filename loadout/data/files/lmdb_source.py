"""dataset=lmdb: one split of LMDB environments of encoded images (lmdb_layout.py: the layouts), a source
(loadout/data/source.py) like any.

Each value is read as the bytes a file would hold and decoded as an ImageFolder's are (DCT-scaled, crop-aware,
data.decode=device, the sample cache): the same work less the file opens. The keys live in numpy arrays (keys.py);
each process opens the environments on its first read, once however many sources read them (per_process.py),
read-only, without locks or readahead.
A missing record or one that does not unpack is a bad sample, skipped and counted (samples.py).
"""

from __future__ import annotations

import torch

from loadout.build import require_extra
from loadout.data.fast.decode import decode_image_file
from loadout.data.files.lmdb_layout import Environments, find_environments, open_env, split_record


class RecordNames:
    """`names[i]` = `<environment> key <key>`: how a bad or stuck sample is named (source.py)."""

    def __init__(self, found: Environments):
        self.found = found

    def __getitem__(self, index: int) -> str:
        return f"{self.found.paths[int(self.found.env_of[index])]} key {self.found.keys[index]!r}"


class LMDBSource:
    """`classes`, `targets`, `paths`, `read_encoded` and `min_side` over the split's environments at `root`."""

    def __init__(self, root: str, split: str = "train", split_keys=None):
        require_extra("lmdb", "lmdb", "dataset=lmdb")
        require_extra("msgpack", "lmdb", "dataset=lmdb")
        self.found = find_environments(str(root), split, split_keys)
        self.classes, self.targets = self.found.classes, self.found.targets
        self.paths = RecordNames(self.found)
        self.min_side: int | None = None

    def __len__(self) -> int:
        return len(self.targets)

    def read_encoded(self, index: int) -> tuple[bytes, int]:
        """The encoded image and its label: data.decode=device, the crop-aware decode."""
        import lmdb  # the extra, checked at build

        number = int(self.found.env_of[index])
        env = open_env(self.found.paths[number], self.found.subdirs[number])
        key = self.found.keys[index]
        try:
            with env.begin(buffers=True) as txn:
                value = txn.get(key)
                if value is None:
                    raise OSError("no record under its key")
                data = split_record(value)[0] if self.found.records else bytes(value)
        except lmdb.Error as err:  # a damaged page: a bad sample (OSError), not a dead worker
            raise OSError(f"LMDB read failed: {err}") from err
        return data, int(self.targets[index])

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        data, label = self.read_encoded(index)
        return decode_image_file(data, self.min_side), label
