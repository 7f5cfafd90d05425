"""How deep to draft: the depth policies and their registry by name; never changes the output law.

base.py holds the interface (RoundStats, AdaptivePolicy, AdaptivePolicyConfig), threshold.py the
threshold policy, goodput.py the goodput policy. The CLI and the server name a policy; this module
builds it.
"""

from __future__ import annotations

from ..errors import ConfigError
from .base import AdaptivePolicyConfig
from .goodput import GoodputPolicyConfig
from .threshold import ThresholdPolicyConfig

# the names the CLI and the server accept; "goodput-plain" may also choose plain rounds (k = 0)
POLICY_NAMES = ("goodput", "goodput-plain", "threshold")


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
