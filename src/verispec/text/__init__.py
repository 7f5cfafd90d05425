"""Tokens <-> text: load(), Decoder, chat templates, TextBatch and text streams."""
