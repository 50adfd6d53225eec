"""A real redis-server for the tests: started on a free loopback port in a temporary directory.

Persistence is on (append-only file, fsync on every write) so a restart keeps queued messages,
as a production broker would be configured.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """One redis-server process; ``restart()`` keeps port and data."""

    def __init__(self, directory: Path, *, port: int | None = None, password: str | None = None,
                 extra_args: tuple[str, ...] = ()):
        self.directory = directory
        self.port = port or free_port()
        self.password = password
        self.extra_args = extra_args
        self.proc: subprocess.Popen[bytes] | None = None
        directory.mkdir(parents=True, exist_ok=True)

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self) -> "RedisServer":
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not installed (scripts/test installs it with apt-get)")
        args = [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.directory),
                "--appendonly", "yes", "--appendfsync", "always", "--save", "",
                "--logfile", str(self.directory / "redis.log"), *self.extra_args]
        if self.password:
            args += ["--requirepass", self.password]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.ping():
                return self
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited: {(self.directory / 'redis.log').read_text()[-2000:]}")
            time.sleep(0.05)
        raise RuntimeError("redis-server did not answer within 20 s")

    def ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                if self.password:
                    s.sendall(f"AUTH {self.password}\r\n".encode())
                    s.recv(64)
                s.sendall(b"PING\r\n")
                return s.recv(64).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self, *, kill: bool = False) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.kill() if kill else self.proc.terminate()
            self.proc.wait(timeout=30)
        self.proc = None

    def restart(self, *, kill: bool = False, down_s: float = 0.0) -> None:
        self.stop(kill=kill)
        time.sleep(down_s)
        self.start()
