"""Training stage: DDP + AMP training that writes weights-only checkpoints plus metadata."""
