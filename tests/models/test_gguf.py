"""GGUF checkpoints through transformers' GGUF loader (backend="transformers"; the llama.cpp
backend, which "auto" picks for GGUF files when llama-cpp-python is installed, is tested in
test_llama_cpp.py): loading, exact equality with the same model from safetensors, quantized
targets, the CLI and the server, and typed errors for bad files.

The .gguf files are written here from tiny random-init Llama models (verispec.models.gguf_export
writes what llama.cpp's converter writes), so what each file holds is known exactly: an F32 file
must give bit-identical logits and tokens to the safetensors model it came from.
"""

from __future__ import annotations

import httpx
import pytest
import torch

import verispec
from verispec import cli
from verispec.errors import ModelLoadError
from verispec.models.gguf_export import save_gguf
from verispec.server import ServerSettings, create_app

from live_server import ServerThread
from tiny_models import build_tokenizer, layer_dropped_draft, save_model, untied_llama

PROMPT = "def add(a, b):"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Safetensors dirs and .gguf files of one tiny target and its layer-dropped draft."""
    root = tmp_path_factory.mktemp("gguf")
    tokenizer = build_tokenizer(vocab_size=400)  # GGUF's BPE needs merges: more than 256 bytes
    target = untied_llama(len(tokenizer), seed=1, max_positions=128)
    draft = layer_dropped_draft(target, num_layers=1)
    return {
        "tokenizer": tokenizer,
        "target": target,
        "target_dir": str(save_model(target, tokenizer, root / "target")),
        "draft_dir": str(save_model(draft, tokenizer, root / "draft")),
        "target_gguf": str(save_gguf(target, tokenizer, root / "target-f32.gguf")),
        "draft_gguf": str(save_gguf(draft, tokenizer, root / "draft-f32.gguf")),
        "target_q8": str(save_gguf(target, tokenizer, root / "target-q8_0.gguf", "Q8_0")),
    }


def _greedy(decoder, **kwargs):
    return decoder.generate(PROMPT, max_new_tokens=40, temperature=0.0, **kwargs)


def test_f32_gguf_is_the_same_model_and_tokenizer(files):
    decoder = verispec.load(files["target_gguf"], backend="transformers")
    ids = files["tokenizer"].encode(PROMPT + "\n    return a + b")
    assert decoder.tokenizer.encode(PROMPT + "\n    return a + b") == ids
    assert decoder.tokenizer.get_vocab() == files["tokenizer"].get_vocab()
    with torch.inference_mode():
        logits = decoder.target.model(torch.tensor([ids])).logits
        expected = files["target"](torch.tensor([ids])).logits
    assert torch.equal(logits, expected)


def test_gguf_pair_decodes_exactly_as_the_safetensors_pair(files):
    from_gguf = verispec.load(files["target_gguf"], files["draft_gguf"], num_draft_tokens=3,
                              backend="transformers")
    from_dirs = verispec.load(files["target_dir"], files["draft_dir"], num_draft_tokens=3)
    greedy = _greedy(from_gguf)
    assert greedy.token_ids == _greedy(from_dirs).token_ids
    assert greedy.token_ids == _greedy(from_gguf, speculative=False).token_ids
    assert greedy.metrics.num_drafted > 0 and 0 < greedy.metrics.num_accepted
    sampled = [d.generate(PROMPT, max_new_tokens=40, temperature=1.0, seed=5).token_ids
               for d in (from_gguf, from_dirs)]
    assert sampled[0] == sampled[1]  # same weights, same seed: the same tokens
    mixed = verispec.load(files["target_gguf"], files["draft_dir"], num_draft_tokens=3)
    assert _greedy(mixed).token_ids == greedy.token_ids


def test_quantized_gguf_target_is_verified_exactly(files):
    # Q8_0 blocks are dequantized on load: a different model from the F32 one, and speculative
    # decoding must reproduce *its* greedy output (plain decoding and transformers generate())
    decoder = verispec.load(files["target_q8"], files["draft_gguf"], num_draft_tokens=3,
                            backend="transformers")
    weight = decoder.target.model.model.layers[0].mlp.down_proj.weight
    original = files["target"].model.layers[0].mlp.down_proj.weight
    assert not torch.equal(weight, original)
    assert torch.allclose(weight, original, atol=0.02)  # 8-bit blocks: close, not equal
    speculative = _greedy(decoder)
    assert speculative.token_ids == _greedy(decoder, speculative=False).token_ids
    prompt_ids = decoder.tokenizer.encode(PROMPT)
    with torch.inference_mode():
        out = decoder.target.model.generate(torch.tensor([prompt_ids]), max_new_tokens=40,
                                            min_new_tokens=40, do_sample=False, pad_token_id=0)
    assert speculative.token_ids == out[0, len(prompt_ids):].tolist()


def test_cli_generates_from_gguf_files(files, capsys):
    status = cli.main(["generate", PROMPT, "--target", files["target_gguf"], "--draft",
                       files["draft_gguf"], "--temperature", "0", "--max-new-tokens", "40",
                       "--backend", "transformers"])
    out = capsys.readouterr().out
    assert status == 0
    expected = _greedy(verispec.load(files["target_dir"], files["draft_dir"]))
    assert out.rstrip("\n") == expected.text.rstrip("\n")


def test_server_serves_a_gguf_pair(files):
    settings = ServerSettings(target=files["target_gguf"], draft=files["draft_gguf"],
                              backend="transformers")
    from verispec.server.run import load_decoder

    decoder = load_decoder(settings)
    expected = _greedy(decoder).text
    with ServerThread(create_app(decoder, settings)) as running:
        body = {"prompt": PROMPT, "max_tokens": 40, "temperature": 0}
        out = httpx.post(running.url + "/v1/completions", json=body, timeout=60)
    assert out.status_code == 200, out.text
    assert out.json()["choices"][0]["text"] == expected


# --- errors ------------------------------------------------------------------------------------


def test_missing_gguf_file(tmp_path, files):
    with pytest.raises(ModelLoadError, match="GGUF file .*missing.gguf.* does not exist"):
        verispec.load(str(tmp_path / "missing.gguf"))
    with pytest.raises(ModelLoadError, match="draft GGUF file"):
        verispec.load(files["target_gguf"], str(tmp_path / "missing.gguf"))


def test_a_file_that_is_not_gguf(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"this is not a gguf file" * 10)
    with pytest.raises(ModelLoadError, match="could not load the target"):
        verispec.load(str(path), backend="transformers")


def test_an_architecture_transformers_cannot_load(tmp_path, files):
    path = save_gguf(files["target"], files["tokenizer"], tmp_path / "odd.gguf",
                     architecture="not-an-architecture")
    with pytest.raises(ModelLoadError, match="could not load the target"):
        verispec.load(str(path), backend="transformers")


def test_cli_bad_gguf_path_exits_2_with_one_line(tmp_path, capsys):
    status = cli.main(["generate", PROMPT, "--target", str(tmp_path / "none.gguf"),
                       "--no-draft"])
    err = capsys.readouterr().err
    assert status == 2 and len(err.strip().splitlines()) == 1 and "does not exist" in err
