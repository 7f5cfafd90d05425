"""Train the demo draft/target pair shipped in src/verispec/assets/demo.

What this is: a rerunnable, seeded script that (1) trains a byte-level BPE tokenizer on the .py
files of the running interpreter's standard library, (2) trains a small draft and a larger target
LlamaForCausalLM on the same token stream, (3) exports both in bf16 safetensors with the tokenizer
in each model dir, and (4) evaluates the shipped (exported) weights: held-out cross-entropy, greedy
draft/target agreement along the target's own greedy continuations, per-token latency, samples.

What this is not: part of the library. Nothing in src/verispec imports it; the package only reads
its outputs through verispec.text.demo.

Data split is BY FILE: the modules in HELDOUT_MODULES are never trained on; held-out loss and the
held-out prompts come from them only. Test suites (any directory named test/tests/idle_test) and
site-packages are excluded, so the corpus is real library code (PSF licence).

Training length: with --max-steps the run is deterministic given the seed. With only
--time-budget-min the cosine schedule runs over the wall-clock budget (progress = elapsed/budget),
so a slower shared CPU shortens the run instead of cutting the schedule; the step count actually
reached is logged and written to report.json so the run can be replayed with --max-steps.

Usage (the command that produced the shipped assets is recorded in report.json and README.md):
    nohup .venv/bin/python scripts/train_demo_pair.py --stage all > runs/train.log 2>&1 &
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import os
import platform
import random
import shlex
import sys
import sysconfig
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
EOT = "<|endoftext|>"
PAD = "<|pad|>"

# Never trained on; held-out loss and prompts come from these files only.
HELDOUT_MODULES = (
    "bisect", "calendar", "cmd", "colorsys", "dataclasses", "difflib", "fnmatch", "fractions",
    "glob", "graphlib", "heapq", "netrc", "numbers", "pprint", "sched", "secrets", "shlex",
    "statistics", "tabnanny", "textwrap", "timeit",
)
EXCLUDED_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
# Prompts end at the end of a line, without the newline: the BPE merges a newline with the next
# line's indentation ("\n   " + " return"), so a prompt ending in a bare "\n" token is a split
# the models never saw in training (the usual token-boundary problem).
SAMPLE_PROMPTS = ("def fibonacci(n):", "class Stack:", "def is_prime(n):")


# ----------------------------------------------------------------------------- data


def stdlib_files() -> tuple[list[Path], list[Path]]:
    """Sorted (train_files, heldout_files) from the running interpreter's stdlib."""
    root = Path(sysconfig.get_paths()["stdlib"])
    train, heldout = [], []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if set(rel.parts[:-1]) & EXCLUDED_DIRS:
            continue
        if len(rel.parts) == 1 and rel.stem in HELDOUT_MODULES:
            heldout.append(path)
        else:
            train.append(path)
    missing = set(HELDOUT_MODULES) - {p.stem for p in heldout}
    assert not missing, f"held-out modules missing from this stdlib: {sorted(missing)}"
    return train, heldout


def read_texts(paths: list[Path]) -> list[str]:
    texts = []
    for path in paths:
        try:
            texts.append(path.read_text(encoding="utf-8"))
        except UnicodeDecodeError:  # a handful of legacy-encoded files; skipped deterministically
            continue
    return texts


def encode_stream(tokenizer, texts: list[str]) -> torch.Tensor:
    """One long token stream: <|endoftext|> doc <|endoftext|> doc ...  -> [N] int32"""
    eot_id = tokenizer.convert_tokens_to_ids(EOT)
    ids: list[int] = []
    for enc in tokenizer.backend_tokenizer.encode_batch(texts):
        ids.append(eot_id)
        ids.extend(enc.ids)
    return torch.tensor(ids, dtype=torch.int32)


# ----------------------------------------------------------------------------- tokenizer


def train_tokenizer(args) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    train_files, _ = stdlib_files()
    texts = read_texts(train_files)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=args.vocab_size,
        min_frequency=2,
        special_tokens=[EOT, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=EOT, eos_token=EOT, unk_token=EOT, pad_token=PAD,
        model_max_length=args.max_positions,
    )
    out = tokenizer_dir(args)
    fast.save_pretrained(out)
    (Path(args.work_dir) / "streams.pt").unlink(missing_ok=True)  # encoded with the old tokenizer
    write_special_tokens_map(out)
    log(f"tokenizer: {len(texts)} train files, vocab {tok.get_vocab_size()} -> {out}")


def write_special_tokens_map(out: Path) -> None:
    """Portable tokenizer files: special_tokens_map.json (transformers 5 no longer always writes
    it) and a tokenizer_config.json naming PreTrainedTokenizerFast (transformers 5 writes its own
    TokenizersBackend class, unknown to transformers 4) without the loader's local-path keys.
    Idempotent."""
    special = {"bos_token": EOT, "eos_token": EOT, "unk_token": EOT, "pad_token": PAD}
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    for key in ("is_local", "local_files_only", "backend"):
        config.pop(key, None)
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def tokenizer_dir(args) -> Path:
    return Path(args.work_dir) / "tokenizer"


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


# ----------------------------------------------------------------------------- models


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    layers: int
    heads: int
    intermediate: int


def llama_config(shape: ModelShape, tokenizer, args):
    from transformers import LlamaConfig

    eot_id = tokenizer.convert_tokens_to_ids(EOT)
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=shape.hidden,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.heads,
        intermediate_size=shape.intermediate,
        max_position_embeddings=args.max_positions,
        tie_word_embeddings=True,
        bos_token_id=eot_id,
        eos_token_id=eot_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def role_shape(role: str, args) -> ModelShape:
    if role == "target":
        return ModelShape(args.target_hidden, args.target_layers, args.target_heads,
                          args.target_intermediate)
    return ModelShape(args.draft_hidden, args.draft_layers, args.draft_heads,
                      args.draft_intermediate)


def role_lr(role: str, args) -> float:
    return args.target_lr if role == "target" else args.draft_lr


def role_batch(role: str, args) -> int:
    return args.target_batch if role == "target" else args.draft_batch


def num_params(model) -> int:
    # tied embeddings are counted once (parameters() deduplicates shared tensors)
    return sum(p.numel() for p in model.parameters())


# ----------------------------------------------------------------------------- training


def lr_at(step: int, progress: float, peak_lr: float, args) -> float:
    """Linear warmup over warmup steps, then cosine from peak to peak*min_lr_ratio over progress."""
    if step < args.warmup_steps:
        return peak_lr * (step + 1) / args.warmup_steps
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))
    return peak_lr * (args.min_lr_ratio + (1.0 - args.min_lr_ratio) * cosine)


def sample_batch(stream: torch.Tensor, batch: int, seq_len: int, gen: torch.Generator):
    """Random windows of the stream.  -> inputs [B, T], labels [B, T] (int64)"""
    starts = torch.randint(0, len(stream) - seq_len - 1, (batch,), generator=gen)
    windows = torch.stack([stream[s : s + seq_len + 1] for s in starts.tolist()]).long()
    return windows[:, :-1], windows[:, 1:]


def heldout_windows(stream: torch.Tensor, seq_len: int, max_windows: int) -> torch.Tensor:
    """Non-overlapping windows from the start of the held-out stream.  -> [W, T+1] int64"""
    num = min(max_windows, (len(stream) - 1) // seq_len)
    return torch.stack([stream[i * seq_len : i * seq_len + seq_len + 1] for i in range(num)]).long()


@torch.no_grad()
def mean_ce(model, windows: torch.Tensor, batch: int) -> float:
    """Token-weighted mean cross-entropy (nats/token) of model on [W, T+1] windows."""
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(windows), batch):
        chunk = windows[i : i + batch]
        logits = model(input_ids=chunk[:, :-1]).logits.float()  # [b, T, V]
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), chunk[:, 1:].reshape(-1), reduction="sum")
        total += loss.item()
        count += chunk[:, 1:].numel()
    model.train()
    return total / count


def checkpoint_path(role: str, args) -> Path:
    return Path(args.work_dir) / f"ckpt_{role}.pt"


def save_checkpoint(role, model, optimizer, gen, state, args) -> None:
    path = checkpoint_path(role, args)
    tmp = path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "gen": gen.get_state(), "state": state}, tmp)
    os.replace(tmp, path)  # atomic: a crash mid-save keeps the previous checkpoint


def train_role(role: str, args) -> None:
    from transformers import LlamaForCausalLM

    tokenizer = load_tokenizer(tokenizer_dir(args))
    train_stream, heldout_stream = load_streams(tokenizer, args)
    seed = args.draft_seed if role == "draft" else args.target_seed
    torch.manual_seed(seed)
    model = LlamaForCausalLM(llama_config(role_shape(role, args), tokenizer, args))
    optimizer = torch.optim.AdamW(model.parameters(), lr=role_lr(role, args), betas=(0.9, 0.95),
                                  weight_decay=args.weight_decay, fused=False)
    gen = torch.Generator().manual_seed(seed + 1)
    state = {"step": 0, "elapsed_s": 0.0, "tokens_seen": 0}
    ckpt = checkpoint_path(role, args)
    if args.resume and ckpt.exists():
        blob = torch.load(ckpt, weights_only=False)
        model.load_state_dict(blob["model"])
        optimizer.load_state_dict(blob["optimizer"])
        gen.set_state(blob["gen"])
        state = blob["state"]
        log(f"{role}: resumed from {ckpt} at step {state['step']}")
    budget_s = (args.draft_budget_min if role == "draft" else args.target_budget_min) * 60
    max_steps = args.draft_steps if role == "draft" else args.target_steps
    log(f"{role}: {num_params(model):,} params, budget {budget_s / 60:.1f} min, "
        f"max_steps {max_steps}, train tokens {len(train_stream):,}")
    run_loop(role, model, optimizer, gen, state, train_stream, heldout_stream, budget_s,
             max_steps, args)
    state["train_tokens_in_corpus"] = len(train_stream)
    state["command"] = args.command_line
    export_model(role, model, tokenizer, state, args)


def lm_loss(model, inputs, labels):
    """Next-token cross-entropy; labels are already shifted by one (HF would shift again)."""
    logits = model(input_ids=inputs).logits  # [B, T, V]
    return torch.nn.functional.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))


def optimizer_step(model, optimizer, loss, state: dict, num_tokens: int, t0: float, args) -> None:
    """One clipped AdamW step on ``loss``; advances the step, token and time counters."""
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
    optimizer.step()
    state["step"] += 1
    state["tokens_seen"] += num_tokens
    state["elapsed_s"] = time.monotonic() - t0


def run_loop(role, model, optimizer, gen, state, train_stream, heldout_stream, budget_s,
             max_steps, args, compute_loss=lm_loss, peak_lr=None, batch=None) -> None:
    probe = heldout_windows(heldout_stream, args.seq_len, args.probe_windows)
    model.train()
    t0 = time.monotonic() - state["elapsed_s"]
    last_ckpt = time.monotonic()
    use_autocast = args.autocast_bf16 and args.device == "cpu"
    while True:
        elapsed = time.monotonic() - t0
        progress = state["step"] / max_steps if max_steps else elapsed / budget_s
        if progress >= 1.0:
            break
        lr = lr_at(state["step"], progress, peak_lr or role_lr(role, args), args)
        for group in optimizer.param_groups:
            group["lr"] = lr
        inputs, labels = sample_batch(train_stream, batch or role_batch(role, args),
                                      args.seq_len, gen)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=use_autocast):
            loss = compute_loss(model, inputs, labels)
        optimizer_step(model, optimizer, loss, state, inputs.numel(), t0, args)
        if state["step"] % args.log_every == 0:
            tok_s = state["tokens_seen"] / max(state["elapsed_s"], 1e-9)
            log(f"{role} step {state['step']} loss {loss.item():.4f} lr {lr:.2e} "
                f"elapsed {state['elapsed_s'] / 60:.1f}m tok/s {tok_s:.0f}")
        if state["step"] % args.eval_every == 0:
            log(f"{role} step {state['step']} heldout_probe_ce {mean_ce(model, probe, 8):.4f}")
        if time.monotonic() - last_ckpt > args.ckpt_every_min * 60:
            save_checkpoint(role, model, optimizer, gen, state, args)
            last_ckpt = time.monotonic()
    save_checkpoint(role, model, optimizer, gen, state, args)
    log(f"{role}: done, {state['step']} steps, {state['tokens_seen']:,} tokens, "
        f"{state['elapsed_s'] / 60:.1f} min")


def distill_draft(args) -> None:
    """Fine-tune the LM-trained draft towards the exported target: forward KL(target || draft).

    Matching the target's whole next-token distribution raises draft/target agreement far faster
    than more plain LM training (DistillSpec, Zhou et al. 2023), and keeps the draft a follower of
    the target rather than an independent model. Data: the same training windows.
    """
    from transformers import LlamaForCausalLM

    tokenizer = load_tokenizer(tokenizer_dir(args))
    train_stream, heldout_stream = load_streams(tokenizer, args)
    target = load_exported("target", args)  # the shipped weights, fp32 compute
    torch.manual_seed(args.draft_seed)
    draft = LlamaForCausalLM(llama_config(role_shape("draft", args), tokenizer, args))
    draft.load_state_dict(torch.load(checkpoint_path("draft", args), weights_only=False)["model"])
    optimizer = torch.optim.AdamW(draft.parameters(), lr=args.distill_lr, betas=(0.9, 0.95),
                                  weight_decay=args.weight_decay)
    gen = torch.Generator().manual_seed(args.draft_seed + 2)
    state = {"step": 0, "elapsed_s": 0.0, "tokens_seen": 0}

    def kl_to_target(model, inputs, labels):
        with torch.no_grad():
            target_logprobs = target(input_ids=inputs).logits.float().log_softmax(-1)  # [B,T,V]
        draft_logprobs = model(input_ids=inputs).logits.float().log_softmax(-1)  # [B, T, V]
        kl = (target_logprobs.exp() * (target_logprobs - draft_logprobs)).sum(-1)  # [B, T]
        return kl.mean()

    log(f"distill: budget {args.distill_budget_min:.1f} min, lr {args.distill_lr}")
    run_loop("distill", draft, optimizer, gen, state, train_stream, heldout_stream,
             args.distill_budget_min * 60, args.distill_steps, args, compute_loss=kl_to_target,
             peak_lr=args.distill_lr, batch=args.draft_batch)
    state_path = Path(args.work_dir) / "train_state_draft.json"
    draft_state = json.loads(state_path.read_text())
    draft_state["distill"] = {"steps": state["step"], "tokens_seen": state["tokens_seen"],
                              "train_time_min": state["elapsed_s"] / 60, "lr": args.distill_lr,
                              "command": args.command_line}
    export_model("draft", draft, tokenizer, draft_state, args)


def generate_on_policy(target, train_stream, args) -> list[torch.Tensor]:
    """The target's own continuations of training-text prefixes, half greedy, half sampled at
    temperature 1 (seeded Generator), for ``--onpolicy-gen-min`` minutes.
    -> batches of sequences [B, prefix + new] int64 (the prefix length varies by batch).

    Prefixes come from the training stream only, never from the held-out files. A batch shares
    one prefix length, so rows need no padding and each step is one forward over the cache.
    """
    from transformers import DynamicCache

    gen = torch.Generator().manual_seed(args.draft_seed + 3)
    chunks: list[torch.Tensor] = []
    t0, num_tokens = time.monotonic(), 0
    while time.monotonic() - t0 < args.onpolicy_gen_min * 60:
        prefix_len = int(torch.randint(16, 129, (1,), generator=gen))
        starts = torch.randint(0, len(train_stream) - prefix_len, (args.onpolicy_gen_batch,),
                               generator=gen)
        seqs = torch.stack([train_stream[s : s + prefix_len] for s in starts.tolist()]).long()
        greedy = len(chunks) % 2 == 0  # alternate batches: greedy, sampled, greedy, ...
        cache = DynamicCache()
        logits = target(input_ids=seqs, past_key_values=cache, use_cache=True).logits[:, -1]
        new_tokens = []
        for _ in range(args.onpolicy_new_tokens):
            if greedy:
                token = logits.argmax(-1, keepdim=True)  # [B, 1]
            else:
                token = torch.multinomial(logits.float().softmax(-1), 1, generator=gen)  # [B, 1]
            new_tokens.append(token)
            logits = target(input_ids=token, past_key_values=cache, use_cache=True).logits[:, -1]
        chunks.append(torch.cat([seqs] + new_tokens, dim=1))
        num_tokens += len(seqs) * args.onpolicy_new_tokens
        log(f"onpolicy: generated {num_tokens:,} target tokens "
            f"({num_tokens / (time.monotonic() - t0):.0f} tok/s)")
    return chunks


def distill_on_policy(args) -> None:
    """Distil the exported draft towards the exported target on the target's own outputs.

    DistillSpec (Zhou et al. 2023): what decides acceptance is how well the draft follows the
    target on the sequences the target itself produces, so the data is target continuations
    (``generate_on_policy``) and the loss forward KL(target || draft) at every position. Starts
    from the exported draft (no checkpoint needed), exports the result over it.
    """
    tokenizer = load_tokenizer(Path(args.out_dir) / "target")
    train_stream, heldout_stream = load_streams(tokenizer, args)
    target, draft = load_exported("target", args), load_exported("draft", args)
    data_path = Path(args.work_dir) / "onpolicy_data.pt"
    if args.resume and data_path.exists():  # train again on what an earlier run generated
        data = torch.load(data_path)
        data["generation_min"] = 0.0
    else:
        with torch.no_grad():
            data = {"chunks": generate_on_policy(target, train_stream, args),
                    "new_tokens": args.onpolicy_new_tokens}
        torch.save(data, data_path)
        data["generation_min"] = args.onpolicy_gen_min
    rows = [row for chunk in data["chunks"] for row in chunk]  # [prefix + new] each
    draft.train()
    optimizer = torch.optim.AdamW(draft.parameters(), lr=args.onpolicy_lr, betas=(0.9, 0.95),
                                  weight_decay=args.weight_decay)
    gen = torch.Generator().manual_seed(args.draft_seed + 4)
    probe = heldout_windows(heldout_stream, args.seq_len, args.probe_windows)
    log(f"onpolicy: {len(rows)} sequences, budget {args.onpolicy_budget_min:.1f} min, "
        f"probe CE {mean_ce(draft, probe, 8):.4f}")
    state = {"step": 0, "elapsed_s": 0.0, "tokens_seen": 0}
    t0 = time.monotonic()
    while (progress := (time.monotonic() - t0) / (args.onpolicy_budget_min * 60)) < 1.0:
        lr = lr_at(state["step"], progress, args.onpolicy_lr, args)
        for group in optimizer.param_groups:
            group["lr"] = lr
        picks = torch.randint(0, len(rows), (args.draft_batch,), generator=gen).tolist()
        width = min(len(rows[i]) for i in picks)
        inputs = torch.stack([rows[i][:width] for i in picks])  # [B, T]
        with torch.no_grad():
            target_logprobs = target(input_ids=inputs).logits.float().log_softmax(-1)
        draft_logprobs = draft(input_ids=inputs).logits.float().log_softmax(-1)  # [B, T, V]
        loss = (target_logprobs.exp() * (target_logprobs - draft_logprobs)).sum(-1).mean()
        optimizer_step(draft, optimizer, loss, state, inputs.numel(), t0, args)
        if state["step"] % args.log_every == 0:
            log(f"onpolicy step {state['step']} kl {loss.item():.4f} lr {lr:.2e} "
                f"elapsed {state['elapsed_s'] / 60:.1f}m")
        if state["step"] % args.eval_every == 0:
            log(f"onpolicy step {state['step']} heldout_probe_ce {mean_ce(draft, probe, 8):.4f}")
    draft.eval()
    # the models' earlier training, as the report of the assets started from records it (this
    # stage needs no checkpoint or train state of theirs), in the train-state form eval reads
    earlier = json.loads((Path(args.out_dir) / "report.json").read_text())
    states = {}
    for role in ("target", "draft"):
        training = earlier["models"][role]["training"]
        states[role] = {"step": training["steps"], "tokens_seen": training["tokens_seen"],
                        "elapsed_s": training["train_time_min"] * 60,
                        "distill": training.get("distill"),
                        "onpolicy": training.get("onpolicy") or [],
                        "train_tokens_in_corpus": earlier["data"]["train_tokens"],
                        "command": earlier["command"]}
    (Path(args.work_dir) / "train_state_target.json").write_text(json.dumps(states["target"]))
    previous = Path(args.work_dir) / "train_state_draft.json"
    if args.resume and previous.exists():  # the runs since the report was last written
        states["draft"]["onpolicy"] = json.loads(previous.read_text()).get("onpolicy") or []
    # one record per run of this stage (export_model writes the draft's train state)
    states["draft"]["onpolicy"].append({
        "steps": state["step"], "tokens_seen": state["tokens_seen"],
        "train_time_min": state["elapsed_s"] / 60, "lr": args.onpolicy_lr,
        "generated_sequences": len(rows), "generated_tokens": len(rows) * data["new_tokens"],
        "generation_min": data["generation_min"], "command": args.command_line})
    export_model("draft", draft, tokenizer, states["draft"], args)


def load_streams(tokenizer, args) -> tuple[torch.Tensor, torch.Tensor]:
    """Token streams for train and held-out files, cached in the work dir."""
    cache = Path(args.work_dir) / "streams.pt"
    if cache.exists():
        blob = torch.load(cache)
        return blob["train"], blob["heldout"]
    train_files, heldout_files = stdlib_files()
    train = encode_stream(tokenizer, read_texts(train_files))
    heldout = encode_stream(tokenizer, read_texts(heldout_files))
    torch.save({"train": train, "heldout": heldout}, cache)
    return train, heldout


def export_model(role, model, tokenizer, state, args) -> None:
    from transformers import GenerationConfig

    out = Path(args.out_dir) / role
    out.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(
        bos_token_id=model.config.bos_token_id, eos_token_id=model.config.eos_token_id,
        pad_token_id=model.config.pad_token_id, do_sample=False, max_new_tokens=64)
    export_dtype = torch.bfloat16 if args.export_dtype == "bf16" else torch.float16
    model.to(export_dtype).save_pretrained(out)
    model.to(torch.float32)
    tokenizer.save_pretrained(out)
    write_special_tokens_map(out)
    (Path(args.work_dir) / f"train_state_{role}.json").write_text(json.dumps(state, indent=2))
    log(f"{role}: exported {args.export_dtype} -> {out}")


# ----------------------------------------------------------------------------- held-out prompts


def heldout_prompts(args) -> list[str]:
    """Seeded sample of 1-6 line snippets starting at a def/class line in the held-out files.

    Each ends at the end of its last line, without the newline (see SAMPLE_PROMPTS).
    """
    _, heldout_files = stdlib_files()
    rng = random.Random(args.prompt_seed)
    candidates = []
    for path in heldout_files:
        source = path.read_text(encoding="utf-8")
        lines = source.splitlines()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                candidates.append((path.name, node.lineno, lines))
    candidates.sort(key=lambda c: (c[0], c[1]))
    prompts: list[str] = []
    for _, lineno, lines in rng.sample(candidates, len(candidates)):
        num_lines = rng.randint(1, 6)
        snippet = textwrap.dedent("\n".join(lines[lineno - 1 : lineno - 1 + num_lines])).rstrip()
        while len(snippet) > 200 and "\n" in snippet:
            snippet = snippet.rsplit("\n", 1)[0].rstrip()  # drop the last line
        if 20 <= len(snippet) <= 200 and snippet not in prompts:
            prompts.append(snippet)
        if len(prompts) == args.num_prompts:
            break
    return prompts


# ----------------------------------------------------------------------------- eval


def load_exported(role: str, args):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(Path(args.out_dir) / role, dtype=torch.float32)
    return model.eval()


@torch.no_grad()
def greedy_continuation(model, prompt_ids: list[int], num_new: int) -> list[int]:
    out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=num_new, do_sample=False,
                         min_new_tokens=num_new, pad_token_id=model.config.pad_token_id)
    return out[0].tolist()


@torch.no_grad()
def greedy_agreement(target, draft, tokenizer, prompts, num_new: int) -> dict:
    """Fraction of positions where draft argmax == target argmax, along the target's greedy path.

    The draft is teacher-forced on the target's greedy sequence; positions are the num_new
    positions that predict a generated token (prompt_len-1 ... prompt_len+num_new-2).
    """
    matches, total, per_prompt = 0, 0, []
    for prompt in prompts:
        prompt_ids = tokenizer(prompt)["input_ids"]
        seq = torch.tensor([greedy_continuation(target, prompt_ids, num_new)])  # [1, P+N]
        positions = slice(len(prompt_ids) - 1, seq.shape[1] - 1)
        target_argmax = target(input_ids=seq).logits[0, positions].argmax(-1)  # [N]
        draft_argmax = draft(input_ids=seq).logits[0, positions].argmax(-1)  # [N]
        hits = (target_argmax == draft_argmax).sum().item()
        matches += hits
        total += target_argmax.numel()
        per_prompt.append(hits / target_argmax.numel())
    rate = matches / total
    return {"greedy_agreement": rate, "num_prompts": len(prompts), "num_positions": total,
            "new_tokens_per_prompt": num_new,
            "per_prompt_min": min(per_prompt), "per_prompt_max": max(per_prompt),
            # iid-position approximation of tokens per target pass in greedy speculation
            "expected_tokens_per_target_pass_iid": {
                str(k): (1 - rate ** (k + 1)) / (1 - rate) for k in (1, 2, 4, 8)}}


@torch.no_grad()
def per_token_latency_ms(model, tokenizer, num_steps: int, repeats: int) -> float:
    """Median wall time of one batch-1 decode step with a KV cache, fp32, ms."""
    prompt_ids = torch.tensor([tokenizer(SAMPLE_PROMPTS[0])["input_ids"]])
    times = []
    for _ in range(repeats):
        out = model(input_ids=prompt_ids, use_cache=True)
        past, next_id = out.past_key_values, out.logits[:, -1:].argmax(-1)
        for _ in range(num_steps):
            start = time.perf_counter()
            out = model(input_ids=next_id, past_key_values=past, use_cache=True)
            times.append(time.perf_counter() - start)
            past, next_id = out.past_key_values, out.logits[:, -1:].argmax(-1)
    times.sort()
    return 1000 * times[len(times) // 2]


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def dir_size_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def evaluate(args) -> None:
    torch.set_num_threads(args.threads)
    out = Path(args.out_dir)
    for role in ("target", "draft"):
        write_special_tokens_map(out / role)
    tokenizer = load_tokenizer(out / "target")
    target, draft = load_exported("target", args), load_exported("draft", args)
    assert tokenizer.get_vocab() == load_tokenizer(out / "draft").get_vocab()
    _, heldout_stream = load_streams(tokenizer, args)
    windows = heldout_windows(heldout_stream, args.seq_len, args.eval_windows)
    prompts = heldout_prompts(args)
    (out / "heldout_prompts.json").write_text(json.dumps(prompts, indent=1) + "\n")
    log(f"eval: {len(windows)} held-out windows, {len(prompts)} prompts")
    ce = {"target": mean_ce(target, windows, 8), "draft": mean_ce(draft, windows, 8)}
    log(f"eval: held-out CE {ce}")
    agreement = greedy_agreement(target, draft, tokenizer, prompts, args.agreement_new_tokens)
    log(f"eval: agreement {agreement['greedy_agreement']:.4f}")
    latency = {role: per_token_latency_ms(m, tokenizer, 64, 3)
               for role, m in (("target", target), ("draft", draft))}
    samples = [{"prompt": p,
                "target": tokenizer.decode(greedy_continuation(target, tokenizer(p)["input_ids"],
                                                               args.sample_new_tokens)),
                "draft": tokenizer.decode(greedy_continuation(draft, tokenizer(p)["input_ids"],
                                                              args.sample_new_tokens))}
               for p in SAMPLE_PROMPTS]
    report = build_report(args, tokenizer, target, draft, windows, ce, agreement, latency, samples)
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "README.md").write_text(model_card(report))
    report["asset_size_bytes"] = dir_size_bytes(out)
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    log(f"eval: report -> {out / 'report.json'}; asset size {report['asset_size_bytes'] / 1e6:.2f} MB")
    if report["asset_size_bytes"] > args.max_asset_mb * 1e6:
        raise SystemExit(f"assets are {report['asset_size_bytes'] / 1e6:.1f} MB, "
                         f"over the {args.max_asset_mb} MB limit")


def render_card(args) -> None:
    out = Path(args.out_dir)
    report = json.loads((out / "report.json").read_text())
    if args.training_note:
        report["training"]["note"] = args.training_note
    if args.commands:
        report["commands"] = args.commands
    (out / "README.md").write_text(model_card(report))
    report["asset_size_bytes"] = dir_size_bytes(out)
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    log(f"card: {out / 'README.md'}")


def build_report(args, tokenizer, target, draft, windows, ce, agreement, latency, samples) -> dict:
    work = Path(args.work_dir)
    states = {role: json.loads((work / f"train_state_{role}.json").read_text())
              for role in ("target", "draft")}
    # the training command, not this eval's, when eval is rerun on its own
    command = states["target"].get("command", args.command_line)
    models = {}
    for role, model in (("target", target), ("draft", draft)):
        cfg = model.config
        models[role] = {
            "architecture": "LlamaForCausalLM", "parameters": num_params(model),
            "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_hidden_layers,
            "num_attention_heads": cfg.num_attention_heads,
            "intermediate_size": cfg.intermediate_size,
            "max_position_embeddings": cfg.max_position_embeddings,
            "tie_word_embeddings": True, "export_dtype": args.export_dtype,
            "heldout_ce_nats_per_token": ce[role],
            "per_token_latency_ms_batch1_fp32": latency[role],
            "training": {"steps": states[role]["step"], "tokens_seen": states[role]["tokens_seen"],
                         "train_time_min": states[role]["elapsed_s"] / 60,
                         "distill": states[role].get("distill"),
                         "onpolicy": states[role].get("onpolicy"),
                         "seed": args.target_seed if role == "target" else args.draft_seed},
        }
    _, heldout_files = stdlib_files()
    return {
        "command": command,
        "commands": args.commands,
        "models": models,
        "cost_ratio_c": latency["draft"] / latency["target"],
        "agreement": agreement,
        "heldout": {"modules": list(HELDOUT_MODULES), "num_files": len(heldout_files),
                    "eval_tokens": int(windows[:, 1:].numel())},
        "data": {"source": f"Python {platform.python_version()} standard library .py files "
                           "(test suites and site-packages excluded), split by file",
                 "train_tokens": states["target"].get("train_tokens_in_corpus"),
                 "licence": "Python Software Foundation License (PSF-2.0)"},
        "tokenizer": {"type": "byte-level BPE (tokenizers)", "vocab_size": len(tokenizer),
                      "special_tokens": [EOT, PAD]},
        "training": {"optimizer": "AdamW(0.9, 0.95)", "lr": {"target": args.target_lr, "draft": args.draft_lr},
                     "batch": {"target": args.target_batch, "draft": args.draft_batch},
                     "seq_len": args.seq_len, "warmup_steps": args.warmup_steps,
                     "schedule": "cosine over wall-clock budget" if not args.target_steps
                     else "cosine over max steps", "note": args.training_note, "precision": "bf16 autocast"
                     if args.autocast_bf16 else "fp32"},
        "hardware": {"cpu": cpu_model(), "threads": args.threads, "device": args.device,
                     "torch": torch.__version__},
        "seeds": {"draft": args.draft_seed, "target": args.target_seed,
                  "prompts": args.prompt_seed},
        "samples": samples,
    }


# ----------------------------------------------------------------------------- model card


def model_card(report: dict) -> str:
    t, d = report["models"]["target"], report["models"]["draft"]
    a = report["agreement"]["greedy_agreement"]
    expected = report["agreement"]["expected_tokens_per_target_pass_iid"]
    rows = "\n".join(
        f"| {role} | {m['parameters']:,} | {m['hidden_size']} | {m['num_hidden_layers']} | "
        f"{m['num_attention_heads']} | {m['intermediate_size']} | "
        f"{m['training']['steps']:,} | {m['training']['tokens_seen']:,} | "
        f"{m['training']['train_time_min']:.1f} | {m['heldout_ce_nats_per_token']:.3f} | "
        f"{m['per_token_latency_ms_batch1_fp32']:.2f} |"
        for role, m in (("target", t), ("draft", d)))
    commands = "\n".join(report.get("commands") or [report["command"]])
    distill = d["training"].get("distill")
    distill_text = (
        f"After LM training the draft was distilled towards the exported target: "
        f"{distill['steps']:,} steps ({distill['tokens_seen']:,} tokens, "
        f"{distill['train_time_min']:.1f} min, peak lr {distill['lr']}) of forward "
        f"KL(target || draft) on the training windows. The draft's steps, tokens and minutes in the "
        f"table are its LM training only." if distill else "The draft was not distilled.")
    onpolicy = d["training"].get("onpolicy") or []
    if onpolicy:
        first = onpolicy[0]
        runs = "; ".join(
            f"{run['steps']:,} steps ({run['tokens_seen']:,} tokens, {run['train_time_min']:.1f} min, "
            f"peak lr {run['lr']})" for run in onpolicy)
        distill_text += (
            f"\n\nThen it was distilled on the target's own outputs (on-policy, DistillSpec; "
            f"`--stage onpolicy`): the target continued random training-text prefixes of 16-128 "
            f"tokens by {first['generated_tokens'] // first['generated_sequences']} tokens, "
            f"greedily in half the batches and sampled at temperature 1 in the other half "
            f"({first['generated_sequences']:,} sequences, {first['generation_min']:.0f} min of "
            f"generation), and the draft trained on forward KL(target || draft) at every position "
            f"of those sequences, in {len(onpolicy)} run(s) on the same data: {runs}. No held-out "
            f"file was used.")
    next_distill = (
        "distil the draft on the target's outputs for longer" if onpolicy else
        "distil the draft for longer, and on the target's own greedy/sampled continuations "
        "(on-policy, DistillSpec) rather than on the training text")
    samples = "\n\n".join(
        f"Prompt `{s['prompt'].strip()}`\n\ntarget:\n```python\n{s['target']}\n```\n"
        f"draft:\n```python\n{s['draft']}\n```" for s in report["samples"])
    return f"""# verispec demo pair: a draft and a target trained on the Python standard library

Two small `LlamaForCausalLM` models sharing one tokenizer, shipped so that examples, tests and
benchmarks of exact speculative decoding run offline. They are toys: they write plausible-looking
Python, not correct Python. Load them with `verispec.text.demo.demo_pair()`:

```python
from transformers import AutoModelForCausalLM, AutoTokenizer
from verispec.text.demo import demo_pair
pair = demo_pair()
tokenizer = AutoTokenizer.from_pretrained(pair.target)
target = AutoModelForCausalLM.from_pretrained(pair.target, dtype="float32")
draft = AutoModelForCausalLM.from_pretrained(pair.draft, dtype="float32")
```

Weights are stored in {t['export_dtype']}; on CPU load them as float32 (bf16 matmuls are slow on
CPUs without native bf16 support). All numbers below were measured on the exported weights.

## Data

{report['data']['source']}. Licence of the data: {report['data']['licence']}.
Training stream: {report['data']['train_tokens']:,} tokens (documents joined with `<|endoftext|>`).
Held out by file, never trained on ({report['heldout']['num_files']} modules,
{report['heldout']['eval_tokens']:,} evaluation tokens): {', '.join(report['heldout']['modules'])}.
`heldout_prompts.json` holds {report['agreement']['num_prompts']} snippets (1-6 lines starting at a
`def`/`class`) cut from those modules. They end at the end of a line without the newline: the
tokenizer merges a newline with the next line's indentation, so a prompt ending in a bare newline
is a token split the models never saw, and they continue it badly.

## Tokenizer

{report['tokenizer']['type']}, vocabulary {report['tokenizer']['vocab_size']:,}, trained on the
training files only. `<|endoftext|>` is bos, eos and the document separator; `<|pad|>` pads. The
tokenizer adds no special tokens when encoding. The same tokenizer files are in both model dirs.

## Models and results

| model | params | hidden | layers | heads | ffn | steps | tokens seen | train min | held-out CE (nats/token) | ms/token (batch 1) |
|---|---|---|---|---|---|---|---|---|---|---|
{rows}

Both: tied input/output embeddings, RoPE, max {t['max_position_embeddings']} positions. Sizes are
bounded by the package: at 2 bytes per parameter the 40 MB cap on assets/demo leaves room for
about 19M parameters in total, so the target has {t['parameters'] / 1e6:.1f}M parameters rather
than 20-40M, and the draft {d['parameters'] / 1e6:.1f}M ({t['parameters'] / d['parameters']:.1f}x
fewer; most of the draft's parameters are its embedding table).
Training: {report['training']['optimizer']}, peak lr {report['training']['lr']['target']} (target) /
{report['training']['lr']['draft']} (draft), batch {report['training']['batch']['target']} / {report['training']['batch']['draft']}
sequences of {report['training']['seq_len']} tokens, {report['training']['warmup_steps']} warmup steps, {report['training']['schedule']}, {report['training']['precision']}. Hardware:
{report['hardware']['cpu']}, {report['hardware']['threads']} threads, torch {report['hardware']['torch']}.
Seeds: {report['seeds']}. {report['training'].get('note', '')}

{distill_text}

- Greedy agreement a = {a:.3f}: the fraction of positions where the draft's argmax equals the
  target's, measured along the target's own greedy continuations ({report['agreement']['new_tokens_per_prompt']}
  new tokens) of {report['agreement']['num_prompts']} held-out prompts, draft teacher-forced
  ({report['agreement']['num_positions']:,} positions; per prompt
  {report['agreement']['per_prompt_min']:.2f} to {report['agreement']['per_prompt_max']:.2f}).
- Per-token latency is the median batch-1 decode step with a KV cache, fp32, on the CPU above.
  Cost ratio c = draft/target = {report['cost_ratio_c']:.3f}. The FLOP ratio per token is about
  the parameter ratio, {d['parameters'] / t['parameters']:.3f} (with tied embeddings every parameter,
  the output head included, is one multiply-add per token); c is larger because a batch-1 decode
  step also pays a fixed per-layer and per-call overhead.
- If positions were independent, greedy speculation with k draft tokens would emit
  (1 - a^(k+1)) / (1 - a) tokens per target pass: {', '.join(f'k={k}: {v:.2f}' for k, v in expected.items())}.
  Real acceptance is correlated along a sequence, so measure it with the benchmarks.

## Sample greedy completions

{samples}

## Reproduce

The shipped assets came from these invocations, in order (from the repository root):

```
{commands}
```

From scratch in one go, `.venv/bin/python scripts/train_demo_pair.py --stage all` runs tokenizer,
target, draft, distill and eval with the defaults.

Training needs no network. `--stage eval` alone re-measures the exported models and rewrites
report.json, this card and heldout_prompts.json (pass `--commands` and `--training-note` again to
keep the two notes above; `--stage card` re-renders this card from report.json). The tokenizer is byte-identical across reruns. Training stopped on a wall-clock
budget, so a rerun on another machine reaches a different step count; pass `--draft-steps` and
`--target-steps` with the steps in the table for a step-deterministic run (same schedule shape, up
to floating-point nondeterminism of the CPU kernels).

## What would raise the agreement

Honestly, most of the gap is training time: on a shared 2-core CPU both models saw only a few
million tokens, and the target is far from converged (at equal tokens seen, the target and the
LM-trained draft had about the same held-out loss: neither was capacity-limited yet). In rough
order of expected effect: train the target much longer; {next_distill}; then a wider or deeper
draft (raises c) or sharing the target's embedding table with the draft. More data beyond the
stdlib would mostly help the target. Note that a is flattered by
weakness: both models put most of their mass on the same frequent tokens (indentation,
punctuation, common names), and both fall into the same repetition loops in greedy decoding.
"""


# ----------------------------------------------------------------------------- main


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add = p.add_argument
    add("--stage", choices=["tokenizer", "draft", "target", "distill", "onpolicy", "eval", "card",
                            "all"], default="all",
        help="which stage to run; 'all' runs tokenizer, target, draft, distill (if its budget > 0), "
             "eval in that order; 'distill' fine-tunes the draft towards the exported target; "
             "'card' only re-renders README.md from report.json (no model work)")
    add("--training-note", default="",
        help="free text about how the run went (shared CPU, resumed stages), stored in the report "
             "and shown in the model card")
    add("--commands", nargs="*", default=[],
        help="the exact invocations that produced the assets, in order, for the model card's "
             "Reproduce section (eval and card stages; default: the last training command)")
    add("--out-dir", default=str(REPO_ROOT / "src/verispec/assets/demo"),
        help="where the exported models, prompts, report.json and README.md go")
    add("--work-dir", default=str(REPO_ROOT / "runs/demo_pair"),
        help="scratch dir: tokenizer, token stream cache, checkpoints, train state")
    add("--resume", action="store_true", help="resume a training stage from its checkpoint")
    add("--vocab-size", type=int, default=8192, help="BPE vocabulary size incl. special tokens")
    add("--max-positions", type=int, default=1024, help="max_position_embeddings of both models")
    add("--target-hidden", type=int, default=512, help="target hidden size")
    add("--target-layers", type=int, default=4, help="target number of layers")
    add("--target-heads", type=int, default=8, help="target attention heads")
    add("--target-intermediate", type=int, default=1376, help="target MLP intermediate size")
    add("--draft-hidden", type=int, default=192, help="draft hidden size")
    add("--draft-layers", type=int, default=2, help="draft number of layers")
    add("--draft-heads", type=int, default=6, help="draft attention heads")
    add("--draft-intermediate", type=int, default=512, help="draft MLP intermediate size")
    add("--draft-budget-min", type=float, default=14.0,
        help="draft wall-clock budget (minutes); the cosine schedule spans it")
    add("--target-budget-min", type=float, default=50.0,
        help="target wall-clock budget (minutes); the cosine schedule spans it")
    add("--draft-steps", type=int, default=0,
        help="if > 0: train the draft exactly this many steps (deterministic), ignore its budget")
    add("--target-steps", type=int, default=0,
        help="if > 0: train the target exactly this many steps (deterministic), ignore its budget")
    add("--distill-budget-min", type=float, default=10.0,
        help="draft distillation wall-clock budget (minutes); 0 skips the distill stage")
    add("--distill-steps", type=int, default=0,
        help="if > 0: distill exactly this many steps (deterministic), ignore its budget")
    add("--distill-lr", type=float, default=1e-3, help="distillation peak learning rate")
    add("--onpolicy-gen-min", type=float, default=12.0,
        help="onpolicy stage: minutes of target generation (its training data)")
    add("--onpolicy-gen-batch", type=int, default=64, help="onpolicy stage: rows per generation batch")
    add("--onpolicy-new-tokens", type=int, default=96,
        help="onpolicy stage: target tokens generated per prefix")
    add("--onpolicy-budget-min", type=float, default=20.0,
        help="onpolicy stage: distillation wall-clock budget (minutes)")
    add("--onpolicy-lr", type=float, default=1e-3, help="onpolicy stage: peak learning rate")
    add("--target-batch", type=int, default=8, help="target sequences per step")
    add("--draft-batch", type=int, default=8, help="draft sequences per step")
    add("--seq-len", type=int, default=256, help="tokens per training sequence")
    add("--target-lr", type=float, default=1.5e-3, help="target peak learning rate")
    add("--draft-lr", type=float, default=3e-3, help="draft peak learning rate")
    add("--min-lr-ratio", type=float, default=0.1, help="final lr as a fraction of the peak")
    add("--warmup-steps", type=int, default=50, help="linear warmup steps")
    add("--weight-decay", type=float, default=0.1, help="AdamW weight decay")
    add("--grad-clip", type=float, default=1.0, help="gradient-norm clip")
    add("--autocast-bf16", action="store_true",
        help="bf16 autocast on CPU (off: measured slower than fp32 on CPUs without AVX512-BF16)")
    add("--draft-seed", type=int, default=1234, help="draft init and data-order seed")
    add("--target-seed", type=int, default=4321, help="target init and data-order seed")
    add("--prompt-seed", type=int, default=7, help="seed for sampling the held-out prompts")
    add("--num-prompts", type=int, default=80, help="number of held-out prompts to write")
    add("--agreement-new-tokens", type=int, default=64,
        help="greedy target tokens per prompt for the agreement measurement")
    add("--sample-new-tokens", type=int, default=64, help="tokens per sample completion")
    add("--eval-windows", type=int, default=10_000,
        help="max held-out windows of seq-len tokens for the final CE")
    add("--probe-windows", type=int, default=16, help="held-out windows for the periodic probe")
    add("--log-every", type=int, default=20, help="log training loss every N steps")
    add("--eval-every", type=int, default=200, help="log held-out probe CE every N steps")
    add("--ckpt-every-min", type=float, default=8.0, help="checkpoint every N minutes")
    add("--export-dtype", choices=["bf16", "fp16"], default="bf16", help="exported weight dtype")
    add("--max-asset-mb", type=float, default=40.0, help="fail if out-dir exceeds this (MB)")
    add("--threads", type=int, default=2, help="torch.set_num_threads")
    add("--device", choices=["cpu"], default="cpu", help="training device (CPU only)")
    args = p.parse_args(argv)
    cli = sys.argv[1:] if argv is None else list(argv)
    args.command_line = shlex.join([".venv/bin/python", "scripts/train_demo_pair.py", *cli])
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    Path(args.work_dir).mkdir(parents=True, exist_ok=True)
    Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    log(f"args: {vars(args)}")
    # target first: it is the long stage, so a crash or a slow shared CPU hits the short one
    stages = (["tokenizer", "target", "draft"] + (["distill"] if args.distill_budget_min > 0 else [])
              + ["eval"]) if args.stage == "all" else [args.stage]
    for stage in stages:
        log(f"=== stage {stage}")
        if stage == "tokenizer":
            train_tokenizer(args)
        elif stage in ("draft", "target"):
            train_role(stage, args)
        elif stage == "distill":
            distill_draft(args)
        elif stage == "onpolicy":
            distill_on_policy(args)
        elif stage == "eval":
            evaluate(args)
        else:
            render_card(args)


if __name__ == "__main__":
    main()
