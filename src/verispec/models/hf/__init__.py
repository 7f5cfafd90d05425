"""The transformers adapter: any Hugging Face causal LM behind models/base.py."""
