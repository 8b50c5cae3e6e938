"""Reading what an offline W&B run wrote (its records and history)."""

import json
import struct
from pathlib import Path

BLOCK = 32 * 1024


HEADER = 7


FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


GOODPUT_KEYS = {"step", "goodput", "step_goodput", "tokens_per_s", "throughput_ratio", "active_gpu_fraction",
                "active_gpus", "tp_degree/replica_0", "tp_degree/replica_1"}


def read_records(path: Path) -> list:
    """Parse every record of a .wandb file."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a wandb datastore"
    pos, payloads, pending = HEADER, [], b""
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        if kind == 0 and length == 0:
            pos += left
            continue
        chunk = data[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        if kind == FULL:
            payloads.append(chunk)
        elif kind == FIRST:
            pending = chunk
        elif kind == MIDDLE:
            pending += chunk
        elif kind == LAST:
            payloads.append(pending + chunk)
        else:
            raise AssertionError(f"unknown record type {kind} at byte {pos}")
    return [wandb_internal_pb2.Record.FromString(p) for p in payloads]


def read_history(run_dir: Path) -> list[dict]:
    """The logged rows of the single offline run under run_dir/wandb."""
    (path,) = sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    rows = []
    for record in read_records(path):
        if record.WhichOneof("record_type") == "history":
            rows.append({(item.key or "/".join(item.nested_key)): json.loads(item.value_json)
                         for item in record.history.item})
    return rows
