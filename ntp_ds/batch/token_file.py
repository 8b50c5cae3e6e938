"""Flat binary token files: token ids back to back as uint16 or uint32, the layout nanoGPT and Megatron users have.

A JSON sidecar `FILE.json` records the dtype, the tokenizer's vocabulary size and the largest id, so a run can
check the ids against the model's vocabulary without reading the whole file. The file is read through a memory map:
a sample is `seq_len` consecutive tokens, and consecutive samples overlap by one token, so every token after the
first is a target exactly once (the model shifts the labels by one itself). Which sample each replica reads is the
`GlobalBatchSampler`'s choice, as for any dataset, so recoveries and resumes read the same tokens.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
SCAN_CHUNK = 1 << 24
"""Tokens read at a time when a file without a sidecar is scanned for its largest id."""


class TokenFileError(ValueError):
    """A token file that cannot be read as configured; the message starts with the config field at fault."""


@dataclass(frozen=True)
class TokenFileMeta:
    """What the sidecar says about a token file."""

    dtype: str
    """`uint16` or `uint32`."""
    vocab_size: int | None = None
    """Vocabulary size of the tokenizer that wrote the file; null if unknown."""
    max_token_id: int | None = None
    """Largest id in the file; null: scan the file when it is needed."""
    tokens: int | None = None
    """Tokens in the file."""
    tokenizer: str | None = None
    """Name or path of the tokenizer."""


def sidecar_path(path: str | Path) -> Path:
    return Path(f"{path}.json")


def dtype_for(vocab_size: int) -> str:
    """The smallest dtype that holds every id of a vocabulary."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def read_meta(path: str | Path, dtype: str | None = None) -> TokenFileMeta:
    """The file's sidecar, or just `dtype` if it has none; a `dtype` that contradicts the sidecar is an error."""
    if not Path(path).is_file():
        raise TokenFileError(f"data.path={path}: no such file")
    if dtype is not None and dtype not in DTYPES:
        raise TokenFileError(f"data.dtype={dtype!r} must be one of {', '.join(DTYPES)}")
    side = sidecar_path(path)
    if not side.is_file():
        if dtype is None:
            raise TokenFileError(f"data.dtype=null and {side} does not exist: set data.dtype to "
                                 f"{' or '.join(DTYPES)}")
        return TokenFileMeta(dtype=dtype)
    try:
        meta = TokenFileMeta(**json.loads(side.read_text()))
    except (ValueError, TypeError) as e:
        raise TokenFileError(f"data.path={path}: sidecar {side} is not a token file description ({e})") from None
    if meta.dtype not in DTYPES:
        raise TokenFileError(f"data.path={path}: sidecar {side} gives dtype {meta.dtype!r}; valid: "
                             f"{', '.join(DTYPES)}")
    if dtype is not None and dtype != meta.dtype:
        raise TokenFileError(f"data.dtype={dtype} contradicts {side} (dtype {meta.dtype}); set data.dtype=null")
    return meta


def write_token_file(path: str | Path, chunks: Iterable, vocab_size: int, tokenizer: str | None = None
                     ) -> TokenFileMeta:
    """Write token ids (an iterable of id sequences, appended in order) and the sidecar; return the sidecar's meta."""
    dtype = dtype_for(vocab_size)
    tokens, max_id = 0, -1
    with open(path, "wb") as f:
        for chunk in chunks:
            ids = np.asarray(chunk, dtype=np.int64)
            if not len(ids):
                continue
            if ids.min() < 0 or ids.max() >= vocab_size:
                raise ValueError(f"token id {int(ids.max() if ids.max() >= vocab_size else ids.min())} is outside "
                                 f"the vocabulary 0..{vocab_size - 1}")
            f.write(ids.astype(DTYPES[dtype]).tobytes())
            tokens, max_id = tokens + len(ids), max(max_id, int(ids.max()))
    meta = TokenFileMeta(dtype=dtype, vocab_size=vocab_size, max_token_id=max_id if tokens else None, tokens=tokens,
                         tokenizer=tokenizer)
    sidecar_path(path).write_text(json.dumps(meta.__dict__, indent=2) + "\n")
    return meta


class TokenFile:
    """Samples of `seq_len` tokens from a token file, read through a memory map; `size` caps the sample count."""

    def __init__(self, path: str | Path, seq_len: int, dtype: str | None = None, size: int | None = None):
        self.path, self.seq_len = Path(path), seq_len
        self.meta = read_meta(path, dtype)
        itemsize = np.dtype(DTYPES[self.meta.dtype]).itemsize
        nbytes = self.path.stat().st_size
        if nbytes % itemsize:
            raise TokenFileError(f"data.path={path}: {nbytes} bytes is not a whole number of {self.meta.dtype} "
                                 f"tokens; check data.dtype")
        self.tokens = np.memmap(self.path, dtype=DTYPES[self.meta.dtype], mode="r") if nbytes else np.zeros(0)
        if seq_len < 2:
            raise TokenFileError(f"data.seq_len={seq_len} must be at least 2 to read a token file")
        available = max(0, (len(self.tokens) - 1) // (seq_len - 1))
        if available == 0:
            raise TokenFileError(f"data.path={path} holds {len(self.tokens)} tokens, fewer than one sample of "
                                 f"data.seq_len={seq_len}")
        if size is not None and size > available:
            raise TokenFileError(f"data.size={size} exceeds the {available} samples of data.seq_len={seq_len} in "
                                 f"{path}; set data.size=null to read them all")
        self.size = available if size is None else size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < self.size:
            raise IndexError(f"sample {index} of a token file with {self.size} samples")
        start = index * (self.seq_len - 1)
        ids = torch.from_numpy(self.tokens[start:start + self.seq_len].astype(np.int64))
        return {"input_ids": ids, "labels": ids.clone()}

    def max_token_id(self) -> int:
        """The largest id the samples may read: the sidecar's, else a scan of the file in chunks."""
        if self.meta.max_token_id is not None:
            return self.meta.max_token_id
        return max(int(self.tokens[i:i + SCAN_CHUNK].max()) for i in range(0, len(self.tokens), SCAN_CHUNK))

    def check_vocab(self, vocab_size: int) -> None:
        """Refuse a file whose ids do not all index the model's embedding."""
        top = self.max_token_id()
        if top >= vocab_size:
            raise TokenFileError(f"data.path={self.path} holds token id {top} but model.vocab_size={vocab_size}; "
                                 f"use a model whose vocabulary covers the tokenizer's")
