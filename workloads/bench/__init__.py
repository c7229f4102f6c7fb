"""GPU benchmarks run under torchrun (no Ray needed): `python -m workloads.bench` compares the
project's training loop with the reference strategy; `python -m workloads.bench nccl` measures
collective bus bandwidth."""
