"""Synthetic task and GSM8K-style verifier."""

from __future__ import annotations

import json

import pytest

from rl.data import DigitSumTask, Gsm8kTask, extract_final_number


def test_digit_sum_prompts_are_seeded_and_correct():
    a, b = DigitSumTask(seed=3).sample(20), DigitSumTask(seed=3).sample(20)
    assert a == b
    for p in a:
        x, y = p.prompt.rstrip("=").split("+")
        assert int(p.answer) == int(x) + int(y)


@pytest.mark.parametrize(
    "response,answer,reward",
    [
        ("12", "12", 1.0),
        (" 12 ", "12", 1.0),
        ("13", "12", 0.8 * (1 - 1 / 19)),
        ("0", "18", 0.8 * (1 - 18 / 19)),
        ("ab", "12", 0.0),
        ("9x", "9", 0.0),
        ("", "5", 0.0),
        ("-1", "1", 0.0),
    ],
)
def test_digit_sum_reward_partial_credit_by_distance(response, answer, reward):
    assert DigitSumTask(seed=0, max_operand=9).reward(response, answer) == pytest.approx(reward)


@pytest.mark.parametrize(
    "text,number",
    [
        ("so 3+4 = 7. #### 7", "7"),
        ("The answer is 1,234.", "1234"),
        ("#### -5 apples", "-5"),
        ("no digits", None),
        ("first 3 then 12.0", "12"),
        ("#### 42\nthen 7", "42"),
    ],
)
def test_extract_final_number(text, number):
    assert extract_final_number(text) == number


def test_gsm8k_from_jsonl(tmp_path):
    path = tmp_path / "train.jsonl"
    rows = [
        {"question": "Tom has 2 apples and buys 3. How many?", "answer": "2+3=5\n#### 5"},
        {"question": "What is 10*100?", "answer": "#### 1,000"},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    task = Gsm8kTask(str(path), seed=0)
    assert sorted(p.answer for p in task.problems) == ["1000", "5"]
    assert task.reward("2 and 3 make 5. #### 5", "5") == 1.0
    assert task.reward("It is 1,000", "1000") == 1.0
    assert task.reward("It is 6", "5") == 0.0
    assert len(task.sample(7)) == 7


def test_gsm8k_bad_input(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Gsm8kTask(str(tmp_path / "missing.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"q": "x"}))
    with pytest.raises(ValueError, match="bad.jsonl line 1: lacks 'question', 'answer'"):
        Gsm8kTask(str(bad))
    other = tmp_path / "data.csv"
    other.write_text("a,b")
    with pytest.raises(ValueError, match="expected a .jsonl or .parquet"):
        Gsm8kTask(str(other))


def test_digit_sum_format_examples_teach_format_not_answers():
    task = DigitSumTask(seed=1)
    examples = task.format_examples(200)
    assert all(e.answer.isdigit() and 0 <= int(e.answer) <= 18 for e in examples)
    assert all(int(e.answer) <= 8 for e in DigitSumTask(seed=1, max_operand=4).format_examples(50))
    correct = sum(int(e.answer) == eval(e.prompt.rstrip("=")) for e in examples)
    assert correct < 40  # ~1/19 by chance; far from the true sums


def test_gsm8k_from_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "train.parquet"
    pq.write_table(pa.table({"question": ["1+1?", "2*3?"], "answer": ["#### 2", "so 6\n#### 6"]}), path)
    task = Gsm8kTask(str(path))
    assert sorted(p.answer for p in task.problems) == ["2", "6"]
    assert task.reward("The answer is 6", "6") == 1.0
