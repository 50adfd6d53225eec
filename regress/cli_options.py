"""The command-line options several commands share, defined once."""

from __future__ import annotations

from enum import Enum
from pathlib import Path

import typer

ParamsOption = typer.Option(Path("params.yaml"), "--params", "-p", help="The params file (baseline, candidates, thresholds).")
ExecutorOption = typer.Option(
    None, "--executor", "-e",
    help="Where shards run: 'local' (this machine, no broker) or 'celery' (workers over Redis). Default: params' executor.",
)
QueueOption = typer.Option(None, "--queue", help="Celery queue for the shards (default: params' celery.queue).")


class GoldenScoring(str, Enum):
    """The modes of :data:`regress.metrics.sample_scorer.GOLDEN_SCORING_MODES` (kept apart so that the
    CLI starts without loading the metrics; a test holds the two equal)."""

    auto = "auto"
    always = "always"
    never = "never"


GoldenScoringOption = typer.Option(
    GoldenScoring.auto, "--golden-scoring", case_sensitive=False,
    help="Sampled prompts: who scores the candidate's samples. auto: the baseline (one more engine load), unless "
         "the candidate's logprobs of the golden's tokens already match the golden's (within 0.02 nat/token on "
         "every entry), when its own stand in; always: the baseline; never: the candidate's own.")
QuickPromptsOption = typer.Option(
    None, "--quick-prompts", min=0, metavar="N",
    help="With --quick: prefill a stratified screening sample of N prompts (every tag, the longest, the rest spread by "
         "length; the same N prompts every time) instead of every prompt; 0 prefills all. Default: params.yaml's "
         "quick.prompts (0).")
