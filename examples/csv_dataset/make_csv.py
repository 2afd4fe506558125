"""Write list.csv and list_val.csv (path,label) for an ImageFolder's train/ and val/: `python make_csv.py ROOT`."""

import csv
import sys
from pathlib import Path


def write_lists(root: Path) -> None:
    for split in ("train", "val"):
        with open(root / ("list.csv" if split == "train" else "list_val.csv"), "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["path", "label"])
            for image in sorted((root / split).glob("*/*")):
                writer.writerow([image.relative_to(root), image.parent.name])


if __name__ == "__main__":
    write_lists(Path(sys.argv[1]))
