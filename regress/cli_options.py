"""The command-line options several commands share, defined once."""

from __future__ import annotations

from pathlib import Path

import typer

ParamsOption = typer.Option(Path("params.yaml"), "--params", "-p", help="The params file (baseline, candidates, thresholds).")
ExecutorOption = typer.Option(
    None, "--executor", "-e",
    help="Where shards run: 'local' (this machine, no broker) or 'celery' (workers over Redis). Default: params' executor.",
)
QueueOption = typer.Option(None, "--queue", help="Celery queue for the shards (default: params' celery.queue).")
