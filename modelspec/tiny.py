"""Tiny Hugging Face checkpoints for tests and the CPU experiment, built in-process (no downloads).

One per family of :mod:`modelspec.families` (its ``tiny_config``), each a normal HF directory (config.json,
model.safetensors, tokenizer files); each family's file says what its tiny model exercises (e.g. the
tiny Llama's vocab 99, the tokenizer's size, is NOT a multiple of 64, so every vocab-padding path runs).

All use hidden 128 with 4 q heads / 2 KV heads of head_dim 32 (``modelspec.family.TINY_COMMON``): the
smallest head size vLLM's CPU attention supports (32, 64, 80, 96, 112, 128, ...), so the same checkpoints
run in vLLM's CPU build.
All share a character-level tokenizer over printable ASCII, saved as ``tokenizer.json`` for
``PreTrainedTokenizerFast``. Weights come from ``from_config`` under a fixed seed, then every norm
weight and bias is drawn at random too (HF init leaves them at 1 and 0, where a tensor written to the
wrong place or not at all changes nothing), so the bytes are identical on every machine. An MoE family's
routers are redrawn with a large std (:data:`ROUTER_STD`): HF's init (std 0.02) gives near-uniform routing,
where top-k margins are so small that rounding differences between implementations pick other experts, and
the routing hardly depends on the token; sharp routers make routing matter and parity meaningful. ``python -m modelspec.tiny --out DIR`` (or ``make tiny-models``) writes
them; ``resolve_model_path("tiny:<family>")`` builds one on demand.
"""

from __future__ import annotations

import argparse
import fcntl
import filecmp
import json
import os
import shutil
import string
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from modelspec.families import FAMILIES
from modelspec.family import TINY_COMMON
from modelspec.shape import ARCHITECTURES_DIR

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TINY_DIR = Path(os.environ.get("RLMEM_TINY_DIR", REPO_ROOT / "tiny_models"))
TINY_PREFIX = "tiny:"
SEED = 1234
# std of an MoE tiny model's router weights [E, h=128]: the router's input is RMSNorm'd (elements ~1), so its
# logits have std ~ 0.3 x sqrt(128) ~ 3.4 and top-k margins are mostly far above float rounding
ROUTER_STD = 0.3

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]
# 4 specials + 95 printable ASCII characters = 99 tokens.
CHARACTERS = [c for c in string.printable if c not in "\t\n\r\x0b\x0c"]
TOKENIZER_VOCAB_SIZE = len(SPECIAL_TOKENS) + len(CHARACTERS)

# family -> (transformers config class name, config kwargs)
TINY_FAMILIES: dict[str, tuple[str, dict]] = {
    name: (family.config_class, family.tiny_config) for name, family in FAMILIES.items()
}


def tiny_hf_config(family: str, **overrides):
    """The transformers config of one tiny family (no files needed); ``overrides`` change its sizes (tests
    that need a bigger model, e.g. to measure memory well above noise)."""
    # first use: at the top transformers would load with `import run.compose, run.config ...`, which do not need it
    import transformers

    if family not in TINY_FAMILIES:
        raise ValueError(f"unknown tiny model family {family!r}; choose one of {sorted(TINY_FAMILIES)}")
    class_name, kwargs = TINY_FAMILIES[family]
    return getattr(transformers, class_name)(**{**kwargs, **overrides})


def build_tokenizer():
    """A character-level fast tokenizer: every printable ASCII char is one token."""
    # first use: at the top tokenizers would load with `import run.compose, run.config ...`, which do not need it
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
    )


def randomize_norms_and_biases(model, seed: int) -> None:
    """Norm weights -> U(0.5, 1.5), biases -> N(0, 0.1^2), from their own generator (deterministic)."""

    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.copy_(0.1 * torch.randn(param.shape, generator=gen))
            elif "norm" in name:
                param.copy_(0.5 + torch.rand(param.shape, generator=gen))


def write_tiny_model(family: str, out_dir: str | os.PathLike, seed: int = SEED, **overrides) -> Path:
    """Write one tiny checkpoint to ``out_dir`` (built in a temp dir, renamed into place under the directory's
    lock: :func:`publish_dir`). Another ``seed`` gives the same architecture with other weights (a "new
    checkpoint" for weight-update tests)."""
    return publish_dir(out_dir, lambda tmp: _save_tiny_model(family, tmp, seed, **overrides))


def write_random_model(
    architecture: str,
    out_dir: str | os.PathLike,
    device: str = "cpu",
    dtype: str = "bfloat16",
    seed: int = SEED,
    **overrides,
) -> Path:
    """A HF checkpoint of a shipped architecture (``modelspec/architectures/<architecture>.json``, ``overrides``
    changing its sizes) with random weights and the tiny models' character tokenizer, built on ``device`` (a
    1.5B model is drawn on a GPU in seconds; no download). Norms and biases are random as in every tiny model;
    the tokenizer's ids (< 99) lie inside any vocabulary, and the config names its special tokens."""

    # first use: at the top transformers would load with `import run.compose, run.config ...`, which do not need it
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    published = json.loads((ARCHITECTURES_DIR / f"{architecture}.json").read_text())
    specials = {name: SPECIAL_TOKENS.index(tok) for name, tok in (("bos_token_id", "<s>"), ("eos_token_id", "</s>"))}
    kwargs = {k: v for k, v in published.items() if k not in ("architectures", "model_type", "transformers_version")}
    config = AutoConfig.for_model(published["model_type"], **{**kwargs, **specials, **overrides})

    def write(tmp: Path) -> None:
        torch.manual_seed(seed)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
        randomize_norms_and_biases(model, seed)
        hf_logging.disable_progress_bar()
        model.save_pretrained(tmp)
        build_tokenizer().save_pretrained(tmp)

    return publish_dir(out_dir, write)


def resolve_model_path(path: str, tiny_dir: str | os.PathLike = DEFAULT_TINY_DIR) -> str:
    """``tiny:<family>`` -> a directory holding that checkpoint (built once); any other path as is.

    Safe when several processes (the ranks of one run, or two runs) resolve the same checkpoint at once: the
    first builds it under the directory's lock, the others wait for it and use it; a current checkpoint is
    never rewritten, so a directory a process got from here stays as it was. Launchers still resolve before
    their ranks start, so that ranks only read."""
    if not path.startswith(TINY_PREFIX):
        return path
    family = path[len(TINY_PREFIX) :]
    out_dir = Path(tiny_dir) / family
    if not _is_current(family, out_dir):
        publish_dir(out_dir, lambda tmp: _save_tiny_model(family, tmp, SEED), keep=lambda d: _is_current(family, d))
    return str(out_dir)


def _save_tiny_model(family: str, out_dir: Path, seed: int, **overrides) -> None:
    # first use: at the top transformers would load with `import run.compose, run.config ...`, which do not need it
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    config = tiny_hf_config(family, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_norms_and_biases(model, seed)
    hf_logging.disable_progress_bar()  # a progress bar on stderr would bury the one-line errors of the CLIs
    model.save_pretrained(out_dir)
    moe = FAMILIES[config.model_type].moe if config.model_type in FAMILIES else None  # sized ones too
    if moe:
        sharpen_routers(out_dir, moe.router.name, seed)
    build_tokenizer().save_pretrained(out_dir)


def sharpen_routers(out_dir: Path, router_name: str, seed: int) -> None:
    """Redraw every ``<router_name>.weight`` [E, h] of the saved checkpoint as N(0, ROUTER_STD^2) (module doc).
    On the saved file, by the checkpoint's names: transformers renames some MoE blocks in memory (Mixtral's
    ``block_sparse_moe`` is ``mlp`` there)."""

    path = Path(out_dir) / "model.safetensors"
    tensors = load_file(path)
    gen = torch.Generator().manual_seed(seed + 2)
    routers = sorted(name for name in tensors if name.endswith(f".{router_name}.weight"))
    if not routers:
        raise ValueError(f"{path} has no {router_name}.weight tensors to sharpen")
    for name in routers:
        tensors[name] = ROUTER_STD * torch.randn(tensors[name].shape, generator=gen, dtype=tensors[name].dtype)
    save_file(tensors, path, metadata={"format": "pt"})


def publish_dir(
    out_dir: str | os.PathLike, write: Callable[[Path], None], keep: Callable[[Path], bool] | None = None
) -> Path:
    """Make ``out_dir`` what ``write(tmp)`` writes into an empty directory, safely beside other processes that
    publish or read the same ``out_dir`` (the ranks of one run, two runs, ``make tiny-models`` during a run).

    Everything happens under an exclusive ``flock`` on ``<parent>/.<name>.lock`` (beside ``out_dir``: the
    directory itself is replaced whole; the kernel drops the lock when its process dies; the file stays, since
    removing it would let a waiter and a newcomer lock two different files). Under the lock: ``keep(out_dir)``
    true -> ``out_dir`` as it is (what a process that waited for the lock sees once another built it);
    otherwise ``write`` fills a temp directory beside ``out_dir`` that then takes its name by a rename, so no
    reader ever sees a half-written one. An ``out_dir`` that already holds the same files byte for byte is left
    as it is (a reader may have it open); a different one is renamed aside first and deleted after."""
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(out_dir.parent / f".{out_dir.name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if keep is not None and keep(out_dir):
            return out_dir
        for kind in ("new", "old"):  # what a process killed in here left
            for leftover in out_dir.parent.glob(f".{out_dir.name}-{kind}-*"):
                shutil.rmtree(leftover, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-new-", dir=out_dir.parent))
        aside = None
        try:
            tmp.chmod(0o755)
            write(tmp)
            if out_dir.is_dir() and _same_files(tmp, out_dir):
                return out_dir
            if out_dir.exists():
                aside = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-old-", dir=out_dir.parent))
                out_dir.rename(aside / out_dir.name)
            tmp.rename(out_dir)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
            if aside is not None:
                shutil.rmtree(aside, ignore_errors=True)
    return out_dir


def _same_files(a: Path, b: Path) -> bool:
    """Both directories hold the same file names with the same bytes (flat: a checkpoint has no subdirs)."""
    names = sorted(p.name for p in a.iterdir())
    if names != sorted(p.name for p in b.iterdir()):
        return False
    _, mismatch, errors = filecmp.cmpfiles(a, b, names, shallow=False)
    return not mismatch and not errors


def _is_current(family: str, out_dir: Path) -> bool:
    """``out_dir`` holds this family's checkpoint with today's sizes (one written by an older version of this
    file, e.g. with head_dim 16, is rebuilt rather than silently reused)."""

    if family not in TINY_FAMILIES:
        raise ValueError(f"unknown tiny model family {family!r}; choose one of {sorted(TINY_FAMILIES)}")
    config_file = out_dir / "config.json"
    if not config_file.exists():
        return False
    written = json.loads(config_file.read_text())
    return all(written.get(key) == value for key, value in TINY_FAMILIES[family][1].items() if key != "rope_theta")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(DEFAULT_TINY_DIR), help="directory to write <family>/ into")
    parser.add_argument("--families", nargs="+", default=sorted(TINY_FAMILIES), choices=sorted(TINY_FAMILIES))
    args = parser.parse_args()
    for family in args.families:
        print(write_tiny_model(family, Path(args.out) / family))


if __name__ == "__main__":
    main()


# ---------------------------------------------------------------- sized checkpoints (memory_cpu)
# Same tokenizer and builder as the tiny families, but large enough that memory is worth measuring:
# in fp32 on one rank (actor TP=1) params, grads and engine weights are ~122 MB each, Adam's states
# ~244 MB. head_dim 64 (vLLM's CPU attention takes 32/64/80/96/112/128). Built on demand by
# ``resolve_model_path("tiny:qwen2_memory")``, never by ``make tiny-models`` or the test fixtures.
SIZED_FAMILIES: dict[str, tuple[str, dict]] = {
    "qwen2_memory": (
        "Qwen2Config",
        dict(
            TINY_COMMON,
            hidden_size=512,
            intermediate_size=2048,
            num_hidden_layers=8,
            num_attention_heads=8,
            vocab_size=128,
            rope_theta=1_000_000.0,
            tie_word_embeddings=False,
        ),
    ),
    # the planner's transient-dominated validation run (tools/validate_plan.py): the tiny Qwen2 with a 16k
    # vocabulary, so the logits of long micro-batches outweigh every other tensor (fp32 [tokens, 16384/TP])
    "qwen2_vocab": (
        "Qwen2Config",
        dict(TINY_COMMON, vocab_size=16384, rope_theta=1_000_000.0, tie_word_embeddings=False),
    ),
}
# The same model with 4 KV heads, so that actor TP=4 divides them (``make bench-sync``'s tp4->tp2).
SIZED_FAMILIES["qwen2_memory_kv4"] = (
    "Qwen2Config",
    dict(SIZED_FAMILIES["qwen2_memory"][1], num_key_value_heads=4),
)
# The step-time fit's deep model (tools/plan_runs.py TIME_FIT_SET, deep_layers): the tiny Qwen2 with 16 layers, so
# that the fixed costs per layer (the actor's ops, the engine's layer steps, the sync's tensors) are four times the
# tiny model's against the same costs per pass and per phase; no other fit run varies the layer count.
SIZED_FAMILIES["qwen2_deep"] = ("Qwen2Config", dict(TINY_FAMILIES["qwen2"][1], num_hidden_layers=16))
# ``make bench-sync``'s MoE layouts (ep2->tp2, tp2ep2->tp2): a Qwen3-MoE of 123 MB in fp32, 92% of it routed
# experts (16 per layer, m = 384: m / 2 = 192 is a multiple of the 32 vLLM's CPU experts pad to), every layer
# sparse, 4 KV heads of head_dim 64 (TP=2 splits them on both sides), top-2 normalised as Qwen3-30B-A3B.
SIZED_FAMILIES["qwen3_moe_memory"] = (
    "Qwen3MoeConfig",
    dict(
        TINY_COMMON,
        hidden_size=512,
        intermediate_size=1024,  # unused: no dense layer
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        vocab_size=128,
        rope_theta=1_000_000.0,
        tie_word_embeddings=False,
        num_local_experts=16,
        num_experts_per_tok=2,
        moe_intermediate_size=384,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    ),
)
TINY_FAMILIES.update(SIZED_FAMILIES)
