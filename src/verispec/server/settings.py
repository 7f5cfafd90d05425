"""Server settings: one frozen dataclass that is also the source of the ``verispec serve`` flags.

Each field's metadata holds its help text (and, where the flag name differs from the field name,
the flag), so the CLI and the Python API cannot drift apart (the llama-cpp-python server does the
same with pydantic-settings). This module imports neither FastAPI nor torch: ``verispec --help``
stays fast and works without the ``serve`` extra.

    settings = ServerSettings(port=8080, api_key="secret")
    app = create_app(verispec.load(), settings)
"""

from __future__ import annotations

import argparse
import sys
import warnings
from dataclasses import Field, InitVar, dataclass, field, fields, replace
from os import PathLike

from ..config import (
    COST_CURVE_MODES,
    CROSS_VOCAB_MODES,
    HYBRID_LOOKUPS,
    MAX_NUM_DRAFT_TOKENS,
    POLICY_NAMES,
    REPACK_MODES,
    VERIFICATION_RULES,
    BatchOptions,
    check_draft_p_min,
    check_int,
    require,
)
from ..errors import ConfigError

# the server's depth policy without --adaptive: speculation where it pays, plain rounds where a
# batch is so large that a verification pass costs more than it saves
DEFAULT_DEPTH_POLICY = "goodput-plain"

DTYPES = ("float32", "bfloat16", "float16")
BACKENDS = ("auto", "fast", "transformers", "llama.cpp")  # = text.assemble.BACKENDS (imports torch)


def check_model_flags(target: str | None, draft: str | None, *, suffix: bool, hybrid: bool,
                      no_draft: bool, hybrid_lookup: str = HYBRID_LOOKUPS[0],
                      hybrid_chain: bool = False, draft_p_min: float = 0.0) -> None:
    """The model flags shared by ``verispec generate`` and ``verispec serve``: neither model is
    the demo pair; a target alone only with --no-draft or --suffix; a draft needs a target;
    --hybrid needs a draft model, --suffix replaces one; --hybrid-lookup and --hybrid-chain
    need --hybrid, --draft-p-min (0 to 1) a draft model. ConfigError names the flag to drop."""
    check_draft_p_min(draft_p_min)
    hybrid_flag = ("--hybrid-chain" if hybrid_chain else "--hybrid-lookup"
                   if hybrid_lookup != HYBRID_LOOKUPS[0] else None)
    if hybrid_flag is not None and not hybrid:
        raise ConfigError(f"{hybrid_flag} sets how --hybrid drafts; pass --hybrid as well, or "
                          f"drop {hybrid_flag}.")
    if draft_p_min > 0 and (suffix or no_draft):
        raise ConfigError(f"--draft-p-min is a floor on a draft model's confidence, and "
                          f"{'--suffix' if suffix else '--no-draft'} drafts without one; drop "
                          "--draft-p-min.")
    if hybrid and (suffix or no_draft):
        raise ConfigError("--hybrid drafts by prompt lookup, then by the draft model; drop "
                          f"{'--suffix' if suffix else '--no-draft'}.")
    if suffix and (draft is not None or no_draft):
        raise ConfigError("--suffix drafts by the suffix drafter instead of a draft model; drop "
                          f"{'--draft' if draft is not None else '--no-draft'}.")
    if draft is not None and target is None:
        raise ConfigError("--draft was given without --target; pass both, or neither for the "
                          "shipped demo pair.")
    if target is not None and draft is None and not (no_draft or suffix):
        from ..models.packaged import missing_paired_draft  # imports torch: only on this path

        missing = missing_paired_draft(target)
        hint = (f" (its paired draft {missing!r} is not installed: pip install "
                "'verispec[coder]')" if missing else "")
        raise ConfigError(f"--target was given without --draft{hint}; pass --draft PATH, "
                          "--suffix for model-free drafting, or --no-draft for plain "
                          "decoding.")


def paired_draft_for(target: str | None, draft: str | None, *, suffix: bool,
                     no_draft: bool) -> str | None:
    """The draft to use where only a target is named: its paired packaged draft (for example
    qwen2.5-coder-0.5b-instruct for qwen2.5-coder-1.5b-instruct) when that is installed and
    neither --suffix nor --no-draft is given; None otherwise (check_model_flags then asks)."""
    if target is None or draft is not None or suffix or no_draft:
        return None
    from ..models.packaged import paired_draft  # imports torch: only on this path

    return paired_draft(target)


def _setting(default: object, help: str, *, flag: str | None = None, metavar: str | None = None,
             choices: tuple[str, ...] | None = None, value_type: type | None = None):
    """A field whose metadata describes its flag; value_type only where the default cannot
    tell it (a None default)."""
    return field(default=default, metadata={"help": help, "flag": flag, "metavar": metavar,
                                            "choices": choices, "value_type": value_type})


@dataclass(frozen=True)
class ServerSettings:
    """How ``verispec serve`` loads its models and which requests it accepts."""

    target: str | PathLike | None = _setting(
        None, "target model directory or .gguf file (default: the shipped demo target)",
        metavar="PATH")
    draft: str | PathLike | None = _setting(
        None, "draft model directory or .gguf file (default: the shipped demo draft when "
        "--target is not given)", metavar="PATH")
    suffix: bool = _setting(False, "draft without a model, by the suffix-decoding rule: spans "
                            "of each request's prompt and output, and of earlier requests, that "
                            "the last tokens repeat (deeper the longer the match)")
    ngram: InitVar[bool | None] = None  # the former name of suffix: DeprecationWarning
    hybrid: bool = _setting(False, "draft by prompt lookup in rounds where it finds a match, "
                            "by the draft model otherwise (needs a draft model)")
    hybrid_lookup: str = _setting(
        HYBRID_LOOKUPS[0], "with --hybrid, what is looked up before the draft model: ngram "
        "(the last 2-3 tokens) or suffix (the suffix drafter: the longest repeated span, its "
        "prompt, output and earlier requests)", choices=HYBRID_LOOKUPS, value_type=str)
    hybrid_chain: bool = _setting(False, "with --hybrid, a row whose lookup finds fewer than "
                                  "k tokens goes on with the draft model's after them in the "
                                  "same round (instead of a round choosing one or the other)")
    draft_p_min: float = _setting(0.0, "the draft model's confidence floor, 0 to 1: a draft "
                                  "ends before the first position where its most likely token "
                                  "is less likely than this (a greedy request's at temperature "
                                  "1); exact, it changes only how many tokens are drafted; "
                                  "0: none", metavar="P")
    cross_vocab: str = _setting(
        CROSS_VOCAB_MODES[0], "how a draft of another tokenizer than the target's proposes: "
        "string (its text re-tokenized into target tokens, kept where they match the target's "
        "own), intersection (drawn over the tokens both vocabularies share, ratio-tested) or "
        "auto (by how much of the two vocabularies is shared)", choices=CROSS_VOCAB_MODES,
        value_type=str)
    no_draft: bool = _setting(False, "serve the target alone: plain decoding through the same "
                              "code path")
    chat_template: str | None = _setting(
        None, "what /v1/chat/completions renders messages with: chatml, gemma, plain or a "
        "Jinja file (default: the model's own template; a model without one answers chat "
        "requests with a 400 naming this option)", metavar="NAME|FILE", value_type=str)
    device: str = _setting("cpu", "cpu, cuda or cuda:N")
    dtype: str = _setting("float32", "model dtype", choices=DTYPES)
    backend: str = _setting("auto", "forward implementation: 'llama.cpp' runs .gguf files on "
                            "llama.cpp (the llamacpp extra), 'fast' a flat Llama forward, "
                            "'transformers' the model's own; auto = llama.cpp for .gguf files "
                            "when installed, else fast where supported", choices=BACKENDS)
    no_cuda_graphs: bool = _setting(False, "on a CUDA device, run decoding steps eagerly instead "
                                    "of replaying them as captured CUDA graphs")
    context_size: int | None = _setting(
        None, "llama.cpp backend: KV-cache tokens per sequence (default: the model's trained "
        "context, at most 4096)", metavar="N", value_type=int)
    repack: str = _setting("auto", "llama.cpp backend: weight kernels. auto: repacked kernels, "
                           "and AMX only where a probe shows llama.cpp's AMX kernel runs here; "
                           "on: all llama.cpp offers, AMX unprobed; off: plain kernels",
                           choices=REPACK_MODES, value_type=str)
    cost_curve: str | None = _setting(
        None, "llama.cpp backend: the target's pass costs over 1 to 9 tokens and the draft's "
        "step, which price the depth policy from the first round (named in the startup line). "
        "cached: measured at the first load of each model file, thread count and kernel set, "
        "read back after; measure: measured afresh; off: not measured (default: "
        "$VERISPEC_COST_CURVE, else cached)", choices=COST_CURVE_MODES, value_type=str)
    uniform_passes: bool = _setting(False, "llama.cpp backend: decode every target token after a "
                                    "prompt in a 4-token pass (padded), so that greedy "
                                    "speculative decoding equals plain decoding token for token "
                                    "on quantized files; a 1-token pass then costs a 4-token one")
    num_draft_tokens: int | None = _setting(
        None, f"draft tokens per round, 1 to {MAX_NUM_DRAFT_TOKENS}; a request may cap it for "
        "itself with num_draft_tokens (default: on llama.cpp the depth its measured cost curve "
        "prices best, see --cost-curve; else 4 on a GPU and on CPUs where the target runs on "
        "packed oneDNN weights, e.g. AMD; 2 on other CPUs, where verifying more costs more than "
        "it saves)", flag="--k", metavar="N", value_type=int)
    adaptive: str | None = _setting(None, "how k moves between rounds, starting at --k: "
                                    "goodput measures which depth is fastest here at each batch "
                                    "size, goodput-plain may also choose plain rounds (k = 0), "
                                    "threshold follows acceptance, fixed keeps --k (default: "
                                    "goodput-plain with a draft: a fixed k that pays for one "
                                    "client costs throughput under load; with --suffix it sets k "
                                    "in batches only, a lone request drafting by its match). No "
                                    "policy changes what a seed gives: a seeded request's text is "
                                    "the same at any depth",
                                    choices=POLICY_NAMES + ("fixed",), value_type=str)
    verification: str = _setting(VERIFICATION_RULES[0], "how an unseeded sampled request tests "
                                 "a draft model's tokens: block (block verification) or token "
                                 "(token-wise rejection sampling); both exact",
                                 choices=VERIFICATION_RULES, value_type=str)
    carry_over: bool = _setting(False, "with --adaptive: each request starts from the depth "
                                "estimates the previous requests left (same sampling settings) "
                                "instead of from priors")
    threads: int | None = _setting(None, "torch intra-op threads of the server process, and "
                                   "llama.cpp's decoding threads (default: one per core)",
                                   metavar="N", value_type=int)
    host: str = _setting("127.0.0.1", "address to bind; 0.0.0.0 exposes the server to the "
                         "network", metavar="ADDR")
    port: int = _setting(8000, "TCP port", metavar="PORT")
    api_key: str | None = _setting(None, "require 'Authorization: Bearer KEY' on /v1 routes",
                                   metavar="KEY")
    model_name: str = _setting("verispec", "the model id served; requests naming another model "
                               "get 404", metavar="NAME")
    max_tokens_limit: int = _setting(1024, "largest max_tokens a request may ask for (also the "
                                     "cap when a request omits max_tokens)", metavar="N")
    max_prompt_tokens: int = _setting(2048, "longest prompt in tokens; longer prompts get 413",
                                      metavar="N")
    max_batch_size: int = _setting(16, "requests decoded together (continuous batching: a "
                                   "request joins the running batch between rounds); more wait "
                                   "in the queue", metavar="N")
    prefill_budget: int = _setting(512, "prompt tokens that may join in one round at most "
                                   "(prefilled between rounds, or on the fast path in the next "
                                   "round's pass; joining requests beyond it wait a round, so a "
                                   "burst of long prompts does not stall the running ones; a "
                                   "single longer prompt is prefilled this much between rounds "
                                   "while the others decode, then joins)", metavar="TOKENS")
    max_queue: int = _setting(64, "requests that may wait for a place in the batch; more get "
                              "503", metavar="N")
    max_body_bytes: int = _setting(1 << 20, "largest request body in bytes; larger bodies get 413",
                                   metavar="N")
    allowed_hosts: str | None = _setting(
        None, "comma-separated host names the server answers to (the Host header, and the "
        "Origin of browser requests); '*' allows any. Default: the loopback names (localhost, "
        "127.0.0.1, ::1), plus --host when it is a specific address (with 0.0.0.0, list the "
        "names clients connect by); other Hosts get 403 (a DNS-rebinding page cannot reach a "
        "local server)", metavar="NAMES")
    max_connections: int = _setting(256, "open connections at most; more are closed at once",
                                    metavar="N")
    header_timeout: float = _setting(10.0, "seconds a client has to send a request's headers "
                                     "(slow or stalled clients are disconnected)",
                                     metavar="SECONDS")
    body_timeout: float = _setting(30.0, "seconds a client has to send a request's body "
                                   "(408 after)", metavar="SECONDS")
    keep_alive_timeout: float = _setting(5.0, "seconds an idle keep-alive connection stays open",
                                         metavar="SECONDS")
    drain_timeout: float = _setting(5.0, "on SIGTERM or Ctrl-C, seconds running and queued "
                                    "requests get to finish; then each ends with an error (503) "
                                    "and, when streaming, an error event and [DONE]",
                                    metavar="SECONDS")

    @property
    def max_choices(self) -> int:
        """The most choices (prompts x n) one request may ask for: all of them fit in the
        batch at once, and in the queue together (a request is queued all or none)."""
        return min(self.max_batch_size, self.max_queue)

    @property
    def depth_policy(self) -> str | None:
        """The name of the depth policy requests follow: --adaptive's, goodput-plain when it
        is not given and there is a draft (with --suffix only in rounds of 2 rows or more:
        run.adaptive_policy builds it), None for a fixed k (--adaptive fixed, or --no-draft)."""
        if self.no_draft or self.adaptive == "fixed":
            return None
        return self.adaptive or DEFAULT_DEPTH_POLICY

    def batch_options(self, loaded: BatchOptions) -> BatchOptions:
        """The options of the server's batch: the loaded decoder's (``loaded``: its depth
        policy and k, from --adaptive and --k) with --prefill-budget and --max-batch-size."""
        return replace(loaded, prefill_budget=self.prefill_budget,
                       max_batch_size=self.max_batch_size)

    def __post_init__(self, ngram: bool | None) -> None:
        if ngram is not None:
            warnings.warn("ServerSettings(ngram=...) is deprecated: the model-free drafter is "
                          "the suffix drafter, ServerSettings(suffix=...).", DeprecationWarning,
                          stacklevel=3)
            object.__setattr__(self, "suffix", self.suffix or ngram)
        check_kinds(self)  # kinds first, so the range checks below compare like with like
        paired = paired_draft_for(self.target, self.draft, suffix=self.suffix,
                                  no_draft=self.no_draft)
        if paired is not None:
            object.__setattr__(self, "draft", paired)
        require(self.hybrid_lookup in HYBRID_LOOKUPS, "hybrid_lookup", self.hybrid_lookup,
                " or ".join(HYBRID_LOOKUPS))
        check_model_flags(self.target, self.draft, suffix=self.suffix, hybrid=self.hybrid,
                          no_draft=self.no_draft, hybrid_lookup=self.hybrid_lookup,
                          hybrid_chain=self.hybrid_chain, draft_p_min=self.draft_p_min)
        k = self.num_draft_tokens
        require(k is None or 1 <= k <= MAX_NUM_DRAFT_TOKENS, "k", k,
                f"an integer from 1 to {MAX_NUM_DRAFT_TOKENS}, or no --k for the device's default")
        require(self.adaptive is None or self.adaptive in POLICY_NAMES + ("fixed",), "adaptive",
                self.adaptive, f"one of {', '.join(POLICY_NAMES)} or fixed")
        require(not (self.adaptive not in (None, "fixed") and self.no_draft), "adaptive",
                self.adaptive, "no --adaptive with --no-draft (there is no draft depth to adapt)")
        require(self.cross_vocab in CROSS_VOCAB_MODES, "cross_vocab", self.cross_vocab,
                " or ".join(CROSS_VOCAB_MODES))
        require(self.verification in VERIFICATION_RULES, "verification", self.verification,
                " or ".join(VERIFICATION_RULES))
        require(not self.carry_over or self.depth_policy is not None, "carry_over",
                self.carry_over, "--carry-over only with an adaptive depth (a fixed k has nothing "
                "to carry over)")
        require(0 <= self.port <= 65535, "port", self.port, "0 to 65535")
        require(self.threads is None or self.threads >= 1, "threads", self.threads,
                "an integer >= 1, or no --threads for torch's default")
        require(self.api_key is None or _header_safe(self.api_key), "api_key", self.api_key,
                "a non-empty key of printable ASCII without spaces (an HTTP header carries it), "
                "or no --api-key for an open server")
        require(self.allowed_hosts is None or bool(_host_names(self.allowed_hosts)),
                "allowed_hosts", self.allowed_hosts,
                "comma-separated host names (or '*'), or no --allowed-hosts for the default")
        for name in ("header_timeout", "body_timeout", "keep_alive_timeout", "drain_timeout"):
            require(0 < getattr(self, name) < float("inf"), name, getattr(self, name),
                    "a number of seconds > 0")
        require(bool(self.model_name), "model_name", self.model_name, "a non-empty name")
        require(self.dtype in DTYPES, "dtype", self.dtype, f"one of {', '.join(DTYPES)}")
        require(self.backend in BACKENDS, "backend", self.backend, f"one of {', '.join(BACKENDS)}")
        require(self.context_size is None or self.context_size >= 1, "context_size",
                self.context_size, "an integer >= 1, or no --context-size for the default")
        for name in ("max_batch_size", "prefill_budget", "max_tokens_limit", "max_prompt_tokens",
                     "max_queue", "max_body_bytes", "max_connections"):
            check_int(name, getattr(self, name), 1)

    def host_names(self) -> frozenset[str]:
        """The Host names this server answers to (lower case, no port); '*' means any."""
        if self.allowed_hosts is not None:
            return frozenset(_host_names(self.allowed_hosts))
        names = set(LOOPBACK_NAMES)
        if self.host not in ("0.0.0.0", "::"):  # a wildcard bind has no one name: loopback only
            names.add(self.host.strip("[]").lower())
        return frozenset(names)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServerSettings:
        """Settings from the namespace of a parser set up by :func:`add_settings_arguments`."""
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})


def add_settings_arguments(parser: argparse.ArgumentParser) -> None:
    """Add one flag per :class:`ServerSettings` field (``--max-queue`` for ``max_queue``)."""
    groups = {"models": parser.add_argument_group("models"),
              "server": parser.add_argument_group("server")}
    for f in fields(ServerSettings):
        add_field_argument(groups["models" if f.name in _MODEL_FIELDS else "server"], f)
    add_alias_switch(groups["models"], "--ngram", "--suffix", "suffix")


class _AliasSwitch(argparse.Action):
    """A former flag's name for a switch: sets it, and says on stderr which flag to use."""

    def __init__(self, option_strings, dest, new_flag: str, **kwargs) -> None:
        self.new_flag = new_flag
        super().__init__(option_strings, dest, nargs=0, default=False, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print(f"verispec: {option_string} is a deprecated alias of {self.new_flag}; use "
              f"{self.new_flag}.", file=sys.stderr)
        setattr(namespace, self.dest, True)


def add_alias_switch(group, old_flag: str, new_flag: str, dest: str) -> None:
    """``old_flag`` as a deprecated alias of the switch ``new_flag`` (stored in ``dest``)."""
    group.add_argument(old_flag, dest=dest, action=_AliasSwitch, new_flag=new_flag,
                       help=f"deprecated alias of {new_flag}")


def add_field_argument(group, f: Field) -> None:
    """The flag of one settings field made by :func:`_setting` (``--max-queue`` for
    ``max_queue``, or the field's own flag); a bool field is a switch."""
    meta = f.metadata
    flag = meta["flag"] or "--" + f.name.replace("_", "-")
    if isinstance(f.default, bool):
        group.add_argument(flag, dest=f.name, action="store_true", help=meta["help"])
        return
    value_type = meta["value_type"] or (str if f.default is None else type(f.default))
    shown = "" if f.default is None else f" (default: {f.default})"
    group.add_argument(flag, dest=f.name, type=value_type, default=f.default,
                       metavar=meta["metavar"], choices=meta["choices"],
                       help=meta["help"] + shown)


_MODEL_FIELDS = frozenset({"target", "draft", "suffix", "hybrid", "hybrid_lookup",
                           "hybrid_chain", "draft_p_min", "cross_vocab", "no_draft",
                           "chat_template", "device", "dtype", "backend", "no_cuda_graphs",
                           "context_size", "repack", "uniform_passes", "num_draft_tokens",
                           "adaptive", "carry_over", "threads", "verification"})


# the field annotations used above (strings: this module has postponed annotations)
_KINDS = {"int": (int,), "int | None": (int, None), "str": (str,), "str | None": (str, None),
          "float": (float, int), "float | None": (float, int, None),
          "str | PathLike | None": (str, PathLike, None), "bool": (bool,)}
_KIND_NAMES = {float: "a number", int: "an integer", str: "a string", PathLike: "a path",
               bool: "True or False",
               None: "None"}


LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def _host_names(value: str) -> list[str]:
    return [name.strip().strip("[]").lower() for name in value.split(",") if name.strip()]


def _header_safe(key: str) -> bool:
    """Printable ASCII, no whitespace: what an Authorization header can carry unchanged."""
    return bool(key) and key.isascii() and key.isprintable() and not any(c.isspace() for c in key)


def _is_kind(value: object, kind: type | None) -> bool:
    if kind is None:
        return value is None
    return isinstance(value, kind) and (kind is bool or not isinstance(value, bool))


def check_kinds(settings) -> None:
    """ConfigError naming the first field of a settings dataclass whose value is not of its
    annotated kind (an int field given a string, a bool given 1)."""
    for f in fields(settings):
        value, kinds = getattr(settings, f.name), _KINDS[f.type]
        require(any(_is_kind(value, kind) for kind in kinds), f.name, value,
                ", ".join(_KIND_NAMES[kind] for kind in kinds[:-1])
                + (" or " if len(kinds) > 1 else "") + _KIND_NAMES[kinds[-1]])
