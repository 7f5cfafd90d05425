"""A cross-vocabulary proposer's session: the draft model's cache kept on each row's context.

Legend: B batch, u unfed draft ids, Vd the draft model's logits.

Each row has a DraftContext (its committed text in the draft's tokens, ``ids``) and ``fed``,
the draft ids its cache holds: always a prefix of ``ids`` between rounds, one id short of it
at least, so that a round's first pass has a token to feed and logits to read. A round feeds
each drafting row its unfed ids (``ids[len(fed):]``) in one pass, then one draft id a step
(the rule's, rules.py). At the commit the row's context takes the committed target ids' text,
and the cache keeps the longest common prefix of what it was fed and the context's ``ids``
(LMSession.rewind is exact): after an accepted draft that prefix is most of what it was fed,
after a rejection the context up to the first changed id.

Worked example: ids [x, y], fed [x]; the round feeds [y], then its first drawn id d1 (the
second, d2, is drawn and not fed): the cache holds x y d1. The target keeps d1's text and
appends t: the context re-encodes to [x, y, d1, t'] (t' the draft's own token of t's text),
the cache keeps x y d1 and [t'] is unfed. Had the new text re-encoded to [x, y, e] (d1's
bytes merged with t's), the cache would keep x y, with [e] unfed.

A row that drafts nothing in a round (k_b = 0, an empty context, a rule's ``drafts`` refusing
it) is fed a DUMMY_ID in the round's passes, rewound at the commit. A row whose context no
longer fits the draft model's window with a round's steps is parked: its cache is emptied and
it never drafts again (the window counts the draft's tokens, which the target's
max_positions does not bound); it still rides each round's passes on DUMMY_IDs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ...models.base import LMSession, TokenText, as_ints
from ..base import DraftPlan, Proposal, RoundConstraint
from .context import DraftContext
from .rules import CrossRule

DUMMY_ID = 0  # what a row that drafts nothing is fed (rewound at the commit)


@dataclass
class _Row:
    """context: None for a parked row; fed: the draft ids its cache holds."""

    context: DraftContext | None
    fed: list[int]


class Drafter:
    """One round's passes of the draft model over every row (rules.Drafter); ``fed``: each
    row's ids fed this round."""

    def __init__(self, session: LMSession, unfed: list[list[int]]) -> None:
        self.session = session
        self.unfed = unfed  # >= 1 id a row
        self.fed = [list(row) for row in unfed]

    def first(self) -> torch.Tensor:
        """Feed every row's unfed ids in one pass, shorter rows padded with their last id and
        the padding rewound at once -> the logits after each row's last id [B, Vd]."""
        widths = [len(row) for row in self.unfed]
        width = max(widths)
        inputs = torch.tensor([row + row[-1:] * (width - len(row)) for row in self.unfed],
                              dtype=torch.int64)  # [B, u]
        logits = self.session.extend(inputs, [w - 1 for w in widths])  # [B, Vd]
        if min(widths) < width:
            self.session.rewind([width - w for w in widths])
        return logits

    def step(self, draft_ids: Sequence[int]) -> torch.Tensor:
        """Feed one draft id a row -> the logits after it [B, Vd]."""
        inputs = torch.tensor(list(draft_ids), dtype=torch.int64)[:, None]  # [B, 1]
        for fed, token in zip(self.fed, draft_ids):
            fed.append(int(token))
        return self.session.extend(inputs, [0] * len(self.fed))


class CrossVocabSession:
    """One generation's draft state (module docstring). ``target_bytes``: the text of target
    ids; ``prefix``: the draft ids each context starts with; ``max_positions``: the draft
    model's window in its own tokens (None: none); ``own_prompt``: a target prompt's draft
    ids where the text layer rendered it for the draft too (DraftPrompts.get), else None."""

    def __init__(self, session: LMSession, rule: CrossRule, draft_text: TokenText,
                 target_bytes: Callable[[Sequence[int]], bytes], prefix: Sequence[int],
                 max_positions: int | None, prompts: Sequence[Sequence[int]],
                 own_prompt: Callable[[Sequence[int]], list[int] | None] = lambda ids: None
                 ) -> None:
        self.session = session
        self.rule = rule
        self.draft_text = draft_text
        self.target_bytes = target_bytes
        self.prefix = list(prefix)
        self.max_positions = max_positions
        self.own_prompt = own_prompt
        self.rows = [self._new_row(prompt, defer=False) for prompt in prompts]
        session.start([row.fed for row in self.rows])
        self._proposal: list[list[int]] | None = None  # this round's [B][K] target ids
        self._round_fed: list[list[int]] = []  # the ids each row was fed this round

    def _new_row(self, prompt: Sequence[int], defer: bool) -> _Row:
        own = self.own_prompt(prompt)  # the draft's own rendering of a chat, where registered
        if own:
            context = DraftContext(self.draft_text, own)  # the target prompt's text is not its
        else:
            context = DraftContext(self.draft_text, self.prefix)
            context.append(self.target_bytes(prompt))
        if not self._fits(context, 1):
            return _Row(None, [])
        return _Row(context, [] if defer else context.ids[:-1])

    def _fits(self, context: DraftContext, num_steps: int) -> bool:
        """Whether the context and a round of ``num_steps`` steps fit the draft's window."""
        return self.max_positions is None or len(context.ids) + num_steps <= self.max_positions

    def add_rows(self, prompts: Sequence[Sequence[int]], defer: bool = False) -> None:
        """Rows join: their contexts are encoded now; their caches prefilled now, or with
        ``defer`` at the next catch_up or propose."""
        assert self._proposal is None, "rows join between rounds"
        rows = [self._new_row(prompt, defer) for prompt in prompts]
        self.session.add_rows([row.fed for row in rows])
        self.rows += rows

    def keep_rows(self, rows: Sequence[int]) -> None:
        assert self._proposal is None, "rows leave between rounds"
        self.session.keep_rows(rows)
        self.rows = [self.rows[row] for row in rows]

    def catch_up(self) -> None:
        """Feed each row's unfed ids but its last, with no logits (LMSession.feed)."""
        assert self._proposal is None, "the draft catches up between rounds"
        self._park(1)
        backlog = [row.context.ids[len(row.fed): -1] if row.context is not None else []
                   for row in self.rows]
        if any(backlog):
            self.session.feed(backlog)
            for row, ids in zip(self.rows, backlog):
                row.fed += ids

    def _park(self, num_steps: int) -> None:
        """Rows whose context no longer fits the window with ``num_steps`` steps leave the
        draft for good: their caches are emptied."""
        rewinds = [0] * len(self.rows)
        for index, row in enumerate(self.rows):
            if row.context is not None and not self._fits(row.context, num_steps):
                rewinds[index], row.context, row.fed = len(row.fed), None, []
        if any(rewinds):
            self.session.rewind(rewinds)

    def propose(self, plan: DraftPlan, constraint: RoundConstraint | None = None) -> Proposal:
        """Up to plan.num_draft_tokens[b] target ids for row b, by the session's rule."""
        assert self._proposal is None
        self._park(self.rule.max_steps(plan.num_steps))
        contexts = [row.context if k > 0 and row.context is not None and row.context.ids
                    and self.rule.drafts(row.context) else None
                    for row, k in zip(self.rows, plan.num_draft_tokens)]
        if all(context is None for context in contexts):
            self._proposal, self._round_fed = [[] for _ in self.rows], []
            return Proposal(torch.zeros((len(self.rows), 0), dtype=torch.int64), None,
                            [0] * len(self.rows))
        drafter = Drafter(self.session, [
            context.ids[len(row.fed):] if context is not None else [DUMMY_ID]
            for row, context in zip(self.rows, contexts)])
        proposal, self._proposal = self.rule.propose(drafter, plan, contexts, constraint)
        self._round_fed = drafter.fed
        return proposal

    def commit(self, num_accepted: Sequence[int], next_tokens: Sequence[int]) -> None:
        """Each row's context takes the committed target ids; its cache keeps the longest
        common prefix of what it was fed and the context's ids (module docstring)."""
        num_accepted, next_tokens = as_ints(num_accepted), as_ints(next_tokens)
        proposal = self._proposal or [[] for _ in self.rows]
        round_fed = self._round_fed or [[] for _ in self.rows]
        self._proposal, self._round_fed = None, []
        rewinds = []
        for row, drafted, n, token, fed_now in zip(self.rows, proposal, num_accepted,
                                                   next_tokens, round_fed):
            num_fed = len(row.fed)
            row.fed += fed_now
            keep = self._kept(row, drafted[:n] + [token], num_fed)
            rewinds.append(len(row.fed) - keep)
            del row.fed[keep:]
        if any(rewinds):
            self.session.rewind(rewinds)

    def _kept(self, row: _Row, committed: list[int], num_fed: int) -> int:
        """How many of the ids the row's cache holds it keeps once its context takes the
        ``committed`` target ids; its first ``num_fed`` were the context's before."""
        if row.context is None:
            return 0
        changed = row.context.append(self.target_bytes(committed))
        ids, fed = row.context.ids, row.fed
        keep, limit = min(num_fed, changed), min(len(fed), len(ids) - 1)
        while keep < limit and fed[keep] == ids[keep]:
            keep += 1
        return max(min(keep, limit), 0)
