"""Is NCCL on the expected network? The offline log verifier, the in-band gate, bus bandwidth."""
