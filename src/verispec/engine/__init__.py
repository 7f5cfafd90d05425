"""The engine: token ids only (no tokenizer, HTTP or printing); the round is batch.Batch."""
