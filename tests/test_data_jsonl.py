"""The data pipeline: synthetic samples, JSONL reading, packing, sharding across ranks, resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from workloads.train.config import DataConfig
from workloads.train.data import (
    PackedSource,
    SyntheticSource,
    batches,
    global_indices,
    load_jsonl_source,
    pack_tokens,
    read_jsonl_texts,
    samples_per_step,
)

WORDS = [f"w{i}" for i in range(40)]


def write_corpus(folder: Path, *, documents: int = 60) -> tuple[Path, Path]:
    """A WordLevel tokenizer saved as a PreTrainedTokenizerFast folder, and a JSONL file of
    documents made of its words. Returns (jsonl path, tokenizer folder)."""
    vocab = {w: i for i, w in enumerate(["<unk>", "<eos>", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer_dir = folder / "tokenizer"
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>").save_pretrained(
        tokenizer_dir
    )
    gen = torch.Generator().manual_seed(0)
    jsonl = folder / "corpus.jsonl"
    with jsonl.open("w") as f:
        for d in range(documents):
            length = 5 + d % 17
            start = int(torch.randint(len(WORDS), (1,), generator=gen))
            text = " ".join(WORDS[(start + 3 * i) % len(WORDS)] for i in range(length))
            f.write(json.dumps({"id": d, "text": text}) + "\n")
    return jsonl, tokenizer_dir


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, Path]:
    return write_corpus(tmp_path_factory.mktemp("corpus"))


def test_pack_tokens_overlaps_by_one_so_every_token_is_a_label_once():
    samples = pack_tokens([[1, 2, 3], [4, 5]], seq_len=3, eos_id=0)
    assert samples.tolist() == [[1, 2, 3, 0], [0, 4, 5, 0]]
    labels = samples[:, 1:].flatten().tolist()
    assert labels == [2, 3, 0, 4, 5, 0]


def test_pack_tokens_too_little_text_names_the_fix():
    with pytest.raises(ValueError, match="lower seq_len"):
        pack_tokens([[1, 2]], seq_len=8, eos_id=0)


def test_jsonl_is_tokenized_packed_and_separated_by_eos(corpus):
    jsonl, tokenizer_dir = corpus
    source = load_jsonl_source(
        DataConfig(kind="jsonl", path=str(jsonl)),
        seq_len=16,
        seed=0,
        tokenizer_name=str(tokenizer_dir),
        vocab_size=512,
    )
    texts = read_jsonl_texts(jsonl, text_field="text")
    total_tokens = sum(len(t.split()) + 1 for t in texts)  # each word is one token, plus EOS
    assert source.samples.shape == ((total_tokens - 1) // 16, 17)
    first = source.samples[0].tolist()
    expected = [2 + WORDS.index(w) for w in texts[0].split()] + [1]  # ids: <unk>=0, <eos>=1, words from 2
    assert first[: len(expected)] == expected
    assert source.samples.min() >= 1  # no <unk>: the tokenizer knows every word


def test_tokenizer_larger_than_the_model_vocabulary_is_refused(corpus):
    jsonl, tokenizer_dir = corpus
    with pytest.raises(ValueError, match="model's vocabulary has 10"):
        load_jsonl_source(
            DataConfig(kind="jsonl", path=str(jsonl)),
            seq_len=16,
            seed=0,
            tokenizer_name=str(tokenizer_dir),
            vocab_size=10,
        )


@pytest.mark.parametrize(
    ("line", "match"),
    [("not json", r"corpus.jsonl:2: not valid JSON"), ('{"body": "w1"}', r":2: no string field 'text'")],
)
def test_bad_jsonl_lines_are_named(tmp_path, line, match):
    path = tmp_path / "corpus.jsonl"
    path.write_text('{"text": "w1 w2"}\n' + line + "\n")
    with pytest.raises(ValueError, match=match):
        read_jsonl_texts(path, text_field="text")


def test_missing_jsonl_file_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="is not a file"):
        read_jsonl_texts(tmp_path / "absent.jsonl", text_field="text")


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_ranks_read_disjoint_samples_that_cover_an_epoch(shuffle, world_size):
    n, micro_batch = 24, 2
    source = PackedSource(samples=torch.arange(n)[:, None].repeat(1, 5), seed=3, shuffle=shuffle)
    steps = n // samples_per_step(micro_batch=micro_batch, world_size=world_size)
    seen: list[list[int]] = []
    for rank in range(world_size):
        it = batches(source, position=0, micro_batch=micro_batch, rank=rank, world_size=world_size)
        seen.append([int(row[0]) for _ in range(steps) for row in next(it).input_ids])
    flat = [s for rank_samples in seen for s in rank_samples]
    assert sorted(flat) == list(range(n))  # complete, and (same length) disjoint


def test_shuffled_epochs_differ_but_each_covers_every_sample():
    source = PackedSource(samples=torch.arange(10)[:, None], seed=0, shuffle=True)
    epoch0 = [int(source.sample(i)[0]) for i in range(10)]
    epoch1 = [int(source.sample(i)[0]) for i in range(10, 20)]
    assert sorted(epoch0) == sorted(epoch1) == list(range(10))
    assert epoch0 != epoch1


def test_resuming_at_a_data_position_continues_the_same_stream():
    source = SyntheticSource(vocab_size=97, seq_len=8, seed=1)
    full = batches(source, position=0, micro_batch=4, rank=1, world_size=2)
    first_three = [next(full).input_ids for _ in range(3)]
    position = 2 * samples_per_step(micro_batch=4, world_size=2)
    resumed = next(batches(source, position=position, micro_batch=4, rank=1, world_size=2))
    assert torch.equal(resumed.input_ids, first_three[2])


def test_a_data_position_stays_valid_on_another_number_of_ranks():
    consumed = 2 * samples_per_step(micro_batch=3, world_size=4)
    before = {
        g
        for step in range(2)
        for r in range(4)
        for g in global_indices(position=0, batch=step, micro_batch=3, rank=r, world_size=4)
    }
    after = {
        g
        for r in range(2)
        for g in global_indices(position=consumed, batch=0, micro_batch=3, rank=r, world_size=2)
    }
    assert before == set(range(consumed))
    assert after == set(range(consumed, consumed + 6))


def test_synthetic_samples_are_learnable_progressions_and_deterministic():
    source = SyntheticSource(vocab_size=50, seq_len=12, seed=7)
    a, b = source.sample(5), source.sample(5)
    assert torch.equal(a, b)
    diffs = set(((a[1:] - a[:-1]) % 50).tolist())
    assert len(diffs) == 1 and diffs <= set(source.strides)
    assert a.shape == (13,) and a.dtype == torch.int64
    assert not torch.equal(source.sample(5), SyntheticSource(vocab_size=50, seq_len=12, seed=8).sample(5))


def test_batch_labels_are_inputs_shifted_by_one():
    batch = next(
        batches(
            SyntheticSource(vocab_size=31, seq_len=6, seed=0), position=0, micro_batch=2, rank=0, world_size=1
        )
    )
    assert batch.input_ids.shape == batch.labels.shape == (2, 6)
    assert torch.equal(batch.input_ids[:, 1:], batch.labels[:, :-1])
