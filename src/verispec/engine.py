"""The speculative decoding loop: propose -> verify -> commit/rewind, one round at a time.

Legend: B batch, K draft tokens this round, V vocabulary.

Each round (Leviathan et al. 2023, Algorithm 1, batched):
  1. propose: the proposer drafts k tokens per row, with the distributions they were drawn from;
  2. score:   the target runs ONE pass over [last committed token, d_1 .. d_k] -> k+1 logits,
              processed by the same sampling.to_probs the draft used (at temperature 0 only
              their argmax, sampling.greedy_tokens, which to_probs' point mass sits on);
  3. verify:  verify.verify_rows (verify.verify, read back as host ints) accepts a prefix per
              row and draws the recovered or bonus token (verify_greedy.verify_greedy_rows at
              temperature 0: no random numbers);
  4. commit:  both sides rewind to the accepted prefix and append the new token;
  5. emit:    each row's new tokens, cut at the first stop token and at max_new_tokens.
Plain decoding is the same loop with k = 0 and no proposer: the "bonus" is an ordinary sample
from the target, so both paths share every line that touches the target.
Under a grammar (constraints.py) every distribution of the round, the draft's k and the
target's k + 1, is masked by the grammar state its token extends, and the grammar commits and
rolls back with the caches; the output then has exactly the constrained target's law.

The engine knows nothing about tokenisers, HTTP or printing; it sees token ids and the
protocols in models/base.py and proposers/base.py.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from .adaptive import AdaptivePolicy, RoundStats
from .config import GenerationConfig
from .constraints import ConstraintSet
from .errors import (
    ConfigError,
    EmptyPromptError,
    IncompatibleModelsError,
    InputError,
    TokenOutOfRangeError,
)
from .metrics import GenerationMetrics, MetricsRecorder
from .models.base import LanguageModel, TargetScorer
from .proposers.base import Proposer, ProposerSession
from .proposers.draft_model import DraftModelProposer
from .sampling import greedy_tokens, make_generator, to_probs
from .verify import verify_rows
from .verify_greedy import verify_greedy_rows


@dataclass(frozen=True)
class GenerationResult:
    """token_ids: the new tokens of each row; finish_reasons: "stop" or "length" per row."""

    token_ids: list[list[int]]
    finish_reasons: list[str]
    metrics: GenerationMetrics


@dataclass(frozen=True)
class Chunk:
    """What one round emitted: new token ids per row (empty for rows already finished)."""

    token_ids: list[list[int]]
    finished: list[bool]


class SpeculativeDecoder:
    """Exact speculative decoding of ``target`` with tokens drafted by ``proposer``.

    The draft's vocabulary and device are checked here, at construction, not on the first
    request.
    """

    def __init__(self, target: LanguageModel, proposer: Proposer | None = None) -> None:
        if proposer is not None and proposer.vocab_size != target.vocab_size:
            raise IncompatibleModelsError(
                f"draft vocab_size={proposer.vocab_size} differs from target vocab_size="
                f"{target.vocab_size}; the draft and the target must share one vocabulary "
                "(the same tokenizer).")
        draft_device = getattr(proposer, "device", None)  # a model-free proposer may omit it
        if draft_device is not None and torch.device(draft_device) != target.device:
            raise IncompatibleModelsError(
                f"the draft is on {draft_device} but the target on {target.device}; "
                "verification compares their probabilities on one device: load both with the "
                "same device=.")
        self.target = target
        self.proposer = proposer
        # adaptive policies with carry_over=True: the latest generation's policy per (policy
        # config, sampling settings, batch size); a new generation resumes from a copy of it
        self.carried_policies: dict[tuple[object, ...], AdaptivePolicy] = {}

    @classmethod
    def from_draft_model(cls, target: LanguageModel, draft: LanguageModel) -> SpeculativeDecoder:
        return cls(target, DraftModelProposer(draft))

    def stream(self, prompts: Sequence[Sequence[int]], config: GenerationConfig,
               speculative: bool = True, constraints: ConstraintSet | None = None
               ) -> DecodingRun:
        """An iterator of per-round :class:`Chunk` s; ``.metrics`` and ``.token_ids`` grow.
        ``constraints``: a grammar per row (constraints.py), applied to draft and target alike."""
        if not isinstance(config, GenerationConfig):
            raise ConfigError(f"config={config!r:.60} is invalid: expected a verispec."
                              "GenerationConfig, e.g. GenerationConfig(max_new_tokens=32).")
        return DecodingRun(self, _check_prompts(prompts, self.target.vocab_size), config,
                           speculative and self.proposer is not None, constraints)

    def generate(self, prompts: Sequence[Sequence[int]], config: GenerationConfig,
                 speculative: bool = True, constraints: ConstraintSet | None = None
                 ) -> GenerationResult:
        run = self.stream(prompts, config, speculative, constraints)
        for _ in run:
            pass
        return run.result()


class DecodingRun:
    """One generation in progress. Iterate it for chunks; read ``result()`` at the end."""

    def __init__(self, decoder: SpeculativeDecoder, prompts: list[list[int]],
                 config: GenerationConfig, speculative: bool,
                 constraints: ConstraintSet | None = None) -> None:
        self.config = config
        self.constraints = constraints if constraints is not None and constraints.active else None
        self.device = decoder.target.device  # where the target's logits, and verification, live
        self.generator = make_generator(config.seed, self.device)
        self.target = TargetScorer(decoder.target.new_session(), prompts)
        self.proposer: ProposerSession | None = None
        self.policy: AdaptivePolicy | None = None
        self._carried = decoder.carried_policies  # where carry-over leaves this run's policy
        self._carry_key: tuple[object, ...] | None = None
        if speculative:
            assert decoder.proposer is not None
            self.proposer = decoder.proposer.start(prompts, config.sampling)
            if config.adaptive is not None:
                self._carry_key = None if not config.adaptive.carry_over else (
                    config.adaptive, config.sampling, len(prompts))
                self.policy = config.adaptive.build(
                    config.num_draft_tokens,
                    self._carried.get(self._carry_key) if self._carry_key else None)
        self.num_draft_tokens = 0 if not speculative else (
            config.num_draft_tokens if self.policy is None  # a policy clamps k to its bounds
            else self.policy.num_draft_tokens)
        batch_size = len(prompts)
        # per-row bookkeeping on the host: each round's result comes over once (two small
        # .tolist() calls), then plain ints
        self.token_ids: list[list[int]] = [[] for _ in range(batch_size)]
        self.num_generated = [0] * batch_size
        self.finished = [False] * batch_size
        self.hit_stop = [False] * batch_size
        self.stop_ids = frozenset(config.stop_token_ids)
        self.recorder = MetricsRecorder(config.cost_ratio)

    def __iter__(self) -> Iterator[Chunk]:
        return self

    def __next__(self) -> Chunk:
        if all(self.finished):
            raise StopIteration
        return self._round()

    @property
    def metrics(self) -> GenerationMetrics:
        """The metrics so far (a frozen snapshot)."""
        return self.recorder.snapshot()

    def result(self) -> GenerationResult:
        reasons = ["stop" if s else "length" for s in self.hit_stop]
        return GenerationResult(self.token_ids, reasons, self.metrics)

    def _round(self) -> Chunk:
        started = time.perf_counter()
        active = [not finished for finished in self.finished]
        remaining = self.config.max_new_tokens - min(
            n for n, is_active in zip(self.num_generated, active) if is_active)
        k = min(self.num_draft_tokens, remaining - 1)  # never draft past max_new_tokens

        # 1. propose (under a grammar: each draft token drawn from its masked distribution)
        draft_started = time.perf_counter()
        draft_tokens, draft_probs = self._propose(k)
        allowed = None  # the grammar's masks for the target's k + 1 positions [B, K+1, V]
        if self.constraints is not None:  # a deterministic proposal is cut where it leaves it
            kept = self.constraints.cover(draft_tokens)
            draft_tokens = draft_tokens[:, :kept]
            draft_probs = None if draft_probs is None else draft_probs[:, :kept]
            allowed = self.constraints.round_masks()
        k = draft_tokens.shape[1]  # a proposer may find fewer (an n-gram lookup: maybe none)
        draft_time = _synced_elapsed(draft_started, draft_tokens)
        # 2. score: one target pass over the pending token and the k draft tokens
        target_started = time.perf_counter()
        target_logits = self._ban_early_stops(self.target.score(draft_tokens))  # [B, K+1, V]
        if self.config.sampling.is_greedy:  # point masses: the argmax is all that is needed
            target_out = greedy_tokens(target_logits, allowed)  # [B, K+1]
        else:  # [B, K+1, V] fp32, masked like the draft's
            target_out = to_probs(target_logits, self.config.sampling, allowed)
        target_time = _synced_elapsed(target_started, target_out)
        # 3. verify, on the host at temperature 0 (no random numbers, a loop over K+1 ints);
        # either way the round's result comes over once, as lists
        verify_started = time.perf_counter()
        if self.config.sampling.is_greedy:
            num_accepted, output_tokens = verify_greedy_rows(
                draft_tokens.tolist(), target_out.tolist(), target_logits.shape[-1])
        else:
            num_accepted, output_tokens = verify_rows(draft_tokens, draft_probs, target_out,
                                                      self.generator)
        next_tokens = [row[n] for row, n in zip(output_tokens, num_accepted)]  # recovered/bonus
        # 4. commit / rewind both sides (and the grammar) to the accepted prefix + the new token
        self.target.commit(num_accepted, next_tokens)
        if self.proposer is not None:
            self.proposer.commit(num_accepted, next_tokens)
        if self.constraints is not None:
            self.constraints.commit(num_accepted, next_tokens)
        # 5. emit
        chunk = self._emit(output_tokens, num_accepted, active)
        verify_time = time.perf_counter() - verify_started
        stats = self._record(k, [n for n, is_active in zip(num_accepted, active) if is_active],
                             draft_time, target_time, verify_time,
                             time.perf_counter() - started, chunk)
        if self.policy is not None:  # k = 0 rounds too: a policy may choose plain rounds
            self.num_draft_tokens = self.policy.next_num_draft_tokens(stats)
            if self._carry_key is not None:  # the next generation resumes from a copy of this
                self._carried[self._carry_key] = self.policy
        return chunk

    def _ban_early_stops(self, target_logits: torch.Tensor) -> torch.Tensor:
        """min_new_tokens: stop tokens get -inf logits at positions before it, so the target's
        distribution there is renormalised without them. Only the target is masked: a stop token
        the draft proposes there has target probability 0 and is always rejected (a point-mass
        draft included), so the output still has exactly the masked target's law; masking the
        draft too would only save those rejections.
        target_logits [B, K+1, V]; position j of row b is new token num_generated[b] + j."""
        need = self.config.min_new_tokens
        width = target_logits.shape[1]
        if not self.stop_ids or need <= min(self.num_generated):
            return target_logits
        banned = torch.tensor([[n + j < need for j in range(width)]
                               for n in self.num_generated])  # [B, K+1] bool
        stop_ids = torch.tensor(sorted(self.stop_ids), device=target_logits.device)
        masked = target_logits.clone()
        columns = masked[:, :, stop_ids]  # [B, K+1, S] (a copy)
        columns[banned.to(target_logits.device)] = -torch.inf
        masked[:, :, stop_ids] = columns
        return masked

    def _propose(self, k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.constraints is not None:
            self.constraints.start_round()
        if k == 0 or self.proposer is None:
            return torch.empty((len(self.token_ids), 0), dtype=torch.int64,
                               device=self.device), None
        proposal = self.proposer.propose(k, self.generator, self.constraints)
        # tokens meet the target's probs on its device (an n-gram lookup proposes host tensors;
        # the draft's probs are on the draft's device, which load() makes the target's)
        return proposal.draft_tokens.to(self.device), proposal.draft_probs

    def _emit(self, output_tokens: list[list[int]], num_accepted: list[int],
              active: list[bool]) -> Chunk:
        """Each active row's num_accepted + 1 tokens, cut at max_new_tokens and after its first
        stop token (which is kept). output_tokens: the round's [B, K+1] rows as lists."""
        new_ids: list[list[int]] = []
        for row, (tokens, accepted, is_active) in enumerate(
                zip(output_tokens, num_accepted, active)):
            if not is_active:
                new_ids.append([])
                continue
            budget = self.config.max_new_tokens - self.num_generated[row]
            new = tokens[: min(accepted + 1, budget)]
            for i, token in enumerate(new):
                if token in self.stop_ids:
                    new = new[: i + 1]
                    self.hit_stop[row] = True
                    break
            self.num_generated[row] += len(new)
            self.finished[row] = (self.hit_stop[row]
                                  or self.num_generated[row] >= self.config.max_new_tokens)
            self.token_ids[row].extend(new)
            new_ids.append(new)
        return Chunk(new_ids, list(self.finished))

    def _record(self, k: int, num_accepted: list[int], draft_time: float, target_time: float,
                verify_time: float, wall_time: float, chunk: Chunk) -> RoundStats:
        """Add this round to the metrics; num_accepted: one count per row that took part."""
        # at_least[j] = rows that accepted >= j tokens, j = 0 .. k
        at_least = [sum(n >= j for n in num_accepted) for j in range(k + 1)]
        reached, accepted_at = at_least[:k], at_least[1:]
        times = {"draft_time": draft_time, "target_time": target_time,
                 "verify_time": verify_time, "wall_time": wall_time}
        self.recorder.record_round(k, len(num_accepted), sum(num_accepted),
                                   sum(map(len, chunk.token_ids)), reached, accepted_at, times)
        return RoundStats(k, tuple(reached), tuple(accepted_at), draft_time, target_time)


def _synced_elapsed(started: float, tensor: torch.Tensor) -> float:
    """Seconds since ``started``, after the device that produced ``tensor`` has finished."""
    if tensor.is_cuda:
        torch.cuda.synchronize(tensor.device)
    return time.perf_counter() - started


def _check_prompts(prompts: Sequence[Sequence[int]], vocab_size: int) -> list[list[int]]:
    """Validate a batch of token-id prompts; return them as lists of ints."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or not prompts:
        raise InputError(f"prompts must be a non-empty list of token-id lists, e.g. [[1, 2, 3]]; "
                         f"got {prompts!r:.80}.")
    checked = []
    for row, prompt in enumerate(prompts):
        if isinstance(prompt, int) or not isinstance(prompt, Sequence):
            raise InputError(f"prompts[{row}]={prompt!r:.40} is not a list of token ids; pass a "
                             "batch, e.g. [[1, 2, 3]] for one prompt.")
        if len(prompt) == 0:
            raise EmptyPromptError(f"prompts[{row}] is empty; a prompt needs at least one token "
                                   "(for example the BOS token).")
        ids = []
        for token in prompt:
            if isinstance(token, bool) or not isinstance(token, int):
                raise InputError(f"prompts[{row}] holds {token!r}; token ids must be ints.")
            if not 0 <= token < vocab_size:
                raise TokenOutOfRangeError(f"prompts[{row}] holds token id {token}, outside the "
                                           f"vocabulary [0, {vocab_size}).")
            ids.append(token)
        checked.append(ids)
    return checked
