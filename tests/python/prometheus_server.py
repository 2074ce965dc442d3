"""A private Prometheus server for the tests (Debian's `prometheus`, which `make test-python`
installs): started on loopback with its own storage directory and a scrape config of 1 s for the
test's endpoints, queried through its HTTP API, stopped and removed after. conftest.py's
`prometheus` fixture hands it out."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
from typing import Optional

from debian_binary import debian_binary


def find_prometheus() -> Optional[str]:
    """The prometheus binary, installed once (as conftest's etcd is) if missing and we are root."""
    return debian_binary("prometheus", "prometheus")


def _config(targets: dict[str, list[str]]) -> str:
    """Scrape config: one job per entry, every target scraped each second. JSON is YAML."""
    return json.dumps({
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [{"job_name": job, "static_configs": [{"targets": list(addrs)}]}
                           for job, addrs in targets.items()],
    }, indent=1)


class Prometheus:
    """One server; `targets`: job name -> ["127.0.0.1:PORT", ...]. Their endpoints may start
    later: Prometheus records them down (up == 0) until they answer."""

    def __init__(self, binary: str, port: int, targets: dict[str, list[str]], ready_s: float = 60.0):
        self.url = f"http://127.0.0.1:{port}"
        self.targets = targets
        self.dir = tempfile.mkdtemp(prefix="fabric-prometheus-")
        with open(os.path.join(self.dir, "prometheus.yml"), "w") as f:
            f.write(_config(targets))
        self._log = open(os.path.join(self.dir, "prometheus.log"), "wb")
        self.proc = subprocess.Popen(
            [binary, f"--config.file={self.dir}/prometheus.yml", f"--storage.tsdb.path={self.dir}/data",
             f"--web.listen-address=127.0.0.1:{port}", "--storage.tsdb.retention.time=1h"],
            stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + ready_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                with urllib.request.urlopen(self.url + "/-/ready", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.1)
        tail = self.log_tail()
        self.stop()
        raise RuntimeError(f"prometheus did not become ready on {self.url} within {ready_s} s; log tail:\n{tail}")

    def log_tail(self, n: int = 3000) -> str:
        self._log.flush()
        try:
            with open(os.path.join(self.dir, "prometheus.log"), errors="replace") as f:
                return f.read()[-n:]
        except OSError:
            return ""

    def stop(self) -> None:
        """Stops the server and removes its directory (config, storage, log)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def query(self, promql: str) -> list[dict]:
        """An instant query (/api/v1/query): the result vector, [{"metric": {...}, "value": [ts, "v"]}]."""
        url = self.url + "/api/v1/query?" + urllib.parse.urlencode({"query": promql})
        with urllib.request.urlopen(url, timeout=10) as r:
            body = json.load(r)
        if body.get("status") != "success":
            raise RuntimeError(f"query {promql!r}: {body}")
        if body["data"]["resultType"] != "vector":
            raise RuntimeError(f"query {promql!r}: a {body['data']['resultType']}, not a vector")
        return body["data"]["result"]

    def value(self, promql: str) -> Optional[float]:
        """The single value an instant query returns (None when it returns nothing)."""
        result = self.query(promql)
        if not result:
            return None
        if len(result) != 1:
            raise RuntimeError(f"query {promql!r}: {len(result)} series, expected one: {result}")
        return float(result[0]["value"][1])

    def wait_scraped_after(self, t: float, timeout_s: float = 60.0) -> None:
        """Returns once every target has been scraped successfully by a scrape that began after
        wall-clock time `t` (time.time()), so the next queries see everything done before `t`.
        Raises TimeoutError naming the targets still behind after timeout_s."""
        want = {(job, a) for job, addrs in self.targets.items() for a in addrs}
        deadline = time.monotonic() + timeout_s
        behind = want
        while time.monotonic() < deadline:
            # timestamp(up): when each target's latest scrape began (of the selector itself: on an
            # expression it would be the evaluation time); up == 1: that scrape was answered.
            fresh = {(s["metric"]["job"], s["metric"]["instance"])
                     for s in self.query("timestamp(up) and on(job, instance) up == 1")
                     if float(s["value"][1]) > t}
            behind = want - fresh
            if not behind:
                return
            time.sleep(0.2)
        raise TimeoutError(f"prometheus: no successful scrape after {t:.3f} within {timeout_s} s from "
                           f"{sorted(behind)}; up: {self.query('up')}; log tail:\n{self.log_tail()}")
