"""Tokenize text files with a Hugging Face tokenizer into a flat binary token file that `data=tokens` reads.

    python tools/tokenize_text.py --tokenizer meta-llama/Llama-3.2-1B --input a.txt b.txt --output tokens.bin
    ntp-ds train recipe=cpu_demo data=tokens data.path=tokens.bin model.vocab_size=...

Each input file is one document: its text is tokenized a block of lines at a time (newlines kept) and the
tokenizer's end-of-sequence token, if it has one, follows it. The ids are written back to back as uint16 (or
uint32 when the vocabulary needs it), with the sidecar tokens.bin.json giving the dtype, the vocabulary size and the
largest id.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ntp_ds.batch.token_file import write_token_file

LINES_PER_BLOCK = 1000


def document_ids(tokenizer, path: Path, eos: bool):
    """Yield the ids of one document, block by block."""
    with open(path, encoding="utf-8") as f:
        block = []
        for line in f:
            block.append(line)
            if len(block) == LINES_PER_BLOCK:
                yield tokenizer("".join(block), add_special_tokens=False)["input_ids"]
                block = []
        if block:
            yield tokenizer("".join(block), add_special_tokens=False)["input_ids"]
    if eos and tokenizer.eos_token_id is not None:
        yield [tokenizer.eos_token_id]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tokenize_text.py", description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", required=True, help="Hugging Face tokenizer: a hub name or a local directory")
    parser.add_argument("--input", required=True, nargs="+", type=Path, help="text files, one document each")
    parser.add_argument("--output", required=True, type=Path, help="token file to write (its sidecar: OUTPUT.json)")
    parser.add_argument("--no-eos", action="store_true", help="do not put the EOS token after each document")
    args = parser.parse_args(argv)
    missing = [str(p) for p in args.input if not p.is_file()]
    if missing:
        print(f"tokenize_text.py: error: --input {missing[0]}: no such file", file=sys.stderr)
        return 2
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    except (OSError, ValueError) as e:
        print(f"tokenize_text.py: error: --tokenizer {args.tokenizer}: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    chunks = (ids for path in args.input for ids in document_ids(tokenizer, path, not args.no_eos))
    meta = write_token_file(args.output, chunks, len(tokenizer), tokenizer=args.tokenizer)
    print(f"wrote {meta.tokens} tokens ({meta.dtype}, vocabulary {meta.vocab_size}, largest id {meta.max_token_id}) "
          f"to {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
