"""Prometheus export of an engine's metrics through prometheus_client (the `metrics` extra).

The engine writes its metrics, and those of the KV, weight-update and MoE endpoints built on it,
in the Prometheus text format (TransferEngine.metrics_text(); docs/api.md has the reference).
FabricCollector hands them to prometheus_client, so that the process's own metrics and the
engine's go out through one endpoint:

    import prometheus_client
    from fabric_lib import metrics

    metrics.register(engine)                      # into prometheus_client.REGISTRY
    prometheus_client.start_http_server(9400)     # or generate_latest() in your own server

Each process exposes its own engine (its own ranks' endpoints); nothing is pooled across
processes. Prometheus scrapes every process, which adds the `instance` label, and PromQL
aggregates the ranks: `sum(rate(fabric_writes_total[1m]))` for a job's write rate,
`sum by (instance) (...)` per process. Processes without Python can serve the same text from the
engine's own HTTP endpoint instead (EngineConfig's metrics port, `metrics_port=` in Python).
"""

from __future__ import annotations

import weakref
from typing import Any, Iterable, Iterator, Union

from prometheus_client.core import REGISTRY, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import CollectorRegistry

__all__ = ["FabricCollector", "register"]


class FabricCollector:
    """A prometheus_client collector for one engine or several of one process. Each collection
    reads every engine's metrics_text() afresh. The engines are held weakly: a collector left
    registered does not keep an engine (and its threads) alive, and an engine that was closed or
    collected is left out of later scrapes. Families that several engines expose are merged into
    one family (their series differ by the engine's own labels)."""

    def __init__(self, engine_or_engines: Union[Any, Iterable[Any]]) -> None:
        engines = list(engine_or_engines) if isinstance(engine_or_engines, (list, tuple, set)) else [engine_or_engines]
        if not engines:
            raise ValueError("FabricCollector: no engine given")
        for e in engines:
            if not callable(getattr(e, "metrics_text", None)):
                raise TypeError(f"FabricCollector: {type(e).__name__} is not a TransferEngine (no metrics_text())")
        self._engines = [weakref.ref(e) for e in engines]

    def _texts(self) -> Iterator[str]:
        for ref in self._engines:
            engine = ref()
            if engine is None or getattr(engine, "closed", False):
                continue
            yield engine.metrics_text()

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for text in self._texts():
            for family in text_string_to_metric_families(text):
                seen = families.get(family.name)
                if seen is None:
                    families[family.name] = family
                elif seen.type != family.type:
                    raise ValueError(f"fabric_lib.metrics: {family.name} is a {seen.type} on one engine "
                                     f"and a {family.type} on another")
                else:
                    seen.samples.extend(family.samples)
        yield from families.values()

    def describe(self) -> list:
        # Nothing up front: the families depend on what the engines run (KV, weights, MoE), so
        # registering never calls collect() and never reads a closed engine.
        return []


def register(engine: Union[Any, Iterable[Any]], registry: CollectorRegistry = REGISTRY) -> FabricCollector:
    """Registers a FabricCollector of `engine` (or a list of engines) in `registry`; returns it,
    for registry.unregister(collector)."""
    collector = FabricCollector(engine)
    registry.register(collector)
    return collector
