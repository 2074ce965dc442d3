"""Shared fixtures: run a role in a second process (spawned, so no engine thread is forked)."""

import multiprocessing as mp
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

# ctest's environment for the engines these tests start, and the processes they spawn inherit it
# (FABRIC_TEST_ENV in tests/CMakeLists.txt: ofi_rxm's default bounce-buffer pools, about 70 MB per
# tcp NIC, become 18 MB). Read by libfabric when the first engine opens.
os.environ.setdefault("FI_OFI_RXM_MSG_RX_SIZE", "64")


@pytest.fixture
def peer():
    """peer(fn, *args) starts fn(conn, *args) in a spawned process; returns (conn, process).
    Every process started is joined (or killed) at the end of the test."""
    ctx = mp.get_context("spawn")
    started = []

    def start(fn, *args):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=fn, args=(child, *args), daemon=True)
        p.start()
        started.append(p)
        return parent, p

    yield start
    for p in started:
        p.join(timeout=60)
        if p.is_alive():
            p.kill()
            pytest.fail("a peer process did not finish")


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _find_etcd():
    """The etcd binary (Debian package etcd-server), installed once if missing and we are root."""
    from debian_binary import debian_binary

    return debian_binary("etcd", "etcd-server")


@pytest.fixture(scope="module")
def etcd_endpoint(tmp_path_factory):
    """A private etcd on loopback (free ports, its own data dir); yields its client URL,
    e.g. "http://127.0.0.1:40123". Skips when no etcd binary can be had."""
    import platform
    import subprocess
    import time
    import urllib.request

    etcd = _find_etcd()
    if etcd is None:
        pytest.skip("no etcd binary (Debian package etcd-server; `make test-python` installs it)")
    env = dict(os.environ)
    if platform.machine() in ("aarch64", "arm64"):
        env["ETCD_UNSUPPORTED_ARCH"] = "arm64"  # etcd 3.4 refuses to start on arm64 without it
    for attempt in range(3):  # a free port can be taken by someone else before etcd binds it
        client, peer_port = _free_port(), _free_port()
        data = tmp_path_factory.mktemp("etcd")
        url, peer_url = f"http://127.0.0.1:{client}", f"http://127.0.0.1:{peer_port}"
        log = open(data / "etcd.log", "wb")
        proc = subprocess.Popen(
            [etcd, "--name", "fabric-test", "--data-dir", str(data / "data"),
             "--listen-client-urls", url, "--advertise-client-urls", url,
             "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
             "--initial-cluster", f"fabric-test={peer_url}", "--initial-cluster-state", "new"],
            stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 20
        healthy = False
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(url + "/health", timeout=1) as r:
                    if b'"true"' in r.read():
                        healthy = True
                        break
            except OSError:
                pass
            time.sleep(0.1)
        if healthy:
            break
        proc.kill()
        proc.wait()
        log.close()
        tail = (data / "etcd.log").read_text(errors="replace")[-2000:]
        if attempt == 2:
            pytest.fail(f"etcd did not become healthy on {url} within 20 s; log tail:\n{tail}")
    try:
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@pytest.fixture
def prometheus():
    """prometheus(targets) starts a private Prometheus on loopback (a free port, its own storage
    dir, every target scraped each second; targets: job name -> ["127.0.0.1:PORT", ...]) and
    returns it (prometheus_server.Prometheus: query, value, wait_scraped_after). Stopped and its
    dir removed at the end of the test. Fails (never skips) when no prometheus binary can be had:
    the test it serves is part of `make test`, which installs it."""
    from prometheus_server import Prometheus, find_prometheus

    started = []

    def start(targets):
        binary = find_prometheus()
        if binary is None:
            pytest.fail("no prometheus binary (Debian package prometheus; `make test-python` installs it)")
        for attempt in range(3):  # a free port can be taken by someone else before prometheus binds it
            try:
                server = Prometheus(binary, _free_port(), targets)
                break
            except RuntimeError:
                if attempt == 2:
                    raise
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()
