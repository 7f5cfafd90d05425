"""Speculative decoding on fixture Markov models: the engine API with no neural network.

Run: .venv/bin/python examples/fixture_models.py
"""

import torch

import verispec
from verispec import Engine, GenerationConfig, MarkovLM, SamplingConfig

generator = torch.Generator().manual_seed(0)
target = MarkovLM.random(vocab_size=8, generator=generator, order=2, sharpness=1.0)
# a draft that knows only the last token: the target's law averaged over the token before it
draft = MarkovLM(torch.softmax(target.table, dim=-1).mean(dim=0).log(), order=1)

decoder = Engine.from_draft_model(target, draft)
config = GenerationConfig(max_new_tokens=24, num_draft_tokens=4,
                          sampling=SamplingConfig(temperature=1.0), seed=7)

result = decoder.generate([[1, 2, 3]], config)
print("tokens:", result.token_ids[0])
print(f"acceptance rate {result.metrics.acceptance_rate:.2f}, "
      f"mean accepted length {result.metrics.mean_accepted_length:.2f}")

# the same seed gives the same tokens; plain decoding shares the target code path
assert decoder.generate([[1, 2, 3]], config).token_ids == result.token_ids
plain = decoder.generate([[1, 2, 3]], config, speculative=False)
print("plain:", plain.token_ids[0])

# streaming: one chunk per verification round
for chunk in decoder.stream([[1, 2, 3]], config):
    print("round emitted", chunk.token_ids[0])

# the batched verification op on its own
draft_tokens = torch.tensor([[2, 5]])                         # [B=1, K=2]
draft_probs = torch.full((1, 2, 8), 1 / 8)                    # [B, K, V]
target_probs = torch.softmax(torch.randn(1, 3, 8, generator=generator), dim=-1)  # [B, K+1, V]
out = verispec.verify(draft_tokens, draft_probs, target_probs, torch.Generator().manual_seed(1))
print("accepted", out.num_accepted.tolist(), "emitted", out.output_tokens.tolist())
print("speedup at a=0.8, k=4, c=0.05:", round(verispec.theoretical_speedup(0.8, 4, 0.05), 2))
