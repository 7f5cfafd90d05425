"""Options more than one command takes: the model flags (``--target``, ``--backend``, ...) and
the llama.cpp settings they give. Here, not in cli/__init__.py, so that cli/bench.py can use them
without importing the module that imports it."""

from __future__ import annotations

import argparse


def _int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    return value


def _add_model_options(parser: argparse.ArgumentParser) -> None:
    models = parser.add_argument_group("models")
    models.add_argument("--target", metavar="PATH", help="target model directory or .gguf file "
                        "(default: the shipped demo target)")
    models.add_argument("--draft", metavar="PATH", help="draft model directory or .gguf file "
                        "(default: the shipped demo draft when --target is not given)")
    models.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: cpu)")
    models.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                        help="model dtype (default: float32)")
    models.add_argument("--backend", default="auto",
                        choices=["auto", "fast", "transformers", "llama.cpp"],
                        help="forward implementation: 'llama.cpp' runs .gguf files on llama.cpp "
                        "(the llamacpp extra), 'fast' is a flat Llama forward, 'transformers' "
                        "the model's own; auto = llama.cpp for .gguf files when installed, "
                        "else fast where supported")
    models.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
                        help="on a CUDA device, run decoding steps eagerly instead of replaying "
                        "them as captured CUDA graphs")
    models.add_argument("--threads", type=_int, default=None, metavar="N",
                        help="llama.cpp backend: decoding threads (default: one per core)")
    models.add_argument("--context-size", type=_int, default=None, metavar="N",
                        help="llama.cpp backend: KV-cache tokens per sequence (default: the "
                        "model's trained context, at most 4096)")
    models.add_argument("--chat-template", default=None, metavar="NAME|FILE",
                        help="what chat renders messages with: chatml, gemma, plain or a Jinja "
                        "file (default: the model's own template)")


def llama_cpp_config(args: argparse.Namespace):
    """The LlamaCppConfig of --threads and --context-size."""
    from ..models.llama_cpp.model import LlamaCppConfig

    return LlamaCppConfig(num_threads=args.threads, context_size=args.context_size)
