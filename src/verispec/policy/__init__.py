"""How deep to draft: the depth policies and their registry by name; never changes the output law.

base.py holds the interface (RoundStats, AdaptivePolicy, AdaptivePolicyConfig), threshold.py the
threshold policy, goodput.py the goodput policy, costs.py the measured cost curve that prices it.
The CLI and the server name a policy; this module builds it, and gives the fixed depth a loaded
decoder starts from when the caller names none.
"""

from __future__ import annotations

from ..config import POLICY_NAMES
from ..errors import ConfigError
from .base import AdaptivePolicyConfig
from .costs import CostCurve
from .goodput import GoodputPolicyConfig
from .threshold import ThresholdPolicyConfig


def named_policy(name: str | None, carry_over: bool = False) -> AdaptivePolicyConfig | None:
    """A policy config with default settings by name (see POLICY_NAMES); None: fixed k."""
    if name is None:
        if carry_over:
            raise ConfigError("carry_over=True needs an adaptive policy (one of "
                              f"{', '.join(POLICY_NAMES)}); a fixed k has nothing to carry.")
        return None
    if name == "goodput":
        return GoodputPolicyConfig(carry_over=carry_over)
    if name == "goodput-plain":
        return GoodputPolicyConfig(min_num_draft_tokens=0, carry_over=carry_over)
    if name == "threshold":
        return ThresholdPolicyConfig(carry_over=carry_over)
    raise ConfigError(f"adaptive={name!r} is invalid: expected one of {', '.join(POLICY_NAMES)}, "
                      "or none for a fixed k.")


# The depth a loaded decoder uses when none is given: where the pair's cost curve was measured,
# the depth it prices best at the goodput policy's prior acceptance; else by its target
# adapter's ``flat_verify`` and the device type it runs on. On a CPU with MKL (Intel) a
# verification pass over k + 1 tokens costs little more than a plain step for k = 1-2 but far
# more from k = 3 (MKL's matmuls over 4+ rows), so deeper drafts lose and k = 2 is the default.
# With packed oneDNN weights (the fast path's kernel on AMD and other non-Intel x86 CPUs), on
# llama.cpp's forward (without a curve) and on an accelerator a pass over a few tokens costs
# about one step, so the depth is 4, the usual choice on accelerators (dev/LOG.md, 2026-11-27,
# default depth).
DEFAULT_NUM_DRAFT_TOKENS = {"cpu": 2}
DEFAULT_NUM_DRAFT_TOKENS_FLAT_VERIFY = 4


def default_num_draft_tokens(device_type: str, flat_verify: bool = False,
                             costs: CostCurve | None = None) -> int:
    """The speculation depth k to use on a device of this type ("cpu", "cuda", "mps", ...) when
    the caller chose none. ``flat_verify``: the target adapter's attribute of that name, True
    where its passes over a few tokens cost about what one token's does on a CPU too (packed
    oneDNN weights, llama.cpp's forward). ``costs``: the pair's measured cost curve, which
    decides instead where given: the measured depth with the most expected tokens per second
    at GoodputPolicyConfig's prior acceptance (at least 1: a fixed k drafts)."""
    if costs is not None:
        return costs.best_depth(GoodputPolicyConfig.prior_acceptance)
    if flat_verify:
        return DEFAULT_NUM_DRAFT_TOKENS_FLAT_VERIFY
    return DEFAULT_NUM_DRAFT_TOKENS.get(device_type, DEFAULT_NUM_DRAFT_TOKENS_FLAT_VERIFY)
