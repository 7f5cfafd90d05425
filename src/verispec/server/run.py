"""``verispec serve``: load the models the settings name, build the app, run uvicorn."""

from __future__ import annotations

from ..adaptive import AdaptivePolicyConfig, named_policy
from ..errors import UnsupportedFeatureError
from .settings import ServerSettings


def adaptive_policy(settings: ServerSettings) -> AdaptivePolicyConfig | None:
    """The depth policy every request uses by default: --adaptive NAME [--carry-over]."""
    return named_policy(settings.adaptive, settings.carry_over)


def load_decoder(settings: ServerSettings):
    """The decoder the settings describe: the demo pair when no --target is given."""
    from ..api import load
    from ..demo import demo_pair
    from ..proposers.ngram import NgramDraft

    target, draft = settings.target, settings.draft
    if target is None:
        pair = demo_pair()
        target, draft = pair.target, pair.draft
    draft = NgramDraft() if settings.ngram else None if settings.no_draft else draft
    return load(target, draft, device=settings.device,
                dtype=settings.dtype, num_draft_tokens=settings.num_draft_tokens,
                adaptive=adaptive_policy(settings),
                hybrid=settings.hybrid)


def serve(settings: ServerSettings) -> int:
    """Serve until interrupted (Ctrl-C); returns the exit status."""
    import torch

    try:
        import uvicorn

        from .app import create_app
    except ModuleNotFoundError as exc:
        raise UnsupportedFeatureError(f"verispec serve needs the serve extra ({exc.name} is not "
                                      "installed): pip install 'verispec[serve]'.") from None

    if settings.threads is not None:  # process-wide, so set here, by the process's entry point
        torch.set_num_threads(settings.threads)
    app = create_app(load_decoder(settings), settings)
    auth = "required" if settings.api_key else "not required"
    print(f"verispec: serving {settings.model_name!r} on http://{settings.host}:{settings.port} "
          f"(API key {auth}; OpenAI routes under /v1)", flush=True)
    uvicorn.run(app, host=settings.host, port=settings.port, log_level="info",
                timeout_graceful_shutdown=5)
    return 0
