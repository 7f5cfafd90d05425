"""Hugging Face transformers causal LMs as verispec language models, with KV-cache rewind.

Legend: B batch, n fed tokens, V vocabulary (the tokenizer's, see below).

The only module (with loading.py) that imports transformers. A session keeps one
``DynamicCache`` per row holding exactly the tokens fed so far: ``start`` prefills the prompt
once, ``extend`` runs one forward pass over the new tokens on top of the cache, and ``rewind``
crops the cache, so after any propose / verify / rewind sequence the next logits equal a fresh
forward over the same tokens. Nothing re-runs the full context per round.

Rows of a batch are run one after another (each with its own cache); batch 1 is the fast path.

Vocabulary: models over one tokenizer may pad their output layers to different widths (e.g.
50257 vs 50304). ``vocab_size`` restricts the logits to the tokenizer's ids, so draft and target
distributions live on the same support and padding ids can never be sampled.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache, PreTrainedModel

from ..errors import ConfigError, ShapeError


def output_width(model: PreTrainedModel) -> int:
    """Number of logits the model produces per position (its padded vocabulary)."""
    head = model.get_output_embeddings()
    if head is not None and hasattr(head, "out_features"):
        return int(head.out_features)
    return int(model.config.vocab_size)


def max_positions(model: PreTrainedModel) -> int | None:
    """The model's context window in tokens, or None when the config does not say."""
    config = model.config
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


class TransformersLM:
    """Wraps a loaded ``PreTrainedModel`` (put in eval mode) as a :class:`LanguageModel`."""

    def __init__(self, model: PreTrainedModel, vocab_size: int | None = None) -> None:
        width = output_width(model)
        vocab_size = width if vocab_size is None else vocab_size
        if not 1 <= vocab_size <= width:
            raise ConfigError(f"vocab_size={vocab_size} is invalid for a model with {width} "
                              "output logits: expected 1 <= vocab_size <= output width.")
        self.model = model.eval()
        self.vocab_size = vocab_size
        self.max_positions = max_positions(model)

    @property
    def device(self) -> torch.device:
        return self.model.device

    def new_session(self) -> TransformersSession:
        return TransformersSession(self)


class TransformersSession:
    """One generation's caches; see the module docstring."""

    def __init__(self, lm: TransformersLM) -> None:
        self.lm = lm
        self.caches: list[DynamicCache] = []
        self.lengths: list[int] = []

    def start(self, prompts: Sequence[Sequence[int]]) -> None:
        self.caches = [DynamicCache(config=self.lm.model.config) for _ in prompts]
        self.lengths = [0] * len(prompts)
        for row, prompt in enumerate(prompts):
            if len(prompt):
                tokens = torch.tensor([list(prompt)], dtype=torch.int64, device=self.lm.device)
                self._forward(row, tokens, logits_to_keep=1)  # prefill: only the cache matters

    def extend(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B, n] -> logits [B, n, V] (model dtype, restricted to the vocabulary)."""
        if tokens.dim() != 2 or tokens.shape[0] != len(self.caches):
            raise ShapeError(f"extend expects tokens [B={len(self.caches)}, n]; got "
                             f"{tuple(tokens.shape)}.")
        tokens = tokens.to(self.lm.device)
        rows = [self._forward(row, tokens[row : row + 1]) for row in range(len(self.caches))]
        return torch.cat(rows, dim=0)[..., : self.lm.vocab_size]

    def rewind(self, num_tokens: torch.Tensor) -> None:
        for row, count in enumerate(torch.as_tensor(num_tokens).tolist()):
            if not 0 <= count <= self.lengths[row]:
                raise ShapeError(f"cannot rewind {count} tokens from row {row} of length "
                                 f"{self.lengths[row]}.")
            if count:
                self.caches[row].crop(-count)
                self.lengths[row] -= count

    def _forward(self, row: int, tokens: torch.Tensor, logits_to_keep: int = 0) -> torch.Tensor:
        """One forward pass of row ``row`` over tokens [1, n] on top of its cache."""
        with torch.inference_mode():
            out = self.lm.model(input_ids=tokens, past_key_values=self.caches[row],
                                use_cache=True, logits_to_keep=logits_to_keep)
        self.lengths[row] += tokens.shape[1]
        return out.logits
