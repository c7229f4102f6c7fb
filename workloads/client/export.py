"""`python -m workloads export`: a run's checkpoint as a Hugging Face folder you can load and serve.

    python -m workloads export RUN [--out FOLDER] [--checkpoint NAME] [--dtype auto|float32|bfloat16|float16]
    python -m workloads export --stack NAME --run NAME [...]

RUN is a local run's name (as `chat` takes it; `python -m workloads runs` lists them), a run folder
(local, or s3://bucket/prefix/RUN: Ray Train's storage of the run, a torchrun --out folder, a
`make demo` runs/<name> folder) or one checkpoint folder; with --stack, the run is
looked up in the stack's checkpoint bucket. The newest checkpoint is exported unless --checkpoint
names one; --out (default: `model/` next to the checkpoints) may be local or s3://. --generate
loads the result with from_pretrained and prints a greedy continuation of a prompt.

Exit codes: 0 exported; 2 bad input (no such run or checkpoint, --out not empty, ...); 3 the stack's
outputs could not be read.

torch and transformers are imported only once there is something to export, so `--help` and a
mistake on the command line answer at once.
"""

from __future__ import annotations

import argparse
import difflib
import sys
import tempfile
from pathlib import Path

from workloads.client.cluster import UnreachableError, read_stack_outputs
from workloads.client.run_record import submitted_base
from workloads.client.runs import RUNS_DIR, find_run, local_runs
from workloads.client.usage import Parser, UsageError
from workloads.files import key_parts
from workloads.model_io.lora_base import LoraBase

EXIT_OK, EXIT_USAGE, EXIT_UNREACHABLE = 0, 2, 3
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
"""workloads.model_io.hf_writer.EXPORT_DTYPES, which this module does not import (it imports torch)."""


def _arg_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="python -m workloads export", description=__doc__.splitlines()[0])
    parser.add_argument("run", nargs="?", help="run folder or checkpoint folder, local or s3://")
    parser.add_argument("--stack", help="take the run from this stack's checkpoint bucket (with --run)")
    parser.add_argument("--run", dest="run_name", help="the run name (Ray Train's) with --stack")
    parser.add_argument("--out", metavar="FOLDER",
                        help="where to write the model folder, local or s3:// (default: RUN/model)")
    parser.add_argument("--checkpoint", help="the checkpoint folder's name, or best: the lowest eval loss's "
                        "(a run with checkpoint.keep_best) (default: the newest)")
    parser.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                        help="weights' dtype (default auto: the pretrained model's own, float32 for random init)")
    parser.add_argument("--from-shards", action="store_true",
                        help="consolidate the checkpoint's shards even when the run already exported it")
    parser.add_argument("--overwrite", action="store_true", help="replace what the --out folder holds")
    parser.add_argument("--base", metavar="FOLDER_OR_HUB_ID",
                        help="a LoRA run: the model to merge its adapter into (default: the base the run was "
                             "submitted with, as this machine recorded it)")
    parser.add_argument("--base-revision", metavar="REV", default="",
                        help="with --base, a hub model's revision (branch, tag or commit; default: its default branch)")
    parser.add_argument("--generate", metavar="PROMPT", help="load the result and print a greedy continuation")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="with --generate: run the model folder's own Python code (auto_map in its config); "
                             "off: it is never run, and export never copies a checkpoint's *.py files")
    parser.add_argument("--runs-dir", type=Path, default=RUNS_DIR,
                        help=f"where local runs are, for RUN given as a run's name (default: {RUNS_DIR})")
    return parser


def local_run(name: str, *, runs_dir: Path) -> str:
    """RUN as given when it is a folder here or a URI, else the folder of the local run of that name
    (as `chat` takes it); ValueError naming the run meant when there is none."""
    if "://" in name or Path(name).exists():
        return name
    found = find_run(runs_dir, name)
    if found is not None:
        return str(found)
    names = [run.name for run in local_runs(runs_dir)]
    close = difflib.get_close_matches(name, names, n=1)
    hint = (f"; did you mean {close[0]} ({_shown(runs_dir / close[0])})?" if close
            else "; python -m workloads runs lists the local runs")
    raise ValueError(f"{name!r} is neither a folder here nor a run of {runs_dir}{hint}")


def _shown(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def run_uri(args: argparse.Namespace) -> str:
    if args.stack or args.run_name:
        if not (args.stack and args.run_name) or args.run:
            raise ValueError("give either RUN, or --stack NAME with --run NAME")
        key_parts(args.run_name)  # a run name is a key below the bucket's prefix, never above it
        bucket = read_stack_outputs(args.stack).checkpoint_bucket_uri
        return f"{bucket.rstrip('/')}/{args.run_name}"
    if not args.run:
        raise ValueError("name the run: RUN (a folder or s3:// prefix), or --stack NAME --run NAME")
    return local_run(args.run, runs_dir=args.runs_dir)


def export_and_show(args: argparse.Namespace, *, scratch: Path) -> int:
    uri = run_uri(args)  # a mistake in naming the run is told before torch's seconds of start-up
    if args.base_revision and not args.base:
        raise ValueError("--base-revision goes with --base (without it, the revision the run was submitted with)")
    from workloads.model_io.export import export_run, greedy_generate

    base = None if not args.base else LoraBase(name_or_path=args.base, revision=args.base_revision, told_by="--base")
    result = export_run(uri, out=args.out, checkpoint=args.checkpoint, dtype=args.dtype,
                        from_shards=args.from_shards, overwrite=args.overwrite,
                        keep_local=scratch / "model" if args.generate else None, base=base,
                        submitted_base=submitted_base)
    print(f"model    {result.out}  ({result.dtype}, {result.how} from {result.checkpoint})")
    from workloads.evaluate.report import carry_model_card

    if carry_model_card(checkpoint_uri=result.checkpoint, out_uri=result.out):
        print(f"card     {result.out}/README.md  (the evaluation against the base)")
    if args.generate:
        assert result.local_folder is not None
        answer = greedy_generate(result.local_folder, args.generate, max_new_tokens=args.max_new_tokens,
                                 trust_remote_code=args.trust_remote_code)
        print(f"generate {args.generate!r} -> {answer!r}")
    return EXIT_OK


def main(command: str, argv: list[str]) -> int:
    try:
        args = _arg_parser().parse_args(argv)
        with tempfile.TemporaryDirectory(prefix="export-") as scratch:
            return export_and_show(args, scratch=Path(scratch))
    except (UsageError, ValueError) as exc:
        print(f"{command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except UnreachableError as exc:
        print(f"{command}: error: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE


if __name__ == "__main__":
    sys.exit(main("export", sys.argv[1:]))
