"""The data pipeline: synthetic samples, JSONL and Parquet records, held-out split, sharding across
ranks, resume. Chat encoding and packing: tests/test_data_chat.py."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from workloads.model_io.sources import fetch_data_file
from workloads.train.config import DataConfig
from workloads.train.data import (
    PackedSource,
    SyntheticSource,
    batches,
    eval_batches,
    global_indices,
    hold_out,
    load_records_data,
    samples_per_step,
)
from workloads.train.loss import IGNORE_INDEX
from workloads.train.packing import PackedRows
from workloads.train.records import read_records

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


def test_jsonl_text_is_tokenized_and_each_document_ends_with_eos(corpus):
    jsonl, tokenizer_dir = corpus
    data = load_records_data(DataConfig(kind="jsonl", path=str(jsonl), eval_fraction=0.0, shuffle=False),
                             seq_len=16, seed=0, vocab_size=512, tokenizer_name=str(tokenizer_dir))
    texts = [r.text for r in read_records([jsonl])]
    rows = data.train.rows
    # Every sequence of every row (a run of position ids from 0) as (inputs, labels).
    sequences = []
    for ids, labels, positions in zip(rows.input_ids.tolist(), rows.labels.tolist(), rows.position_ids.tolist()):
        starts = [i for i, p in enumerate(positions) if p == 0] + [len(positions)]
        sequences += [(ids[a:b], labels[a:b]) for a, b in itertools.pairwise(starts)]
    expected = [2 + WORDS.index(w) for w in texts[0].split()] + [1]  # ids: <unk>=0, <eos>=1, words from 2
    assert (expected[:-1], expected[1:]) in sequences  # the first document, whole, in a sequence of its own
    assert int((rows.labels != -100).sum()) == data.stats["label_tokens"] == sum(len(t.split()) for t in texts)
    assert data.stats["records"] == len(texts) and data.eval is None and data.tokenizer is not None


def test_held_out_records_are_a_seeded_disjoint_share(corpus):
    jsonl, tokenizer_dir = corpus
    cfg = DataConfig(kind="jsonl", path=str(jsonl), eval_fraction=0.1)
    data = load_records_data(cfg, seq_len=16, seed=3, vocab_size=512, tokenizer_name=str(tokenizer_dir))
    held = hold_out(60, fraction=0.1, seed=3)
    assert len(held) == 6 == data.stats["held_out"] and held == hold_out(60, fraction=0.1, seed=3)
    assert held != hold_out(60, fraction=0.1, seed=4)
    train_labels = int((data.train.rows.labels != -100).sum())
    eval_labels = int((data.eval.rows.labels != -100).sum())
    texts = [r.text for r in read_records([jsonl])]
    assert eval_labels == sum(len(texts[i].split()) for i in held)
    assert train_labels + eval_labels == sum(len(t.split()) for t in texts)


def test_tokenizer_larger_than_the_model_vocabulary_is_refused(corpus):
    jsonl, tokenizer_dir = corpus
    with pytest.raises(ValueError, match="model's vocabulary has 10"):
        load_records_data(DataConfig(kind="jsonl", path=str(jsonl)), seq_len=16, seed=0, vocab_size=10,
                          tokenizer_name=str(tokenizer_dir))


@pytest.mark.parametrize(
    ("line", "match"),
    [
        ("not json", r"corpus.jsonl:2: not valid JSON"),
        ('{"body": "w1"}', r":2: no 'messages' list, no string 'text' field, no Alpaca 'instruction' and 'output'"),
        ('{"instruction": "a", "output": "b", "text": "c"}', r":2: the record fits the formats alpaca and text: set "
                                                             r"data.format"),
        ('{"conversations": [{"from": "bot", "value": "hi"}]}', r":2: turn 0 is from 'bot': ShareGPT turns are from"),
        ('{"conversations": [{"from": "human", "value": "hi"}]}', r":2: the conversation has no assistant message"),
        ('{"instruction": "a", "output": 3}', r":2: the Alpaca record's 'output' must be a string"),
        ('["w1"]', r":2: a record must be a JSON object, got list"),
        ('{"messages": []}', r":2: 'messages' must be a non-empty list"),
        ('{"messages": [{"role": "user", "content": "hi"}]}', r":2: the conversation has no assistant message"),
        ('{"messages": [{"role": "bot", "content": "hi"}]}', r":2: message 0 has role 'bot'"),
        ('{"messages": [{"role": "assistant"}]}', r":2: message 0 needs a string 'content'"),
    ],
)
def test_bad_jsonl_lines_are_named(tmp_path, line, match):
    path = tmp_path / "corpus.jsonl"
    path.write_text('{"text": "w1 w2"}\n\n' + line + "\n")
    with pytest.raises(ValueError, match=match.replace(":2:", ":3:")):
        read_records([path])


def test_alpaca_and_sharegpt_records_are_chats_of_messages(tmp_path):
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [
        {"instruction": "Name the colour of snow.", "input": "", "output": "White."},
        {"instruction": "Translate.", "input": "Schnee", "output": "Snow.", "system": "You translate."},
        {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Sky?"},
                           {"from": "gpt", "value": "Blue."}, {"from": "human", "value": "Coal?"},
                           {"from": "gpt", "value": "Black."}]},
        {"text": "a document", "id": 4},
    ]) + "\n")
    alpaca, with_input, sharegpt, text = read_records([path])
    assert alpaca.messages == [{"role": "user", "content": "Name the colour of snow."},
                               {"role": "assistant", "content": "White."}]
    assert with_input.messages == [{"role": "system", "content": "You translate."},
                                   {"role": "user", "content": "Translate.\n\nSchnee"},
                                   {"role": "assistant", "content": "Snow."}]
    assert [m["role"] for m in sharegpt.messages] == ["system", "user", "assistant", "user", "assistant"]
    assert sharegpt.messages[-1]["content"] == "Black." and text.text == "a document"
    # A format named is the only one read: a record of another is named with what it lacks.
    with pytest.raises(ValueError, match=r"mixed.jsonl:3: data.format is 'alpaca' but the record has no Alpaca's"):
        read_records([path], data_format="alpaca")
    both = tmp_path / "both.jsonl"
    both.write_text(json.dumps({"instruction": "a", "output": "b", "text": "a b"}) + "\n")
    assert read_records([both], data_format="alpaca")[0].messages[-1] == {"role": "assistant", "content": "b"}
    assert read_records([both], data_format="text")[0].text == "a b"
    with pytest.raises(ValueError, match="data.format is 'csv': use one of auto, messages, text, alpaca, sharegpt, "
                                         "prompt_completion"):
        DataConfig(kind="jsonl", path=str(path), format="csv")


def test_parquet_rows_are_read_as_records_and_named_by_row(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    chat = [{"role": "user", "content": "w1"}, {"role": "assistant", "content": "w2"}]
    pq.write_table(pa.table({"messages": [chat, chat], "prompt": ["a", "b"]}), tmp_path / "train-0.parquet")
    records = read_records([tmp_path / "train-0.parquet"], limit=1)
    assert len(records) == 1 and records[0].messages == chat
    pq.write_table(pa.table({"messages": [chat, []]}), tmp_path / "bad.parquet")
    with pytest.raises(ValueError, match=r"bad.parquet:row 1: 'messages' must be a non-empty list"):
        read_records([tmp_path / "bad.parquet"])


def test_missing_or_empty_data_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="is not a file"):
        fetch_data_file(str(tmp_path / "absent.jsonl"))
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="no records"):
        read_records([tmp_path / "empty.jsonl"])


def _rows(values: torch.Tensor) -> PackedRows:
    return PackedRows(input_ids=values, labels=values, position_ids=torch.zeros_like(values),
                      lengths=torch.full((len(values),), values.shape[-1]))


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_ranks_read_disjoint_samples_that_cover_an_epoch(shuffle, world_size):
    n, micro_batch = 24, 2
    source = PackedSource(rows=_rows(torch.arange(n)[:, None].repeat(1, 5)), seed=3, shuffle=shuffle)
    steps = n // samples_per_step(micro_batch=micro_batch, world_size=world_size)
    seen: list[list[int]] = []
    for rank in range(world_size):
        it = batches(source, position=0, micro_batch=micro_batch, rank=rank, world_size=world_size)
        seen.append([int(row[0]) for _ in range(steps) for row in next(it).input_ids])
    flat = [s for rank_samples in seen for s in rank_samples]
    assert sorted(flat) == list(range(n))  # complete, and (same length) disjoint


@pytest.mark.parametrize("held_out", [5, 40])
def test_an_evaluation_scores_the_same_samples_at_every_world_size(held_out):
    # Planned for 4 ranks, 2 micro-batches of 2 each: 16 samples, or all of a smaller held-out set.
    source = PackedSource(rows=_rows(torch.arange(held_out)[:, None].repeat(1, 5)), seed=0, shuffle=False)

    def scored(world_size: int) -> list[int]:
        out, batch_counts = [], set()
        for rank in range(world_size):
            held = eval_batches(source, rows=held_out, micro_batch=2, rank=rank, world_size=world_size,
                                max_rows=2 * 2 * 4)
            batch_counts.add(len(held))
            out += [int(ids[0]) for batch in held for ids, labels in zip(batch.input_ids, batch.labels, strict=True)
                    if (labels != IGNORE_INDEX).any()]
        assert len(batch_counts) == 1  # every rank runs as many forwards (collectives)
        return sorted(out)

    assert scored(4) == list(range(min(held_out, 16)))
    for world_size in (1, 2, 3, 5, 7):
        assert scored(world_size) == scored(4), world_size


def test_shuffled_epochs_differ_but_each_covers_every_sample():
    source = PackedSource(rows=_rows(torch.arange(10)[:, None]), seed=0, shuffle=True)
    epoch0 = [int(source.sample(i).input_ids[0]) for i in range(10)]
    epoch1 = [int(source.sample(i).input_ids[0]) for i in range(10, 20)]
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
    assert torch.equal(a.input_ids, b.input_ids) and a.position_ids is None
    tokens = torch.cat([a.input_ids, a.labels[-1:]])
    diffs = set(((tokens[1:] - tokens[:-1]) % 50).tolist())
    assert len(diffs) == 1 and diffs <= set(source.strides)
    assert a.input_ids.shape == a.labels.shape == (12,) and a.input_ids.dtype == torch.int64
    assert not torch.equal(a.input_ids, SyntheticSource(vocab_size=50, seq_len=12, seed=8).sample(5).input_ids)


def test_batch_labels_are_inputs_shifted_by_one():
    batch = next(
        batches(
            SyntheticSource(vocab_size=31, seq_len=6, seed=0), position=0, micro_batch=2, rank=0, world_size=1
        )
    )
    assert batch.input_ids.shape == batch.labels.shape == (2, 6)
    assert torch.equal(batch.input_ids[:, 1:], batch.labels[:, :-1])
