"""What a parquet file written by `datasets` holds, read as `datasets` reads it: which column is the image and which
the label (from the Hugging Face features metadata), the class names, and each row's encoded image.

`datasets` stores its features as JSON under the schema metadata key `huggingface` (`{"info": {"features": ...}}`).
An `Image` feature (with `decode=False` too: the storage is the same) is a struct of `bytes` and `path`: the bytes
embedded (the Hub's files, `push_to_hub`), or only a path (`to_parquet` of a dataset built from image files), absolute
or relative to the parquet file's folder; a string column typed `Image` holds paths and a binary one the bytes, as
`datasets` casts them. A `ClassLabel` feature names the classes. For segmentation a second image column (named by
dataset.mask_column) holds each row's PNG mask, stored the same ways, and no label column is needed.
"""

from __future__ import annotations

import json
import posixpath
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

from loadout.errors import ConfigError

IMAGE_TYPES = "an Image feature: a struct of `bytes` and `path`, binary, or string paths typed Image in the features"


def features_of(schema: pa.Schema) -> dict:
    """The `datasets` features of a parquet file's schema ({} when it was not written by `datasets`)."""
    metadata = (schema.metadata or {}).get(b"huggingface")
    if not metadata:
        return {}
    return json.loads(metadata).get("info", {}).get("features") or {}


def typed(features: dict, kind: str) -> list[str]:
    return [name for name, feature in features.items() if isinstance(feature, dict) and feature.get("_type") == kind]


@dataclass(frozen=True)
class Layout:
    """The image and label (or mask) columns of a split's files, and the class names when the label is a ClassLabel."""

    image: str
    label: str | None  # None: a mask column instead
    classes: list[str] | None
    mask: str | None = None

    @property
    def columns(self) -> list[str]:
        """The columns read per row group: the image, and the mask where there is one."""
        return [self.image] if self.mask is None else [self.image, self.mask]

    @classmethod
    def of(cls, schema: pa.Schema, url: str, mask: str | None = None) -> Layout:
        """The layout of the file at `url` (with the mask column `mask`), or a one-line error naming the file and the
        column it cannot read."""
        features, names = features_of(schema), schema.names
        images = [name for name in typed(features, "Image") if name != mask]
        image = pick(images, names, "image", url, "an image column (an Image feature)")
        if mask is not None and mask not in names:
            raise ConfigError(f"dataset.mask_column={mask}: {url} has no such column (its columns: "
                              f"{', '.join(names)})")
        for column in (image, mask) if mask else (image,):
            check_image_column(schema, features, column, url)
        if mask is not None:
            return cls(image, None, None, mask)
        label = pick(typed(features, "ClassLabel"), names, "label", url, "a label column (a ClassLabel feature)")
        if not pa.types.is_integer(schema.field(label).type):
            raise ConfigError(f"data.root: {url}: column `{label}` is {schema.field(label).type}: loadout needs "
                              "integer labels (a ClassLabel feature; cast it with `datasets`' class_encode_column)")
        names = features.get(label, {}).get("names") if label in typed(features, "ClassLabel") else None
        return cls(image, label, list(names) if names else None)


def check_image_column(schema: pa.Schema, features: dict, column: str, url: str) -> None:
    """A one-line error naming the file unless `column` holds images (or masks) as `datasets` stores them."""
    kind = schema.field(column).type
    fields = {field.name for field in kind} if pa.types.is_struct(kind) else set()
    readable = (fields and fields <= {"bytes", "path"} or pa.types.is_binary(kind) or pa.types.is_large_binary(kind)
                or (column in typed(features, "Image") and (pa.types.is_string(kind)
                                                             or pa.types.is_large_string(kind))))
    if not readable:
        raise ConfigError(f"data.root: {url}: column `{column}` is {kind}, which loadout cannot read as images "
                          f"(it reads {IMAGE_TYPES})")


def pick(typed_columns: list[str], names: list[str], usual: str, url: str, what: str) -> str:
    """The column named `usual`, else the one column of that feature type; else a one-line error naming the file."""
    if usual in names:
        return usual
    if len(typed_columns) == 1 and typed_columns[0] in names:
        return typed_columns[0]
    found = f"several: {', '.join(typed_columns)}" if typed_columns else f"its columns: {', '.join(names)}"
    raise ConfigError(f"data.root: {url} has no `{usual}` column and no single {what} ({found})")


def check_labels(labels: pa.ChunkedArray, url: str, column: str) -> None:
    """Every row labelled: `datasets` writes -1 (or null) for a row without a label, as in the Hub's test splits."""
    if labels.null_count or (len(labels) and pc.min(labels).as_py() < 0):
        raise ConfigError(f"data.root: {url}: column `{column}` has rows without a label (null or -1, as a test "
                          "split has): train and validate on labelled splits")


def image_of(row, parquet_url: str) -> tuple[bytes | None, str | None]:
    """(the embedded bytes, or None and the image file's URL or path) of one row of an image column."""
    if isinstance(row, dict):
        data, path = row.get("bytes"), row.get("path")
    elif isinstance(row, bytes):
        data, path = row, None
    else:
        data, path = None, row
    if data:
        return data, None
    if not path:
        raise OSError(f"{parquet_url}: a row with neither image bytes nor a path")
    if "://" in path or posixpath.isabs(path):
        return None, path
    return None, posixpath.join(posixpath.dirname(parquet_url), path)  # relative to the parquet file's folder
