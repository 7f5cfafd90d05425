"""Deprecated: the verification math moved to :mod:`verispec.sample` (vLLM's name for it).

``import verispec.spec.sampling`` and the like keep working, with a DeprecationWarning: each
former module name is bound to its module in verispec.sample, so both names give the same
objects. Nothing in verispec imports this package.
"""

import importlib
import sys
import warnings

_MODULES = ("block", "checks", "greedy", "host_probs", "penalties", "rejection", "result",
            "sampling", "seeded", "theory")

warnings.warn("verispec.spec is deprecated: import verispec.sample (the same modules)",
              DeprecationWarning, stacklevel=2)
for _name in _MODULES:
    sys.modules[f"{__name__}.{_name}"] = importlib.import_module(f"verispec.sample.{_name}")
