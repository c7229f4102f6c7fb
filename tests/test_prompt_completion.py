"""TRL's prompt-completion records (`prompt`, `completion`; strings, or conversational lists of
messages) are read, and trained as TRL's SFTTrainer trains them: the loss on the completion only."""

from __future__ import annotations

import json

import pytest

from workloads.model_io.toy import IM_END, toy_tokenizer
from workloads.train.encode import encode_records
from workloads.train.records import read_records


@pytest.fixture(scope="module")
def tokenizer():
    return toy_tokenizer()


def _records(tmp_path, *objects: dict, **kwargs):
    path = tmp_path / "trl.jsonl"
    path.write_text("".join(json.dumps(obj) + "\n" for obj in objects))
    return read_records([path], **kwargs)


def _learned(tokenizer, example) -> str:
    return tokenizer.decode([t for t, target in zip(example.tokens, example.targets, strict=True) if target])


def test_a_standard_prompt_completion_learns_the_completion_and_eos_only(tmp_path, tokenizer):
    (record,) = _records(tmp_path, {"prompt": "The sky is", "completion": " blue."})
    (example,) = encode_records(tokenizer, [record])
    # As TRL tokenizes it: prompt and completion together, the completion's tokens and EOS learned.
    assert example.tokens == tokenizer("The sky is blue.", add_special_tokens=False)["input_ids"] + [
        tokenizer.eos_token_id]
    assert _learned(tokenizer, example) == " blue." + tokenizer.eos_token
    assert not any(example.targets[:len(tokenizer("The sky is", add_special_tokens=False)["input_ids"])])


def test_a_conversational_prompt_completion_learns_the_completion_turns_only(tmp_path, tokenizer):
    prompt = [{"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": "Paris."},
              {"role": "user", "content": "Opposite of hot?"}]
    (record,) = _records(tmp_path, {"prompt": prompt, "completion": [{"role": "assistant", "content": "Cold."}]})
    assert record.messages == [*prompt, {"role": "assistant", "content": "Cold."}]
    (example,) = encode_records(tokenizer, [record])
    # The prompt's own assistant turn is context, as TRL's completion mask has it.
    assert _learned(tokenizer, example) == f"Cold.{IM_END}\n"


def test_prompt_completion_is_told_by_its_keys_or_named_and_mistakes_are_clear(tmp_path):
    chat = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    pc, messages = _records(tmp_path, {"prompt": "a", "completion": "b"}, chat)
    assert pc.prompt == "a" and pc.text == "b" and messages.is_chat
    (named,) = _records(tmp_path, {"prompt": "a", "completion": "b", "text": "ab"}, data_format="prompt_completion")
    assert named.text == "b"
    for obj, message in [
        ({"prompt": "a", "completion": [{"role": "assistant", "content": "b"}]},
         "'prompt' and 'completion' must both be strings or both lists of messages"),
        ({"prompt": [{"role": "user", "content": "a"}], "completion": [{"role": "user", "content": "b"}]},
         "the completion's message 0 has role 'user': a completion is the assistant's turns"),
        ({"prompt": "a", "completion": ""}, "'completion' is empty: nothing to learn"),
        ({"prompt": "a", "completion": "b", "text": "ab"}, "the record fits the formats text and prompt_completion"),
    ]:
        with pytest.raises(ValueError, match=rf"trl.jsonl:1: {message}"):
            _records(tmp_path, obj)


def test_the_demo_asks_a_conversational_prompt_completion_its_prompt(tmp_path):
    from workloads.local.demo import question_of

    prompt = [{"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": "Paris."},
              {"role": "user", "content": "Opposite of hot?"}]
    (record,) = _records(tmp_path, {"prompt": prompt, "completion": [{"role": "assistant", "content": "Cold."}]})
    question = question_of(record)
    assert question.messages == prompt and question.answer == "Cold."
