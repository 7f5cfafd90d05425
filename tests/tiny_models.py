"""Tiny random-init transformers models and a tokenizer, built in tests (no network).

A byte-level BPE tokenizer trained on a few lines of Python, and Llama / GPT-2 style causal LMs
of a few thousand parameters over it, saved as ordinary model directories so the whole loading
path (config.json, safetensors, tokenizer files) is exercised.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(i * 2)\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "import os\nprint(os.path.join('a', 'b'))\n",
    "if x > 0 and y < 0:\n    z = x - y\nelse:\n    z = 0\n",
    "héllo wörld ünïcode ✓ → λ\n",
]
PROMPTS = [
    "def add(a, b):", "for i in", "class Point:", "import os", "if x > 0", "print(", "return",
    "self.x = ", "else:\n", "z = x", "héllo", "def f(x):\n    return",
]


def build_tokenizer(vocab_size: int = 200) -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(CORPUS * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>",
                                   bos_token="<|endoftext|>", pad_token="<|endoftext|>")


def tiny_llama(vocab_size: int, seed: int, hidden: int = 32, layers: int = 2,
               max_positions: int = 256) -> LlamaForCausalLM:
    torch.manual_seed(seed)  # model init only; never used by verispec itself
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=max_positions, tie_word_embeddings=True,
                         bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return LlamaForCausalLM(config).eval()


def tiny_gpt2(vocab_size: int, seed: int, hidden: int = 32, layers: int = 2,
              max_positions: int = 256) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=vocab_size, n_embd=hidden, n_layer=layers, n_head=4,
                        n_positions=max_positions, bos_token_id=0, eos_token_id=0,
                        pad_token_id=0)
    return GPT2LMHeadModel(config).eval()


def save_model(model, tokenizer, directory: Path) -> Path:
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
