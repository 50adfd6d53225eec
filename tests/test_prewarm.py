"""regress.prewarm: the scoring's imports made beside the replay (docs/benchmarks.md, what a check costs)."""

from __future__ import annotations

import subprocess
import sys

from conftest import REPO


def _fresh(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)


def test_the_scoring_imports_load_in_the_background_and_a_failed_one_is_left_to_the_scoring():
    result = _fresh(
        "import sys\n"
        "from regress.prewarm import SCORING_IMPORTS, import_in_background\n"
        "assert not any(m in sys.modules for m in SCORING_IMPORTS)\n"
        "t = import_in_background(SCORING_IMPORTS + ('regress_no_such_module',))\n"
        "assert t.daemon and t.name == 'regress-prewarm'\n"
        "t.join(60)\n"
        "assert all(m in sys.modules for m in SCORING_IMPORTS), SCORING_IMPORTS\n"
        "print('ok')\n")
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_nothing_on_the_replay_path_imports_what_the_background_thread_does():
    """The two threads never share a module lock: the replay's modules do not import scipy."""
    result = _fresh(
        "import sys\n"
        "import regress.checks, regress.quick, regress.replay, regress.replay.run, regress.replay.warm\n"
        "import regress.replay.executors, regress.engine.client, regress.metrics.sample_scorer, regress.envs\n"
        "print([m for m in sys.modules if m == 'scipy' or m.startswith('scipy.')])\n")
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stdout + result.stderr
