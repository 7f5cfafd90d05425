"""Property-based fuzzing of the HTTP API with schemathesis, against a real uvicorn on 127.0.0.1.

What it is: every route of the running server's own /openapi.json, called with requests that
schemathesis generates from the schema, in three runs per body route:

  positive  bodies the request models accept (pydantic's JSON schema): 200, or a 4xx error body;
  negative  bodies they do not accept (wrong types, missing fields, not JSON): a 4xx error body;
  accepted  bodies inside every range the server documents (model, max_tokens 1..limit, n 1,
            logprobs, echo and penalties in range, a short prompt, ...): 200, so generation
            itself is fuzzed with sampled settings, stop strings, token-id prompts and streams.

Each response must have a status the server documents, never 5xx (not_a_server_error), the
documented content type, headers and body schema (schemathesis's checks), a protected route must
refuse a request without the key (ignored_auth), a stream must be well-formed server-sent events
ending in [DONE] with no error event, and the server must log no error while answering.

What it is not: a test of outputs (test_server.py compares them with the library's) or of load
(benchmarks/soak.py, benchmarks/load_test.py).

The document fuzzed is the server's /openapi.json completed here, not in src/: the POST routes
read their bodies by hand, so FastAPI documents no request body for them; this file adds the
pydantic request models of server/schemas.py as their bodies, the OpenAI error body for the
statuses the server answers with, the 200 bodies, text/event-stream for streams, text/plain for
/metrics and the bearer scheme. Bounded (a few hundred requests of at most 8 tokens each) and
deterministic (derandomize, no example database); loopback only.
"""

from __future__ import annotations

import copy
import json
import logging

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, assume, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    ignored_auth,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

import verispec
from verispec.server import ServerSettings, create_app
from verispec.server.schemas import ChatCompletionRequest, CompletionRequest

from live_server import ServerThread
from tiny_models import build_tokenizer, save_model, tiny_llama

API_KEY = "fuzz-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
SETTINGS = ServerSettings(api_key=API_KEY, model_name="tiny", max_tokens_limit=8,
                          max_prompt_tokens=128, max_queue=4, max_body_bytes=16_384)
# the statuses the server may refuse a request with: its error table (400, 401, 404, 405, 408,
# 413, 422), the Host/Origin and Content-Type checks in front of it (403, 415), a rate limit
# (429), a full queue (503); never another 5xx
CLIENT_ERRORS = (400, 401, 403, 404, 405, 408, 413, 415, 422, 429)
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_headers_conformance, response_schema_conformance, ignored_auth,
          negative_data_rejection]
POSITIVE, NEGATIVE = GenerationMode.POSITIVE, GenerationMode.NEGATIVE
# (method, path, document, mode, examples); negative mode only where there is something to
# negate (a body: any string is a valid path parameter), and a handful of examples for the
# routes without parameters
RUNS = [
    ("POST", "/v1/completions", "models", POSITIVE, 60),
    ("POST", "/v1/completions", "models", NEGATIVE, 60),
    ("POST", "/v1/completions", "accepted", POSITIVE, 80),
    ("POST", "/v1/chat/completions", "models", POSITIVE, 60),
    ("POST", "/v1/chat/completions", "models", NEGATIVE, 60),
    ("POST", "/v1/chat/completions", "accepted", POSITIVE, 80),
    ("GET", "/v1/models/{model}", "models", POSITIVE, 15),
    ("GET", "/v1/models", "models", POSITIVE, 5),
    ("GET", "/health", "models", POSITIVE, 5),
    ("GET", "/metrics", "models", POSITIVE, 5),
]


class ErrorLog(logging.Handler):
    """The ERROR records (with tracebacks) the server logs: a 500 and a fault in the middle of a
    stream are both logged, and only the log has the traceback."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.setFormatter(logging.Formatter("%(name)s: %(message)s"))
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(self.format(record))


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    tokenizer = build_tokenizer()
    root = tmp_path_factory.mktemp("fuzz_models")
    target = save_model(tiny_llama(len(tokenizer), seed=1), tokenizer, root / "target")
    draft = save_model(tiny_llama(len(tokenizer), seed=2, layers=1), tokenizer, root / "draft")
    return target, draft


@pytest.fixture(scope="module")
def server(model_dirs):
    decoder = verispec.load(*model_dirs, chat_template="plain")
    with ServerThread(create_app(decoder, SETTINGS)) as running:
        yield running


@pytest.fixture(scope="module")
def server_errors(server):
    handler = ErrorLog()
    loggers = [logging.getLogger(name) for name in ("verispec.server", "uvicorn.error")]
    for logger in loggers:
        logger.addHandler(handler)
    yield handler.records
    for logger in loggers:
        logger.removeHandler(handler)


@pytest.fixture(scope="module")
def api_schemas(server):
    """{"models": the document with the request models' bodies, "accepted": with the bodies
    narrowed to the values the server accepts}, both from the running server's /openapi.json."""
    served = httpx.get(server.url + "/openapi.json", timeout=30).json()
    vocab_size = len(build_tokenizer())
    schemas = {}
    for name, narrowed in (("models", False), ("accepted", True)):
        schema = schemathesis.openapi.from_dict(
            completed_document(served, vocab_size if narrowed else None))
        schema.config.update(base_url=server.url, headers=AUTH, request_timeout=60)
        schema.config.max_stream_events = 64  # a whole stream: at most 8 deltas and 3 more events
        # a body the request model refuses gets one of these (schemathesis's list lacks 408, 413)
        schema.config.checks.negative_data_rejection.expected_statuses = [
            str(status) for status in CLIENT_ERRORS]
        schemas[name] = schema
    return schemas


# --- the OpenAPI document: the server's, completed ---------------------------------------------

ERROR_BODY = {
    "type": "object", "required": ["error"],
    "properties": {"error": {
        "type": "object", "required": ["message", "type", "code"],
        "properties": {"message": {"type": "string", "minLength": 1}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": "string"}}}}}
USAGE = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
         "properties": {name: {"type": "integer", "minimum": 0}
                        for name in ("prompt_tokens", "completion_tokens", "total_tokens")}}
SPECULATION = {
    "type": "object",
    "required": ["num_draft_tokens", "drafted", "accepted", "acceptance_rate",
                 "mean_accepted_length", "per_position_acceptance"],
    "properties": {"num_draft_tokens": {"type": "integer", "minimum": 0},
                   "drafted": {"type": "integer", "minimum": 0},
                   "accepted": {"type": "integer", "minimum": 0},
                   "acceptance_rate": {"type": "number", "minimum": 0, "maximum": 1},
                   "mean_accepted_length": {"type": "number", "minimum": 0},
                   "per_position_acceptance": {"type": "array", "items": {
                       "type": "number", "minimum": 0, "maximum": 1}}}}
FINISH_REASON = {"enum": ["stop", "length"]}


def body_schema(object_name: str, choice: dict, max_choices: int | None = 1) -> dict:
    """A whole (not streamed) response body: its choices (at most ``max_choices``; None: one
    per prompt of a list), usage and the speculation summary."""
    choices = {"type": "array", "minItems": 1, "items": choice}
    if max_choices is not None:
        choices["maxItems"] = max_choices
    return {"type": "object",
            "required": ["id", "object", "created", "model", "choices", "usage", "speculation"],
            "properties": {"id": {"type": "string"}, "object": {"const": object_name},
                           "created": {"type": "integer"}, "model": {"const": SETTINGS.model_name},
                           "choices": choices, "usage": USAGE, "speculation": SPECULATION}}


# a list of prompts gets one choice each, indexed in order (OpenAI's completions)
COMPLETION_BODY = body_schema("text_completion", {
    "type": "object", "required": ["index", "text", "finish_reason"],
    "properties": {"index": {"type": "integer", "minimum": 0}, "text": {"type": "string"},
                   "finish_reason": FINISH_REASON}}, max_choices=None)
CHAT_BODY = body_schema("chat.completion", {
    "type": "object", "required": ["index", "message", "finish_reason"],
    "properties": {"index": {"const": 0}, "finish_reason": FINISH_REASON,
                   "message": {"type": "object", "required": ["role", "content"],
                               "properties": {"role": {"const": "assistant"},
                                              "content": {"type": "string"}}}}})
MODEL_CARD = {"type": "object", "required": ["id", "object", "owned_by"],
              "properties": {"id": {"const": SETTINGS.model_name}, "object": {"const": "model"}}}
MODEL_LIST = {"type": "object", "required": ["object", "data"],
              "properties": {"object": {"const": "list"},
                             "data": {"type": "array", "items": MODEL_CARD}}}
HEALTH = {"type": "object", "required": ["status", "model", "speculative", "busy", "queue_depth"],
          "properties": {"status": {"const": "ok"}, "speculative": {"type": "boolean"},
                         "busy": {"type": "boolean"},
                         "queue_depth": {"type": "integer", "minimum": 0}}}
STREAM = {"text/event-stream": {}}  # no schema: checked event by event in assert_event_stream
# per route: the 200 content, and the error statuses it documents
ROUTES = {
    ("post", "/v1/completions"): ({"application/json": {"schema": COMPLETION_BODY}, **STREAM},
                                  CLIENT_ERRORS + (503,)),
    ("post", "/v1/chat/completions"): ({"application/json": {"schema": CHAT_BODY}, **STREAM},
                                       CLIENT_ERRORS + (503,)),
    ("get", "/v1/models"): ({"application/json": {"schema": MODEL_LIST}}, (401, 403, 429)),
    ("get", "/v1/models/{model}"): ({"application/json": {"schema": MODEL_CARD}},
                                    (401, 403, 404, 429)),
    ("get", "/health"): ({"application/json": {"schema": HEALTH}}, (403,)),
    ("get", "/metrics"): ({"text/plain": {"schema": {"type": "string"}}}, (403,)),
}
REQUEST_MODELS = {("post", "/v1/completions"): CompletionRequest,
                  ("post", "/v1/chat/completions"): ChatCompletionRequest}
ERROR_HEADERS = {401: {"WWW-Authenticate": {"required": True, "schema": {"const": "Bearer"}}},
                 503: {"Retry-After": {"required": True, "schema": {"type": "integer"}}}}


def completed_document(served: dict, vocab_size: int | None) -> dict:
    """The server's OpenAPI document with request bodies, responses and the bearer scheme;
    with ``vocab_size``, request bodies narrowed to what the server accepts (accepted_body)."""
    document = copy.deepcopy(served)
    components = document.setdefault("components", {})
    schemas = components.setdefault("schemas", {})
    schemas["Error"] = ERROR_BODY
    components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    for (method, path), (ok_content, error_statuses) in ROUTES.items():
        operation = document["paths"][path][method]
        responses = {"200": {"description": "OK", "content": ok_content}}
        for status in error_statuses:
            responses[str(status)] = {
                "description": "an OpenAI error body", "headers": ERROR_HEADERS.get(status, {}),
                "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
        operation["responses"] = responses  # replaces FastAPI's 422 HTTPValidationError
        if path.startswith("/v1/"):
            operation["security"] = [{"bearer": []}]
        model = REQUEST_MODELS.get((method, path))
        if model is not None:
            # refs straight to components/schemas; the nested models' definitions moved there
            body = model.model_json_schema(ref_template="#/components/schemas/{model}")
            schemas.update(body.pop("$defs", {}))
            if vocab_size is not None:
                body = accepted_body(body, vocab_size)
            schemas[model.__name__] = body
            operation["requestBody"] = {"required": True, "content": {"application/json": {
                "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
    return document


def nullable(schema: dict) -> dict:
    return {"anyOf": [schema, {"type": "null"}]}


# The values the server documents as accepted (server/schemas.py, config.py), field by field:
# a body generated from these must get 200. Prompts stay short: at most 8 characters a text
# (4 bytes each; a byte-level tokenizer: at most 32 tokens), within --max-prompt-tokens=128.
TEXT = {"type": "string", "minLength": 1, "maxLength": 8}
SAMPLING_ACCEPTED = {
    "model": nullable({"const": SETTINGS.model_name}),
    "max_tokens": nullable({"type": "integer", "minimum": 1,
                            "maximum": SETTINGS.max_tokens_limit}),
    "temperature": nullable({"type": "number", "minimum": 0, "maximum": 4}),
    "top_p": nullable({"type": "number", "exclusiveMinimum": 0, "maximum": 1}),
    "top_k": nullable({"type": "integer", "minimum": 1, "maximum": 10_000}),
    "seed": nullable({"type": "integer", "minimum": 0, "maximum": 2**63 - 1}),
    "stop": nullable({"anyOf": [TEXT, {"type": "array", "items": TEXT, "maxItems": 4}]}),
    "n": nullable({"const": 1}),
    "num_draft_tokens": nullable({"type": "integer", "minimum": 1, "maximum": 32}),
    "min_tokens": {"type": "integer", "minimum": 0, "maximum": 1},
    "presence_penalty": nullable({"type": "number", "minimum": -2, "maximum": 2}),
    "frequency_penalty": nullable({"type": "number", "minimum": -2, "maximum": 2}),
    "repetition_penalty": nullable({"type": "number", "minimum": 0.5, "maximum": 2}),
    "min_p": nullable({"type": "number", "minimum": 0, "maximum": 1}),
    "logit_bias": nullable({"type": "object", "maxProperties": 0}),
    "stream_options": {"type": "null"},  # only with stream: true (the models run sends it)
}
CONTENT_PART = {"type": "object", "required": ["type", "text"],
                "properties": {"type": {"const": "text"}, "text": {**TEXT, "maxLength": 4}}}
MESSAGE = {"type": "object", "required": ["role"], "properties": {
    "role": {"enum": ["system", "developer", "user", "assistant", "tool"]},
    "content": {"anyOf": [TEXT, {"type": "array", "items": CONTENT_PART, "minItems": 1,
                                 "maxItems": 2}, {"type": "null"}]}}}
CHAT_ACCEPTED = {
    "messages": {"type": "array", "items": MESSAGE, "minItems": 1, "maxItems": 3},
    "max_completion_tokens": SAMPLING_ACCEPTED["max_tokens"],
    "logprobs": nullable({"type": "boolean"}), "top_logprobs": {"type": "null"},
}


def completion_accepted(vocab_size: int) -> dict:
    token_ids = {"type": "array", "minItems": 1, "maxItems": 16,
                 "items": {"type": "integer", "minimum": 0, "maximum": vocab_size - 1}}
    one = {"minItems": 1, "maxItems": 1}
    return {"prompt": {"anyOf": [TEXT, {"type": "array", "items": TEXT, **one}, token_ids,
                                 {"type": "array", "items": token_ids, **one}]},
            "logprobs": nullable({"type": "integer", "minimum": 0, "maximum": 20}),
            "echo": nullable({"type": "boolean"}),
            "best_of": nullable({"const": 1}), "suffix": nullable({"const": ""})}


ACCEPTED_AS_IS = ("stream", "ignore_eos")  # booleans: either value is accepted


def accepted_body(body: dict, vocab_size: int) -> dict:
    """A request model's JSON schema narrowed to the accepted values, every field required
    (null where it means the default): many settings at once, streams as often as not. Fields
    these lists do not name (a feature newer than this file) are left out: the models runs
    fuzz them."""
    fields = SAMPLING_ACCEPTED | (completion_accepted(vocab_size) if "prompt" in body["properties"]
                                  else CHAT_ACCEPTED)
    missing = fields.keys() - body["properties"].keys() - {"stream_options"}
    assert not missing, f"the request model has no field {sorted(missing)}: update this list"
    narrowed = copy.deepcopy(body)
    for name in narrowed["properties"]:
        if name not in ACCEPTED_AS_IS:
            narrowed["properties"][name] = fields.get(name, False)  # false: never sent
    narrowed["required"] = sorted({*ACCEPTED_AS_IS, *fields} & narrowed["properties"].keys())
    return narrowed


# --- the fuzzing ---------------------------------------------------------------------------


@pytest.mark.parametrize("method, path, document, mode, examples", RUNS,
                         ids=[f"{m}{p}-{d}-{mode.value}" for m, p, d, mode, _ in RUNS])
def test_fuzzed_requests_get_documented_answers(api_schemas, server_errors, method, path,
                                                document, mode, examples):
    operation = api_schemas[document][path][method]
    expected = {200} if document == "accepted" else {200, 503, *CLIENT_ERRORS}

    @settings(max_examples=examples, derandomize=True, database=None, deadline=None,
              phases=[Phase.explicit, Phase.generate, Phase.shrink],
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                     HealthCheck.data_too_large])
    @given(case=operation.as_strategy(generation_mode=mode))
    def fuzz(case) -> None:
        if document == "accepted":
            assume(not floats_for_integers(case.body))
        server_errors.clear()
        response = case.call()
        request = describe_request(response)
        assert response.status_code in expected, (
            f"{request}\n-> {response.status_code} {response.content[:2000]!r}\n"
            + "\n".join(server_errors))
        case.validate_response(response, checks=CHECKS, headers=AUTH)
        if response.status_code == 200 and is_event_stream(response):
            assert_event_stream(response.content.decode(), request)
        assert not server_errors, f"{request}\nthe server logged:\n" + "\n".join(server_errors)

    fuzz()


INTEGER_FIELDS = ("max_tokens", "max_completion_tokens", "top_k", "seed", "n",
                  "num_draft_tokens", "min_tokens", "best_of", "logprobs", "top_logprobs")


def floats_for_integers(body: dict) -> bool:
    """Whether an integer field holds a float such as 2.0: an integer to JSON Schema, from which
    schemathesis generates it, but not to the server's strict integer fields (422)."""
    prompt = body.get("prompt")
    values = [body.get(name) for name in INTEGER_FIELDS]
    if isinstance(prompt, list):
        values += [t for item in prompt for t in (item if isinstance(item, list) else [item])]
    return any(isinstance(value, float) for value in values)


def describe_request(response) -> str:
    """The request as sent: method, path, body."""
    sent = response.request
    body = sent.body.decode(errors="replace") if isinstance(sent.body, bytes) else sent.body
    return f"{sent.method} {sent.path_url} body={body!r}"


def is_event_stream(response) -> bool:
    return response.headers.get("content-type", [""])[0].startswith("text/event-stream")


def assert_event_stream(raw: str, request: str) -> None:
    """data: events, each one JSON chunk and none an error, then data: [DONE]; every chunk with
    a choice has finish_reason null but the finishing one, which has the speculation summary;
    usage, when sent, only in the last chunk (the framing test_server.py tests with well-formed
    requests, checked here on fuzzed ones)."""
    events = raw.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""], f"{request}\nstream ends {raw[-500:]!r}"
    assert all(event.startswith("data: ") for event in events[:-2]), f"{request}\n{raw!r}"
    chunks = [json.loads(event[len("data: "):]) for event in events[:-2]]
    assert chunks and not [c for c in chunks if "error" in c], f"{request}\n{chunks}"
    with_choice = [c for c in chunks if c["choices"]]
    assert all(len(c["choices"]) == 1 for c in with_choice), f"{request}\n{chunks}"
    finishing = with_choice[-1]
    assert finishing["choices"][0]["finish_reason"] in ("stop", "length"), f"{request}\n{chunks}"
    assert "speculation" in finishing, f"{request}\n{finishing}"
    assert all(c["choices"][0]["finish_reason"] is None for c in with_choice[:-1]), (
        f"{request}\n{chunks}")
    assert all("usage" not in c for c in chunks[:-1]), f"{request}\n{chunks}"
