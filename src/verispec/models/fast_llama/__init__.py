"""The fast path: a flat Llama forward with its own KV cache (model.py)."""
