"""The metrics as an operator reads them: a real Prometheus server (Debian's, conftest's prometheus
fixture) scrapes two processes over loopback, one serving its engine's metrics through
fabric_lib.metrics and prometheus_client's HTTP server, the other from the engine's own endpoint
(metrics_port). Each runs its side of KV requests, weight updates and MoE steps
(prometheus_roles.py); PromQL through Prometheus' HTTP API then returns exactly the counts moved,
and every fabric_ series of each process's own metrics_text() with the value Prometheus holds."""

import math
import time

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

import prometheus_roles as R  # noqa: E402
from conftest import _free_port  # noqa: E402

PY_JOB, ENGINE_JOB = "fabric-python", "fabric-engine"


def _recv(conn, what, timeout=120):
    assert conn.poll(timeout), f"no {what} within {timeout} s"
    msg = conn.recv()
    assert not (isinstance(msg, str) and msg.startswith("error")), msg
    return msg


def _samples(text):
    """Every sample of a metrics text: (name, sorted labels) -> value."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _promql(name, labels):
    def quoted(v):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'

    inner = ",".join(f"{k}={quoted(v)}" for k, v in labels)
    return f"{name}{{{inner}}}"


def test_prometheus_scrapes_exact_counts_from_both_endpoints(peer, prometheus):
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ports = [_free_port(), _free_port()]
    # Started first: its start and first scrapes (~5 s) overlap the processes' start.
    prom = prometheus({PY_JOB: [f"127.0.0.1:{ports[0]}"], ENGINE_JOB: [f"127.0.0.1:{ports[1]}"]})
    sides = [peer(R.rank_main, dict(side=s, store_port=store.port, metrics_port=ports[s])) for s in (0, 1)]
    for conn, _ in sides:
        assert _recv(conn, "ready") == "ready"
    moved = [_recv(conn, "result") for conn, _ in sides]
    done_at = time.time()  # nothing moves after this: both sides only serve their metrics now
    texts = []
    for conn, _ in sides:
        conn.send("text")
        texts.append(_recv(conn, "metrics text"))
    try:
        prom.wait_scraped_after(done_at, timeout_s=60)

        def value(q):
            v = prom.value(q)
            assert v is not None, f"{q}: no series; up: {prom.query('up')}"
            return v

        # KV: 3 requests, 4 layers each, decode side on the prometheus_client path, prefill on the
        # engine's endpoint.
        kv_bytes = moved[0]["kv_bytes"]
        assert value(f'fabric_kv_requests_admitted_total{{job="{PY_JOB}",side="decode"}}') == R.REQUESTS
        assert value(f'fabric_kv_requests_begun_total{{job="{ENGINE_JOB}",side="prefill"}}') == R.REQUESTS
        assert value('sum(fabric_kv_requests_completed_total)') == 2 * R.REQUESTS
        assert value('sum(fabric_kv_requests_failed_total)') == 0
        assert value('fabric_kv_layers_total{side="prefill"}') == R.REQUESTS * R.LAYERS
        assert value('fabric_kv_layers_total{side="decode"}') == R.REQUESTS * R.LAYERS
        assert value('fabric_kv_bytes_total{side="prefill"}') == kv_bytes
        assert value('fabric_kv_bytes_total{side="decode"}') == kv_bytes
        assert value('fabric_kv_exposed_seconds_count') == R.REQUESTS
        assert value('histogram_quantile(1, fabric_kv_exposed_seconds_bucket)') > 0

        # Weights: 2 updates of one training rank into one inference rank (no gathers: the bytes
        # it wrote are the bytes that landed).
        w_bytes = moved[1]["weights_bytes"]
        assert w_bytes > 0
        assert value(f'fabric_weights_updates_total{{job="{ENGINE_JOB}",side="train"}}') == R.UPDATES
        assert value(f'fabric_weights_updates_total{{job="{PY_JOB}",side="inference"}}') == R.UPDATES
        assert value('fabric_weights_bytes_total{side="train"}') == w_bytes
        assert value('fabric_weights_bytes_total{side="inference"}') == w_bytes
        assert value('sum(fabric_weights_failed_steps_total)') == 0
        assert value('fabric_weights_update_seconds_count') == R.UPDATES
        assert value('fabric_weights_last_update_bytes') == w_bytes / R.UPDATES

        # MoE: 3 steps on each of the 2 ranks, summed over the ranks in PromQL.
        assert value('sum(fabric_moe_dispatches_total{job=~"fabric-.*"})') == 2 * R.MOE_STEPS
        assert value('sum(fabric_moe_combines_total)') == 2 * R.MOE_STEPS
        assert value('sum by (job) (fabric_moe_dispatches_total{rank="0"})') == R.MOE_STEPS
        assert value('sum(fabric_moe_proxy_steps_total{half="dispatch"})') == 2 * R.MOE_STEPS
        assert value('sum(fabric_moe_proxy_steps_total{half="combine"})') == 2 * R.MOE_STEPS
        assert value('sum(fabric_moe_dispatch_seconds_count)') == 2 * R.MOE_STEPS
        assert value('sum(fabric_moe_timeouts_total) + sum(fabric_moe_masked_ranks)') == 0

        # Every other counter each engine has (its WRITEs, bytes, transfers, ...), as the process
        # read it after its last action: Prometheus holds the same values, through both paths.
        checked = 0
        for text, job in zip(texts, (PY_JOB, ENGINE_JOB)):
            for (name, labels), v in _samples(text).items():
                if not name.startswith("fabric_") or not name.endswith("_total") or "_seconds" in name:
                    continue  # counts only: times keep growing in the engine (idle polling)
                got = prom.query(_promql(name, (("job", job),) + labels))
                assert len(got) == 1, f"{job}: {name}{dict(labels)}: {got}"
                assert math.isclose(float(got[0]["value"][1]), v, rel_tol=0, abs_tol=0), (job, name, labels, got, v)
                checked += 1
        assert checked > 20, checked
    finally:
        for conn, _ in sides:
            conn.send("stop")
        for conn, _ in sides:
            assert _recv(conn, "bye", 60) == "bye"
        del store
