"""Real `regress worker` processes for the tests: started, waited for, stopped or killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

TEST_KEY = "regress-test-broker-key-0123456789abcdef"
"""The signing key the tests' orchestrators, watchers and workers share."""
KEY_ENV = {"REGRESS_BROKER_KEY": TEST_KEY}
"""Environment that gives a process the tests' signing key."""


class WorkerProcess:
    """One `regress worker` subprocess in its own process group, logging to a file."""

    def __init__(self, cwd: Path, *, broker_url: str, queue: str, name: str, log: Path,
                 visibility_timeout_s: float = 3600, key: str | None = TEST_KEY, extra_args: tuple[str, ...] = ()):
        self.cwd, self.queue, self.name, self.log = cwd, queue, name, log
        self.extra_args = extra_args
        self.env = {k: v for k, v in os.environ.items() if k not in ("REGRESS_BROKER_KEY", "REGRESS_BROKER_KEY_FILE")}
        self.env.update({"REGRESS_BROKER_URL": broker_url, "REGRESS_VISIBILITY_TIMEOUT_S": str(visibility_timeout_s)})
        if key is not None:
            self.env["REGRESS_BROKER_KEY"] = key
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, *, wait_ready_s: float = 60) -> "WorkerProcess":
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "regress.cli", "worker", "--queue", self.queue, "--name", self.name,
                 *self.extra_args],
                cwd=self.cwd, env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            )
        deadline = time.monotonic() + wait_ready_s
        while time.monotonic() < deadline:
            if "ready." in self.text():
                return self
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker {self.name} exited:\n{self.text()[-3000:]}")
            time.sleep(0.2)
        raise RuntimeError(f"worker {self.name} not ready after {wait_ready_s} s:\n{self.text()[-3000:]}")

    def text(self) -> str:
        try:
            return self.log.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL the worker (its engine dies with it: the engine asks the kernel for that)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        """Warm shutdown (SIGTERM), killed if it takes too long."""
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.kill()
