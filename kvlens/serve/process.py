"""``kvlens serve`` as a child process on a free loopback port (the benchmark, the tour, the tests)."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def served_model(url: str, api_key: str | None = None) -> str:
    """The id of the model an OpenAI-compatible server at ``url`` serves (its first ``/v1/models``
    entry). A server that cannot be reached or does not answer as one is a ValueError naming it."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(f"{url}/v1/models", headers=headers, timeout=30)
    except httpx.HTTPError as e:
        raise ValueError(f"cannot reach a server at {url}: {e}") from None
    if r.status_code != 200:
        raise ValueError(f"{url}/v1/models answered HTTP {r.status_code}: {r.text[:200]}")
    try:
        return r.json()["data"][0]["id"]
    except (ValueError, LookupError, TypeError):
        raise ValueError(
            f"{url}/v1/models did not list a model (is it an OpenAI-compatible server?)"
        ) from None


def scrape_metrics(url: str) -> dict[str, float]:
    """A server's ``/metrics`` as ``{name|label=value...: value}``."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {
        s.name + "".join(f"|{k}={v}" for k, v in sorted(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


async def watch_peaks(url: str, peaks: dict[str, float], stop, period_s: float = 0.2) -> None:
    """Until ``stop`` (an asyncio.Event) is set, poll ``/metrics`` and keep each named sample's max."""
    import asyncio

    from prometheus_client.parser import text_string_to_metric_families

    async with httpx.AsyncClient(timeout=10) as http:
        while not stop.is_set():
            try:
                text = (await http.get(f"{url}/metrics")).text
            except httpx.HTTPError:
                text = ""
            for family in text_string_to_metric_families(text):
                for s in family.samples:
                    if s.name in peaks:
                        peaks[s.name] = max(peaks[s.name], s.value)
            try:
                await asyncio.wait_for(stop.wait(), period_s)
            except asyncio.TimeoutError:
                pass


def _die_with_parent() -> None:
    """Linux: the server gets SIGTERM if the process that started it dies (no orphaned servers)."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    except OSError:
        pass


class ServerProcess:
    """Start ``kvlens serve ARGS`` on 127.0.0.1, wait for ``/health``; ``stop()`` sends SIGTERM.

    Output (start-up budget line, one log line per request) goes to a temporary file: ``output()``.
    A subclass starts another server by overriding ``name`` and ``command`` (``kvlens.bench.llama_server``).
    """

    name = "kvlens serve"

    def command(self, args: list[str], host: str, port: int) -> list[str]:
        return [sys.executable, "-m", "kvlens.cli", "serve", *args, "--host", host, "--port", str(port)]

    def __init__(self, args: list[str], start_timeout: float = 300.0, host: str = "127.0.0.1") -> None:
        self.port = free_port(host)
        self.url = f"http://{host}:{self.port}"
        fd, log = tempfile.mkstemp(prefix="kvlens-serve-", suffix=".log")
        self.log = Path(log)
        cmd = self.command(args, host, self.port)
        with open(fd, "w", encoding="utf-8") as out:
            self.proc = subprocess.Popen(
                cmd,
                stdout=out,
                stderr=subprocess.STDOUT,
                preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
            )
        try:
            self._wait_healthy(start_timeout)
        except BaseException:
            # The error carries the output; no one holds this object to close() it.
            self.proc.kill()
            self.proc.wait()
            self.log.unlink(missing_ok=True)
            raise

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} was not healthy after {timeout:.0f} s:\n{self.output()}")
            time.sleep(0.25)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def metrics(self) -> dict[str, float]:
        return scrape_metrics(self.url)

    def budget_line(self) -> str:
        """The start-up line saying what the KV budget holds."""
        return next((ln for ln in self.output().splitlines() if ln.startswith("KV pool")), "")

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM, wait, return the exit code (the process is killed if it does not stop in time)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def close(self) -> None:
        self.stop()
        self.log.unlink(missing_ok=True)

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
