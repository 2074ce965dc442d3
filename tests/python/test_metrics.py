"""fabric_lib.metrics without a server: the collector's families through prometheus_client's own
exposition (generate_latest, read back with its parser), several engines merged, engines closed or
collected left out, and what it refuses. Engines here are stand-ins with a metrics_text(); a real
engine's text goes through the same path in test_prometheus.py."""

import gc

import pytest

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from fabric_lib import metrics  # noqa: E402


class FakeEngine:
    def __init__(self, text):
        self.text = text
        self.closed = False
        self.reads = 0

    def metrics_text(self):
        self.reads += 1
        return self.text


def _engine_text(instance, writes, seconds):
    return (
        "# HELP fabric_writes_total WRITEs posted\n# TYPE fabric_writes_total counter\n"
        f'fabric_writes_total{{nic="{instance}"}} {writes}\n'
        "# HELP fabric_in_flight WRITEs in flight\n# TYPE fabric_in_flight gauge\n"
        f'fabric_in_flight{{nic="{instance}"}} 2\n'
        "# HELP fabric_x_seconds a histogram\n# TYPE fabric_x_seconds histogram\n"
        f'fabric_x_seconds_bucket{{nic="{instance}",le="0.5"}} 1\n'
        f'fabric_x_seconds_bucket{{nic="{instance}",le="+Inf"}} 3\n'
        f'fabric_x_seconds_sum{{nic="{instance}"}} {seconds}\n'
        f'fabric_x_seconds_count{{nic="{instance}"}} 3\n')


def _exposed(registry):
    out = {}
    for family in text_string_to_metric_families(prometheus_client.generate_latest(registry).decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = (family.type, s.value)
    return out


def test_engines_families_go_out_beside_the_users_own_merged_and_read_fresh_each_scrape():
    a, b = FakeEngine(_engine_text("a", 5, 1.5)), FakeEngine(_engine_text("b", 7, 2.5))
    registry = prometheus_client.CollectorRegistry()
    mine = prometheus_client.Counter("app_requests", "the user's own", registry=registry)
    mine.inc(4)
    collector = metrics.register([a, b], registry)
    got = _exposed(registry)
    assert got[("app_requests_total", ())] == ("counter", 4)
    assert got[("fabric_writes_total", (("nic", "a"),))] == ("counter", 5)
    assert got[("fabric_writes_total", (("nic", "b"),))] == ("counter", 7)
    assert got[("fabric_in_flight", (("nic", "b"),))] == ("gauge", 2)
    assert got[("fabric_x_seconds_bucket", (("le", "0.5"), ("nic", "a")))] == ("histogram", 1)
    assert got[("fabric_x_seconds_sum", (("nic", "b"),))] == ("histogram", 2.5)
    assert got[("fabric_x_seconds_count", (("nic", "a"),))] == ("histogram", 3)
    a.text = _engine_text("a", 9, 1.5)  # each scrape reads the engines again
    assert _exposed(registry)[("fabric_writes_total", (("nic", "a"),))] == ("counter", 9)
    # A closed engine is left out; one that is gone too (held weakly).
    a.closed = True
    got = _exposed(registry)
    assert ("fabric_writes_total", (("nic", "a"),)) not in got
    assert got[("fabric_writes_total", (("nic", "b"),))] == ("counter", 7)
    reads = b.reads
    del b
    gc.collect()
    assert not any(name.startswith("fabric_") for name, _ in _exposed(registry))
    assert reads > 0
    registry.unregister(collector)
    assert set(_exposed(registry)) == {("app_requests_total", ()), ("app_requests_created", ())}


def test_registering_reads_nothing_and_mistakes_are_refused():
    e = FakeEngine(_engine_text("a", 1, 0.5))
    registry = prometheus_client.CollectorRegistry()
    metrics.register(e, registry)
    assert e.reads == 0  # describe() names nothing: registering never reads an engine
    with pytest.raises(TypeError, match="not a TransferEngine"):
        metrics.FabricCollector(object())
    with pytest.raises(ValueError, match="no engine"):
        metrics.FabricCollector([])
    other = FakeEngine("# HELP fabric_in_flight x\n# TYPE fabric_in_flight counter\nfabric_in_flight_total 1\n")
    with pytest.raises(ValueError, match="fabric_in_flight is a gauge on one engine and a counter on another"):
        list(metrics.FabricCollector([e, other]).collect())
