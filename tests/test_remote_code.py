"""A model folder's own Python code never runs unless the user says so. A job can put code in its
checkpoint's model/ folder and name it in config.json's `auto_map`; transformers asks on standard
input whether to run such code when `trust_remote_code` is left unset, and `chat` feeds standard
input to the conversation. So every load of a model, config or tokenizer passes
`trust_remote_code=False` (`chat`/`export --trust-remote-code` turn it on), and export never copies
a `*.py` file into the model folder it writes."""

from __future__ import annotations

import ast
import io
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

from workloads.client import chat as chat_cli
from workloads.client import export as export_cli
from workloads.model_io.toy import write_toy_model

REPO = Path(__file__).resolve().parents[1]

CONFIGURATION = """
from pathlib import Path

from transformers import Qwen2Config

Path({marker!r}).write_text("the folder's code ran")


class EvilConfig(Qwen2Config):
    model_type = "evil_qwen2"
"""

MODELING = """
from transformers import Qwen2ForCausalLM

from .configuration_evil import EvilConfig


class EvilForCausalLM(Qwen2ForCausalLM):
    config_class = EvilConfig
"""


def with_its_own_code(folder: Path, *, marker: Path, model_type: str = "evil_qwen2") -> Path:
    """Turn a model folder into one whose config asks to run the folder's code, which touches `marker`
    (a `model_type` transformers knows is loaded by its own class, with trust_remote_code off)."""
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type=model_type, auto_map={"AutoConfig": "configuration_evil.EvilConfig",
                                                     "AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"})
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "configuration_evil.py").write_text(CONFIGURATION.format(marker=str(marker)))
    (folder / "modeling_evil.py").write_text(MODELING)
    return folder


def test_chat_runs_no_code_of_the_folder_even_when_standard_input_says_yes(tmp_path, monkeypatch, capsys):
    marker = tmp_path / "ran"
    folder = with_its_own_code(write_toy_model(tmp_path / "model"), marker=marker)
    monkeypatch.setattr(sys, "stdin", io.StringIO("yes\nWhat is the capital of France?\n"))
    assert chat_cli.main("chat", [str(folder), "--max-new-tokens", "2"]) == chat_cli.EXIT_USAGE
    assert not marker.exists()
    (error,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("chat: error: ")]
    assert f"{folder} asks to run its own code" in error and "--trust-remote-code" in error


def test_chat_runs_the_folders_code_when_the_user_trusts_it(tmp_path, monkeypatch, capsys):
    marker = tmp_path / "ran"
    folder = with_its_own_code(write_toy_model(tmp_path / "model"), marker=marker)
    monkeypatch.setattr(sys, "stdin", io.StringIO("What is the capital of France?\n"))
    assert chat_cli.main("chat", [str(folder), "--max-new-tokens", "2", "--trust-remote-code"]) == chat_cli.EXIT_OK
    assert marker.exists()


@pytest.fixture
def run_with_code(tmp_path) -> Path:
    """A local run whose checkpoint (the toy model, under the loop's `model.lm.` prefix) carries a
    `*.py` file and an `auto_map` in its model/ folder, beside its run's export."""
    checkpoint = tmp_path / "run" / "checkpoint-0000002"
    toy = write_toy_model(tmp_path / "toy")
    dcp.save({f"model.lm.{k}": v for k, v in load_file(toy / "model.safetensors").items()},
             checkpoint_id=str(checkpoint), no_dist=True)
    shutil.copytree(toy, checkpoint / "model")
    with_its_own_code(checkpoint / "model", marker=tmp_path / "ran", model_type="qwen2")
    return checkpoint.parent


@pytest.mark.parametrize("how", [[], ["--from-shards"]], ids=["copied", "consolidated"])
def test_export_copies_no_python_file_of_the_checkpoint(run_with_code, tmp_path, how):
    out = tmp_path / "out"
    assert export_cli.main("export", [str(run_with_code), "--out", str(out), *how]) == export_cli.EXIT_OK
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()
    assert sorted(p.name for p in out.rglob("*.py")) == []
    assert not (tmp_path / "ran").exists()


LOADERS = ("AutoConfig", "AutoTokenizer", "AutoModelForCausalLM", "AutoModel", "AutoProcessor")


def test_every_load_of_a_model_config_or_tokenizer_says_whether_to_trust_its_code():
    unset = []
    for path in sorted((REPO / "workloads").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "from_pretrained" and isinstance(node.func.value, ast.Name)
                    and node.func.value.id in LOADERS
                    and "trust_remote_code" not in {k.arg for k in node.keywords}):
                unset.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert unset == []
