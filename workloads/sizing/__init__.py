"""What a run needs, predicted before it starts: the memory model (peak GPU memory per rank) and the
step-time model (tokens/s on a cluster's links), which `plan` and `submit`'s fit check use. Pure
functions; the GPU runs that check them are benchmarks (workloads/bench/)."""
