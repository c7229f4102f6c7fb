"""Chats into tokens and packed rows: the loss is on the assistant's tokens only, samples are packed
to seq_len, and no packed sample can attend to another (also in the loop's own check)."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch
import torch.distributed as dist

from workloads.model_io.toy import CHAT_TEMPLATE, IM_END, toy_conversations, toy_tokenizer
from workloads.train import attention
from workloads.train.config import ModelConfig
from workloads.train.data import Batch, Sample
from workloads.train.encode import Example, encode_chat, encode_records, end_of_turn_id
from workloads.train.loop import packed_attention_leaks
from workloads.train.loss import IGNORE_INDEX, LinearCrossEntropy
from workloads.train.model import CausalLMWithLoss, model_config
from workloads.train.packing import best_fit_decreasing, fit_to_length, pack
from workloads.train.records import Record

CHAT = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "What is the opposite of hot?"},
    {"role": "assistant", "content": "Cold."},
]


@pytest.fixture(scope="module")
def tokenizer():
    return toy_tokenizer()


def test_only_the_assistant_turns_are_targets(tokenizer):
    example = encode_chat(tokenizer, Record(where="t:1", messages=CHAT))
    assert example.tokens == tokenizer.apply_chat_template(CHAT, tokenize=True, return_dict=True)["input_ids"]
    targets = [t for t, is_target in zip(example.tokens, example.targets, strict=True) if is_target]
    # Each assistant turn's content, its end-of-turn token and the newline the template puts after it.
    assert tokenizer.decode(targets) == f"Paris.{IM_END}\nCold.{IM_END}\n"
    context = tokenizer.decode(
        [t for t, is_target in zip(example.tokens, example.targets, strict=True) if not is_target])
    for message in CHAT[:2] + CHAT[3:4]:
        assert message["content"] in context
    assert "Paris" not in context and "Cold" not in context


DEFAULT_SYSTEM_TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}" + CHAT_TEMPLATE
)
"""ChatML with a default system prompt when the conversation has none, as Qwen2.5's own template."""


@pytest.mark.parametrize("template", [CHAT_TEMPLATE, DEFAULT_SYSTEM_TEMPLATE], ids=["chatml", "default-system"])
def test_a_conversation_that_opens_with_an_assistant_turn_trains_on_its_answers_only(template):
    tokenizer = toy_tokenizer()
    tokenizer.chat_template = template
    messages = [{"role": "assistant", "content": "Paris."}, {"role": "user", "content": "What is the opposite of hot?"},
                {"role": "assistant", "content": "Cold."}]
    example = encode_chat(tokenizer, Record(where="t:2", messages=messages))
    targets = [t for t, is_target in zip(example.tokens, example.targets, strict=True) if is_target]
    # Not the template's system prompt, nor the opening turn's header.
    assert tokenizer.decode(targets) == f"Paris.{IM_END}\nCold.{IM_END}\n"


def test_a_chat_needs_a_template_and_the_end_of_turn_token_is_found(tokenizer):
    assert end_of_turn_id(tokenizer) == tokenizer.convert_tokens_to_ids(IM_END)
    bare = toy_tokenizer()
    bare.chat_template = None
    with pytest.raises(ValueError, match=r"t:7: a chat record, but the tokenizer has no chat template"):
        encode_chat(bare, Record(where="t:7", messages=CHAT))


def test_text_and_chat_records_mix(tokenizer):
    examples = encode_records(tokenizer, [Record(where="a", text="Paris."), Record(where="b", messages=CHAT[1:3])])
    assert examples[0].tokens[-1] == tokenizer.eos_token_id and all(examples[0].targets)
    assert not all(examples[1].targets) and any(examples[1].targets)


def test_packing_fills_rows_restarts_positions_and_masks_boundaries():
    a = Example(tokens=[10, 11, 12, 13], targets=[False, True, True, True])
    b = Example(tokens=[20, 21, 22], targets=[False, False, True])
    c = Example(tokens=[30, 31, 32, 33, 34], targets=[True] * 5)
    rows, stats = pack([a, b, c], seq_len=6, pad_id=0, split_long=[False, False, False])
    # Best fit, longest first: c (4 positions) opens row 0, a (3) does not fit beside it and opens
    # row 1, b (2) fills row 0 exactly.
    assert rows.input_ids.tolist() == [[30, 31, 32, 33, 20, 21], [10, 11, 12, 0, 0, 0]]
    assert rows.labels.tolist() == [[31, 32, 33, 34, -100, 22], [11, 12, 13, -100, -100, -100]]
    assert rows.position_ids.tolist() == [[0, 1, 2, 3, 0, 1], [0, 1, 2, 0, 1, 2]]
    assert rows.lengths.tolist() == [6, 3]
    assert (stats.rows, stats.examples, stats.label_tokens, stats.truncated, stats.dropped) == (2, 3, 8, 0, 0)
    assert stats.fill == round(9 / 12, 4)


@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.integers(1, 64), max_size=60))
def test_best_fit_places_every_item_once_within_capacity(lengths):
    bins = best_fit_decreasing(lengths, capacity=64)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 64 for b in bins)
    # Any fit: a bin is opened only for an item that fits in no other, so no two bins are half empty.
    assert sum(sum(lengths[i] for i in b) <= 32 for b in bins) <= 1


def _next_fit_bins(lengths, *, capacity):
    bins, room = 0, 0
    for n in lengths:
        if n > room:
            bins, room = bins + 1, capacity
        room -= n
    return bins


def test_chat_lengths_pack_with_little_padding():
    """Chats of roughly ultrachat's lengths (the benchmark's generator) in 2,048-token rows: best
    fit leaves under 2% padding, where arrival order leaves far more."""
    from workloads.bench.chats import conversation_lengths

    lengths = [min(n, 2048) for n in conversation_lengths(3000, seed=0)]
    bins = best_fit_decreasing(lengths, capacity=2048)
    padding = 1 - sum(lengths) / (len(bins) * 2048)
    in_order = 1 - sum(lengths) / (_next_fit_bins(lengths, capacity=2048) * 2048)
    assert padding < 0.02 < 0.1 < in_order


def test_long_text_is_windowed_long_chats_truncated_and_empty_ones_dropped():
    text = Example(tokens=list(range(10)), targets=[True] * 10)
    windows = fit_to_length(text, seq_len=4, split=True)
    assert [w.tokens for w in windows] == [[0, 1, 2, 3, 4], [4, 5, 6, 7, 8], [8, 9]]  # every label once
    chat = Example(tokens=list(range(10)), targets=[False] * 6 + [True] * 4)
    rows, stats = pack([chat, text], seq_len=4, pad_id=0, split_long=[False, True])
    assert (stats.truncated, stats.dropped) == (1, 1)  # the chat's first 5 tokens hold no target
    assert stats.longest_cut == 9  # seq_len 9 keeps the chat whole: its 10 tokens are 9 positions
    assert int((rows.labels != IGNORE_INDEX).sum()) == 9


def _toy_lm(attn_implementation: str):
    tokenizer = toy_tokenizer()
    cfg = ModelConfig(name_or_path="tiny-qwen2", attn_implementation=attn_implementation)
    config = model_config(cfg)
    config.vocab_size = len(tokenizer)
    torch.manual_seed(0)
    from transformers import Qwen2ForCausalLM

    return Qwen2ForCausalLM(config).eval(), tokenizer


@pytest.mark.parametrize("attn_implementation", ["varlen", "sdpa", "eager"])
def test_a_packed_sample_never_sees_its_neighbour(attn_implementation):
    lm, tokenizer = _toy_lm(attn_implementation)
    chats = [encode_chat(tokenizer, Record(where=str(i), messages=c["messages"]))
             for i, c in enumerate(toy_conversations(3, seed=1))]
    rows, _ = pack(chats, seq_len=256, pad_id=0, split_long=[False] * 3)
    assert len(rows) == 1
    positions = rows.position_ids[0].tolist()
    b_start = positions.index(0, 1)
    b_end = positions.index(0, b_start + 1)
    altered = rows.input_ids.clone()
    altered[0, :b_start] = (altered[0, :b_start] + 7) % len(tokenizer)  # sample A, before B in the row

    def logits(ids, position_ids):
        # The sequences' boundaries, as the loop's batches carry them (varlen reads them; the others
        # build their mask from the position ids).
        bounds = {} if position_ids is None else Batch.stack(
            [Sample(input_ids=ids[0], labels=ids[0], position_ids=position_ids[0])]).attention()
        with torch.no_grad():
            return lm(input_ids=ids, position_ids=position_ids, **bounds).logits[0, b_start:b_end]

    # Sample B's logits do not move when sample A changes...
    assert torch.equal(logits(rows.input_ids, rows.position_ids), logits(altered, rows.position_ids))
    # ...and B alone in a row gives the same logits: its own tokens are all it sees.
    alone = rows.input_ids[:, b_start:b_end]
    with torch.no_grad():
        own = lm(input_ids=alone, position_ids=torch.arange(b_end - b_start)[None]).logits[0]
    torch.testing.assert_close(logits(rows.input_ids, rows.position_ids), own, rtol=1e-5, atol=1e-5)
    # Without the restarting position ids (one causal sequence) they would move: the check can fail.
    assert not torch.allclose(logits(rows.input_ids, None), logits(altered, None))


@pytest.mark.parametrize(("dtype", "capability", "why", "fix"), [
    (torch.float32, (9, 0), "attention runs in float32", "set mixed_precision=true, or attn_implementation='sdpa'"),
    (torch.bfloat16, (7, 5), "the GPU is sm75", "use attn_implementation='sdpa'"),
])
def test_packed_rows_on_a_gpu_without_the_flash_path_are_refused_with_the_way_out(monkeypatch, dtype, capability,
                                                                                   why, fix):
    query, key = torch.randn(2, 4, 8, 16, dtype=dtype), torch.randn(2, 2, 8, 16, dtype=dtype)
    bounds = {"cu_seq_lens_q": torch.tensor([0, 3, 8, 11, 16], dtype=torch.int32), "max_length_q": 8}
    out, _ = attention.varlen_attention_forward(None, query, key, key, None, **bounds)  # the CPU: the masked reference
    assert out.shape == (2, 8, 4, 16)
    monkeypatch.setattr(attention, "_gpu_capability", lambda _: capability)  # as if on such a GPU
    with pytest.raises(ValueError, match=rf"\({why}.*\(micro_batch x seq_len\)\^2 mask: {re.escape(fix)}"):
        attention.varlen_attention_forward(None, query, key, key, None, **bounds)


class _IgnoresPositions(CausalLMWithLoss):
    """Drops what keeps samples apart: the position ids and the sequences' boundaries."""

    def forward(self, input_ids, labels, position_ids=None, **_):
        return super().forward(input_ids, labels, None)


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("attn_implementation", ["varlen", "sdpa"])
def test_the_loops_check_catches_attention_across_samples(one_rank_group, attn_implementation):
    lm, tokenizer = _toy_lm(attn_implementation)
    chats = [encode_chat(tokenizer, Record(where=str(i), messages=c["messages"]))
             for i, c in enumerate(toy_conversations(8, seed=2))]
    rows, _ = pack(chats, seq_len=64, pad_id=0, split_long=[False] * len(chats))
    batch = Batch.stack([Sample(input_ids=i, labels=la, position_ids=p)
                         for i, la, p in zip(rows.input_ids, rows.labels, rows.position_ids)])
    loss = LinearCrossEntropy(implementation="chunked")
    vocab = len(tokenizer)
    assert not packed_attention_leaks(CausalLMWithLoss(lm, loss=loss), batch, vocab_size=vocab)
    assert packed_attention_leaks(_IgnoresPositions(lm, loss=loss), batch, vocab_size=vocab)
