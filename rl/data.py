"""Prompts and verifiable rewards, no downloads.

- :class:`DigitSumTask`: the synthetic task shipped in the repo for the tiny CPU experiment. A prompt
  is ``"a+b="`` with digits up to ``max_operand``; the answer is the decimal sum followed by
  end-of-sequence. The reward gives partial credit by numeric distance (1.0 exact, a near miss most
  of 0.8, a non-number 0), a smooth signal a tiny model climbs in a few dozen steps. It is generated
  from a seed, so every rank sees the same prompts.
- :class:`Gsm8kTask`: GSM8K-style math over a local ``.jsonl`` or ``.parquet`` file with ``question``
  and ``answer`` fields (the answer's final number after ``####`` is the ground truth). The verifier
  takes the number after the response's last ``####``, else its last number.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from pathlib import Path

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str


class _SeededSampling:
    """The data cursor of a task: its ``random.Random`` and how many prompts it has drawn (checkpoints)."""

    rng: random.Random
    num_drawn: int = 0

    def state_dict(self) -> dict:
        return {"rng": self.rng.getstate(), "num_drawn": self.num_drawn}

    def load_state_dict(self, state: dict) -> None:
        self.rng.setstate(state["rng"])
        self.num_drawn = int(state["num_drawn"])


class DigitSumTask(_SeededSampling):
    """``"a+b="`` -> ``"<a+b>"``, with 0 <= a, b <= ``max_operand`` (<= 9)."""

    name = "digit_sum"

    def __init__(self, seed: int = 0, max_operand: int = 9):
        if not 1 <= max_operand <= 9:
            raise ValueError(f"data.max_operand={max_operand} must be in [1, 9]")
        self.rng = random.Random(seed)
        self.max_operand = max_operand

    def sample(self, num_prompts: int) -> list[Problem]:
        self.num_drawn += num_prompts
        problems = []
        for _ in range(num_prompts):
            a, b = self.rng.randint(0, self.max_operand), self.rng.randint(0, self.max_operand)
            problems.append(Problem(prompt=f"{a}+{b}=", answer=str(a + b)))
        return problems

    def longest_prompts(self) -> list[str]:
        """Candidates for the longest prompt (the memory plan sizes sequences by it)."""
        return [f"{self.max_operand}+{self.max_operand}="]

    def format_examples(self, num_examples: int) -> list[Problem]:
        """Supervised warm-up data: real prompts with RANDOM answers in the answer range.

        It teaches the format (a number, then end-of-sequence) and no arithmetic, so whatever the
        model later gets right beyond chance, the RL steps taught it.
        """
        return [Problem(p.prompt, str(self.rng.randint(0, 2 * self.max_operand))) for p in self.sample(num_examples)]

    def reward(self, response: str, answer: str) -> float:
        """1.0 for the exact sum; a number off by d earns 0.8 x (1 - d / (2 x max_operand + 1)); anything else 0."""
        response = response.strip()
        if response == answer:
            return 1.0
        if not response.isdigit():
            return 0.0
        distance = abs(int(response) - int(answer))
        return 0.8 * max(0.0, 1.0 - distance / (2 * self.max_operand + 1))


def extract_final_number(text: str) -> str | None:
    """The number after the last ``####`` if present, else the last number; commas dropped."""
    tail = text.rsplit("####", 1)[1] if "####" in text else text
    numbers = _NUMBER.findall(tail)
    if not numbers:
        return None
    value = numbers[0] if "####" in text else numbers[-1]
    value = value.replace(",", "")
    return value[:-2] if value.endswith(".0") else value.rstrip(".")


def read_records(file: Path, fields: tuple[str, ...]) -> list[dict]:
    """Every record of a ``.jsonl`` or ``.parquet`` file, each a dict with ``fields``; a ValueError names
    the file, the line (jsonl) or row (parquet) and what is wrong with it."""
    where = f"data.path={str(file)}"
    if file.suffix == ".jsonl":
        records, lines = [], []
        with open(file, encoding="utf-8") as f:
            for number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    records.append(json.loads(line.strip()))
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{where} line {number}: not valid JSON ({exc}); fix or drop that line") from None
                lines.append(f"line {number}")
    elif file.suffix == ".parquet":
        # first use: at the top pyarrow would load with `import rl.evaluation, rl.generation ...`, which do not need it
        import pyarrow.parquet as pq

        records = pq.read_table(file).to_pylist()
        lines = [f"row {i}" for i in range(len(records))]
    else:
        raise ValueError(f"{where}: expected a .jsonl or .parquet file")
    for record, line in zip(records, lines):
        missing = [name for name in fields if not isinstance(record, dict) or name not in record]
        if missing:
            raise ValueError(f"{where} {line}: lacks {', '.join(map(repr, missing))}; every record needs {fields}")
    return records


class Gsm8kTask(_SeededSampling):
    """GSM8K-style problems from a local file; reward 1.0 iff the final numbers match."""

    name = "gsm8k"

    def __init__(self, path: str, seed: int = 0):
        file = Path(path)
        if not file.is_file():
            raise FileNotFoundError(f"data.path={path!r} does not exist; point it at a local .jsonl or .parquet file")
        records = read_records(file, ("question", "answer"))
        self.problems = [Problem(r["question"], extract_final_number(str(r["answer"])) or "") for r in records]
        if not self.problems:
            raise ValueError(f"data.path={path!r} holds no records")
        self.rng = random.Random(seed)

    def sample(self, num_prompts: int) -> list[Problem]:
        self.num_drawn += num_prompts
        return [self.rng.choice(self.problems) for _ in range(num_prompts)]

    def longest_prompts(self) -> list[str]:
        """Candidates for the longest prompt in tokens: the longest ones in characters."""
        return sorted((p.prompt for p in self.problems), key=len)[-8:]

    @staticmethod
    def reward(response: str, answer: str) -> float:
        predicted = extract_final_number(response)
        return 1.0 if predicted is not None and predicted == answer else 0.0


TASKS = ("digit_sum", "gsm8k")


def longest_prompt_tokens(task: DigitSumTask | Gsm8kTask, tokenizer) -> int:
    """The task's longest prompt in ``tokenizer``'s tokens, as the rollout feeds it (no chat template): what
    the memory plan sizes sequences by, in the run (run/setup.py) and before launch (run/memory_plan.py)."""
    return max(len(tokenizer(p).input_ids) for p in task.longest_prompts())


@dataclass(kw_only=True)
class DataConfig:
    """Prompts and rewards (``data.*``): the shipped synthetic task, or GSM8K-style math from a local file."""

    task: str = "digit_sum"
    path: str | None = None  # gsm8k: a local .jsonl or .parquet with question/answer fields
    max_operand: int = 9  # digit_sum: operands in [0, max_operand]

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"data.task={self.task!r} is not one of {TASKS}")
        if self.task == "gsm8k" and not self.path:
            raise ValueError("data.task=gsm8k needs data.path=<local .jsonl or .parquet file>")
        if not 1 <= self.max_operand <= 9:
            raise ValueError(f"data.max_operand={self.max_operand} must be in [1, 9]")

    def build(self, seed: int) -> DigitSumTask | Gsm8kTask:
        """The task; ``seed`` drives prompt sampling (the same on every rank)."""
        if self.task == "gsm8k":
            return Gsm8kTask(self.path, seed=seed)
        return DigitSumTask(seed, self.max_operand)
