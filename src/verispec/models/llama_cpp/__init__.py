"""The llama.cpp backend: GGUF files on llama.cpp's own forward (model.py)."""
