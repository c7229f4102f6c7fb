"""Preference records in the shapes users have, tokenized as TRL tokenizes them, packed a pair to a
row's share, and every bad record named with its place before anything trains."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from workloads.model_io.toy import toy_preference_pairs, toy_tokenizer
from workloads.train.config import DataConfig, TrainConfig
from workloads.train.loss import IGNORE_INDEX
from workloads.train.pair_records import preference_record, read_pairs
from workloads.train.pairs import EncodedPair, PairBatch, encode_pair, load_pair_data, pack_pairs, pair_batches
from workloads.train.reference import pair_sums

USER = {"role": "user", "content": "What is the capital of France?"}
RIGHT, WRONG = {"role": "assistant", "content": "Paris."}, {"role": "assistant", "content": "Rome."}


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture(scope="module")
def tokenizer():
    return toy_tokenizer()


def test_every_shape_reads_as_the_same_prompt_and_answers():
    explicit = preference_record({"prompt": [USER], "chosen": [RIGHT], "rejected": [WRONG]}, where="a")
    implicit = preference_record({"chosen": [USER, RIGHT], "rejected": [USER, WRONG]}, where="b")
    ultrafeedback = preference_record({"prompt": USER["content"], "chosen": [USER, RIGHT],
                                       "rejected": [USER, WRONG], "score_chosen": 8.0}, where="c")
    repeated = preference_record({"prompt": [USER], "chosen": [USER, RIGHT], "rejected": [USER, WRONG]}, where="d")
    for record in (explicit, implicit, ultrafeedback, repeated):
        assert (record.prompt, record.chosen, record.rejected) == ([USER], [RIGHT], [WRONG]), record.where
    # Texts, as TRL's extract_prompt splits them: the space before the answers stays with them.
    text = preference_record({"chosen": "The capital of France is Paris.",
                              "rejected": "The capital of France is Rome."}, where="e")
    assert (text.prompt, text.chosen, text.rejected) == ("The capital of France is", " Paris.", " Rome.")


def test_answers_are_tokenized_as_trl_tokenizes_them(tokenizer):
    from trl.data_utils import extract_prompt

    record = {"chosen": [USER, RIGHT], "rejected": [USER, WRONG]}
    pair = encode_pair(tokenizer, preference_record(record, where="x"))
    trl = extract_prompt(record)
    prompt = tokenizer.apply_chat_template(trl["prompt"], add_generation_prompt=True, tokenize=True,
                                           return_dict=True)["input_ids"]
    whole = tokenizer.apply_chat_template(trl["prompt"] + trl["chosen"], tokenize=True, return_dict=True)["input_ids"]
    assert pair.prompt == list(prompt) and pair.prompt + pair.chosen == list(whole)
    assert tokenizer.decode(pair.chosen) == "Paris.<|im_end|>\n"
    # Text answers end with EOS, as TRL appends it.
    text = encode_pair(tokenizer, preference_record({"prompt": "What is", "chosen": " Paris.",
                                                     "rejected": " Rome."}, where="y"))
    assert text.chosen[-1] == text.rejected[-1] == tokenizer.eos_token_id


def test_pairs_share_a_row_and_each_sequence_is_summed_over_its_answer_only():
    pairs = [EncodedPair(prompt=[1, 2, 3], chosen=[4, 5], rejected=[6]),
             EncodedPair(prompt=[7, 8], chosen=[9], rejected=[10, 11, 12])]
    rows, stats = pack_pairs(pairs, [10, 11], seq_len=16, pad_id=0)
    assert stats.rows == 1 and stats.pairs == 2 and stats.dropped == stats.truncated == 0
    # Inputs are each sequence's tokens but its last; labels its answer tokens, predicted from the one
    # before; the longer pair first (best-fit decreasing), chosen then rejected.
    assert rows.input_ids[0, :13].tolist() == [1, 2, 3, 4, 1, 2, 3, 7, 8, 7, 8, 10, 11]
    assert rows.position_ids[0, :13].tolist() == [0, 1, 2, 3, 0, 1, 2, 0, 1, 0, 1, 2, 3]
    assert rows.labels[0, :13].tolist() == [-100, -100, 4, 5, -100, -100, 6, -100, 9, -100, 10, 11, 12]
    assert (rows.labels[0, 13:] == IGNORE_INDEX).all() and int(rows.lengths[0]) == 13
    source_batch = next(pair_batches(_source(rows), position=0, micro_batch=1, rank=0, world_size=1))
    assert source_batch.pair_ids.tolist() == [10, 11]
    # Per-token log-probabilities at every position: the pair sums take each sequence's answer only.
    token_logps = torch.arange(1.0, 17.0)
    logps, tokens = pair_sums(token_logps, source_batch)
    mask = source_batch.labels.flatten() != IGNORE_INDEX
    assert tokens.tolist() == [[2.0, 1.0], [1.0, 3.0]]
    assert logps.sum() == (token_logps * mask).sum()
    assert logps[0].tolist() == [3.0 + 4.0, 7.0]


def _source(rows):
    from workloads.train.pairs import PairSource

    return PairSource(rows=rows, seed=0, shuffle=False)


def test_a_prompt_longer_than_half_a_row_is_dropped_with_the_seq_len_that_keeps_it():
    long = EncodedPair(prompt=list(range(1, 40)), chosen=[50, 51], rejected=[52])
    short = EncodedPair(prompt=[1, 2], chosen=[3], rejected=[4])
    cut = EncodedPair(prompt=[1, 2], chosen=list(range(10, 30)), rejected=[4])
    rows, stats = pack_pairs([long, short, cut], [0, 1, 2], seq_len=32, pad_id=0)
    assert stats.pairs == 2 and stats.dropped == 1 and stats.truncated == 1
    # The long one keeps its two sequences whole at 2 * (39 + 2 - 1) = 80 positions; the cut one at 2 * 21.
    assert stats.keeps_dropped == 128 and stats.keeps_truncated == 64
    # The cut chosen sequence keeps 16 positions, 15 of them its answer's; then its rejected answer's
    # one label and the short pair's two.
    assert int((rows.sequence >= 0).sum()) == 15 + 1 + 2


def test_bad_records_are_named_with_their_place(tmp_path):
    cases = {
        "missing": ({"prompt": [USER], "chosen": [RIGHT]}, "no 'rejected'"),
        "same": ({"prompt": [USER], "chosen": [RIGHT], "rejected": [RIGHT]}, "the same answer"),
        "other prompt": ({"chosen": [USER, RIGHT], "rejected": [{"role": "user", "content": "Hi"}, WRONG]},
                         "different prompts"),
        "ultrafeedback mismatch": ({"prompt": "What is up?", "chosen": [USER, RIGHT], "rejected": [USER, WRONG]},
                                   "different prompts"),
        "own prompt": ({"prompt": [USER], "chosen": [{"role": "user", "content": "Hi"}, RIGHT], "rejected": [WRONG]},
                       "different prompts"),
        "mixed": ({"prompt": "What is", "chosen": [RIGHT], "rejected": [WRONG]}, "give 'prompt' as messages"),
    }
    for name, (record, message) in cases.items():
        path = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": [USER], "chosen": [RIGHT], "rejected": [WRONG]},
                                                      record])
        with pytest.raises(ValueError, match=message) as info:
            read_pairs([path])
        assert f"{path}:2" in str(info.value), name


def test_parquet_and_jsonl_read_alike(tmp_path):
    records = toy_preference_pairs(6)
    jsonl = read_pairs([write_jsonl(tmp_path / "p.jsonl", records)])
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "p.parquet")
    parquet = read_pairs([tmp_path / "p.parquet"])
    assert [(r.prompt, r.chosen, r.rejected) for r in parquet] == [(r.prompt, r.chosen, r.rejected) for r in jsonl]
    assert parquet[3].where.endswith("p.parquet:row 3")


def test_loaded_pairs_hold_out_whole_pairs_and_report_drops(tmp_path, tokenizer):
    folder = tmp_path / "tokenizer"
    tokenizer.save_pretrained(folder)
    records = toy_preference_pairs(40)
    records.append({"prompt": [{"role": "user", "content": " capital" * 80}], "chosen": [RIGHT], "rejected": [WRONG]})
    path = write_jsonl(tmp_path / "pairs.jsonl", records)
    data = load_pair_data(DataConfig(kind="jsonl", path=str(path), tokenizer=str(folder), eval_fraction=0.1),
                          seq_len=96, seed=0, vocab_size=512, tokenizer_name=str(folder))
    stats = data.stats
    assert stats["records"] == 41 and stats["held_out"] == 4 and stats["eval_pairs"] == 4
    assert stats["pairs"] + stats["dropped"] == 37 and stats["dropped"] == 1
    assert "seq_len=192 keeps them" in stats["pairs_note"]
    train_ids = set(data.train.rows.pair_ids.flatten().tolist()) - {-1}
    eval_ids = set(data.eval.rows.pair_ids.flatten().tolist()) - {-1}
    assert not train_ids & eval_ids and len(eval_ids) == 4
    batch = PairBatch.stack([data.train.sample(0), data.train.sample(1)])
    assert batch.pairs == len(set(batch.pair_ids.tolist()))


def test_dpo_config_is_checked_at_the_edge():
    base = {"objective": "dpo", "data": {"kind": "jsonl", "path": "p.jsonl", "tokenizer": "t"}}
    TrainConfig.from_dict(base)
    for change, message in [({"objective": "ppo"}, "objective is 'ppo'"),
                            ({"dpo": {"beta": 0}}, "dpo.beta"),
                            ({"dpo": {"loss_type": "hinge"}}, "dpo.loss_type"),
                            ({"dpo": {"loss_type": "ipo", "label_smoothing": 0.1}}, "label smoothing"),
                            ({"dpo": {"reference": "copy"}}, "dpo.reference"),
                            ({"data": {**base["data"], "format": "messages"}}, "leave data.format at auto")]:
        with pytest.raises(ValueError, match=message):
            TrainConfig.from_dict({**base, **change})
