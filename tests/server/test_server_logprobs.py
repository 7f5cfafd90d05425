"""Logprobs, echo, penalties, logit_bias and min_p through the server, with the openai client.

On the shipped demo pair: the logprobs a greedy request returns equal a direct transformers
forward of the target over prompt + output (at temperature 0 the processed distribution is the
target's at temperature 1), a stream's logprobs put together equal the body's, an echoed
prompt's scores equal Decoder.prompt_logprobs and the direct forward, a stop string cuts the
logprobs where it cuts the tokens, and penalised requests give the library's own output.
"""

from __future__ import annotations

import httpx
import openai
import pytest

import verispec
from verispec.server import ServerSettings, create_app

from direct_logprobs import direct_logprobs, load_demo_target
from live_server import ServerThread

pytestmark = pytest.mark.usefixtures("single_thread_torch")

MODEL = "demo"
PROMPT = "def add(a, b):"
MESSAGES = [{"role": "user", "content": "Write a function that adds two numbers."}]
TOLERANCE = 1e-4  # the fast path against transformers' forward (tests/text/test_prompt_logprobs)


@pytest.fixture(scope="module")
def decoder():
    return verispec.load()


@pytest.fixture(scope="module")
def server(decoder):
    settings = ServerSettings(model_name=MODEL, max_batch_size=4, max_tokens_limit=256)
    with ServerThread(create_app(verispec.load(), settings)) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def target():
    return load_demo_target()


def assert_scores_direct(target, prompt_ids, token_ids, values, tops) -> None:
    """values[j] (and tops[j]: {token id: logprob}) of token_ids[j] after prompt + earlier
    tokens, against the direct forward."""
    expected = direct_logprobs(target, prompt_ids + token_ids)[len(prompt_ids) - 1 :]
    assert len(values) == len(token_ids) > 0
    for j, token in enumerate(token_ids):
        assert values[j] == pytest.approx(expected[j, token].item(), abs=TOLERANCE)
        for alternative, value in tops[j].items():
            assert value == pytest.approx(expected[j, alternative].item(), abs=TOLERANCE)
        best = expected[j].topk(len(tops[j])).indices.tolist()
        assert set(tops[j]) == set(best)


def ids_by_text(tokenizer) -> dict[str, int]:
    """Each token's text (as the server names it) -> its id (the demo vocabulary's texts are
    distinct for the tokens these tests meet)."""
    return {tokenizer.decode([t], skip_special_tokens=False): t for t in range(len(tokenizer))}


# --- chat -----------------------------------------------------------------------------------


def test_chat_logprobs_equal_the_target_and_stream_equals_body(client, decoder, target):
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12,
                                         temperature=0, logprobs=True, top_logprobs=3)
    expected = decoder.chat(MESSAGES, max_new_tokens=12)
    assert out.choices[0].message.content == expected.text
    content = out.choices[0].logprobs.content
    assert len(content) == len(expected.token_ids) == out.usage.completion_tokens
    assert "".join(entry.token for entry in content) == expected.text
    assert all(bytes(entry.bytes).decode() == entry.token for entry in content)
    ids = ids_by_text(decoder.tokenizer)
    assert_scores_direct(target, decoder.chat_prompt_ids(MESSAGES), expected.token_ids,
                         [entry.logprob for entry in content],
                         [{ids[top.token]: top.logprob for top in entry.top_logprobs}
                          for entry in content])
    streamed = []
    for chunk in client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12,
                                                temperature=0, logprobs=True, top_logprobs=3,
                                                stream=True):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.content
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in content]


def test_chat_without_logprobs_has_none(client):
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3,
                                         temperature=0)
    assert out.choices[0].logprobs is None


# --- completions ----------------------------------------------------------------------------


def completion_scores(logprobs, tokenizer):
    """(values, [{token id: logprob}]) of a completions logprobs object (the entry's own token
    is in its dict too, as OpenAI's)."""
    vocab = ids_by_text(tokenizer)
    tops = [None if top is None else {vocab[text]: value for text, value in top.items()}
            for top in logprobs.top_logprobs]
    return logprobs.token_logprobs, tops


def test_completion_logprobs_equal_the_target_and_stream_equals_body(client, decoder, target):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                    logprobs=2)
    expected = decoder.generate(PROMPT, max_new_tokens=12)
    choice = out.choices[0]
    assert choice.text == expected.text
    assert len(choice.logprobs.tokens) == len(expected.token_ids) == out.usage.completion_tokens
    assert "".join(choice.logprobs.tokens) == choice.text
    assert choice.logprobs.text_offset == [sum(map(len, choice.logprobs.tokens[:i]))
                                           for i in range(len(choice.logprobs.tokens))]
    values, tops = completion_scores(choice.logprobs, decoder.tokenizer)
    # each dict: the 2 most likely and the token itself (2 or 3 entries)
    assert all(2 <= len(top) <= 3 and token in top
               for top, token in zip(tops, expected.token_ids))
    alternatives = [dict(sorted(top.items(), key=lambda kv: -kv[1])[:2]) for top in tops]
    assert_scores_direct(target, decoder.tokenizer.encode(PROMPT), expected.token_ids, values,
                         alternatives)
    streamed = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    text = ""
    for chunk in client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12,
                                           temperature=0, logprobs=2, stream=True):
        text += chunk.choices[0].text
        if chunk.choices[0].logprobs is not None:
            for key in streamed:
                streamed[key] += getattr(chunk.choices[0].logprobs, key)
    assert text == choice.text and streamed == choice.logprobs.model_dump()


def test_a_stop_string_cuts_the_logprobs_with_the_tokens(client, decoder):
    """Stops that start exactly at a token, ending one character into the next: the round that
    delivers that token holds its text back (it may start the stop), and the next round cuts
    it, so its logprob must never have been streamed."""
    full = decoder.generate(PROMPT, max_new_tokens=24)
    texts = [decoder.tokenizer.decode([t]) for t in full.token_ids]
    for j in range(1, len(texts) - 1):
        stop = texts[j] + texts[j + 1][:1]
        if not texts[j].strip() or stop in "".join(texts[:j]) + texts[j][:-1]:
            continue
        expected = decoder.generate(PROMPT, max_new_tokens=24, stop=stop)
        assert expected.finish_reason == "stop"
        kept = [decoder.tokenizer.decode([t], skip_special_tokens=False)
                for t in expected.token_ids]
        for stream in (False, True):
            chunks = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24,
                                               temperature=0, logprobs=0, stop=stop,
                                               stream=stream)
            tokens, text = [], ""
            for chunk in (chunks if stream else [chunks]):
                text += chunk.choices[0].text
                if chunk.choices[0].logprobs is not None:
                    tokens += chunk.choices[0].logprobs.tokens
            assert text == expected.text and tokens == kept, (stop, stream)


def test_echo_scores_the_prompt(client, decoder, target):
    prompt_ids = decoder.tokenizer.encode(PROMPT)
    scored = decoder.prompt_logprobs(prompt_ids, num_top=1)
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True,
                                    logprobs=1, temperature=0)
    choice = out.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert out.usage.prompt_tokens == len(prompt_ids) and out.usage.completion_tokens == 0
    lp = choice.logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == [s.logprob for s in scored[1:]]
    values, tops = completion_scores(lp, decoder.tokenizer)
    alternatives = [dict(sorted(top.items(), key=lambda kv: -kv[1])[:1]) for top in tops[1:]]
    assert_scores_direct(target, prompt_ids[:1], prompt_ids[1:], values[1:], alternatives)
    # echo with generation: prompt first, then the completion, in the body and the stream
    body = client.completions.create(model=MODEL, prompt=[prompt_ids], max_tokens=6, echo=True,
                                     logprobs=1, temperature=0)
    generated = decoder.generate(PROMPT, max_new_tokens=6)
    assert body.choices[0].text == decoder.tokenizer.decode(prompt_ids) + generated.text
    assert body.choices[0].logprobs.token_logprobs[: len(prompt_ids)] == lp.token_logprobs
    assert len(body.choices[0].logprobs.tokens) == len(prompt_ids) + len(generated.token_ids)
    text, logprobs = "", []
    for chunk in client.completions.create(model=MODEL, prompt=[prompt_ids], max_tokens=6,
                                           echo=True, logprobs=1, temperature=0, stream=True):
        text += chunk.choices[0].text
        logprobs += chunk.choices[0].logprobs.token_logprobs if chunk.choices[0].logprobs else []
    assert text == body.choices[0].text and logprobs == body.choices[0].logprobs.token_logprobs


@pytest.mark.parametrize("max_tokens, logprobs", [(0, 1), (0, None), (4, 1), (4, None)])
def test_a_prompt_is_checked_once_per_request(client, monkeypatch, max_tokens, logprobs):
    """Echo only, echo with scores, and generation: the prompt's ids are checked against the
    vocabulary once (text.prompts.check_prompt_ids, which Decoder.encode calls)."""
    import verispec.text.decoder as text_decoder

    calls = []
    check = text_decoder.check_prompt_ids
    monkeypatch.setattr(text_decoder, "check_prompt_ids",
                        lambda ids, size: calls.append(len(ids)) or check(ids, size))
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=max_tokens,
                                    echo=True, logprobs=logprobs, temperature=0)
    assert out.choices[0].text.startswith(PROMPT)
    assert len(calls) == 1, calls


UNICODE_PROMPT = "héllo 日本語 🎉 = 'x'"  # 17 characters, 24 byte-level tokens


def collect_completion(client, stream: bool, **request) -> tuple[str, dict[str, list]]:
    """A completion's text and its logprobs lists, from the body or put together from a
    stream."""
    if not stream:
        choice = client.completions.create(model=MODEL, **request).choices[0]
        return choice.text, choice.logprobs.model_dump()
    text, logprobs = "", {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                          "text_offset": []}
    for chunk in client.completions.create(model=MODEL, stream=True, **request):
        text += chunk.choices[0].text
        if chunk.choices[0].logprobs is not None:
            for key in logprobs:
                logprobs[key] += getattr(chunk.choices[0].logprobs, key)
    return text, logprobs


def assert_offsets_fit_the_text(text: str, tokens: list[str], offsets: list[int]) -> None:
    """OpenAI's text_offset: the characters of the text before each token's text; a token
    holding part of a character (its text U+FFFD) starts where that character starts."""
    assert offsets[0] == 0 and offsets == sorted(offsets)
    assert offsets[-1] + len(tokens[-1]) == len(text)
    for token, offset in zip(tokens, offsets):
        if "\ufffd" not in token:
            assert text[offset : offset + len(token)] == token, (token, offset)


@pytest.mark.parametrize("stream", [False, True], ids=["body", "stream"])
@pytest.mark.parametrize("as_ids", [False, True], ids=["text", "token_ids"])
def test_text_offsets_count_characters_of_split_characters_once(client, decoder, stream,
                                                                 as_ids):
    prompt_ids = decoder.tokenizer.encode(UNICODE_PROMPT)
    assert len(prompt_ids) > len(UNICODE_PROMPT)  # characters split over byte tokens
    text, logprobs = collect_completion(
        client, stream, prompt=prompt_ids if as_ids else UNICODE_PROMPT, max_tokens=8,
        temperature=0, echo=True, logprobs=0)
    offsets, tokens = logprobs["text_offset"], logprobs["tokens"]
    assert text.startswith(UNICODE_PROMPT) and len(tokens) > len(prompt_ids)
    assert offsets[len(prompt_ids)] == len(UNICODE_PROMPT)  # the first new token's
    assert offsets[: len(prompt_ids)] == [0, 1, 1, 2, 3, 5, 6, 6, 6, 7, 7, 7, 8, 8, 8, 9, 10,
                                          10, 10, 10, 11, 13, 15, 16]
    assert_offsets_fit_the_text(text, tokens, offsets)


def test_text_offsets_of_new_tokens_that_split_characters(client, decoder):
    """New tokens that split characters: a logit bias on the first and last byte of "日"
    (E6 .. A5) makes the greedy text lone E6 bytes (a U+FFFD each), then E6 A5 A5, a character
    of its own (楥), then lone A5 bytes: each character counts once, and starts a token."""
    first, _, last = decoder.tokenizer.encode("日", add_special_tokens=False)
    for stream in (False, True):
        text, logprobs = collect_completion(client, stream, prompt="x =", max_tokens=10,
                                            temperature=0, logit_bias={str(first): 100,
                                                                       str(last): 100},
                                            logprobs=0)
        offsets = logprobs["text_offset"]
        assert_offsets_fit_the_text(text, logprobs["tokens"], offsets)
        assert len(text) < len(offsets) and text.strip("\ufffd")  # a character was split
        assert sorted(set(offsets)) == list(range(len(text)))


def test_echo_without_logprobs_and_several_prompts(client, decoder):
    out = client.completions.create(model=MODEL, prompt=["a = 1", "b = 2"], max_tokens=0,
                                    echo=True)
    assert [c.text for c in out.choices] == ["a = 1", "b = 2"]
    assert all(c.logprobs is None for c in out.choices)


# --- penalties, logit_bias, min_p -----------------------------------------------------------


OPENAI_PENALTIES = ("presence_penalty", "frequency_penalty")


@pytest.mark.parametrize("settings", [
    {"frequency_penalty": 1.5}, {"presence_penalty": 2.0, "frequency_penalty": 0.5},
    {"repetition_penalty": 1.3}, {"min_p": 0.2, "temperature": 0.8, "seed": 3}])
def test_penalised_output_equals_the_library(client, decoder, settings):
    temperature = settings.get("temperature", 0)
    openai_fields = {k: v for k, v in settings.items() if k in OPENAI_PENALTIES}
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, logprobs=1,
                                    temperature=temperature, seed=settings.get("seed"),
                                    extra_body={k: v for k, v in settings.items()
                                                if k in ("repetition_penalty", "min_p")},
                                    **openai_fields)
    expected = decoder.generate(PROMPT, max_new_tokens=24, logprobs=1, **settings)
    plain = decoder.generate(PROMPT, max_new_tokens=24, temperature=temperature,
                             seed=settings.get("seed"))
    assert out.choices[0].text == expected.text and expected.text != plain.text
    assert out.choices[0].logprobs.token_logprobs == pytest.approx(
        [lp.logprob for lp in expected.logprobs], abs=1e-6)


def test_logit_bias_of_100_forces_a_token(client, decoder):
    token = decoder.tokenizer.encode(" banana")[0]
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0,
                                    logit_bias={str(token): 100})
    assert out.choices[0].text == decoder.tokenizer.decode([token] * 5)
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3,
                                          temperature=0.7, seed=1,
                                          logit_bias={str(token): 100})
    assert chat.choices[0].message.content == decoder.tokenizer.decode([token] * 3)


def test_bad_values_are_400_with_the_field(server):
    cases = [({"logprobs": 21}, "logprobs"), ({"logit_bias": {"x": 1}}, "logit_bias"),
             ({"logit_bias": {"3": -101}}, "logit_bias"), ({"max_tokens": 0}, "max_tokens")]
    for extra, param in cases:
        response = httpx.post(server.url + "/v1/completions",
                              json={"prompt": PROMPT, "max_tokens": 2, **extra})
        assert response.status_code == 400, extra
        assert response.json()["error"]["param"] == param
    response = httpx.post(server.url + "/v1/chat/completions", json={
        "messages": MESSAGES, "logprobs": True, "top_logprobs": 30})
    assert response.status_code == 400 and response.json()["error"]["param"] == "top_logprobs"
