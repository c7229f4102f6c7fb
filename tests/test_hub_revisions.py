"""Hub revisions pinned to commits once, when a run is submitted (`submit` and `run --local`), and kept
by every resume of the run: huggingface_hub's client against a stand-in of the hub's API on 127.0.0.1
(tests/fake_hub.py), never the network."""

from __future__ import annotations

import argparse

import pytest
from fake_hub import CHATS_MAIN, THERE_MAIN, THERE_V1, fake_hub

from workloads.client import revisions, submit
from workloads.local import run as local
from workloads.model_io.sources import hub_commit
from workloads.model_io.toy import write_toy_model
from workloads.train.config import TrainConfig, preset, with_overrides
from workloads.train.resumed import RESUME_PREFIX, hub_revisions, keep_hub_revisions

HUB_RUN = ["model.name_or_path=org/there", "data.kind=hub", "data.path=org/chats", "data.tokenizer=org/there"]
"""demo-cpu on a hub model and a hub dataset."""


@pytest.fixture
def hub(monkeypatch):
    with fake_hub(monkeypatch) as asked:
        yield asked


def _train(*overrides: str) -> dict:
    return with_overrides(preset("demo-cpu"), list(overrides)).to_dict()


def test_the_hub_names_the_commit_of_a_branch_a_tag_or_the_default_branch(hub):
    endpoint = revisions.hub_endpoint()
    assert hub_commit("org/there", repo_type="model", revision="", endpoint=endpoint) == THERE_MAIN
    assert hub_commit("org/there", repo_type="model", revision="v1", endpoint=endpoint) == THERE_V1
    assert hub_commit("org/chats", repo_type="dataset", revision="main", endpoint=endpoint) == CHATS_MAIN
    with pytest.raises(ValueError, match=r"^hub model 'org/there' has no revision 'v9': use a branch, tag or commit"):
        hub_commit("org/there", repo_type="model", revision="v9", endpoint=endpoint)
    with pytest.raises(ValueError, match=r"^hub dataset 'org/gone' does not exist on the Hugging Face hub"):
        hub_commit("org/gone", repo_type="dataset", revision="", endpoint=endpoint)


def test_a_runs_hub_model_and_dataset_are_pinned_to_commits_and_a_commit_is_kept(hub):
    train, said = revisions.pin_hub_revisions(_train(*HUB_RUN, "model.revision=v1"), local={})
    assert (train["model"]["revision"], train["data"]["revision"]) == (THERE_V1, CHATS_MAIN)
    assert said == [f"hub model org/there pinned at commit {THERE_V1} (v1 now): every node and restart of the run "
                    "reads it",
                    f"hub dataset org/chats pinned at commit {CHATS_MAIN} (its default branch now): every node and "
                    "restart of the run reads it"]
    asked = len(hub)
    again, said = revisions.pin_hub_revisions(train, local={})
    assert again == train and said == [] and len(hub) == asked  # commits already: the hub is not asked


def test_what_is_no_hub_repository_is_left_alone(tmp_path):
    def never(*args, **kwargs):
        raise AssertionError("the hub was asked")

    folder = write_toy_model(tmp_path / "base")
    for train, local_files in ((_train(), {}),  # a named architecture, synthetic data
                               (_train(f"model.name_or_path={folder}"), {"model.name_or_path": folder}),
                               (_train("model.name_or_path=/models/on/the/nodes"), {}),
                               (_train("model.name_or_path=s3://bucket/model"), {})):
        assert revisions.pin_hub_revisions(train, local=local_files, commit=never) == (train, [])


def test_a_hub_that_cannot_answer_says_how_to_pin_by_hand(monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    with pytest.raises(ValueError, match=r"^cannot reach the Hugging Face hub for hub model 'org/there' .*; or pin "
                                         r"model\.revision to a commit yourself \(--set model\.revision=SHA\)$"):
        revisions.pin_hub_revisions(_train(*HUB_RUN), local={})


def test_submit_sends_the_job_the_commits(hub, monkeypatch, capsys):
    sent = []

    def follow(conn, request, *, console, on_submitted):
        sent.append(request)
        raise KeyboardInterrupt  # enough: the job's config is what is checked

    monkeypatch.setattr(submit, "submit_and_follow", follow)
    argv = ["--address", "http://127.0.0.1:1", "--storage-path", "/tmp/x", "--preset", "demo-cpu"]
    assert submit.main("submit", [*argv, *(a for item in HUB_RUN for a in ("--set", item))]) == submit.EXIT_INTERRUPTED
    (request,) = sent
    assert (request.train["model"]["revision"], request.train["data"]["revision"]) == (THERE_MAIN, CHATS_MAIN)
    assert f"hub model org/there pinned at commit {THERE_MAIN}" in " ".join(capsys.readouterr().out.split())


def test_a_local_run_is_given_the_commits(hub, tmp_path, monkeypatch):
    monkeypatch.setattr(local, "check_inputs", lambda *a, **k: None)  # the stand-in serves no files to check
    said = []
    args = argparse.Namespace(preset="demo-cpu", set=[*HUB_RUN], nodes=2, cpus_per_node=1)
    train, _ = local.local_train_config(args, tmp_path / "run", say=said.append)
    assert (train["model"]["revision"], train["data"]["revision"]) == (THERE_MAIN, CHATS_MAIN)
    assert len(said) == 2


# --- the loop's side: what a checkpoint records, and a resume reads -----------------------------------


def test_a_checkpoint_records_the_commits_and_a_resume_reads_them_not_newer_ones():
    pinned = TrainConfig.from_dict(_train(*HUB_RUN, f"model.revision={THERE_V1}", f"data.revision={CHATS_MAIN}"))
    recorded = hub_revisions(pinned)
    assert recorded == {"model:org/there": THERE_V1, "dataset:org/chats": CHATS_MAIN}
    # Resubmitted days later: the client pinned the branches again, to newer commits.
    newer = TrainConfig.from_dict(_train(*HUB_RUN, f"model.revision={THERE_MAIN}", f"data.revision={'d4' * 20}"))
    kept, said = keep_hub_revisions(newer, {"hub_revisions": recorded})
    assert hub_revisions(kept) == recorded
    assert len(said) == 2 and all(line.startswith(RESUME_PREFIX) for line in said)
    assert f"hub model org/there at commit {THERE_V1}, as the checkpoint's run read it (this start was given " \
           f"model.revision={THERE_MAIN})" in said[0]
    # A fresh start, or a checkpoint from before the record, keeps what the config says.
    assert keep_hub_revisions(newer, {}) == (newer, [])
    # Another dataset than the checkpoint's run read is the user's choice: nothing is carried over.
    other = TrainConfig.from_dict(_train(*HUB_RUN[:2], "data.path=org/other", "data.tokenizer=org/there"))
    assert keep_hub_revisions(other, {"hub_revisions": recorded})[0].data == other.data


def test_only_hub_repositories_are_recorded(tmp_path):
    assert hub_revisions(TrainConfig.from_dict(_train())) == {}
    folder = write_toy_model(tmp_path / "base")
    assert hub_revisions(TrainConfig.from_dict(_train(f"model.name_or_path={folder}"))) == {}
    assert list(hub_revisions(TrainConfig.from_dict(_train(*HUB_RUN)))) == ["model:org/there", "dataset:org/chats"]


def test_the_loop_reads_the_hub_at_the_configs_revision(monkeypatch, tmp_path):
    """Where the commit takes effect on a node: the model's and the dataset's fetch are given it."""
    from workloads.train import data, loop

    fetched = []
    monkeypatch.setattr(loop, "fetch_model", lambda spec, **kw: fetched.append(("model", spec, kw["revision"])))
    monkeypatch.setattr(data, "fetch_hub_dataset", lambda repo, **kw: fetched.append(("dataset", repo, kw["revision"])))
    cfg = TrainConfig.from_dict(_train(*HUB_RUN, f"model.revision={THERE_V1}", f"data.revision={CHATS_MAIN}"))
    loop.fetch_pretrained(cfg)
    data.data_files(cfg.data, cache_dir=str(tmp_path))
    assert fetched == [("model", "org/there", THERE_V1), ("dataset", "org/chats", CHATS_MAIN)]

