"""Running the training loop: the Ray job's driver, the Ray Train worker adapter, torchrun."""
