"""The training loop on the DeepSpeed engine, logging and checkpoints."""
