"""Token files: the reader (pure), the tokenizer tool, the config checks, and a run on a token file that survives a
crash and ends with the failure-free run's weights."""

import json
import random
import runpy
import sys

import numpy as np
import pytest
import torch

from ntp_ds.batch import plan_batch
from ntp_ds.batch.loader import GlobalBatchSampler, SyntheticTokens, replica_micro_batches
from ntp_ds.batch.token_file import TokenFile, TokenFileError, read_meta, sidecar_path, write_token_file
from ntp_ds.engine.config import ConfigError
from ntp_ds.models import Llama
from ntp_ds.run.compose import load_config
from tests.helpers.cli import REPO, ntp_ds, run

WORDS = ["the", "cat", "dog", "sat", "ran", "on", "under", "a", "mat", "tree", "big", "small", "red", "quiet"]


def test_samples_overlap_by_one_token_so_every_token_is_a_target_once(tmp_path):
    path = tmp_path / "t.bin"
    meta = write_token_file(path, [range(0, 30), range(30, 41)], vocab_size=100, tokenizer="test")
    assert meta.dtype == "uint16" and meta.tokens == 41 and meta.max_token_id == 40
    assert json.loads(sidecar_path(path).read_text())["dtype"] == "uint16"
    data = TokenFile(path, seq_len=5)
    assert len(data) == 10  # (41 - 1) // (5 - 1)
    assert data[0]["input_ids"].tolist() == [0, 1, 2, 3, 4] and data[1]["input_ids"].tolist() == [4, 5, 6, 7, 8]
    assert data[9]["input_ids"].dtype == torch.int64 and data[9]["labels"].tolist() == [36, 37, 38, 39, 40]
    targets = [t for i in range(len(data)) for t in data[i]["input_ids"][1:].tolist()]
    assert targets == list(range(1, 41))
    assert len(TokenFile(path, seq_len=5, size=3)) == 3
    with pytest.raises(IndexError):
        data[10]


def test_large_vocabularies_take_uint32_and_a_file_without_sidecar_needs_its_dtype(tmp_path):
    path = tmp_path / "big.bin"
    write_token_file(path, [[70_000, 3, 65_536, 1]], vocab_size=100_000)
    assert read_meta(path).dtype == "uint32" and TokenFile(path, 2)[0]["input_ids"].tolist() == [70_000, 3]
    raw = tmp_path / "raw.bin"
    np.arange(9, dtype=np.uint16).tofile(raw)
    with pytest.raises(TokenFileError, match=r"^data.dtype=null and .*raw.bin.json does not exist"):
        TokenFile(raw, 3)
    data = TokenFile(raw, 3, dtype="uint16")
    assert len(data) == 4 and data.max_token_id() == 8  # no sidecar: the file is scanned
    with pytest.raises(TokenFileError, match=r"^data.dtype=uint16 contradicts .*big.bin.json \(dtype uint32\)"):
        TokenFile(path, 2, dtype="uint16")
    with pytest.raises(TokenFileError, match=r"^data.size=9 exceeds the 4 samples"):
        TokenFile(raw, 3, dtype="uint16", size=9)


def test_replicas_read_disjoint_samples_that_cover_the_global_batch(tmp_path):
    path = tmp_path / "t.bin"
    write_token_file(path, [np.arange(400) % 97], vocab_size=97)
    data = TokenFile(path, seq_len=8)
    plan = plan_batch((1.0, 2.0), 10, 2, "preserve_global_batch")
    sampler = GlobalBatchSampler(len(data), seed=4)
    seen = [tuple(row.tolist()) for r in range(2) for b in replica_micro_batches(data, sampler, plan, r, step=5)
            for row in b["input_ids"]]
    expected = [tuple(data[i]["input_ids"].tolist()) for i in GlobalBatchSampler(len(data), seed=4).indices(5, 10)]
    assert len(set(expected)) == 10 and sorted(seen) == sorted(expected)


def test_the_generated_language_is_a_pure_function_of_seed_and_index_with_low_entropy():
    data = SyntheticTokens(vocab_size=256, seq_len=64, size=100, seed=5)
    assert torch.equal(data[17]["input_ids"], SyntheticTokens(256, 64, 100, 5)[17]["input_ids"])
    assert not torch.equal(data[17]["input_ids"], SyntheticTokens(256, 64, 100, 6)[17]["input_ids"])
    pairs = {}
    for i in range(100):
        ids = data[i]["input_ids"].tolist()
        for a, b in zip(ids, ids[1:]):
            pairs.setdefault(a, set()).add(b)
    assert max(len(s) for s in pairs.values()) <= 4, "each token has at most `branching` successors"
    assert SyntheticTokens(256, 1)[0]["input_ids"].shape == (1,)
    uniform = SyntheticTokens(256, 64, 100, 5, branching=0)
    assert len({t for i in range(20) for t in uniform[i]["input_ids"].tolist()}) > 200


def test_config_errors_name_the_field_before_any_worker(tmp_path):
    path = tmp_path / "t.bin"
    write_token_file(path, [np.arange(300) % 300], vocab_size=300)
    cases = [(["data=tokens"], r"^data.path=null: data=tokens reads a token file"),
             (["data=tokens", f"data.path={tmp_path}/none.bin"], r"^data.path=.*none.bin: no such file"),
             (["data=tokens", f"data.path={path}"], r"^data.path=.*t.bin holds token id 299 but model.vocab_size=256"),
             (["data=tokens", f"data.path={path}", "data.dtype=int8"], r"^data.dtype='int8' must be one of"),
             (["data.branching=-1"], r"^data.branching=-1 must lie in 0 \(uniform tokens\)..model.vocab_size=256"),
             (["data.branching=300"], r"^data.branching=300 must lie in")]
    for overrides, message in cases:
        with pytest.raises(ConfigError, match=message):
            load_config(["fault=none", *overrides]).validate()
    load_config(["fault=none", "data=tokens", f"data.path={path}", "model.vocab_size=320"]).validate()
    result = ntp_ds("train", "recipe=cpu_demo", "data=tokens", f"data.path={path}")
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        f"ntp-ds train: error: data.path={path} holds token id 299 but model.vocab_size=256; use a model whose "
        f"vocabulary covers the tokenizer's"]


def write_tokenizer(directory):
    """A word-level tokenizer trained here, saved as a transformers tokenizer directory (no network)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([" ".join(WORDS)], trainers.WordLevelTrainer(special_tokens=["<unk>", "<eos>"]))
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>").save_pretrained(directory)


@pytest.fixture(scope="module")
def token_file(tmp_path_factory):
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("tokens")
    write_tokenizer(root / "tokenizer")
    rng = random.Random(0)
    docs = []
    for d in range(2):
        lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 9))) for _ in range(60)]
        (root / f"doc{d}.txt").write_text("\n".join(lines) + "\n")
        docs.append(" ".join(lines).split())
    out = root / "tokens.bin"
    result = run([sys.executable, str(REPO / "tools" / "tokenize_text.py"), "--tokenizer", str(root / "tokenizer"),
                  "--input", str(root / "doc0.txt"), str(root / "doc1.txt"), "--output", str(out)], timeout=60)
    assert result.returncode == 0, result.stderr[-3000:]
    return out, docs, root / "tokenizer"


def test_the_tool_writes_every_document_followed_by_eos(token_file):
    from transformers import AutoTokenizer

    path, docs, tokenizer_dir = token_file
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    meta = read_meta(path)
    ids = np.fromfile(path, dtype=np.uint16).tolist()
    assert meta.dtype == "uint16" and meta.tokens == len(ids) and meta.vocab_size == len(tokenizer)
    assert meta.max_token_id == max(ids) < len(tokenizer)
    eos = tokenizer.eos_token_id
    first, second = ids[:ids.index(eos)], ids[ids.index(eos) + 1:-1]
    assert ids[-1] == eos and eos not in second
    assert tokenizer.convert_ids_to_tokens(first) == docs[0]
    assert tokenizer.convert_ids_to_tokens(second) == docs[1]


def test_the_tool_refuses_a_missing_input_in_one_line(tmp_path, capsys):
    tool = runpy.run_path(str(REPO / "tools" / "tokenize_text.py"), run_name="tokenize_text")
    assert tool["main"](["--tokenizer", "t", "--input", str(tmp_path / "none.txt"), "--output", "o.bin"]) == 2
    assert capsys.readouterr().err == f"tokenize_text.py: error: --input {tmp_path / 'none.txt'}: no such file\n"


@pytest.mark.long
def test_a_crash_while_training_on_a_token_file_ends_with_the_failure_free_weights(token_file, tmp_path):
    path, _, _ = token_file
    common = ["recipe=cpu_demo", "data=tokens", f"data.path={path}", "data.seq_len=16", "train.steps=4",
              "logging=disabled", "logging.progress=false"]
    crashed = ntp_ds("train", *common, "fault.faults=[{rank:3,step:2,phase:backward,kind:crash}]",
                     f"hydra.run.dir={tmp_path / 'crashed'}", timeout=180)
    assert crashed.returncode == 0, crashed.stderr[-5000:]
    assert "recovered at step 2 from the loss of rank 3; TP degrees [2, 2] -> [2, 1]" in crashed.stderr
    # the failure-free reference: one worker training the unsharded model on the same samples
    clean = ntp_ds("train", *common, "fault=none", "parallel.tp=1", "parallel.replicas=1",
                   f"hydra.run.dir={tmp_path / 'clean'}", timeout=180)
    assert clean.returncode == 0, clean.stderr[-5000:]
    got, want = (dict(Llama.from_pretrained(tmp_path / name / "final").named_parameters())
                 for name in ("crashed", "clean"))
    diff = max((got[n] - want[n]).abs().max().item() for n in want)
    assert diff <= 1e-4, f"max abs difference {diff:.3g} to the failure-free weights"
    init = dict(Llama(Llama.from_pretrained(tmp_path / "clean" / "final").config, seed=0).named_parameters())
    assert max((want[n] - init[n]).abs().max().item() for n in want) > 1e-3, "training must move the weights"
    summaries = [json.loads((tmp_path / name / "summary.json").read_text()) for name in ("crashed", "clean")]
    assert summaries[0]["recoveries"] == 1 and summaries[1]["recoveries"] == 0
    assert summaries[0]["degrees_end"] == [2, 1] and summaries[1]["degrees_end"] == [1]
