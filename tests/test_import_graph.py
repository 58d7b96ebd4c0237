"""The package map holds: who may import whom, checked on every module's source (static, no imports run)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PROJECT = (
    "modelspec", "colocation", "configs", "megatron_backend", "rollout", "planner", "weight_sync", "rl", "telemetry",
    "checkpointing", "run", "tools", "tests",
)  # fmt: skip
LEAVES = ("modelspec", "colocation")  # import nothing from this project
# package -> project packages it must never import (one way down: leaves -> configs -> megatron_backend / rollout /
# planner -> weight_sync -> rl -> telemetry, checkpointing -> run -> tools)
ABOVE_RUN = {"run", "tools", "tests"}
FORBIDDEN = {
    **{leaf: set(PROJECT) - {leaf} for leaf in LEAVES},
    # the components' configs: read by the planner and by the components they configure, so below all of them
    "configs": set(PROJECT) - set(LEAVES) - {"configs"},
    # the planner may import only the leaves and the configs it plans: the step's table is in colocation
    "planner": set(PROJECT) - set(LEAVES) - {"configs", "planner"},
    "rollout": set(PROJECT) - set(LEAVES) - {"configs", "rollout"},
    "megatron_backend": set(PROJECT) - set(LEAVES) - {"configs", "megatron_backend"},
    "weight_sync": {"planner", "rl", "telemetry", "checkpointing"} | ABOVE_RUN,
    "rl": {"telemetry", "checkpointing"} | ABOVE_RUN,
    "telemetry": {"checkpointing"} | ABOVE_RUN,
    "checkpointing": {"planner", "weight_sync", "rl", "telemetry"} | ABOVE_RUN,
    "run": {"tools", "tests"},
}


def imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def modules(package: str) -> list[Path]:
    return sorted((REPO / package).rglob("*.py"))


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_only_what_the_map_allows(package):
    offenders = {
        str(path.relative_to(REPO)): sorted(imported_roots(path) & FORBIDDEN[package]) for path in modules(package)
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def test_only_megatron_backend_imports_megatron():
    # tests/test_megatron_cpu.py drives megatron's own schedule on purpose: tests are exempt
    offenders = [
        str(path.relative_to(REPO))
        for package in PROJECT
        if package not in ("megatron_backend", "tests")
        for path in modules(package)
        if "megatron" in imported_roots(path)
    ]
    assert offenders == []


def test_the_checker_sees_imports():
    # a guard against a checker that can never fail: rl really imports megatron_backend and rollout, and the
    # run harness every package below it
    roots = set().union(*(imported_roots(p) for p in modules("rl")))
    assert {"megatron_backend", "rollout", "modelspec"} <= roots
    run_roots = set().union(*(imported_roots(p) for p in modules("run")))
    assert set(PROJECT) - {"run", "tools", "tests"} <= run_roots


def test_every_package_is_on_the_map():
    # a new top-level package gets its place in the map (and its rules) before it lands
    assert {p.parent.name for p in REPO.glob("*/__init__.py")} == set(PROJECT)


def test_the_configs_import_no_torch_and_the_planner_reads_them():
    # configs/ is read by the planner on a laptop with no GPU stack: no torch, megatron, vLLM or transformers there
    heavy = {"torch", "megatron", "vllm", "transformers"}
    assert {
        str(p.relative_to(REPO)): imported_roots(p) & heavy for p in modules("configs") if imported_roots(p) & heavy
    } == {}
    assert "configs" in set().union(*(imported_roots(p) for p in modules("planner")))
