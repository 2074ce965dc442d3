"""fabric-top: the exposition parser, rates from counter differences over the clock between two
scrapes (exact, with a fake clock), counter resets, unreachable endpoints, and a real engine's
endpoint."""

import http.server
import re
import socket
import threading
import time

import pytest

from fabric_lib import top


class FakeClock:
    """Time moves only when the code under test sleeps: rates come out exact on any machine."""

    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t

    def sleep(self, s):
        self.t += s


class CannedServer:
    """Serves bodies[0] to the first GET, bodies[1] to the second, ... the last one from then on."""

    def __init__(self, bodies):
        self.bodies = list(bodies)
        self.requests = 0
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                body = outer.bodies[min(outer.requests, len(outer.bodies) - 1)].encode()
                outer.requests += 1
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/metrics"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def canned():
    servers = []

    def make(*bodies):
        s = CannedServer(bodies)
        servers.append(s)
        return s

    yield make
    for s in servers:
        s.close()


def exposition(writes, nbytes, peer_writes, peer_bytes, in_flight=3, failed=0):
    """The engine's names and labels (docs/api.md, "Metrics reference"), two NICs and a peer."""
    return f"""# HELP fabric_nic_writes_total WRITEs completed successfully on this NIC
# TYPE fabric_nic_writes_total counter
fabric_nic_writes_total{{worker="0",rail="0",nic="eth0"}} {writes}
fabric_nic_writes_total{{worker="0",rail="1",nic="eth1"}} 7
# TYPE fabric_nic_write_bytes_total counter
fabric_nic_write_bytes_total{{worker="0",rail="0",nic="eth0"}} {nbytes}
fabric_nic_write_bytes_total{{worker="0",rail="1",nic="eth1"}} 700
# TYPE fabric_nic_in_flight gauge
fabric_nic_in_flight{{worker="0",rail="0",nic="eth0"}} {in_flight}
# TYPE fabric_writes_total counter
fabric_writes_total {writes + 7}
# TYPE fabric_peer_writes_total counter
fabric_peer_writes_total{{worker="0",peer="10.0.0.2:5000"}} {peer_writes}
# TYPE fabric_peer_write_bytes_total counter
fabric_peer_write_bytes_total{{worker="0",peer="10.0.0.2:5000"}} {peer_bytes}
# TYPE fabric_peer_errors_total counter
fabric_peer_errors_total{{worker="0",peer="10.0.0.2:5000"}} {failed + 1}
# TYPE fabric_transfers_completed_total counter
fabric_transfers_completed_total{{worker="0",kind="single"}} {peer_writes}
fabric_transfers_completed_total{{worker="0",kind="paged"}} {peer_writes}
# TYPE fabric_transfer_failures_total counter
fabric_transfer_failures_total{{worker="0",kind="single",code="timeout"}} {failed}
fabric_transfer_failures_total{{worker="0",kind="single",code="peer_lost"}} 1
"""


def row(text, *words):
    """The one line of a frame holding every word."""
    lines = [l for l in text.splitlines() if all(w in l.split() for w in words)]
    assert len(lines) == 1, (words, text)
    return lines[0].split()


# --- the parser ------------------------------------------------------------------------------


def test_parser_reads_labels_escapes_and_special_values():
    exp = top.parse_exposition(
        '# HELP x_total a "help" line\n'
        "# TYPE x_total counter\n"
        'x_total{b="2",a="q\\"uote\\\\slash\\nline",} 12 1700000000000\n'
        "y NaN\n"
        'z{le="+Inf"} +Inf\n'
        "w -3.5e-1\n")
    assert exp.types == {"x_total": "counter"}
    assert exp.samples[("x_total", (("a", 'q"uote\\slash\nline'), ("b", "2")))] == 12
    assert exp.samples[("z", (("le", "+Inf"),))] == float("inf")
    assert exp.samples[("w", ())] == -0.35
    assert str(exp.samples[("y", ())]) == "nan"


def test_parser_agrees_with_prometheus_client():
    # The reference parser (the metrics extra; fabric-top itself must not need it).
    parser = pytest.importorskip("prometheus_client.parser")
    text = exposition(600, 1_010_000, 240, 504_000, failed=2) + (
        "# TYPE fabric_post_seconds histogram\n"
        'fabric_post_seconds_bucket{kind="single",le="1e-06"} 3\n'
        'fabric_post_seconds_bucket{kind="single",le="+Inf"} 5\n'
        'fabric_post_seconds_sum{kind="single"} 1.5e-05\n'
        'fabric_post_seconds_count{kind="single"} 5\n'
        'fabric_engine_info{provider="tcp;ofi_rxm",note="a \\"q\\" \\\\ \\n"} 1\n')
    theirs = {(s.name, tuple(sorted(s.labels.items()))): s.value
              for f in parser.text_string_to_metric_families(text) for s in f.samples}
    assert top.parse_exposition(text).samples == theirs


@pytest.mark.parametrize("bad", ['x{a="1" 2', "x", 'x{a=1} 2', "x one", 'x{a="\\q"} 1', "1x 2"])
def test_parser_refuses_what_is_not_the_format(bad):
    with pytest.raises(top.ExpositionError, match="line 1"):
        top.parse_exposition(bad + "\n")


# --- rates -----------------------------------------------------------------------------------


def test_rates_are_counter_differences_over_the_clock(canned):
    s = canned(exposition(100, 10_000, 40, 4_000, failed=0),
               exposition(600, 1_010_000, 240, 504_000, in_flight=5, failed=2),
               exposition(700, 1_210_000, 240, 504_000, in_flight=0, failed=2))
    clock = FakeClock()
    t = top.Top([s.url], interval=2.0, clock=clock, sleep=clock.sleep)
    try:
        t.start()
        f1 = t.step()
        frame1, ok1 = f1.text, f1.ok
        f2 = t.step()
        frame2, ok2 = f2.text, f2.ok
    finally:
        t.close()
    assert ok1 and ok2 and s.requests == 3
    # 500 WRITEs and 1,000,000 bytes in 2 s of the clock (endpoint, worker, rail, nic, then the columns).
    assert row(frame1, "eth0")[4:] == ["250", "500.00", "kB/s", "5", "-", "-"]
    # eth1 did nothing: 0/s, not its totals.
    assert row(frame1, "eth1")[1:] == ["0", "1", "eth1", "0", "0", "B/s", "-", "-", "-"]
    # Per peer: 200 WRITEs, 500,000 bytes; errors 3, +2 since the last scrape.
    assert row(frame1, "10.0.0.2:5000")[1:] == ["0", "10.0.0.2:5000", "100", "250.00", "kB/s", "-", "3", "(+2)"]
    # Per worker: transfers summed over kinds (400 in 2 s), failures over kinds and codes.
    lines = frame1.splitlines()
    header = next(i for i, l in enumerate(lines) if l.split()[1:3] == ["WORKER", "xfer/s"])
    assert lines[header + 1].split()[1:] == ["0", "200", "-", "3", "(+2)", "-", "-", "-"]
    assert row(frame2, "eth0")[4:] == ["50", "100.00", "kB/s", "0", "-", "-"]
    assert row(frame2, "10.0.0.2:5000")[3:] == ["0", "0", "B/s", "-", "3"]


def test_rates_use_the_time_between_scrapes_not_the_interval_asked(canned):
    # A scrape that comes late (a slow endpoint, a busy machine) divides by the time that passed.
    s = canned(exposition(0, 0, 0, 0), exposition(300, 3_000, 0, 0))
    clock = FakeClock()

    def late_sleep(secs):
        clock.sleep(secs + 2.0)

    t = top.Top([s.url], interval=1.0, clock=clock, sleep=late_sleep)
    try:
        t.start()
        frame = t.step().text
    finally:
        t.close()
    assert row(frame, "eth0")[4:7] == ["100", "1.00", "kB/s"]


def test_a_counter_that_goes_down_resets_the_rate(canned):
    # The process restarted between scrapes: its counters start again from 0.
    s = canned(exposition(5_000, 5_000_000, 100, 100_000, failed=4),
               exposition(20, 20_000, 10, 10_000, failed=0),
               exposition(120, 220_000, 10, 10_000, failed=0))
    clock = FakeClock()
    t = top.Top([s.url], clock=clock, sleep=clock.sleep)
    try:
        t.start()
        after_restart = t.step().text
        next_frame = t.step().text
    finally:
        t.close()
    assert row(after_restart, "eth0")[4:7] == ["reset", "reset", "3"]
    assert row(after_restart, "10.0.0.2:5000")[3:] == ["reset", "reset", "-", "1", "(reset)"]
    assert not re.search(r"(^|\s)-\d", after_restart)  # no negative number anywhere
    # The next interval counts from the restarted values again.
    assert row(next_frame, "eth0")[4:7] == ["100", "200.00", "kB/s"]


def test_a_series_born_between_scrapes_counts_from_zero(canned):
    # The engine creates a peer's series at its first WRITE: absent from the previous scrape of the
    # same process, it started at 0 since.
    first = "\n".join(l for l in exposition(0, 0, 0, 0).splitlines() if "peer" not in l) + "\n"
    s = canned(first, exposition(40, 4_000, 30, 3_000, failed=1))
    clock = FakeClock()
    t = top.Top([s.url], clock=clock, sleep=clock.sleep)
    try:
        t.start()
        f = t.step()
    finally:
        t.close()
    (peer,) = f.tables["PEER"]
    assert [c.value for c in peer.cells] == [30, 3_000, None, 2] and peer.cells[3].delta == 2


def test_several_endpoints_one_row_each(canned):
    a = canned(exposition(0, 0, 0, 0), exposition(10, 1_000, 0, 0))
    b = canned(exposition(0, 0, 0, 0), exposition(30, 3_000, 0, 0))
    clock = FakeClock()
    t = top.Top([a.url, b.url], clock=clock, sleep=clock.sleep)
    try:
        t.start()
        f = t.step()
        frame, ok = f.text, f.ok
    finally:
        t.close()
    assert ok
    port_a, port_b = a.url.split("/")[2], b.url.split("/")[2]
    assert row(frame, port_a, "eth0")[4:7] == ["10", "1.00", "kB/s"]
    assert row(frame, port_b, "eth0")[4:7] == ["30", "3.00", "kB/s"]


# --- endpoints that do not answer -------------------------------------------------------------


def closed_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_unreachable_endpoint_is_an_error(capsys):
    port = closed_port()
    assert top.main(["--once", "--timeout", "1", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"127.0.0.1:{port}/metrics" in err and "metrics port" in err


def test_an_endpoint_that_never_answers_ends_within_the_timeout(capsys):
    # Accepts connections (the kernel's backlog) but never reads or answers.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        port = silent.getsockname()[1]
        t0 = time.monotonic()
        assert top.main(["--iterations", "3", "--timeout", "0.5", f"127.0.0.1:{port}"]) == 2
        # Bounded, not hung (generous for a loaded machine).
        assert time.monotonic() - t0 < 30
    assert "timed out" in capsys.readouterr().err


def test_an_endpoint_lost_later_is_shown_down_and_fails_the_run(canned, capsys):
    s = canned(exposition(0, 0, 0, 0))
    url = s.url
    clock = FakeClock()
    t = top.Top([url], clock=clock, sleep=clock.sleep, timeout=1.0)
    try:
        t.start()
        s.close()
        f = t.step()
        frame, ok = f.text, f.ok
    finally:
        t.close()
    assert not ok
    assert "DOWN:" in frame and url.split("/")[2] in frame


def test_main_prints_frames_and_exits_zero(canned, capsys):
    s = canned(exposition(0, 0, 0, 0), exposition(5, 50, 0, 0), exposition(9, 90, 0, 0))
    assert top.main(["--iterations", "2", "--interval", "0.05", s.url]) == 0
    out = capsys.readouterr().out
    assert out.count("fabric-top: 1 endpoint, every 0.05 s") == 2
    assert s.requests == 3

