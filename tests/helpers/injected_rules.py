"""Verification rules injected into the engine, for the law tests' controls.

inject_verify makes the engine verify with any function of verify's signature; _rule_verify builds
one from an acceptance test (_exact_accept, _threshold_accept, _accept_all) and a distribution to
draw from after a rejection (_residual, _target), so the same injected code path runs the exact
rule (the positive control) and classic mistakes (the negative controls).
accept_every_draft_token is another mistake: each draft token tested against its own
distribution.

Legend: B batch, K draft tokens, V vocabulary.
"""

from __future__ import annotations

import torch

import verispec.engine.verification
from verispec.sample.rejection import point_mass, residual_probs, verify
from verispec.sample.result import PAD_TOKEN, VerifyResult
from verispec.sample.sampling import sample_with_uniform


def _exact_accept(uniforms, target_at_draft, draft_at_draft):
    return uniforms < (target_at_draft / draft_at_draft).clamp(max=1.0)


def _threshold_accept(uniforms, target_at_draft, draft_at_draft):
    return target_at_draft / draft_at_draft >= 0.5  # deterministic: ignores the uniforms


def _accept_all(uniforms, target_at_draft, draft_at_draft):
    return torch.ones_like(uniforms, dtype=torch.bool)


def _residual(draft_row, target_row):
    return residual_probs(draft_row, target_row)


def _target(draft_row, target_row):
    return target_row  # resample from the target: overweights tokens the draft covers


def _rule_verify(accept, recover):
    """A verify() with the same signature and random-number order as
    verispec.sample.rejection.verify, whose acceptance test and post-rejection distribution are
    ``accept`` and ``recover``.

    Shapes as in verify: draft_tokens [B, K], draft_probs [B, K, V] | None,
    target_probs [B, K+1, V]; uniforms [B, K] then next_uniforms [B] drawn from ``generator``.
    """

    def rule_verify(draft_tokens, draft_probs, target_probs, generator, num_draft_tokens=None):
        assert num_draft_tokens is None  # the engine drafts the same k for every row
        batch_size, max_k = draft_tokens.shape
        vocab_size = target_probs.shape[-1]
        uniforms = torch.rand((batch_size, max_k), generator=generator)
        next_uniforms = torch.rand((batch_size,), generator=generator, dtype=torch.float64)
        if draft_probs is None:
            draft_probs = point_mass(draft_tokens, vocab_size)
        target_at_draft = target_probs[:, :max_k].gather(-1, draft_tokens[..., None])[..., 0]
        draft_at_draft = draft_probs.gather(-1, draft_tokens[..., None])[..., 0]  # [B, K]
        accepted = accept(uniforms, target_at_draft, draft_at_draft)
        num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)  # [B]
        all_accepted = num_accepted == max_k
        rows = torch.arange(batch_size)
        next_probs = target_probs[rows, num_accepted]  # bonus distribution [B, V]
        if max_k > 0:
            rejected_at = num_accepted.clamp(max=max_k - 1)
            recovered = recover(draft_probs[rows, rejected_at], target_probs[rows, rejected_at])
            next_probs = torch.where(all_accepted[:, None], next_probs, recovered)
        next_tokens = sample_with_uniform(next_probs, next_uniforms)  # [B]
        positions = torch.arange(max_k + 1)[None, :]
        padded = torch.cat([draft_tokens, draft_tokens.new_full((batch_size, 1), PAD_TOKEN)], 1)
        output_tokens = torch.where(positions < num_accepted[:, None], padded, PAD_TOKEN)
        output_tokens.scatter_(1, num_accepted[:, None], next_tokens[:, None])
        return VerifyResult(num_accepted=num_accepted, output_tokens=output_tokens,
                            num_emitted=num_accepted + 1, first_rejection=num_accepted,
                            all_accepted=all_accepted)

    return rule_verify


def inject_verify(monkeypatch, verify_fn) -> None:
    """Make the engine verify with ``verify_fn`` (verify's signature and result, one generator)
    at temperature > 0, where it calls sample.rejection.verify_rows: verify read back as host
    lists."""

    def injected_verify_rows(draft_tokens, draft_probs, target_probs, generators,
                             num_draft_tokens=None):
        # rows of equal depth k sharing a generator are verified together on their first k
        # tokens (rows near max_new_tokens draft fewer than the round's width)
        width = draft_tokens.shape[1]
        counts = list(num_draft_tokens or [width] * draft_tokens.shape[0])
        groups = {}
        for b, (count, generator) in enumerate(zip(counts, generators)):
            groups.setdefault((count, id(generator)), (generator, []))[1].append(b)
        num_accepted, output_tokens = [0] * len(counts), [[]] * len(counts)
        for (k, _), (generator, rows) in groups.items():
            index = torch.tensor(rows)
            result = verify_fn(draft_tokens[index, :k],
                               None if draft_probs is None else draft_probs[index, :k],
                               target_probs[index, : k + 1], generator)
            for b, n, tokens in zip(rows, result.num_accepted.tolist(),
                                    result.output_tokens.tolist()):
                num_accepted[b], output_tokens[b] = n, tokens
        return num_accepted, output_tokens

    assert hasattr(verispec.engine.verification, "verify_rows")  # the name the engine really calls
    monkeypatch.setattr(verispec.engine.verification, "verify_rows", injected_verify_rows)


def accept_every_draft_token(draft_tokens, draft_probs, target_probs, generator,
                             num_draft_tokens=None):
    """Wrong on purpose: each draft token is tested against its own distribution (p/q = 1),
    so every draft token is accepted; the bonus still comes from the target."""
    num_drafted = draft_tokens.shape[1]
    if draft_probs is not None and num_drafted > 0:
        target_probs = torch.cat([draft_probs, target_probs[:, num_drafted:]], dim=1)
    return verify(draft_tokens, draft_probs, target_probs, generator, num_draft_tokens)
