"""Greedy replies compared across pass shapes on quantized llama.cpp models.

llama.cpp's quantized kernels round by pass shape: a one-token pass runs a GEMV, a pass over
several tokens a GEMM on repacked (or AMX) weights, and a prompt goes through in one large
batch. Two greedy runs that feed the same tokens in different passes (streamed and whole
replies whose suffix-drafter pools differ, speculative and plain decoding) therefore agree
token for token except where the target's two best tokens are closer than that rounding. A
comparison here passes when the replies are equal, or when they first differ at a position
where the token one reply chose is within NEAR_TIE_NATS of the other's choice, measured in the
first reply's own logprobs at that position (docs/exactness.md states the bound and the
measurements behind it). Anything else fails, naming the position and the margin.

A step is (token text, logprob, {alternative text: logprob}) as the server's chat logprobs
give them (a token's text is its own decode with special tokens kept).
"""

from __future__ import annotations

from collections.abc import Sequence

NEAR_TIE_NATS = 0.5  # docs/exactness.md: the documented bound across pass shapes

Step = tuple[str, float, dict[str, float]]


def steps_of_chat(choice) -> list[Step]:
    """The steps of a whole chat choice from the openai client (logprobs=True)."""
    return [(entry.token, entry.logprob, {alt.token: alt.logprob for alt in entry.top_logprobs})
            for entry in choice.logprobs.content]


def steps_of_stream(chunks) -> list[Step]:
    """The steps of a streamed chat reply's chunks (logprobs=True)."""
    steps: list[Step] = []
    for chunk in chunks:
        if chunk.choices and chunk.choices[0].logprobs and chunk.choices[0].logprobs.content:
            steps += steps_of_chat(chunk.choices[0])
    return steps


def steps_of_completion(completion, tokenizer) -> list[Step]:
    """The steps of a library Completion generated with ``logprobs`` > 0."""

    def text(token_id: int) -> str:
        return tokenizer.decode([token_id], skip_special_tokens=False)

    return [(text(entry.token_id), entry.logprob,
             {text(token_id): logprob for token_id, logprob in entry.top})
            for entry in completion.logprobs]


def first_difference(first: Sequence[Step], second: Sequence[Step]) -> int | None:
    for position, (one, other) in enumerate(zip(first, second)):
        if one[0] != other[0]:
            return position
    return None if len(first) == len(second) else min(len(first), len(second))


def assert_greedy_agree(first: Sequence[Step], second: Sequence[Step],
                        bound: float = NEAR_TIE_NATS) -> None:
    """Equal token for token, or first different at a near-tie within ``bound`` nats."""
    position = first_difference(first, second)
    if position is None:
        return
    assert position < min(len(first), len(second)), (
        f"one reply stops at token {position}, the other goes on: {first[position:][:3]} / "
        f"{second[position:][:3]}")
    token, logprob, alternatives = first[position]
    other = second[position][0]
    assert other in alternatives, (
        f"the replies differ at token {position} ({token!r} vs {other!r}), and {other!r} is "
        f"not among the first reply's alternatives there {alternatives}: not a near-tie")
    margin = logprob - alternatives[other]
    assert margin <= bound, (
        f"the replies differ at token {position} ({token!r} vs {other!r}) by {margin:.3f} nats, "
        f"more than the {bound} nats that kernel rounding across pass shapes explains")
