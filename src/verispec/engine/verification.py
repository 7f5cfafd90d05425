"""Steps 2-3 of a batch's round, row by row: the target's logits processed by each row's own
settings, then each row verified by its own rule.

Legend: B rows, K draft tokens this round (the largest row's k), V vocabulary, S sampled rows.

What it is: the part of :class:`verispec.engine.batch.Batch`'s round between the target's pass and
the commit, as functions of the rows (rows.Row: settings, stop tokens, generator, clocks) and
tensors. A greedy row takes the target's argmax (no random numbers,
sample.greedy.verify_greedy_rows); a seeded sampled row the target's race winner on its
position-keyed clocks (sample/seeded.py); another sampled row its own temperature/top-k/top-p
distributions and its own generator's uniforms under block or token-wise verification
(sample/block.py, sample/rejection.py). A row with min_new_tokens has its stop tokens masked out of
the target's distribution where they are not yet allowed. A row with penalties or a logit bias has
its logits reshaped first, position j counting the row's first j draft tokens
(sample/penalties.py). A row that asks for logprobs gets them for its emitted tokens from the
same processed logits (emitted_logprobs).
Faults per row: each function takes the round's ``faults`` (row -> its error). A row whose own
work raises (non-finite logits, a rule's arithmetic, its processor) is entered there and left out
of the rest of the round, and the batch engine fails it; its batch mates' results are exactly
what they would have been: work done over several rows at once is done again row by row
when it raises (proposers.base.run_isolated), and a rule that draws random numbers draws them
again from the generators' states before the call (verify_batch).
What it is not: the acceptance math (sample/rejection.py, sample/block.py, sample/greedy.py,
sample/seeded.py), the loop, its policy and its caches (batch.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..proposers.base import run_isolated
from ..sample.block import verify_block_rows
from ..sample.checks import raise_out_of_range
from ..sample.greedy import verify_greedy_rows
from ..sample.rejection import verify_rows
from ..sample.result import PAD_TOKEN
from ..sample.sampling import greedy_tokens, to_logprobs, to_probs
from ..sample.seeded import race
from .rows import Row, TokenLogprob, token_logprobs

RowFaults = dict[int, Exception]  # a round's failed rows (batch index) -> each one's error


@dataclass(frozen=True)
class TargetOutputs:
    """The target's side of one round's verification (:func:`target_outputs`).

    greedy          the greedy rows (batch indices) not failed before processing;
    sampled         the sampled rows (batch indices) not failed before processing, in the
                    order of target_probs' rows;
    greedy_tokens   {greedy row: its K+1 argmax tokens (host ints)}; a row whose logits could
                    not be processed is missing (it joined the round's faults);
    target_probs    [S, K+1, V] fp32: row s holds sampled[s]'s processed distributions (zeros
                    for a row that failed in processing); None when no row is sampled.
    """

    greedy: list[int]
    sampled: list[int]
    greedy_tokens: dict[int, list[int]]
    target_probs: torch.Tensor | None


def _failer(faults: RowFaults, rows: Sequence[int] | None = None
            ) -> Callable[[int, Exception], None]:
    """run_isolated's on_fault: enters a row's first error; ``rows`` maps positions to rows."""
    return lambda at, error: faults.setdefault(at if rows is None else rows[at], error)


def process_target_logits(rows: Sequence[Row], target_logits: torch.Tensor,
                        draft_tokens: torch.Tensor, num_draft: Sequence[int],
                        faults: RowFaults) -> torch.Tensor:
    """Each row with penalties or a logit bias gets its k_b + 1 positions reshaped, position
    j counting its committed tokens and its draft tokens d_1 .. d_j (Row.process_logits); the
    others are untouched. target_logits [B, K+1, V]; draft_tokens [B, K] -> [B, K+1, V]."""
    processed_rows = [b for b, row in enumerate(rows) if row.config.penalty.active]
    if not processed_rows:
        return target_logits
    processed = target_logits.float().clone()  # fp32 whatever the model's dtype, as to_probs
    drafted = draft_tokens.tolist()
    for b in processed_rows:
        positions = num_draft[b] + 1
        try:
            processed[b, :positions] = rows[b].process_logits(target_logits[b, :positions],
                                                         drafted[b][: num_draft[b]])
        except Exception as exc:  # the row's own fault: it fails alone
            faults.setdefault(b, exc)
    return processed


def emitted_logprobs(rows: Sequence[Row], target_logits: torch.Tensor,
                     allowed: torch.Tensor | None, output_tokens: Sequence[Sequence[int]],
                     num_accepted: Sequence[int], faults: RowFaults
                     ) -> list[list[TokenLogprob] | None]:
    """Per row, None or (when its config asks for logprobs) the TokenLogprob of each token it
    takes this round: output_tokens[b][: n_b + 1], position j under the processed logits
    target_logits[b, j] (processed and stop-banned) and the grammar's mask allowed[b, j] [B, K+1,
    V] (sample.sampling.to_logprobs)."""
    out: list[list[TokenLogprob] | None] = [None] * len(rows)
    for b, row in enumerate(rows):
        num_top = row.config.logprobs
        if num_top is None or b in faults:
            continue
        tokens = list(output_tokens[b][: num_accepted[b] + 1])
        try:
            logprobs = to_logprobs(target_logits[b, : len(tokens)], row.config.sampling,
                                   None if allowed is None else allowed[b, : len(tokens)])
            out[b] = token_logprobs(logprobs, tokens, num_top)
        except Exception as exc:  # the row's own fault: it fails alone
            faults.setdefault(b, exc)
    return out


def ban_early_stops(rows: Sequence[Row], target_logits: torch.Tensor) -> torch.Tensor:
    """min_new_tokens: a row's stop tokens get -inf logits at its positions before it, so the
    target's distribution there is renormalised without them. A draft model bans them too
    (Row.process_draft); a stop token another proposal holds there has target probability 0 and
    is always rejected (a point mass), so the output has exactly the masked target's law.
    target_logits [B, K+1, V]; position j of row b is its new token num_generated + j."""
    banned = [row.num_banned_positions() for row in rows]
    if not any(banned):
        return target_logits
    masked = target_logits.clone()
    for b, (row, num_positions) in enumerate(zip(rows, banned)):
        if num_positions:
            stop_ids = torch.tensor(sorted(row.stop_ids), device=masked.device)
            masked[b, :num_positions, stop_ids] = -torch.inf
    return masked


def target_outputs(rows: Sequence[Row], target_logits: torch.Tensor,
                   allowed: torch.Tensor | None, faults: RowFaults) -> TargetOutputs:
    """The target's side of verification: greedy rows' argmax tokens and sampled rows' probs,
    each row processed by its own settings (rows with equal settings in one call; all rows in
    one call needs no indexing). Rows already in ``faults`` are left out; a row whose logits
    cannot be processed (not finite) joins them. target_logits [B, K+1, V]; allowed: a
    grammar's masks [B, K+1, V] or None."""
    greedy = [b for b, row in enumerate(rows) if row.is_greedy and b not in faults]
    sampled = [b for b, row in enumerate(rows) if not row.is_greedy and b not in faults]
    tokens: dict[int, list[int]] = {}
    if greedy:
        for part, part_tokens in run_isolated(
                greedy, lambda part: greedy_tokens(_take(target_logits, part),
                                                   _take(allowed, part)).tolist(),
                _failer(faults)):
            tokens.update(zip(part, part_tokens))
    target_probs = None
    if sampled:
        groups: dict[object, list[int]] = {}
        for position, b in enumerate(sampled):
            groups.setdefault(rows[b].config.sampling, []).append(position)
        logits, masks = _take(target_logits, sampled), _take(allowed, sampled)
        for sampling, positions in groups.items():
            def process(part: list[int], sampling: object = sampling) -> torch.Tensor:
                return to_probs(_take(logits, part), sampling, _take(masks, part))

            for part, part_probs in run_isolated(positions, process, _failer(faults, sampled)):
                if len(part) == len(sampled):  # every sampled row in one call: no copy
                    target_probs = part_probs
                    continue
                if target_probs is None:
                    target_probs = torch.zeros(logits.shape, dtype=torch.float32,
                                               device=logits.device)
                target_probs[part] = part_probs
        if target_probs is None:  # every sampled row failed
            target_probs = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
    return TargetOutputs(greedy, sampled, tokens, target_probs)


def verify_batch(rows: Sequence[Row], draft_tokens: torch.Tensor,
                 draft_probs: torch.Tensor | None, num_draft: list[int],
                 target_out: TargetOutputs, vocab_size: int, faults: RowFaults
                 ) -> tuple[list[int], list[list[int]]]:
    """Each row's accepted count and output tokens (K+1 ints, PAD after its new token), row b
    verified on its first num_draft[b] draft tokens. draft_tokens [B, K]; draft_probs
    [B, K, V] fp32, or None for a deterministic proposal; target_out from target_outputs.
    A row in ``faults``, or whose verification raises (then entered there), gets 0 accepted
    and a placeholder token it never emits.

    Three rules, one per kind of row: greedy rows keep draft tokens while they are the
    target's argmax; keyed rows (seeded, sampled) while they are the target's race winner on
    the row's clocks (sample/seeded.py); the other sampled rows by rejection sampling, token-wise
    (sample/rejection.py) or over the block (sample/block.py) as their config's ``verification``
    asks, with their own generators."""
    num_rows, width = draft_tokens.shape
    num_accepted, output_tokens = [0] * num_rows, [[0] + [PAD_TOKEN] * width] * num_rows
    sampled = target_out.sampled
    draft_rows = draft_tokens.tolist()
    for b, (n, tokens) in _verify_greedy(draft_rows, num_draft, target_out, vocab_size,
                                         faults).items():
        num_accepted[b], output_tokens[b] = n, tokens
    target_probs = target_out.target_probs  # [S, K+1, V], rows in `sampled` order
    by_rule: dict[str, list[int]] = {}
    for position, b in enumerate(sampled):
        if b not in faults:
            by_rule.setdefault(_rule(rows[b], draft_probs), []).append(position)
    for position in by_rule.pop("keyed", []):
        b = sampled[position]
        try:
            n, tokens = _verify_keyed(rows[b], draft_rows[b][: num_draft[b]],
                                      target_probs[position], vocab_size)
        except Exception as exc:  # the row's own fault: it fails alone
            faults.setdefault(b, exc)
            continue
        num_accepted[b], output_tokens[b] = n, tokens + [PAD_TOKEN] * (width - n)
    for rule, positions in by_rule.items():
        chosen = [sampled[position] for position in positions]
        verified = _verify_drawing(verify_block_rows if rule == "block" else verify_rows,
                                   [rows[b].generator for b in chosen],
                                   [num_draft[b] for b in chosen],
                                   _take(draft_tokens, chosen), _take(draft_probs, chosen),
                                   _take(target_probs, positions), _failer(faults, chosen))
        for i, (n, tokens) in verified.items():
            num_accepted[chosen[i]], output_tokens[chosen[i]] = n, tokens
    assert all(n <= k for n, k in zip(num_accepted, num_draft)) and width >= max(num_draft)
    return num_accepted, output_tokens


def _verify_greedy(draft_rows: list[list[int]], num_draft: list[int],
                   target_out: TargetOutputs, vocab_size: int, faults: RowFaults
                   ) -> dict[int, tuple[int, list[int]]]:
    """The greedy rows (not in ``faults``) by sample.greedy.verify_greedy_rows on host lists:
    {row: (num_accepted, output tokens)}; a row that raises joins ``faults``."""
    greedy = [b for b in target_out.greedy if b not in faults]
    target_tokens = target_out.greedy_tokens
    verified = {}
    for part, (accepted, outputs) in run_isolated(greedy, lambda part: verify_greedy_rows(
            [draft_rows[b][: num_draft[b]] for b in part],
            [target_tokens[b][: num_draft[b] + 1] for b in part], vocab_size),
            _failer(faults)):
        verified.update(zip(part, zip(accepted, outputs)))
    return verified


def _verify_drawing(verify: Callable, generators: list[torch.Generator], num_draft: list[int],
                    draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                    target_probs: torch.Tensor, on_fault: Callable[[int, Exception], None]
                    ) -> dict[int, tuple[int, list[int]]]:
    """``verify`` (a rows-form rule: verify_rows, verify_block_rows) over these R rows with
    their generators -> {row: (num_accepted, output tokens)}. A rule draws its numbers before
    it decides, so when the call raises, the generators are set back to their states before it
    and each row is verified alone: a row with a generator of its own draws the numbers it
    drew in the call and gets what the call would have given it (rows sharing one draw fresh
    numbers, each used once); a row that raises alone goes to ``on_fault``. draft_tokens [R, K];
    draft_probs [R, K, V] or None; target_probs [R, K+1, V]."""
    states = {id(generator): (generator, generator.get_state()) for generator in generators}
    try:
        return dict(enumerate(zip(*verify(draft_tokens, draft_probs, target_probs, generators,
                                          num_draft))))
    except Exception as exc:  # some row's fault: each row alone finds which
        if len(generators) == 1:
            on_fault(0, exc)
            return {}
    for generator, state in states.values():
        generator.set_state(state)
    verified = {}
    for i, generator in enumerate(generators):
        try:
            (n,), (tokens,) = verify(draft_tokens[i : i + 1], _take(draft_probs, [i]),
                                     target_probs[i : i + 1], [generator], num_draft[i : i + 1])
        except Exception as exc:  # the row's own fault: it fails alone
            on_fault(i, exc)
            continue
        verified[i] = (n, tokens)
    return verified


def _rule(row: Row, draft_probs: torch.Tensor | None) -> str:
    """A sampled row's verification rule: "keyed", "block" or "token". Block verification
    needs the draft's distributions: a deterministic proposal stays on the token-wise rule,
    where it is a point mass (block verification gains nothing there)."""
    if row.keyed:
        return "keyed"
    return "block" if row.config.verification == "block" and draft_probs is not None else (
        "token")


def _verify_keyed(row: Row, drafted: list[int], target_probs: torch.Tensor,
                  vocab_size: int) -> tuple[int, list[int]]:
    """A keyed row: keep draft tokens while each is the target's race winner at its position
    (sample.seeded.race on the row's clocks), then that winner. target_probs [K+1, V]; drafted: the
    row's k_b draft tokens. Races run only up to the first mismatch, on the host (one copy of
    the row's k_b + 1 distributions, not one per race, from an accelerator). -> (num_accepted,
    the accepted tokens and the next one)."""
    target_probs = target_probs[: len(drafted) + 1].cpu()
    for step, token in enumerate(drafted):
        if not 0 <= token < vocab_size:
            raise_out_of_range(drafted, vocab_size)
        target_token = race(target_probs[step], row.clocks(step, vocab_size))
        if target_token != token:
            return step, drafted[:step] + [target_token]
    step = len(drafted)
    return step, drafted + [race(target_probs[step], row.clocks(step, vocab_size))]


def _take(tensor: torch.Tensor | None, rows: list[int]) -> torch.Tensor | None:
    """tensor[rows] along dim 0; the tensor itself when rows are all of them, in order."""
    if tensor is None or len(rows) == tensor.shape[0]:
        return tensor
    return tensor[torch.tensor(rows, device=tensor.device)]
