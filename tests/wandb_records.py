"""Read an offline W&B run's ``.wandb`` file back into wandb's own protobuf ``Record`` messages.

wandb 0.31 ships no public reader (the old ``DataStore`` is gone), so this follows its format:
7 header bytes (``:W&B``, magic uint16, version uint8), then LevelDB-log blocks of 32 KiB addressed
from the start of the file. Each chunk has a 7-byte header (crc32c uint32, length uint16, type uint8:
1 full, 2 first, 3 middle, 4 last); a block with fewer than 7 bytes left is zero padding. Payloads
are ``wandb.proto.wandb_internal_pb2.Record``. Pinned by setup.cfg's wandb range and tested.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path

BLOCK_BYTES = 32 * 1024
HEADER_BYTES = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def iter_records(path: str | Path) -> Iterator:
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path} is not a W&B run file (header {data[:4]!r})")
    offset, pending = HEADER_BYTES, b""
    while offset + HEADER_BYTES <= len(data):
        left_in_block = BLOCK_BYTES - offset % BLOCK_BYTES
        if left_in_block < HEADER_BYTES:
            offset += left_in_block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[offset : offset + HEADER_BYTES])
        if kind == 0 and length == 0:  # zero padding at the end of a block
            offset += left_in_block
            continue
        if offset + HEADER_BYTES + length > len(data):  # the last chunk of a run killed while writing
            return
        payload = data[offset + HEADER_BYTES : offset + HEADER_BYTES + length]
        offset += HEADER_BYTES + length
        pending = payload if kind in (FULL, FIRST) else pending + payload
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record
            pending = b""


def history_rows(path: str | Path) -> list[dict]:
    """Every ``run.log`` call as a dict of key -> decoded value."""
    rows = []
    for record in iter_records(path):
        if record.WhichOneof("record_type") == "history":
            row = {}
            for item in record.history.item:
                key = item.key or "/".join(item.nested_key)
                row[key] = json.loads(item.value_json)
            rows.append(row)
    return rows


def find_run_file(wandb_dir: str | Path) -> Path:
    """The ``run-*.wandb`` file under an offline run directory (or a parent holding one)."""
    files = sorted(Path(wandb_dir).rglob("run-*.wandb"))
    if not files:
        raise FileNotFoundError(f"no run-*.wandb under {wandb_dir}")
    return files[-1]


def summary_items(path: str | Path) -> dict:
    """The run's summary as its ``summary`` records set it (later updates win): key -> decoded value."""
    out = {}
    for record in iter_records(path):
        if record.WhichOneof("record_type") == "summary":
            for item in record.summary.update:
                out[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return out
