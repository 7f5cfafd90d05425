"""``verispec serve``: bind the address, load the models the settings name, build the app, run
uvicorn on the bound socket.

The address is bound before the models load, so a port in use or a host that does not resolve
is reported in one line at once, not after the load and not as uvicorn's log and exit code.
"""

from __future__ import annotations

import socket
from dataclasses import replace

from ..errors import ConfigError, UnsupportedFeatureError
from ..text.named import AdaptivePolicyConfig, named_policy
from .settings import ServerSettings


def adaptive_policy(settings: ServerSettings) -> AdaptivePolicyConfig | None:
    """The depth policy every request uses by default: --adaptive NAME [--carry-over], or the
    server's default (ServerSettings.depth_policy). With --suffix and no --adaptive, the
    default goodput-plain sets k only in rounds of 2 rows or more: a lone row drafts by the
    suffix drafter's own rule, whose drafts cost that row alone, while in a batch a draft
    widens the pass every row waits for and the policy prices that."""
    config = named_policy(settings.depth_policy, settings.carry_over)
    if settings.suffix and settings.adaptive is None and config is not None:
        config = replace(config, min_rows=2)
    return config


def load_decoder(settings: ServerSettings):
    """The decoder the settings describe: the demo pair when no --target is given."""
    from ..models.llama_cpp.model import LlamaCppConfig
    from ..text.demo import demo_pair
    from ..text.load import load
    from ..text.named import hybrid_lookup, suffix_draft

    target, draft = settings.target, settings.draft
    if target is None:
        pair = demo_pair()
        target, draft = pair.target, pair.draft
    draft = suffix_draft() if settings.suffix else None if settings.no_draft else draft
    return load(target, draft, device=settings.device,
                dtype=settings.dtype, num_draft_tokens=settings.num_draft_tokens,
                adaptive=adaptive_policy(settings), verification=settings.verification,
                hybrid=hybrid_lookup(settings.hybrid_lookup) if settings.hybrid else False,
                hybrid_chain=settings.hybrid_chain, draft_p_min=settings.draft_p_min,
                cross_vocab=settings.cross_vocab,
                backend=settings.backend,
                chat_template=settings.chat_template, cuda_graphs=not settings.no_cuda_graphs,
                llama_cpp_config=LlamaCppConfig(num_threads=settings.threads,
                                                context_size=settings.context_size,
                                                repack=settings.repack,
                                                cost_curve=settings.cost_curve,
                                                uniform_passes=settings.uniform_passes))


def serve(settings: ServerSettings) -> int:
    """Serve until interrupted: Ctrl-C is a graceful shutdown and returns 0 (SIGTERM shuts down
    as gracefully, then uvicorn re-raises it, so the process ends with status 143). Either way,
    requests still running after --drain-timeout seconds end with a 503 (a stream: an error
    event and [DONE])."""
    listener = bind_address(settings.host, settings.port)  # first: it is quick to fail
    try:
        import torch

        try:
            from .app import create_app
            from .http import VerispecServer, uvicorn_config
        except ModuleNotFoundError as exc:
            raise UnsupportedFeatureError(
                f"verispec serve needs the serve extra ({exc.name} is not installed): pip "
                "install 'verispec[serve]'.") from None
        # Every forward runs on the generation worker's thread, which sets --threads (default:
        # torch's, one per core) when it starts. The models load with one thread: a main
        # thread that ran a parallel region keeps an OpenMP pool, and with more OpenMP threads
        # than cores libgomp stops spin-waiting, which makes each round on the worker markedly
        # slower on a small CPU (dev/LOG.md: server threads).
        settings = replace(settings, threads=settings.threads or torch.get_num_threads())
        torch.set_num_threads(1)
        decoder = load_decoder(settings)
        app = create_app(decoder, settings)
        host, port = listener.getsockname()[:2]  # the port the OS chose for --port 0
        auth = "required" if settings.api_key else "not required"
        url_host = f"[{host}]" if listener.family == socket.AF_INET6 else host
        print(f"verispec: serving {settings.model_name!r} on http://{url_host}:{port} "
              f"({describe_decoding(decoder, settings)}; API key {auth}; OpenAI routes under "
              "/v1)", flush=True)
        try:
            VerispecServer(uvicorn_config(app, settings)).run(sockets=[listener])
        except KeyboardInterrupt:
            # uvicorn re-raises the Ctrl-C it shut down on, unless SIGINT was ignored when the
            # process started (a background job): either way the shutdown was graceful, so 0
            pass
    finally:
        listener.close()
    return 0


def describe_decoding(decoder, settings: ServerSettings) -> str:
    """How requests are decoded, for the startup line: the drafting and its depth k (which,
    without --k, is the device's default, or the measured cost curve's), then the curve."""
    curve = "" if decoder.cost_curve is None else f"; cost curve {decoder.cost_curve.describe()}"
    if settings.no_draft:
        return "plain decoding" + curve
    drafting = ("suffix drafting" if settings.suffix else
                "hybrid drafting" if settings.hybrid else "draft model")
    from ..models.packaged import is_paired_draft

    if is_paired_draft(settings.target, settings.draft):
        drafting += f" {settings.draft} (the target's paired draft; --no-draft to go without)"
    if settings.hybrid:  # how, where it is not the default
        how = [f"{settings.hybrid_lookup} lookup"] if settings.hybrid_lookup != "ngram" else []
        how += ["chained"] if settings.hybrid_chain else []
        drafting += f" ({', '.join(how)})" if how else ""
    if decoder.cross_vocab is not None:
        drafting += f" of another tokenizer ({decoder.cross_vocab} rule)"
    if settings.draft_p_min:
        drafting += f", draft-p-min {settings.draft_p_min}"
    depth = f"k = {decoder.num_draft_tokens}"
    if settings.num_draft_tokens is None:
        depth += (f" by default on {decoder.target.device.type}" if decoder.cost_curve is None
                  else " by the cost curve")
    if settings.depth_policy:
        depth = f"{settings.depth_policy} depth from {depth}"
    return f"{drafting}, {depth}{curve}"


def bind_address(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port and listening (connections that arrive while the models
    load wait in the backlog). ConfigError names the address, the reason and the fix when the
    host does not resolve or the port cannot be bound or listened on: with SO_REUSEADDR two
    processes may both bind one port if neither listens yet, so listening here, at once, is what
    makes the second of two servers started together fail in one line instead of in uvicorn."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except (socket.gaierror, UnicodeError) as exc:
        raise ConfigError(f"host={host!r} is invalid: it does not resolve ({exc}); pass an "
                          "address such as 127.0.0.1, 0.0.0.0 or ::1.") from None
    listener = socket.socket(family, kind, proto)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
        listener.bind(address)
        listener.listen(2048)  # uvicorn's default backlog
    except OSError as exc:
        listener.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc}; pass another "
                          "--port (0 picks a free one) or stop what holds it.") from None
    return listener
