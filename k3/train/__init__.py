"""Training: data and tokenizer, optimizer, the loop, checkpoints (systems.md §1–§4)."""
