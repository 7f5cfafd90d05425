"""Shared pytest fixtures, and the crash policy of the suite.

The tests mirror src/verispec (tests/sample, tests/engine, tests/policy, ...); what they share lives
in tests/helpers, the one folder on the tests' import path (pytest's ``pythonpath`` in
pyproject.toml): the models and statistics (tiny_models, arch_specs, helpers_stats,
markov_chains), the law harnesses (law_checks, injected_rules, real_law), a live server
(live_server) and the fast path's pair (fast_llama_pair). pytest imports each test module by its
file name (the folders are not packages); no test module imports another.
"""

from __future__ import annotations

import os

import pytest
import torch

# a plugin from tests/helpers: a crashed pytest-xdist worker fails the run at once
pytest_plugins = ["crash_policy"]
MACHINE_CORES = frozenset(os.sched_getaffinity(0))  # before any worker is pinned


@pytest.fixture(scope="module")
def single_thread_torch():
    """Run a module's tensor work on one intra-op thread, then restore the previous setting.

    The fixture models and statistical tests use many small tensors; on a small shared machine
    torch's thread pool costs more in hand-offs than it gains (measured 3-5x slower on 2 busy
    cores). Results do not depend on the thread count: every draw comes from a seeded Generator.
    Opt in with ``pytestmark = pytest.mark.usefixtures("single_thread_torch")``.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread_for_the_suite():
    """The whole suite runs torch on one intra-op thread.

    Every model in the suite is tiny (or the small demo pair at batch 1), where a thread pool
    costs more in hand-offs than it gains, and `make test` runs two pytest workers on a 2-core
    CI machine, one core each. Results never depend on it: every draw comes from a seeded
    Generator.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session", autouse=True)
def _one_core_per_worker():
    """Under ``pytest -n N`` with at least as many workers as cores (`make test`: 2 on 2), each
    worker keeps to a core of its own. llama.cpp's thread pool spins: a model on both cores
    beside another worker's busy core waits on a descheduled thread every pass, which slows a
    pass by orders of magnitude. Pinned, llama.cpp takes one thread (its default is the cores
    the process may run on), as torch does here, and the servers the tests start inherit the
    core. Ray's modules take every core back (``all_cores``). Results never depend on it."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    cores = sorted(MACHINE_CORES)
    if workers < 2 or workers < len(cores) or not worker.startswith("gw"):
        yield
        return
    try:
        os.sched_setaffinity(0, {cores[int(worker[2:]) % len(cores)]})
    except OSError:  # a sandbox that refuses it: the workers share the cores as before
        yield
        return
    yield
    os.sched_setaffinity(0, set(cores))


@pytest.fixture(scope="module")
def all_cores():
    """Every core of the machine for one module (Ray's clusters: replicas and proxies that
    expect the CPUs they were given), whatever _one_core_per_worker pinned; the pin after."""
    pinned = os.sched_getaffinity(0)
    if pinned == MACHINE_CORES:
        yield
        return
    os.sched_setaffinity(0, MACHINE_CORES)
    yield
    os.sched_setaffinity(0, pinned)


@pytest.fixture(scope="session", autouse=True)
def _no_cost_curve_unless_asked():
    """llama.cpp loads in the suite measure no cost curve (VERISPEC_COST_CURVE=off, which
    servers the tests start inherit) unless a test names LlamaCppConfig.cost_curve: a curve
    measured on a tiny model is timing noise, and the depth it picks would make a test's
    default k depend on the machine's load; nor should the suite fill the user's cache. The
    curve's own tests (tests/models/test_llama_cpp_costs.py) ask for it."""
    previous = os.environ.get("VERISPEC_COST_CURVE")
    os.environ["VERISPEC_COST_CURVE"] = "off"
    yield
    if previous is None:
        os.environ.pop("VERISPEC_COST_CURVE", None)
    else:
        os.environ["VERISPEC_COST_CURVE"] = previous


@pytest.fixture(scope="session")
def demo_decoder():
    """The shipped demo pair through verispec.load. Its assets ship with the package, so a
    missing asset is a broken install: DemoAssetsMissingError fails the test, never a skip."""
    import verispec

    return verispec.load()
