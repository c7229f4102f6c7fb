"""The benchmark's generated chats: exact token lengths, and the shape docs/PERFORMANCE.md states."""

from __future__ import annotations

from workloads.bench.chats import conversation_lengths, describe, generate_chats, write_chat_data
from workloads.model_io.toy import toy_tokenizer
from workloads.train.encode import encode_chat
from workloads.train.records import Record, read_records


def test_lengths_are_the_encoded_lengths():
    tokenizer = toy_tokenizer()
    records = generate_chats(30, seed=3)
    encoded = [encode_chat(tokenizer, Record(where=str(i), messages=r["messages"])) for i, r in enumerate(records)]
    assert [len(e.tokens) for e in encoded] == conversation_lengths(30, seed=3)
    # Answers (and their end-of-turn token) are the labels: most of a conversation.
    share = sum(sum(e.targets) for e in encoded) / sum(len(e.tokens) for e in encoded)
    assert 0.65 < share < 0.85


def test_the_shape_is_multi_turn_answer_heavy_and_long_tailed():
    shape = describe(5000, seed=0, seq_len=2048)
    assert 850 < shape["mean_tokens"] < 1050 and shape["median_tokens"] < shape["mean_tokens"]
    assert 0.72 < shape["answer_share"] < 0.82 and 2.7 < shape["mean_turns"] < 3.3
    assert 0.01 < shape["longer_than_row"] < 0.08  # a few are truncated, as real long chats are
    assert generate_chats(5, seed=1) == generate_chats(5, seed=1) != generate_chats(5, seed=2)


def test_written_data_reads_back_as_chats(tmp_path):
    jsonl, tokenizer_dir = write_chat_data(tmp_path, count=12, seed=0)
    records = read_records([jsonl])
    assert len(records) == 12 and all(r.is_chat for r in records)
    assert (tokenizer_dir / "tokenizer_config.json").is_file()
