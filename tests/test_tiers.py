"""The tiers of tests/conftest.py: a test that starts processes, directly or through a helper or a fixture, is
``procs``; one that only computes is not."""

from __future__ import annotations

import subprocess

import pytest

from tests import conftest
from tests.dist import run_ranks


def _rank(rank: int, world_size: int) -> int:
    return rank


def _helper_that_spawns() -> list:
    return run_ranks(_rank, 2)


def _helper_that_runs_a_command() -> str:
    return subprocess.run(["true"], check=True).stdout


def _helper_that_computes(x: int) -> int:
    return sum(range(x))


def _calls_a_tool_that_spawns() -> int:
    from tools.logprob_gap import main  # imports run.launch.spawn_local inside one of its functions

    return main([])


def _calls_a_tools_rank_function() -> dict:
    from tools.parity import parity  # what each rank runs: starts nothing itself

    return parity(None)


@pytest.mark.parametrize(
    ("fn", "starts_processes"),
    [
        (_helper_that_spawns, True),
        (_helper_that_runs_a_command, True),
        (_calls_a_tool_that_spawns, True),
        (_calls_a_tools_rank_function, False),
        (_helper_that_computes, False),
        (_rank, False),
    ],
)
def test_a_function_is_procs_when_it_reaches_a_process_start(fn, starts_processes):
    assert conftest._reaches(fn, conftest._starts_processes(), {}) is starts_processes


def test_this_files_tests_are_tiered_by_what_they_use(request):
    tiers = {item.name: "procs" in item.keywords for item in request.session.items if item.path == request.path}
    assert tiers.get("test_this_files_tests_are_tiered_by_what_they_use") is False
