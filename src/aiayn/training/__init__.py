"""The paper's training recipe: loss, optimizer and schedule, trainer, checkpoints, DDP."""
