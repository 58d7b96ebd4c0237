"""The package map holds: who may import whom, checked on every module's source (static, no imports run)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PROJECT = ("modelspec", "megatron_backend", "rollout", "rl", "planner", "tools", "tests")
# package -> project packages it must never import
FORBIDDEN = {
    "modelspec": set(PROJECT) - {"modelspec"},
    "rollout": {"rl", "megatron_backend", "planner", "tools", "tests"},
    "megatron_backend": {"rl", "rollout", "planner", "tools", "tests"},
    "planner": {"rl", "megatron_backend", "rollout", "tools", "tests"},
    "rl": {"tools", "tests"},
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
    # a guard against a checker that can never fail: rl really imports megatron_backend and rollout
    roots = set().union(*(imported_roots(p) for p in modules("rl")))
    assert {"megatron_backend", "rollout", "modelspec"} <= roots
