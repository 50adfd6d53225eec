#!/usr/bin/env python3
"""Write the demo set's quiz: the prompts with a checkable answer that let the quality verdict conclude.

The demo prompt set (regress/data/prompts/demo.jsonl) holds 127 hand-written prompts, 88 of them
with an expected answer: too few for a paired test to tell a 5-point loss from none (about 240 to
430 answered prompts are needed at the flip rates quantizations show; docs/verdicts.md,
"Quality"). This script appends a quiz written for the demo, deterministically (one seed), so the
set can be regenerated and reviewed: short free-text answers (arithmetic in English and Chinese,
Python expressions, days, months, opposites, capitals) with short ``max_tokens``, and
multiple-choice questions scored by log-likelihood (``choices`` + ``answer``), and a few sampled
prompts (``samples`` at temperature 0.8), twelve of them short questions with an answer. Lines it wrote before (ids ``quiz-*``, ``mc-*``,
``sample-*``) are replaced; the hand-written ones are kept as they are.

    python scripts/make_demo_quiz.py            # rewrites regress/data/prompts/demo.jsonl
"""

from __future__ import annotations

import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "regress" / "data" / "prompts" / "demo.jsonl"
GENERATED = ("quiz-", "mc-", "sample-")
SHORT = {"max_tokens": 10}

CAPITALS = [("France", "Paris"), ("Japan", "Tokyo"), ("Italy", "Rome"), ("Germany", "Berlin"), ("Spain", "Madrid"),
            ("Egypt", "Cairo"), ("Russia", "Moscow"), ("China", "Beijing"), ("England", "London"),
            ("Greece", "Athens"), ("Portugal", "Lisbon"), ("Austria", "Vienna"), ("Norway", "Oslo"),
            ("Sweden", "Stockholm"), ("Ireland", "Dublin"), ("Poland", "Warsaw"), ("Kenya", "Nairobi"),
            ("Peru", "Lima"), ("Cuba", "Havana"), ("Canada", "Ottawa"), ("Australia", "Canberra"),
            ("India", "New Delhi"), ("Thailand", "Bangkok"), ("Turkey", "Ankara"), ("Argentina", "Buenos Aires"),
            ("Belgium", "Brussels"), ("Denmark", "Copenhagen"), ("Finland", "Helsinki"), ("Hungary", "Budapest"),
            ("Chile", "Santiago")]
OPPOSITES = [("hot", "cold"), ("big", "small"), ("up", "down"), ("fast", "slow"), ("day", "night"),
             ("happy", "sad"), ("open", "closed"), ("light", "dark"), ("old", "young"), ("early", "late"),
             ("full", "empty"), ("hard", "soft"), ("high", "low"), ("wet", "dry"), ("rich", "poor"),
             ("strong", "weak"), ("long", "short"), ("clean", "dirty"), ("loud", "quiet"), ("true", "false")]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December"]
ZH_CAPITALS = [("中国", "北京"), ("日本", "东京"), ("法国", "巴黎"), ("英国", "伦敦"), ("德国", "柏林"),
               ("意大利", "罗马"), ("俄罗斯", "莫斯科"), ("美国", "华盛顿"), ("韩国", "首尔"), ("埃及", "开罗")]
ZH_DIGITS = "零一二三四五六七八九十"


def chat(pid: str, text: str, expected: list[str] | str, tags: list[str], **extra: object) -> dict:
    return {"id": pid, "messages": [{"role": "user", "content": text}], "expected": expected,
            "tags": ["chat", "quiz", *tags], "sampling": dict(SHORT), **extra}


def free_text(rng: random.Random) -> list[dict]:
    rows = []
    for i in range(60):  # arithmetic, English
        a, b = rng.randint(2, 60), rng.randint(2, 40)
        op = ("+", "-", "*")[i % 3]
        if op == "*":
            a, b = rng.randint(2, 12), rng.randint(2, 12)
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        rows.append(chat(f"quiz-arith-{i:03d}", f"What is {a} {op} {b}? Answer with the number only.", str(value),
                         ["arithmetic"]))
    for i in range(40):  # arithmetic, Chinese
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        rows.append(chat(f"quiz-zh-{i:03d}", f"{a} 加 {b} 等于几？只回答数字。", [str(a + b)], ["chinese", "arithmetic"]))
    for i, (country, city) in enumerate(ZH_CAPITALS):
        rows.append(chat(f"quiz-zh-cap-{i:03d}", f"{country}的首都是哪座城市？只回答城市名。", city, ["chinese"]))
    exprs = []
    for i in range(50):  # Python expressions
        kind = i % 5
        if kind == 0:
            word = rng.choice(["hello", "python", "banana", "regress", "token", "kernel", "batch"])
            exprs.append((f"len('{word}')", str(len(word))))
        elif kind == 1:
            xs = [rng.randint(1, 20) for _ in range(3)]
            exprs.append((f"sum({xs})", str(sum(xs))))
        elif kind == 2:
            xs = [rng.randint(1, 50) for _ in range(4)]
            exprs.append((f"max({xs})", str(max(xs))))
        elif kind == 3:
            b, e = rng.randint(2, 5), rng.randint(2, 4)
            exprs.append((f"{b} ** {e}", str(b ** e)))
        else:
            a, b = rng.randint(10, 99), rng.randint(2, 9)
            exprs.append((f"{a} // {b}", str(a // b)))
    for i, (expr, value) in enumerate(exprs):
        rows.append(chat(f"quiz-code-{i:03d}", f"What does the Python expression {expr} evaluate to? Answer with the "
                         "value only.", value, ["code"]))
    for i, day in enumerate(DAYS):
        rows.append(chat(f"quiz-day-{i:03d}", f"What day of the week comes after {day}? One word.",
                         DAYS[(i + 1) % 7], ["english"]))
    for i, month in enumerate(MONTHS):
        rows.append(chat(f"quiz-month-{i:03d}", f"What month comes after {month}? One word.",
                         MONTHS[(i + 1) % 12], ["english"]))
    for i, (word, opposite) in enumerate(OPPOSITES):
        rows.append(chat(f"quiz-opp-{i:03d}", f"What is the opposite of '{word}'? One word.", opposite, ["english"]))
    for i, (country, city) in enumerate(CAPITALS):
        rows.append(chat(f"quiz-cap-{i:03d}", f"What is the capital of {country}? Answer with the city only.", city,
                         ["english"]))
    return rows


def _mc(pid: str, prompt: str, right: str, wrong: list[str], rng: random.Random, tags: list[str]) -> dict:
    choices = [right, *wrong]
    rng.shuffle(choices)
    return {"id": pid, "prompt": prompt, "choices": choices, "answer": choices.index(right),
            "tags": ["multiple-choice", *tags], "sampling": {"max_tokens": 4}}


def multiple_choice(rng: random.Random) -> list[dict]:
    rows = []
    cities = [c for _, c in CAPITALS]
    for i, (country, city) in enumerate(CAPITALS):
        wrong = rng.sample([c for c in cities if c != city], 3)
        rows.append(_mc(f"mc-cap-{i:03d}", f"Question: What is the capital of {country}?\nAnswer:", f" {city}",
                        [f" {w}" for w in wrong], rng, ["english"]))
    for i, (word, opposite) in enumerate(OPPOSITES):
        others = [o for _, o in OPPOSITES if o != opposite]
        rows.append(_mc(f"mc-opp-{i:03d}", f"Question: What is the opposite of '{word}'?\nAnswer:", f" {opposite}",
                        [f" {w}" for w in rng.sample(others, 3)], rng, ["english"]))
    for i in range(40):
        a, b = rng.randint(2, 30), rng.randint(2, 30)
        value = a + b
        wrong = rng.sample([v for v in range(value - 6, value + 7) if v != value and v > 0], 3)
        rows.append(_mc(f"mc-arith-{i:03d}", f"Question: What is {a} plus {b}?\nAnswer:", f" {value}",
                        [f" {w}" for w in wrong], rng, ["arithmetic"]))
    for i, (country, city) in enumerate(ZH_CAPITALS):
        others = [c for _, c in ZH_CAPITALS if c != city]
        rows.append(_mc(f"mc-zh-cap-{i:03d}", f"问题：{country}的首都是哪座城市？\n答案：", city, rng.sample(others, 3), rng,
                        ["chinese"]))
    for i in range(20):
        a, b = rng.randint(1, 4), rng.randint(1, 5)
        value = a + b
        wrong = rng.sample([v for v in range(1, 11) if v != value], 3)
        rows.append(_mc(f"mc-zh-arith-{i:03d}", f"问题：{a} 加 {b} 等于几？\n答案：", ZH_DIGITS[value],
                        [ZH_DIGITS[w] for w in wrong], rng, ["chinese", "arithmetic"]))
    return rows


def sampled() -> list[dict]:
    """Sampled prompts (production traffic is mostly sampled): open-ended ones, judged as
    distributions by the fidelity verdict, and short questions with an answer, which the quality
    verdict also judges as distributions (each side's share of right samples)."""
    topics = ["the sea", "a city at night", "autumn leaves", "a cup of coffee", "the first snow", "a train journey"]
    rows = [{"id": f"sample-{i:03d}", "messages": [{"role": "user", "content": f"Write one short sentence about {t}."}],
             "samples": 4, "sampling": {"temperature": 0.8, "top_p": 0.95, "max_tokens": 24},
             "tags": ["chat", "sampled"]} for i, t in enumerate(topics)]
    questions = [(f"What is the capital of {country}? Answer with the city only.", city)
                 for country, city in CAPITALS[:8]]
    questions += [(f"What is {a} + {b}? Answer with the number only.", str(a + b))
                  for a, b in ((7, 5), (12, 9), (23, 14), (6, 8))]
    rows += [{"id": f"sample-qa-{i:03d}", "messages": [{"role": "user", "content": q}], "expected": answer,
              "samples": 4, "sampling": {"temperature": 0.8, "top_p": 0.95, "max_tokens": 10},
              "tags": ["chat", "sampled", "quiz"]} for i, (q, answer) in enumerate(questions)]
    return rows


def main() -> None:
    kept = [line for line in OUT.read_text(encoding="utf-8").splitlines()
            if line.strip() and not json.loads(line)["id"].startswith(GENERATED)]
    rng = random.Random(20261202)
    rows = free_text(rng) + multiple_choice(rng) + sampled()
    lines = kept + [json.dumps(r, ensure_ascii=False) for r in rows]
    OUT.write_text("\n".join(lines) + "\n", encoding="utf-8")
    answered = sum(1 for line in lines if '"expected"' in line or '"choices"' in line)
    print(f"{OUT}: {len(lines)} prompts ({len(kept)} kept, {len(rows)} generated), {answered} with a checkable answer")


if __name__ == "__main__":
    main()
