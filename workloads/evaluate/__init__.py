"""Did the model get better? The stage after training: the tuned model and its base scored on the same
tasks with EleutherAI's lm-evaluation-harness (its Hugging Face backend), side by side, with a gate.

One module per concern: `settings` (the `evaluate` config section and the gate's rules, no heavy
import), `tasks` (the run's held-out records as an lm-eval task; standard task names checked),
`harness` (one model on some tasks through lm-eval), `units` (one model on one task, wherever it
runs), `compare` (the table and the gate), `cache` (the base's scores by model revision, task and
settings), `report` (table, plot, MLflow, model card), `stage` (the job's workers evaluate after
training), `timing` (what `plan` adds for it) and `cli` (`python -m workloads evaluate`).
docs/EVALUATION.md tells the whole of it.
"""
