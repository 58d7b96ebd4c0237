"""The GPU kit's wheels: what the device image lacks of what the loop imports (issue 40, "Deliver 2").

    python -m tools.gpu_kit wheels [--out .gpu-wheels]   # `make gpu-wheels`: fill the folder, print one JSON line
    python -m tools.gpu_kit check                        # the loop's distributions, the kit's, the missing ones

A lent GPU machine runs a Python 3.12 image with torch and transformers but without megatron-core, hydra or
omegaconf, and it cannot download: the kit carries those as cp312 wheels, installed there with
``pip --no-index --no-deps`` (pyarrow alone is 55 MB, so nothing comes along as a dependency). What the loop
imports is found by running it (:func:`loop_distributions`), not by reading, so a new import of a library
the image lacks fails ``tests/test_gpu_kit.py`` here rather than the device's 15 minutes.
"""

from __future__ import annotations

import argparse
import configparser
import importlib.metadata
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from packaging.utils import canonicalize_name, parse_wheel_filename

REPO = Path(__file__).resolve().parent.parent
PROJECT = "rlmem"

# The device image's package list as read on 2026-11-17 (/work/.library/device/KINDS.md, "Python packages
# already there", nvidia-h200 kind; Python 3.12.3, torch 2.11.0, transformers 5.17.0).
# fmt: off
IMAGE_DISTRIBUTIONS = frozenset({
    "absl-py", "accelerate", "aiofiles", "aiohappyeyeballs", "aiohttp", "aiosignal", "annotated-doc", "anyio",
    "attrs", "botorch", "build", "certifi", "charset-normalizer", "chex", "click", "cloudpickle", "cmake",
    "colorama", "contourpy", "coverage", "cuda-bindings", "cuda-core", "cuda-pathfinder", "cuda-toolkit",
    "cupy-cuda13x", "cycler", "cython", "diffrax", "e3nn", "einops", "equinox", "etils", "execnet", "filelock",
    "flatbuffers", "flax", "fonttools", "formulaic", "frozenlist", "fsspec", "gpytorch", "grpcio", "h11", "h5py",
    "hf-xet", "httpcore", "httpx", "huggingface-hub", "humanize", "hypothesis", "idna", "imageio", "iniconfig",
    "interface-meta", "jax", "jax-cuda13-pjrt", "jax-cuda13-plugin", "jaxlib", "jaxtyping", "jinja2", "joblib",
    "kiwisolver", "lazy-loader", "lightning", "lightning-utilities", "linear-operator", "lineax", "llvmlite", "lxml",
    "markdown", "markdown-it-py", "markupsafe", "matplotlib", "mdurl", "meson", "ml-dtypes", "mpi4py", "mpmath",
    "msgpack", "multidict", "multipledispatch", "mypy-extensions", "nanobind", "narwhals", "networkx", "ninja",
    "numba", "numba-cuda", "numpy", "numpyro", "nvidia-cublas", "nvidia-cuda-cupti", "nvidia-cuda-nvrtc",
    "nvidia-cuda-runtime", "nvidia-cudnn-cu13", "nvidia-cufft", "nvidia-cufile", "nvidia-curand", "nvidia-cusolver",
    "nvidia-cusparse", "nvidia-cusparselt-cu13", "nvidia-ml-py", "nvidia-nccl-cu13", "nvidia-nvjitlink",
    "nvidia-nvshmem-cu13", "nvidia-nvtx", "onnx", "onnx-ir", "onnxruntime", "onnxscript", "opencv-python-headless",
    "opt-einsum", "opt-einsum-fx", "optax", "optimistix", "orbax-checkpoint", "packaging", "pandas", "pathspec",
    "patsy", "peft", "pillow", "pip", "pluggy", "portalocker", "prometheus-client", "propcache", "protobuf",
    "psutil", "py-cpuinfo", "pyarrow", "pybind11", "pygments", "pyparsing", "pyproject-hooks", "pyre-extensions",
    "pytest", "pytest-benchmark", "pytest-cov", "pytest-mock", "pytest-timeout", "pytest-xdist", "python-dateutil",
    "pytorch-lightning", "pyyaml", "regex", "requests", "rich", "sacrebleu", "safetensors", "scikit-build-core",
    "scikit-image", "scikit-learn", "scipy", "seaborn", "sentence-transformers", "sentencepiece", "setuptools",
    "shellingham", "simplejson", "six", "sortedcontainers", "statsmodels", "sympy", "tabulate", "tensorboard",
    "tensorboard-data-server", "tensorstore", "threadpoolctl", "tifffile", "tiktoken", "timm", "tokenizers", "toolz",
    "torch", "torch-geometric", "torchaudio", "torchdiffeq", "torchmetrics", "torchvision", "tqdm", "transformers",
    "treescope", "triton", "typer", "typing-extensions", "typing-inspect", "urllib3", "uvloop", "wadler-lindig",
    "werkzeug", "wheel", "wrapt", "xarray", "xxhash", "yarl", "zipp",
})
# fmt: on

# What the loop imports and the image lacks, pinned at call time (kit_pins) to this venv's versions, the ones CI
# tests. wandb is not here: the kit's runs set wandb.mode=disabled, telemetry/tracking.py imports wandb only
# when the mode is not disabled, and megatron-core's own import of it is optional (try/except ImportError in
# megatron/core/inference/contexts/dynamic_context.py); loop_distributions runs the loop with wandb blocked.
KIT = ("megatron-core", "hydra-core", "omegaconf", "antlr4-python3-runtime")
# antlr4-python3-runtime 4.9.3 (what omegaconf 2.3 pins) is on PyPI as an sdist only; it is pure python
SDIST_ONLY = frozenset({"antlr4-python3-runtime"})
NOT_CARRIED = ("wandb",)

# the bound; the device tool carries at most 64 MiB of working tree and carried files in all
MAX_KIT_BYTES = 40 * 2**20
PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)
# the device check runs these besides the loop (issue 40: the calibration, the plan, the sync, the export, eval)
TOOLS = ("tools.calibrate", "tools.plan", "tools.bench_sync", "tools.export", "tools.eval")
# one step of the default tiny experiment on one process, with a checkpoint and an HF export at its end
LOOP_ARGS = (
    "--exp", "tiny_cpu",
    "trainer.steps=1", "trainer.sft_warmup_steps=0", "trainer.export_at_end=true", "wandb.mode=disabled",
    "cluster.procs_per_node=1", "actor.tp=1", "rollout.tp=1",
)  # fmt: skip

# Put first on PYTHONPATH as sitecustomize, it runs in every process of the run (the spawned ranks too). It
# blocks NOT_CARRIED (None in sys.modules: `import` raises ModuleNotFoundError, importlib.util.find_spec answers
# None) and records who imports what, top-level name to top-level name: through `__import__` (every import
# statement, also of a module already loaded) and a meta-path finder (importlib.import_module, lazy imports).
# At exit it writes the edges to <dir>/<pid>.json, keeping only the modules still loaded (the import succeeded).
HOOK = """
import atexit, builtins, json, os, sys

_dir = os.environ["GPU_KIT_IMPORTS"]
for _name in filter(None, os.environ.get("GPU_KIT_BLOCK", "").split(",")):
    sys.modules[_name] = None
_edges = set()


def _top(name):
    return (name or "").partition(".")[0]


# the import system's own frames (the frozen bootstrap runs as _frozen_importlib*) and this hook's are not the
# importer: a C extension's or importlib.import_module's import is the first other frame's up the stack
_machinery = ("importlib", "_frozen_importlib", __name__)


def _importer(globals):
    name = (globals or {}).get("__name__") or ""
    frame = sys._getframe(1)
    while (not name or name.startswith(_machinery)) and frame is not None:
        name, frame = frame.f_globals.get("__name__") or "", frame.f_back
    return _top(name)


class _Watch:
    def find_spec(self, name, path=None, target=None):
        _edges.add((_importer(None), _top(name)))
        return None


_import = builtins.__import__


def _recording_import(name, globals=None, locals=None, fromlist=(), level=0):
    module = _import(name, globals, locals, fromlist, level)
    if level == 0:
        _edges.add((_importer(globals), _top(name)))
    return module


def _dump():
    loaded = {_top(name) for name, module in list(sys.modules.items()) if module is not None}
    with open(os.path.join(_dir, f"{os.getpid()}.json"), "w") as f:
        json.dump(sorted(e for e in _edges if e[1] in loaded and e[0] != e[1]), f)


sys.meta_path.insert(0, _Watch())
builtins.__import__ = _recording_import
atexit.register(_dump)
"""


def kit_pins() -> dict[str, str]:
    """KIT -> the version installed here (what CI tests)."""
    return {name: importlib.metadata.version(name) for name in KIT}


def project_packages() -> frozenset[str]:
    """This project's top-level packages (setup.cfg's find includes)."""
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    include = cfg["options.packages.find"]["include"].split()
    return frozenset(name for name in include if "." not in name)


def missing_from_image(distributions) -> list[str]:
    """The distributions neither the image, nor the kit, nor this project brings."""
    brought = IMAGE_DISTRIBUTIONS | {canonicalize_name(n) for n in KIT} | {PROJECT}
    return sorted({canonicalize_name(d) for d in distributions} - brought)


def _run_recorded(args: list[str], dump_dir: Path, timeout_s: float) -> None:
    hook_dir = dump_dir / "hook"
    hook_dir.mkdir(exist_ok=True)
    (hook_dir / "sitecustomize.py").write_text(HOOK)
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(hook_dir), str(REPO)]),
        GPU_KIT_IMPORTS=str(dump_dir),
        GPU_KIT_BLOCK=",".join(NOT_CARRIED),
    )
    done = subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode:
        tail = (done.stdout + done.stderr).strip().splitlines()[-15:]
        raise RuntimeError(
            f"`python {' '.join(args)}` (imports recorded, {NOT_CARRIED} blocked) exited "
            f"{done.returncode}:\n" + "\n".join(tail)
        )


def loop_distributions(timeout_s: float = 600) -> list[str]:
    """The distributions a tiny run of the loop (and the TOOLS the device check runs) imports, found by running it.

    Counted: what the project's code (and the stdlib, __main__) imports, and what any distribution counted that
    the image lacks imports in turn. Not followed: the imports of the image's own distributions; its versions
    bring their own (huggingface_hub here imports httpx2, the image's may not).
    """
    with tempfile.TemporaryDirectory(prefix="gpu-kit-imports-") as tmp:
        dump_dir = Path(tmp)
        _run_recorded(["-m", "run.main", "--run-dir", str(dump_dir / "run"), *LOOP_ARGS], dump_dir, timeout_s)
        _run_recorded(["-c", "; ".join(f"import {m}" for m in TOOLS)], dump_dir, timeout_s)
        edges = {tuple(e) for f in dump_dir.glob("*.json") for e in json.loads(f.read_text())}
    # a package's vendored copies come with it (setuptools puts setuptools/_vendor on sys.path once imported, and
    # its jaraco, more_itertools, backports then map to distributions of their own): not the image's to lack
    vendored = {
        canonicalize_name(d.metadata["Name"])
        for d in importlib.metadata.distributions()
        if "_vendor" in Path(str(d.locate_file(""))).parts
    }
    module_dists = {
        top: {canonicalize_name(d) for d in dists} - vendored
        for top, dists in importlib.metadata.packages_distributions().items()
    }
    roots = project_packages() | set(sys.stdlib_module_names) | {"", "__main__", "__mp_main__"}
    counted: set[str] = set()
    importers = set(roots)
    while True:  # to a fixpoint: a counted distribution the image lacks makes its modules importers
        new = {d for importer, top in edges if importer in importers for d in module_dists.get(top, ())} - counted
        if not new:
            break
        counted |= new
        importers |= {top for top, dists in module_dists.items() if dists & new and not dists <= IMAGE_DISTRIBUTIONS}
    return sorted(counted - {PROJECT})


def _pip(args: list[str]) -> None:
    done = subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True)
    if done.returncode:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-10:])
        raise RuntimeError(f"`pip {' '.join(args)}` exited {done.returncode}:\n{tail}")


def download_wheels(out_dir: str | Path) -> dict:
    """Fill ``out_dir`` with the kit's cp312 manylinux x86_64 wheels (built here for an sdist-only one), remove
    wheels of other versions, and return {files: {name: bytes}, total_bytes}. ValueError above MAX_KIT_BYTES."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    pins = kit_pins()
    for wheel in out.glob("*.whl"):
        name, version, _, _ = parse_wheel_filename(wheel.name)
        if pins.get(name) != str(version):
            wheel.unlink()
    have = {parse_wheel_filename(w.name)[0] for w in out.glob("*.whl")}
    for name, version in pins.items():
        if canonicalize_name(name) in have:
            continue
        if name in SDIST_ONLY:
            _pip(["wheel", "--no-deps", "--no-binary", ":all:", f"{name}=={version}", "-w", str(out)])
            continue
        platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
        _pip(["download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
              *platforms, "-d", str(out), f"{name}=={version}"])  # fmt: skip
    files = {w.name: w.stat().st_size for w in sorted(out.glob("*.whl"))}
    report = {"out": str(out), "files": files, "total_bytes": sum(files.values())}
    if report["total_bytes"] > MAX_KIT_BYTES:
        raise ValueError(
            f"the kit in {out} is {report['total_bytes'] / 2**20:.1f} MiB, over the {MAX_KIT_BYTES // 2**20} MiB "
            "the device run can carry beside the tree"
        )
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.gpu_kit", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    wheels = sub.add_parser("wheels", help="download / build the kit's wheels into --out")
    wheels.add_argument("--out", default=".gpu-wheels")
    sub.add_parser("check", help="run the loop, list what it imports and what neither the image nor the kit brings")
    args = parser.parse_args(argv)
    try:
        if args.command == "wheels":
            print(json.dumps(download_wheels(args.out)))
            return 0
        loop = loop_distributions()
        missing = missing_from_image(loop)
        print(json.dumps({"loop": loop, "kit": kit_pins(), "missing": missing}))
        return 1 if missing else 0
    except (RuntimeError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
