"""Hugging Face datasets' files, read without the ``datasets`` library: a split as one Arrow table.

Two layouts, both as users have them locally (nothing is downloaded):

- **Parquet as on the hub**: files named after the split, ``train-00000-of-00001.parquet``
  (or ``train.parquet``), in one folder;
- **``DatasetDict.save_to_disk``**: ``dataset_dict.json`` and one folder of Arrow stream files
  per split (``train/data-00000-of-00001.arrow``).

A file that cannot be read is one line naming it, raised as the caller's error class.
"""

from __future__ import annotations

import json
from pathlib import Path

from bert_ds.base.errors import UserError


def parquet_files(folder: Path, split: str) -> list[Path]:
    """The Parquet files of ``split`` in ``folder``, in order (none: the layout is not there)."""
    return sorted(p for p in folder.glob("*.parquet") if p.name == f"{split}.parquet" or p.name.startswith(f"{split}-"))


def read_parquet(files: list[Path], error: type[UserError]):
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pa.concat_tables([pq.read_table(f) for f in files])
    except (OSError, pa.ArrowException) as e:
        raise error(f"{files[0].parent}: unreadable Parquet ({e})") from None


def is_saved_dataset(folder: Path) -> bool:
    return (folder / "dataset_dict.json").is_file()


def read_saved_split(folder: Path, split: str, error: type[UserError]):
    """``split`` of a ``DatasetDict.save_to_disk`` folder."""
    import pyarrow as pa

    try:
        splits = json.loads((folder / "dataset_dict.json").read_text())["splits"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise error(f"{folder / 'dataset_dict.json'}: unreadable ({e})") from None
    if split not in splits:
        raise error(f"{folder}: no {split} split (it has {', '.join(splits)})")
    files = sorted((folder / split).glob("data-*.arrow"))
    if not files:
        raise error(f"{folder / split}: no data-*.arrow files")
    try:
        tables = []
        for file in files:
            with pa.memory_map(str(file)) as source:
                tables.append(pa.ipc.open_stream(source).read_all())
        return pa.concat_tables(tables)
    except (OSError, pa.ArrowException) as e:
        raise error(f"{folder / split}: unreadable Arrow files ({e})") from None
