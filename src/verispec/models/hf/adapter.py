"""Hugging Face transformers causal LMs as verispec language models, with a rewindable KV cache.

Legend: B batch, n fed tokens, T cache capacity, H kv heads, D head dim, V vocabulary.

The only module (with models/loading.py and masks.py) that imports transformers. A session owns a
preallocated :class:`RowCache`: per layer, keys and values [B, H, T, D] plus each row's length.
Feeding n tokens writes their keys/values at positions length[b] .. length[b] + n - 1 of row b, with
position ids and attention masks built from those lengths (masks.py: one per layer kind,
full, sliding-window or chunked, by transformers' own rules), so rows of a batch may hold
different lengths (ragged acceptance). The cache keeps every key (a window is a mask, not a ring
buffer), so a windowed layer rewinds exactly. Rewind only lowers the lengths: the stale entries are
masked out and overwritten by the next write. The prompt is prefilled once; each ``extend`` is
one forward pass over the new tokens; nothing re-runs the full context.

After any propose / verify / rewind sequence the next logits equal a fresh forward over the same
tokens (tests/models/test_transformers_adapter.py checks it; tests/models/test_architectures.py on
every architecture accepted). A model verispec cannot run exactly is refused when it is wrapped
(UnsupportedModelError): transformers marks it stateful (recurrent, state-space, hybrid), its
config lists non-attention layers, or a load-time check of prefill, extend and rewind on two
ragged rows against fresh forwards fails.

Vocabulary: models over one tokenizer may pad their output layers to different widths (e.g.
50257 vs 50304). ``vocab_size`` restricts the logits to the tokenizer's ids, so draft and target
distributions live on the same support and padding ids can never be sampled.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator, Sequence

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import Cache

from ...errors import ConfigError, ShapeError, UnsupportedModelError
from ..attention import attention_kernels
from ..base import logits_columns, right_padded
from .masks import MaskPlan, build_masks, mask_plan


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


# architectures whose attention verispec's masks cannot reach, and why
REFUSED = {
    "gpt_neo": "its local-attention layers take their window from a fixed causal buffer that "
               "assumes every row ends at the last cache slot, so ragged rows would see the "
               "wrong window",
}


def check_supported(model: PreTrainedModel, role: str = "model") -> MaskPlan:
    """The model's :class:`MaskPlan`, or UnsupportedModelError naming the architecture and why."""
    config = model.config.get_text_config()
    architecture = getattr(config, "model_type", type(model).__name__)
    if architecture in REFUSED:
        raise UnsupportedModelError(f"the {role} ({architecture}) is not supported: "
                                    f"{REFUSED[architecture]}.")
    if getattr(model, "_is_stateful", False):  # transformers' own mark, which refuses assisted
        # generation for the same reason
        raise UnsupportedModelError(
            f"the {role} ({architecture}) has recurrent or state-space layers (transformers "
            "marks it stateful): their state cannot drop rejected draft tokens exactly, so "
            "verispec cannot verify it; use a transformer (attention-only) model.")
    return mask_plan(config, role)


@contextlib.contextmanager
def alibi_from_slots(model: PreTrainedModel) -> Iterator[None]:
    """For models that build ALiBi from a 2D padding mask (Bloom): build it from cache slots.

    Such a model computes key positions as cumsum(mask) - 1; verispec hands it a 4D mask, and its
    rows keep token p in slot p, so the bias for slot j is slope * j, the same as an unpadded
    row's (a constant per query, which softmax ignores, is the only difference ALiBi's relative
    form would make).
    """
    base = model.base_model
    if not hasattr(type(base), "build_alibi_tensor"):
        yield
        return
    original = base.build_alibi_tensor

    def from_slots(mask: torch.Tensor, num_heads: int, dtype: torch.dtype) -> torch.Tensor:
        slots = torch.ones(mask.shape[0], mask.shape[-1], dtype=torch.int64, device=mask.device)
        return original(slots, num_heads, dtype)  # mask [B, 1, n, T] -> slots [B, T]

    base.build_alibi_tensor = from_slots  # an instance attribute over the class's method
    try:
        yield
    finally:
        del base.build_alibi_tensor


class TransformersLM:
    """Wraps a loaded ``PreTrainedModel`` (put in eval mode) as a :class:`LanguageModel`."""

    matmul = "aten"  # its own nn.Linear modules (models/fast_llama/matmul.py names the kernels)
    # a pass over k + 1 tokens costs more than one token's on a CPU (MKL's matmuls over rows):
    # the shallower default depth there (policy.default_num_draft_tokens)
    flat_verify = False

    def __init__(self, model: PreTrainedModel, vocab_size: int | None = None) -> None:
        width = output_width(model)
        vocab_size = width if vocab_size is None else vocab_size
        if not 1 <= vocab_size <= width:
            raise ConfigError(f"vocab_size={vocab_size} is invalid for a model with {width} "
                              "output logits: expected 1 <= vocab_size <= output width.")
        self.model = model.eval()
        self.vocab_size = vocab_size
        self.max_positions = max_positions(model)
        self.mask_plan = check_supported(model)
        # transformers 5 renamed forward's past_key_values to cache (the old name is deprecated)
        parameters = inspect.signature(model.forward).parameters
        self.cache_argument = "cache" if "cache" in parameters else "past_key_values"
        self._check_rewind()

    @property
    def device(self) -> torch.device:
        return self.model.device

    def new_session(self) -> TransformersSession:
        return TransformersSession(self)

    def _check_rewind(self) -> None:
        """At load: ragged prefill, extend, rewind, extend must give a fresh forward's logits.

        A few tokens through two rows of different lengths: catches a model whose layers keep
        state the cache does not hold, or whose forward does not take verispec's masks, before
        it can produce a wrong token. (Windows are checked by the test matrix, not here: a real
        window is longer than a load-time check can afford.)
        """
        ids = [(7 * i + 3) % self.vocab_size for i in range(12)]
        rows, fed = [ids[:5], ids[:3]], [[ids[5], ids[6]], [ids[7], ids[8]]]
        try:
            session = self.new_session()
            session.start(rows)
            session.extend(torch.tensor(fed))
            session.rewind([2, 1])  # row 0 back to its prompt, row 1 keeps ids[7]
            fed = [[ids[9], ids[10]], [ids[11], ids[9]]]
            logits = session.extend(torch.tensor(fed))  # [2, 2, V]
            sequences = [rows[0] + fed[0], rows[1] + [ids[7]] + fed[1]]
            with torch.inference_mode():
                expected = [self.model(torch.tensor([seq], device=self.device)).logits[0, -2:]
                            for seq in sequences]
        except (RuntimeError, ValueError, TypeError, IndexError, AttributeError) as exc:
            raise self._refusal(f"its forward failed on a ragged cached batch ({type(exc).__name__}"
                                f": {str(exc).splitlines()[0] if str(exc) else ''})") from exc
        tolerance = 1e-3 if self.model.dtype == torch.float32 else 5e-2
        for row, reference in enumerate(expected):
            reference = reference[:, : self.vocab_size].float()
            error = float((logits[row].float() - reference).abs().max())
            if not error <= tolerance * max(1.0, float(reference.abs().max())):
                raise self._refusal(f"after a rewind its logits differ from a fresh forward's "
                                    f"by {error:.3g} (row {row})")

    def _refusal(self, reason: str) -> UnsupportedModelError:
        architecture = getattr(self.model.config, "model_type", type(self.model).__name__)
        return UnsupportedModelError(
            f"{architecture} cannot be verified exactly: {reason}. Its layers keep state that "
            "verispec's cache cannot rewind, or attend in a way verispec does not mask; it is "
            "refused rather than run inexactly.")


class RowCache(Cache):
    """Preallocated keys/values with a length per row; written at explicit positions.

    ``positions`` [B, n] must be set before each forward; ``update`` (called by every attention
    layer) scatters the new keys/values there and returns the used prefix [B, H, T_used, D].
    """

    is_compileable = False

    def __init__(self, batch_size: int, capacity: int) -> None:
        # no super().__init__(): transformers' Cache.__init__ wants layer objects; this cache
        # manages raw tensors.
        self.layers = []
        self.layer_class_to_replicate = None
        self.offloading = False
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.num_rows = batch_size
        self.capacity = capacity
        self.positions = torch.zeros((batch_size, 0), dtype=torch.int64)  # [B, n]
        self.used = 0  # T_used: keys attended over in the current forward

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """key_states, value_states [B, H, n, D] -> all keys, values [B, H, T_used, D]."""
        if layer_idx == len(self.keys):
            shape = (self.num_rows, key_states.shape[1], self.capacity, key_states.shape[3])
            self.keys.append(key_states.new_zeros(shape))
            self.values.append(value_states.new_zeros(shape[:3] + (value_states.shape[3],)))
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        rows = torch.arange(self.num_rows, device=keys.device)[:, None]  # [B, 1]
        # advanced indices around a slice: the indexed view is [B, n, H, D]
        keys[rows, :, self.positions] = key_states.transpose(1, 2)
        values[rows, :, self.positions] = value_states.transpose(1, 2)
        return keys[:, :, : self.used], values[:, :, : self.used]

    def grow(self, capacity: int) -> None:
        """Reallocate to ``capacity`` positions, keeping the contents."""
        for store in (self.keys, self.values):
            for i, old in enumerate(store):
                new = old.new_zeros(old.shape[:2] + (capacity,) + old.shape[3:])
                new[:, :, : old.shape[2]] = old
                store[i] = new
        self.capacity = capacity

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.used

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.used, 0

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return self.capacity


class TransformersSession:
    """One generation's cache and row lengths; see the module docstring."""

    def __init__(self, lm: TransformersLM) -> None:
        self.lm = lm
        self.cache = RowCache(0, 0)
        self.lengths = torch.zeros(0, dtype=torch.int64)  # [B] tokens held per row

    def start(self, prompts: Sequence[Sequence[int]]) -> None:
        longest = max((len(p) for p in prompts), default=0)
        self.cache = RowCache(len(prompts), max(64, 2 * longest))
        self.lengths = torch.zeros(len(prompts), dtype=torch.int64, device=self.lm.device)
        if longest == 0:
            return
        # Right-pad ragged prompts: the padding's keys land past each row's length, where they
        # are masked out and later overwritten.
        padded, _ = right_padded(prompts, len(prompts))  # [B, longest]
        self._forward(padded.to(self.lm.device), logits_to_keep=1)  # only the cache matters
        self.lengths = torch.tensor([len(p) for p in prompts], dtype=torch.int64,
                                    device=self.lm.device)

    def add_rows(self, prompts: Sequence[Sequence[int]], ride: bool = False) -> bool:
        """New rows at the end holding these prompts, prefilled in a cache of their own and
        then appended; the other rows' caches are copied, not recomputed. Never rides
        (FastLlamaSession.add_rows): returns False."""
        joining = TransformersSession(self.lm)
        joining.start(prompts)
        self._append(joining)
        return False

    def adopt_rows(self, sessions: Sequence[TransformersSession]) -> None:
        """New rows at the end whose caches are copies of these sessions of the same model (a
        long prompt prefilled apart, over several rounds: engine/prefill.py)."""
        if not all(isinstance(s, TransformersSession) and s.lm is self.lm for s in sessions):
            raise ShapeError("adopt_rows expects sessions of this model")
        for session in sessions:
            self._append(session)

    def _append(self, joining: TransformersSession) -> None:
        """``joining``'s rows after ours (its cache may be regrown in place)."""
        ours, theirs = self.cache, joining.cache
        capacity = max(ours.capacity, theirs.capacity)
        for cache in (ours, theirs):
            if cache.capacity < capacity:
                cache.grow(capacity)
        if not ours.keys or not theirs.keys:  # a side that never ran a forward has no layers
            template = ours if ours.keys else theirs
            for cache in (ours, theirs):
                if not cache.keys:
                    cache.keys = [k.new_zeros((cache.num_rows,) + k.shape[1:])
                                  for k in template.keys]
                    cache.values = [v.new_zeros((cache.num_rows,) + v.shape[1:])
                                    for v in template.values]
        ours.keys = [torch.cat(pair) for pair in zip(ours.keys, theirs.keys)]
        ours.values = [torch.cat(pair) for pair in zip(ours.values, theirs.values)]
        ours.num_rows += theirs.num_rows
        self.lengths = torch.cat([self.lengths, joining.lengths])

    def keep_rows(self, rows: Sequence[int]) -> None:
        """Keep only these rows, in this order."""
        num_rows = self.cache.num_rows
        rows = [int(row) for row in rows]
        if len(set(rows)) != len(rows) or not all(0 <= row < num_rows for row in rows):
            raise ShapeError(f"keep_rows expects distinct rows in [0, {num_rows}); got {rows}.")
        index = torch.tensor(rows, dtype=torch.int64, device=self.lm.device)
        self.cache.keys = [k.index_select(0, index) for k in self.cache.keys]
        self.cache.values = [v.index_select(0, index) for v in self.cache.values]
        self.cache.num_rows = len(rows)
        self.lengths = self.lengths.index_select(0, index)

    def extend(self, tokens: torch.Tensor, logits_at: Sequence[int] | None = None
               ) -> torch.Tensor:
        """tokens [B, n] -> logits [B, n, V] (model dtype, restricted to the vocabulary; [B, V]
        with logits_at: LMSession.extend)."""
        if tokens.dim() != 2 or tokens.shape[0] != self.cache.num_rows:
            raise ShapeError(f"extend expects tokens [B={self.cache.num_rows}, n]; got "
                             f"{tuple(tokens.shape)}.")
        logits = self._forward(tokens.to(self.lm.device))
        self.lengths = self.lengths + tokens.shape[1]
        return logits_columns(logits[..., : self.lm.vocab_size], logits_at)

    def feed(self, rows: Sequence[Sequence[int]]) -> None:
        """Append rows[b] to row b with no logits (LMSession.feed): one right-padded pass whose
        head runs at one position a row; the padding lands past each row's length."""
        tokens, widths = right_padded(rows, self.cache.num_rows)  # [B, u]
        if any(widths):
            self._forward(tokens.to(self.lm.device), logits_to_keep=1)
            self.lengths = self.lengths + torch.tensor(widths, dtype=torch.int64,
                                                       device=self.lengths.device)

    def rewind(self, num_tokens: torch.Tensor) -> None:
        """Forget the last num_tokens[b] tokens of each row: only the lengths move."""
        num_tokens = torch.as_tensor(num_tokens, dtype=torch.int64, device=self.lengths.device)
        self.lengths = self.lengths - num_tokens

    def _forward(self, tokens: torch.Tensor, logits_to_keep: int = 0) -> torch.Tensor:
        """One forward pass over tokens [B, n] placed after each row's current length."""
        num_new = tokens.shape[1]
        positions = self.lengths[:, None] + torch.arange(num_new, device=tokens.device)  # [B, n]
        used = int(positions.max()) + 1
        if used > self.cache.capacity:
            self.cache.grow(max(used, 2 * self.cache.capacity))
        self.cache.positions, self.cache.used = positions, used
        # row b, query i sees its own prefix (within the layer's window), nothing stale
        masks = build_masks(self.lm.mask_plan, positions, used, self.lm.model.dtype)
        with torch.inference_mode(), attention_kernels(self.lm.device), \
                alibi_from_slots(self.lm.model):
            out = self.lm.model(input_ids=tokens, position_ids=positions, attention_mask=masks,
                                use_cache=True, logits_to_keep=logits_to_keep,
                                **{self.lm.cache_argument: self.cache})
        return out.logits
