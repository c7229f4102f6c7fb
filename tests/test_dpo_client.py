"""What users see of a DPO run before and around it: the progress and [data] lines, MLflow's metric
names, the report's plot, the inputs checked before anything starts (bad pairs, a reference with
another tokenizer), the demo's pairs, and the memory of each reference."""

from __future__ import annotations

import json

import pytest

from workloads.sizing.memory import Architecture, predict, settings_for
from workloads.local.demo import DemoInputs, plan_demo_inputs
from workloads.client.fit import Target, assess, nearest_fits
from workloads.client.inputs_check import check_inputs
from workloads.client.report import curves, draw_curves, format_data, format_record
from workloads.model_io.architectures import named_architecture
from workloads.model_io.toy import toy_preference_pairs, toy_tokenizer, write_chat_jsonl, write_toy_model
from workloads.train.config import preset, with_overrides
from workloads.train.tracking import step_metrics

STEP = {"step": 20, "loss": 0.51, "lr": 1e-3, "rewards/chosen": 0.3, "rewards/rejected": -0.2,
        "rewards/accuracies": 0.75, "rewards/margins": 0.5, "logps/chosen": -30.0, "logps/rejected": -35.0,
        "eval_loss": 0.52, "eval_rewards/accuracies": 0.8, "eval_rewards/margins": 0.45}


def test_progress_lines_and_mlflow_carry_the_rewards():
    line = format_record(STEP, total_steps=60)
    assert "margin 0.5000  accuracy 0.75" in line and "eval accuracy 0.80" in line
    assert "margin" not in format_record({"step": 1, "loss": 2.0})  # SFT lines as they were
    metrics = step_metrics(STEP)
    assert metrics["rewards/margins"] == 0.5 and metrics["eval_rewards/accuracies"] == 0.8
    assert metrics["logps/rejected"] == -35.0 and metrics["train_loss"] == 0.51


def test_the_data_line_says_what_was_dropped_and_the_seq_len_that_keeps_it():
    record = {"objective": "dpo", "records": 41, "held_out": 4, "pairs": 36, "rows": 12, "seq_len": 96,
              "label_tokens": 300, "pairs_note": "1 pair(s) dropped: ...; seq_len=192 keeps them"}
    line = format_data(record)
    assert line.startswith("41 preference records, 4 held out") and "36 pairs in 12 rows" in line
    assert line.endswith("seq_len=192 keeps them")


def test_the_report_plot_has_a_panel_of_margins_and_accuracies():
    records = [dict(STEP, step=s, **{"rewards/margins": s / 10}) for s in (10, 20, 30)]
    series = curves(records)
    assert series.preference["rewards/margins"] == [(10, 1.0), (20, 2.0), (30, 3.0)]
    figure = draw_curves(series, title="t")
    assert len(figure.axes) == 4  # loss with its learning rate, rewards with their accuracies
    assert not curves([{"step": 1, "loss": 2.0}]).preference


def dpo_train(tmp_path, **dpo) -> dict:
    model = write_toy_model(tmp_path / "model")
    pairs = write_chat_jsonl(tmp_path / "pairs.jsonl", toy_preference_pairs(5))
    cfg = with_overrides(preset("demo-cpu-dpo"), [f"model.name_or_path={model}", "data.kind=jsonl",
                                                   f"data.path={pairs}"])
    train = cfg.to_dict()
    train["dpo"].update(dpo)
    return train


def test_bad_pairs_and_a_reference_with_another_tokenizer_are_refused_before_anything_starts(tmp_path):
    train = dpo_train(tmp_path)
    local = {"model.name_or_path": tmp_path / "model", "data.path": tmp_path / "pairs.jsonl"}
    check_inputs(train, local=local, hub=False)
    with (tmp_path / "pairs.jsonl").open("a") as f:
        f.write(json.dumps({"prompt": "Hi", "chosen": "Hello."}) + "\n")
    with pytest.raises(ValueError, match=r"pairs.jsonl:6: no 'rejected'"):
        check_inputs(train, local=local, hub=False)
    write_chat_jsonl(tmp_path / "pairs.jsonl", toy_preference_pairs(5))
    # A reference that reads text with another tokenizer (one more token).
    other = write_toy_model(tmp_path / "other")
    tokenizer = toy_tokenizer()
    tokenizer.add_tokens([" Berlin"])
    tokenizer.save_pretrained(other)
    train = dpo_train(tmp_path, reference_model=str(other))
    with pytest.raises(ValueError, match="does not read text as the policy does.*' Berlin' is in only one"):
        check_inputs(train, local={**local, "dpo.reference_model": other}, hub=False)
    same = write_toy_model(tmp_path / "same", seed=1)
    check_inputs(dpo_train(tmp_path, reference_model=str(same)), local={**local, "dpo.reference_model": same},
                 hub=False)


def test_the_loop_refuses_a_reference_with_another_tokenizer_before_building_the_model(tmp_path):
    from workloads.train.preference import reference_model_folder

    model = write_toy_model(tmp_path / "model")
    other = tmp_path / "other"
    write_toy_model(other)
    tokenizer = toy_tokenizer()
    tokenizer.add_tokens([" Berlin"])
    tokenizer.save_pretrained(other)
    with pytest.raises(ValueError, match="dpo.reference_model .* does not read text as the policy does"):
        reference_model_folder(str(other), cache_dir=str(tmp_path / "cache"), tokenizer=toy_tokenizer())
    assert reference_model_folder(str(model), cache_dir="", tokenizer=toy_tokenizer()) == model


def test_the_dpo_demo_makes_the_toy_model_and_toy_pairs(tmp_path):
    inputs = plan_demo_inputs(tmp_path, preset_name="demo-cpu-dpo", overrides=[])
    assert inputs.pairs and inputs.chats == tmp_path / "pairs.jsonl" and inputs.model == tmp_path / "base-model"
    assert f"data.path={tmp_path / 'pairs.jsonl'}" in inputs.overrides
    assert plan_demo_inputs(tmp_path, preset_name="demo-cpu", overrides=[]).chats == tmp_path / "chat.jsonl"
    assert plan_demo_inputs(tmp_path, preset_name="qwen2.5-1.5b-dpo", overrides=[]) == DemoInputs()
    # The rule the chosen answers follow: the right capital or opposite.
    for record in toy_preference_pairs(50):
        question, chosen, rejected = (record[k][-1]["content"] for k in ("prompt", "chosen", "rejected"))
        if "capital of France" in question:
            assert chosen == "Paris." and rejected != "Paris."


def test_the_memory_model_knows_each_reference():
    arch = Architecture.from_config(named_architecture("qwen2.5-1.5b"))
    full = with_overrides(preset("qwen2.5-1.5b-dpo"), ["micro_batch=2", "rows_per_step=0"])
    terms = {name: predict(arch, settings_for(cfg, shard_ranks=8)).terms for name, cfg in {
        "copy": full, "precomputed": with_overrides(full, ["dpo.reference=precomputed"]),
        "lora": with_overrides(full, ["method=lora"]), "sft": with_overrides(full, ["objective=sft"])}.items()}
    # The frozen copy: every parameter's bf16 shard, an eighth of 2 bytes x 1.54 B.
    assert terms["copy"]["reference"] == pytest.approx(2 * arch.params / 8, rel=0.01)
    assert terms["precomputed"]["reference"] == terms["lora"]["reference"] == terms["sft"]["reference"] == 0
    # A full fine-tune's reference copy, where it is what does not fit: a precomputed table is offered.
    target = Target.instances("g6.12xlarge", 1)
    tight = with_overrides(full, ["micro_batch=1", "seq_len=4992"])
    assert not assess(tight, arch, target).fits
    assert assess(with_overrides(tight, ["dpo.reference=precomputed"]), arch, target).fits
    assert "--set dpo.reference=precomputed" in [a.label for a in nearest_fits(tight, arch, target)]


def test_plan_says_how_the_reference_is_had_and_counts_its_memory_and_work(tmp_path):
    from workloads.client.plan import format_plan, make_plan

    shape = ["model.name_or_path=qwen2.5-1.5b", "data.tokenizer=toy"]
    plans = {reference: make_plan(with_overrides(preset("qwen2.5-1.5b-dpo"), [*shape, f"dpo.reference={reference}"]),
                                  preset_name="qwen2.5-1.5b-dpo", instance_type="g6.12xlarge", nodes=2, cwd=tmp_path)
             for reference in ("model", "precomputed")}
    copy, table = plans["model"], plans["precomputed"]
    assert copy["objective"] == "dpo" and copy["reference"] == "a frozen copy"
    assert "DPO, full fine-tune (reference: a frozen copy)" in format_plan(copy)
    assert copy["memory"]["terms_gib"]["reference"] > 0 == table["memory"]["terms_gib"]["reference"]
    # The reference's forward is work of every step: fewer tokens/s than with a precomputed table.
    assert copy["speed"]["tokens_per_s_per_gpu"] < table["speed"]["tokens_per_s_per_gpu"]
