"""Planted damage on 2 % of prompts, caught by the interval gate (real engine, fixture model).

The candidate is the fixture model with the input embedding of one token (``@``, which the
model never generates) replaced by noise (:func:`regress.model_variants.damage_token`): every
prompt holding ``@`` is damaged and no other is. 4 of 200 prompts hold it. With
``max_regression_rate: 0.005`` the run fails because the Wilson interval's lower bound of 4/200
(0.78 %) is above 0.5 %; the reason states the interval, checked here against scipy.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from conftest import run_cli, write_params
from regress.scoring import read_scored_run

pytestmark = pytest.mark.engine

PROMPTS, DAMAGED = 200, 4
TRIGGER = "@"


def _prompts() -> list[dict]:
    """200 prompts cut from the fixture corpus (English prose), every 50th with the trigger at its end."""
    from regress.fixture_model import corpus_documents

    words: list[str] = []
    for name, text in corpus_documents():
        if name.startswith("en_"):
            words += text.split()
    rows = []
    for i in range(PROMPTS):
        start = (i * 7) % (len(words) - 12)
        text = " ".join(words[start: start + 6 + i % 5])
        if i % (PROMPTS // DAMAGED) == 0:
            # Last, so that the damaged embedding is what the first output token is read from
            # (RMSNorm makes its size moot further away; only its direction reaches later tokens).
            text = f"{text} {TRIGGER}"
        rows.append({"id": f"p-{i:03d}", "prompt": text})
    return rows


@pytest.fixture(scope="module")
def damaged_workspace(tmp_path_factory: pytest.TempPathFactory, fixture_model: Path) -> Path:
    from transformers import AutoTokenizer

    from regress.model_variants import damage_token

    root = tmp_path_factory.mktemp("planted")
    [token_id] = AutoTokenizer.from_pretrained(fixture_model).encode(TRIGGER, add_special_tokens=False)
    damage_token(fixture_model, root / "damaged", token_id=token_id, scale=30.0)
    sets = root / "datasets" / "prompts"
    sets.mkdir(parents=True)
    (sets / "planted.jsonl").write_text("\n".join(json.dumps(r) for r in _prompts()) + "\n")
    (sets / "planted.yaml").write_text("defaults: {temperature: 0, max_tokens: 12, logprobs: 5}\n")
    write_params(root, model=fixture_model, dataset="datasets/prompts/planted.jsonl", shard_size=100,
                 candidates={"damaged": {"model": str(root / "damaged")}})
    params = yaml.safe_load((root / "params.yaml").read_text())
    # The rate gate alone (max_regressions not written: the count does not gate).
    params["thresholds"] = {"max_regression_rate": 0.005, "metrics": ["exact_tokens", "divergence_point",
                                                                       "prefix_logprobs", "teacher_forced"]}
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    result = run_cli("golden", cwd=root)
    assert result.returncode == 0, result.stderr
    return root


def test_damage_on_two_percent_of_prompts_fails_the_interval_gate(damaged_workspace: Path) -> None:
    from scipy.stats import binomtest

    result = run_cli("check", "damaged", cwd=damaged_workspace)
    assert result.returncode == 1, result.stdout + result.stderr
    scored = read_scored_run(damaged_workspace / "scores" / "damaged")
    m = scored.metrics
    damaged = {s.prompt_id for s in scored.scores if s.prompt_class == "regression"}
    planted = {f"p-{i:03d}" for i in range(0, PROMPTS, PROMPTS // DAMAGED)}
    assert damaged == planted  # exactly the prompts holding the damaged token
    assert m.regression == DAMAGED and m.prompts == PROMPTS
    low, high = binomtest(DAMAGED, PROMPTS).proportion_ci(0.95, method="wilson")
    assert m.regression_rate_low == pytest.approx(low) and m.regression_rate_high == pytest.approx(high)
    assert low > 0.005  # why the gate fails: the whole interval is above the allowed rate
    reason = next(r for r in scored.verdict_reasons if "regression rate" in r)
    shown = re.findall(r"\d+(?:\.\d+)?", reason)
    assert f"{low * 100:.1f}" in shown and f"{high * 100:.1f}" in shown, reason
    # Nothing else moved: the other 196 prompts are identical.
    assert m.identical == PROMPTS - DAMAGED
