"""Tiny random-init transformers models and a tokenizer, built in tests (no network).

A byte-level BPE tokenizer trained on a few lines of Python, and Llama / GPT-2 style causal LMs
of a few thousand parameters over it, saved as ordinary model directories so the whole loading
path (config.json, safetensors, tokenizer files) is exercised.
"""

from __future__ import annotations

import copy
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


def build_tokenizer(vocab_size: int = 200, corpus: list[str] = CORPUS,
                    special_tokens: tuple[str, ...] = ("<|endoftext|>",)
                    ) -> PreTrainedTokenizerFast:
    """Bytes, then merges up to ``vocab_size`` learned from ``corpus``; ``special_tokens``
    first (ids 0, 1, ...), <|endoftext|> among them."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(special_tokens),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(corpus * 4, trainer)
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


# ---------------------------------------------------------------------------------------------
# Helpers for the adapter / API / CLI tests: models whose outputs are informative.
#
# tiny_llama / tiny_gpt2 tie the output layer to the embeddings, so a random-init model mostly
# repeats its last token (greedy equality would then compare constant sequences). The untied
# variants below continue prompts with varied tokens, and layer_dropped_draft gives a smaller
# draft correlated with its target (greedy acceptance around 0.4), so both the accept and the
# reject paths of verification run.


def untied_llama(vocab_size: int, seed: int, hidden: int = 32, layers: int = 2,
                 max_positions: int = 256) -> LlamaForCausalLM:
    torch.manual_seed(seed)  # model init only; never used by verispec itself
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=max_positions, tie_word_embeddings=False,
                         bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return LlamaForCausalLM(config).eval()


def untied_gpt2(vocab_size: int, seed: int, hidden: int = 32, layers: int = 2,
                max_positions: int = 256) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=vocab_size, n_embd=hidden, n_layer=layers, n_head=4,
                        n_positions=max_positions, tie_word_embeddings=False, bos_token_id=0,
                        eos_token_id=0, pad_token_id=0)
    return GPT2LMHeadModel(config).eval()


def layer_dropped_draft(target, num_layers: int = 1):
    """A smaller draft: the target's embeddings, first ``num_layers`` blocks and output head."""
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = num_layers  # n_layer for GPT-2, through its attribute map
    draft = type(target)(config).eval()
    missing, _ = draft.load_state_dict(target.state_dict(), strict=False)
    assert not missing, missing
    return draft


def scripted_llama(vocab_size: int, successors: dict[int, int], hidden: int = 16,
                   seed: int = 0) -> LlamaForCausalLM:
    """A real Llama whose next token after token a is successors[a], with probability ~1.

    The attention and MLP output projections are zeroed, so the last hidden state is the
    current token's embedding; token a (the i-th key) embeds as the basis vector e_i and the
    output row of successors[a] gets 10 * e_i, a logit gap of ~40 after the final RMSNorm.
    Needs len(successors) <= hidden.
    """
    assert len(successors) <= hidden
    model = untied_llama(vocab_size, seed, hidden=hidden, layers=1)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        for i, (token, successor) in enumerate(successors.items()):
            model.model.embed_tokens.weight[token] = torch.nn.functional.one_hot(
                torch.tensor(i), hidden).float()
            model.lm_head.weight[successor] += 10.0 * model.model.embed_tokens.weight[token]
    return model


def save_untied_pair(root: Path) -> tuple[str, str]:
    """An untied tiny Llama target and its layer-dropped draft, saved under root -> their dirs.

    The pair the CLI and bench tests drive through the command line (128 positions).
    """
    tokenizer = build_tokenizer()
    target = untied_llama(len(tokenizer), seed=1, max_positions=128)
    draft = layer_dropped_draft(target, num_layers=1)
    return (str(save_model(target, tokenizer, root / "target")),
            str(save_model(draft, tokenizer, root / "draft")))
