"""A real ``redis-server`` for the tests (the Debian package; ``make test`` installs it)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

from kvgate.dev.stack import free_port


class RedisServer:
    def __init__(self, workdir: Path) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.skip("redis-server is not installed (apt-get install redis-server; make test installs it)")
        self.binary = binary
        self.workdir = workdir
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, aof: bool = False) -> RedisServer:
        """Start it (again, on the same port). Empty, nothing saved; with ``aof``, as the chart runs the
        spend ledger's store: an append-only file fsynced every second, replayed at the next start."""
        log = open(self.workdir / "redis.log", "ab")  # noqa: SIM115 (lives as long as the process)
        durability = ["--appendonly", "yes", "--appendfsync", "everysec"] if aof else ["--appendonly", "no"]
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", *durability,
             "--dir", str(self.workdir)], stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return self
            except OSError:
                time.sleep(0.05)
        raise TimeoutError("redis-server did not start")

    def stop(self, kill: bool = False) -> None:
        if self.proc is not None and self.proc.poll() is None:
            (self.proc.kill if kill else self.proc.terminate)()
            self.proc.wait(10)
        self.proc = None
