"""The packaged same-family pair on the llama.cpp backend: Qwen2.5-Coder-1.5B-Instruct (Q4_K_M)
drafted by Qwen2.5-Coder-0.5B-Instruct, both loaded by name from their chunk packages.

Greedy speculative decoding with the draft model (k 1, 4), with hybrid drafting and with
SmolLM2-135M of another tokenizer drafting (the string rule) equals
plain decoding, compared by tests/helpers/near_ties.py: the 1.5B's Q4_K weights are repacked,
so a pass of several tokens rounds differently from a one-token pass, and a reply may first
differ at a near-tie, never elsewhere (docs/exactness.md). A seeded request gives the same text
with and without the draft; the server, given only the target, drafts with its paired draft and
ends a chat at <|im_end|>.

The packages come with the [coder] extra, which `make test` installs: a missing one fails here
with ModelLoadError naming it, never a skip.
"""

from __future__ import annotations

import openai
import pytest

import verispec
from verispec.models.packaged import (
    QWEN_CODER_0_5B,
    QWEN_CODER_1_5B,
    packaged_model_path,
    paired_draft,
)
from verispec.server import ServerSettings, create_app
from verispec.server.run import describe_decoding, load_decoder

from live_server import ServerThread
from near_ties import assert_greedy_agree, steps_of_completion

TARGET = "qwen2.5-coder-1.5b-instruct"
DRAFT = "qwen2.5-coder-0.5b-instruct"
SMOLLM2 = "smollm2-135m-instruct"  # a draft of another tokenizer
IM_END = 151645  # Qwen2.5's <|im_end|>
NUM_NEW_TOKENS = 64
PROMPTS = {
    "fibonacci": "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "palindrome": "Write a Python function is_palindrome(s) that ignores case and spaces.",
    "rename": "Rename the variable `x` to `total` in this code and show the whole code:\n\n"
              "def add_all(items):\n    x = 0\n    for item in items:\n        x += item\n"
              "    return x\n",
}


def messages(prompt: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": prompt}]


@pytest.fixture(scope="module")
def coder():
    return verispec.load(TARGET, DRAFT)


@pytest.fixture(scope="module")
def coder_hybrid():
    return verispec.load(TARGET, DRAFT, hybrid=True)


@pytest.fixture(scope="module")
def plain_replies(coder):
    """prompt name -> the plain greedy reply (logprobs for the near-tie check), once."""
    return {name: coder.chat(messages(prompt), max_new_tokens=NUM_NEW_TOKENS, ignore_eos=True,
                             speculative=False, logprobs=5)
            for name, prompt in PROMPTS.items()}


def test_both_names_load_their_checked_files_on_llama_cpp(coder):
    target_path, draft_path = packaged_model_path(TARGET), packaged_model_path(DRAFT)
    assert target_path.stat().st_size == QWEN_CODER_1_5B.size
    assert draft_path.stat().st_size == QWEN_CODER_0_5B.size
    assert coder.target.model.path == str(target_path)
    assert type(coder.target.model).__name__ == "LlamaCppModel"
    assert paired_draft(TARGET) == DRAFT and paired_draft(DRAFT) is None
    assert IM_END in coder.stop_token_ids


def assert_each_agrees_with_plain(decoder, plain_replies, **settings) -> None:
    """The three prompts decoded as one batch with ``settings``: each reply agrees with its
    plain reply up to near-ties, and its drafts were verified (one batch instead of three
    calls: the suite's time; rows of a batch are decoded as they would be alone)."""
    prompts = [decoder.chat_prompt_ids(messages(prompt)) for prompt in PROMPTS.values()]
    replies = decoder.generate(prompts, max_new_tokens=NUM_NEW_TOKENS, ignore_eos=True,
                               adaptive=None, logprobs=5, **settings)
    for name, reply in zip(PROMPTS, replies):
        plain = plain_replies[name]
        assert reply.metrics.num_accepted > 0  # drafts were accepted: verification ran
        assert len(plain.token_ids) == NUM_NEW_TOKENS
        assert_greedy_agree(steps_of_completion(plain, decoder.tokenizer),
                            steps_of_completion(reply, decoder.tokenizer))


@pytest.mark.parametrize("k", [1, 4])  # a one-token draft and a 5-token pass
def test_greedy_draft_model_equals_plain(coder, plain_replies, k):
    assert_each_agrees_with_plain(coder, plain_replies, num_draft_tokens=k)


def test_greedy_hybrid_equals_plain(coder_hybrid, plain_replies):
    assert_each_agrees_with_plain(coder_hybrid, plain_replies, num_draft_tokens=3)


def test_greedy_smollm2_of_another_tokenizer_equals_plain(plain_replies):
    """SmolLM2-135M-Instruct (49,152 tokens) drafting the 1.5B (151,936) by the rule "auto"
    picks, the string rule (the intersection rule on real models:
    tests/models/test_cross_vocab_models.py): the same replies as the target alone."""
    decoder = verispec.load(TARGET, SMOLLM2)
    assert decoder.cross_vocab == "string"
    assert_each_agrees_with_plain(decoder, plain_replies, num_draft_tokens=3)
    # each model reads the chat in its own template: Qwen's default system prompt, SmolLM2's
    proposer = decoder.engine.proposer
    target_ids = decoder.chat_prompt_ids(messages(PROMPTS["fibonacci"]))
    draft_ids = proposer.draft_prompts.get(target_ids)
    assert b"Qwen" in proposer.target_bytes(target_ids)
    assert draft_ids and b"SmolLM" in b"".join(map(proposer.draft_text.piece, draft_ids))


def test_a_seeded_request_gives_the_same_text_with_and_without_the_draft(coder):
    settings = {"max_new_tokens": 48, "temperature": 0.7, "seed": 7, "ignore_eos": True}
    plain = coder.chat(messages(PROMPTS["fibonacci"]), speculative=False, **settings)
    speculative = coder.chat(messages(PROMPTS["fibonacci"]), num_draft_tokens=3,
                             adaptive=None, **settings)
    assert speculative.metrics.num_drafted > 0
    assert speculative.token_ids == plain.token_ids


def test_the_server_given_the_target_drafts_with_its_pair_and_ends_at_im_end():
    settings = ServerSettings(target=TARGET, model_name="coder")
    assert settings.draft == DRAFT
    decoder = load_decoder(settings)
    assert DRAFT in describe_decoding(decoder, settings)
    with ServerThread(create_app(decoder, settings)) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                               timeout=300)
        reply = client.chat.completions.create(
            model="coder", max_tokens=128, temperature=0,
            messages=messages("Answer with one word: what language is `def f(): pass`?"))
    assert reply.choices[0].finish_reason == "stop"
    assert reply.choices[0].message.content.strip()
    assert reply.usage.completion_tokens < 128
