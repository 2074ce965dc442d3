"""engine.metrics_text() and the metrics endpoint from Python: the counts of what moved."""

import socket
import urllib.error
import urllib.request

import numpy as np

import fabric_lib as fl


def series(text):
    """name{labels} -> value, and the TYPE lines (each family once)."""
    out, types = {}, {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert name not in types, f"second TYPE line for {name}"
            types[name] = kind
        elif line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out, types


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_metrics_text_counts_writes_and_the_endpoint_serves_it():
    port = free_port()
    with fl.TransferEngine(metrics_port=port) as a, fl.TransferEngine() as b:
        h, _ = a.register_tensor(np.arange(8192, dtype=np.uint8))
        _, d = b.register_tensor(np.zeros(8192, np.uint8))
        r = a.add_remote(d)
        done = fl.DoneCounter()
        for i in range(3):
            a.submit_single_write(len=1000, src=h, dst=r, dst_offset=1000 * i, on_done=done)
        assert done.wait(3, 30) and done.failed == 0
        text = a.metrics_text()
        got, types = series(text)
        assert got["fabric_writes_total"] == 3
        assert got["fabric_write_bytes_total"] == 3000
        assert got['fabric_transfers_completed_total{worker="0",kind="single"}'] == 3
        assert got['fabric_transfer_duration_seconds_count{worker="0",kind="single"}'] == 3
        assert types["fabric_transfer_duration_seconds"] == "histogram"
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            assert resp.status == 200
            assert resp.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            assert series(resp.read().decode())[0] == got  # nothing moved in between
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/other", timeout=10)
            raise AssertionError("served a path other than /metrics")
        except urllib.error.HTTPError as e:
            assert e.code == 404
