"""Which safetensors files of a Hugging Face checkpoint folder hold which tensors.

The index (``model.safetensors.index.json``) when the folder has one: it names exactly the checkpoint's shards and
tensors, so a stray ``*.safetensors`` beside them (a shard of an earlier save with another shard count) is not read,
and a listed shard that is missing is named. Without an index, every ``*.safetensors`` file of the folder. One listing
for every reader of a folder (the bridge's load_hf, the hf engine's weights, a server engine's weight table), so they
agree on what a folder holds.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from spade_mega.errors import SpadeError

INDEX = "model.safetensors.index.json"


class WeightFolderError(SpadeError):
    """A folder whose safetensors files cannot be listed as one checkpoint."""


def weight_files(folder: str | Path) -> dict[str, Optional[set[str]]]:
    """File name -> the names of the tensors the index puts in it (None without an index: all of the file's), in
    file-name order; the files are not opened."""
    folder = Path(folder)
    index = folder / INDEX
    if not index.is_file():
        files = sorted(p.name for p in folder.glob("*.safetensors"))
        if not files:
            raise WeightFolderError(f"{folder}: no *.safetensors files (only safetensors checkpoints are read)")
        return {file: None for file in files}
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (ValueError, KeyError, TypeError) as exc:
        raise WeightFolderError(f"{index}: not a safetensors index ({exc})") from None
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise WeightFolderError(f"{index}: weight_map must map tensor names to file names")
    listing: dict[str, Optional[set[str]]] = {}
    for name, file in sorted(weight_map.items(), key=lambda item: item[1]):
        listing.setdefault(file, set()).add(name)  # type: ignore[union-attr]
    if not listing:
        raise WeightFolderError(f"{index}: lists no tensors")
    absent = [file for file in listing if not (folder / file).is_file()]
    if absent:
        raise WeightFolderError(f"{index} lists the shard {absent[0]} ({len(listing[absent[0]] or ())} tensors), "
                                f"which is not in the folder ({len(absent)} of {len(listing)} shards missing): an "
                                "incomplete copy or download")
    return listing
