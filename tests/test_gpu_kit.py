"""The GPU kit's wheel list (tools/gpu_kit.py): pinned within the project's ranges, enough for what the loop imports.

No test here downloads: `make gpu-wheels` does, on this machine, before a device run.
"""

from __future__ import annotations

import configparser
import importlib.metadata

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.conftest import REPO
from tools import gpu_kit


def install_requires() -> dict[str, Requirement]:
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    lines = (line.split("#")[0].strip() for line in cfg["options"]["install_requires"].splitlines())
    return {canonicalize_name(r.name): r for r in map(Requirement, filter(None, lines))}


def test_kit_pins_are_within_the_project_ranges_and_the_ranges_accept_the_image_torch_and_transformers():
    ranges = install_requires()
    # a kit member setup.cfg does not name (antlr4) is held to the range of the kit member that requires it
    required_by_kit = {
        canonicalize_name(r.name): r
        for name in gpu_kit.KIT
        for r in map(Requirement, importlib.metadata.requires(name) or [])
        if r.marker is None or r.marker.evaluate({"extra": ""})
    }
    for name, version in gpu_kit.kit_pins().items():
        requirement = ranges.get(canonicalize_name(name)) or required_by_kit[canonicalize_name(name)]
        assert requirement.specifier.contains(version, prereleases=True), (name, version, str(requirement))
    # the device image's (KINDS.md, read on 2026-11-17)
    for name, version in {"torch": "2.11.0", "transformers": "5.17.0"}.items():
        assert ranges[name].specifier.contains(version), (name, version, str(ranges[name]))


def test_everything_the_loop_imports_is_in_the_image_or_the_kit():
    # as after an earlier test of the same process: importing setuptools puts its _vendor folder on sys.path, whose
    # jaraco, more_itertools and backports then map to distributions (CI's test-procs failed on them)
    import setuptools  # noqa: F401

    loop = gpu_kit.loop_distributions()
    # the run really ran: the kit's own members are among what it imported
    assert {canonicalize_name(name) for name in gpu_kit.KIT} <= set(loop), loop
    assert gpu_kit.missing_from_image(loop) == []


def test_missing_from_image_names_what_neither_the_image_nor_the_kit_nor_the_project_brings():
    made_up = ["torch", "Megatron_Core", "omegaconf", "rlmem", "PyYAML", "wandb", "dill", "not-a-package"]
    assert gpu_kit.missing_from_image(made_up) == ["dill", "not-a-package", "wandb"]


def test_wheels_of_other_versions_are_removed_and_an_oversized_kit_is_refused(tmp_path, monkeypatch):
    pins = gpu_kit.kit_pins()
    # every pinned wheel already there: nothing is downloaded
    for name, version in pins.items():
        (tmp_path / f"{name.replace('-', '_')}-{version}-py3-none-any.whl").write_bytes(b"x" * 10)
    stale = tmp_path / "omegaconf-2.0.0-py3-none-any.whl"
    stale.write_bytes(b"x")
    report = gpu_kit.download_wheels(tmp_path)
    assert not stale.exists()
    assert len(report["files"]) == len(pins) and report["total_bytes"] == 10 * len(pins)
    monkeypatch.setattr(gpu_kit, "MAX_KIT_BYTES", 10)
    with pytest.raises(ValueError, match="the device run can carry"):
        gpu_kit.download_wheels(tmp_path)
