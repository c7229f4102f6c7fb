"""The training loop and its components (model, data, optimizer, parallelism, loss, checkpoints);
it never imports Ray."""
