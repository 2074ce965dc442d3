"""fabric-top: a live view of one or more engines' metrics endpoints (one per rank), refreshed every
second: per worker transfers/s, in flight, failures; per NIC and per peer WRITEs/s, bytes/s, in
flight, errors (docs/operations.md).

    fabric-top http://127.0.0.1:9400/metrics 127.0.0.1:9401 9402
    fabric-top --once 9400          # one frame (two scrapes an interval apart), for scripts

Rates are counter differences between two scrapes over the wall-clock time between them, never
bytes over summed transfer times. A counter that went down (the process restarted) shows "reset"
for that interval instead of a negative rate. Standard library only: the text format (0.0.4) is
parsed here, so the tool runs wherever the package does.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import math
import re
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

Labels = Tuple[Tuple[str, str], ...]  # sorted (name, value) pairs
SeriesKey = Tuple[str, Labels]


class ExpositionError(ValueError):
    """Text that is not Prometheus text exposition 0.0.4."""


@dataclass
class Exposition:
    samples: Dict[SeriesKey, float] = field(default_factory=dict)
    types: Dict[str, str] = field(default_factory=dict)  # family name -> counter, gauge, ...


_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
_ESCAPES = {"\\": "\\", '"': '"', "n": "\n"}


def _value(text: str, lineno: int) -> float:
    try:
        return float(text)  # accepts NaN, +Inf, -Inf as the format writes them
    except ValueError:
        raise ExpositionError(f"line {lineno}: {text!r} is not a number") from None


def _labels(line: str, i: int, lineno: int) -> Tuple[Labels, int]:
    """Parses `{name="value",...}` from line[i] == '{'; returns the labels and the index after '}'."""
    labels = []
    i += 1
    while True:
        while i < len(line) and line[i] in " \t":
            i += 1
        if i < len(line) and line[i] == "}":
            return tuple(sorted(labels)), i + 1
        m = _LABEL.match(line, i)
        if not m:
            raise ExpositionError(f"line {lineno}: a label name expected at column {i + 1}")
        name, i = m.group(0), m.end()
        if line[i : i + 2] != '="':
            raise ExpositionError(f'line {lineno}: {name}= and a quoted value expected')
        i += 2
        value = []
        while True:
            if i >= len(line):
                raise ExpositionError(f"line {lineno}: the value of label {name} is not closed")
            c = line[i]
            if c == '"':
                i += 1
                break
            if c == "\\":
                if i + 1 >= len(line) or line[i + 1] not in _ESCAPES:
                    raise ExpositionError(f"line {lineno}: bad escape in the value of label {name}")
                value.append(_ESCAPES[line[i + 1]])
                i += 2
            else:
                value.append(c)
                i += 1
        labels.append((name, "".join(value)))
        while i < len(line) and line[i] in " \t":
            i += 1
        if i < len(line) and line[i] == ",":
            i += 1
        elif i >= len(line) or line[i] != "}":
            raise ExpositionError(f"line {lineno}: ',' or '}}' expected after label {name}")


def parse_exposition(text: str) -> Exposition:
    """Every sample of a Prometheus text exposition (0.0.4), keyed by name and sorted labels."""
    out = Exposition()
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line:
            continue
        if line.startswith("#"):
            parts = line.split(None, 3)
            if len(parts) >= 4 and parts[1] == "TYPE":
                out.types[parts[2]] = parts[3].strip()
            continue
        m = _NAME.match(line)
        if not m:
            raise ExpositionError(f"line {lineno}: a metric name expected: {raw!r}")
        name, i = m.group(0), m.end()
        labels: Labels = ()
        if i < len(line) and line[i] == "{":
            labels, i = _labels(line, i, lineno)
        rest = line[i:].split()
        if not rest or len(rest) > 2:
            raise ExpositionError(f"line {lineno}: a value (and at most a timestamp) expected: {raw!r}")
        out.samples[(name, labels)] = _value(rest[0], lineno)
    return out


class ScrapeError(Exception):
    """An endpoint that did not answer with an exposition: unreachable, an HTTP error, bad text."""


def normalize_endpoint(arg: str) -> str:
    """`http://h:p/path` as given; `h:p` and a bare port (on 127.0.0.1) get http:// and /metrics."""
    if "://" in arg:
        return arg
    if arg.isdigit():
        arg = f"127.0.0.1:{arg}"
    return f"http://{arg}/metrics"


def fetch(url: str, timeout: float) -> str:
    """The body of GET url within `timeout` seconds in all (connecting and reading), or ScrapeError."""
    deadline = time.monotonic() + timeout
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            chunks = []
            while True:
                if time.monotonic() > deadline:
                    raise ScrapeError(f"{url}: no complete answer within {timeout:g} s")
                chunk = resp.read(65536)
                if not chunk:
                    break
                chunks.append(chunk)
            return b"".join(chunks).decode("utf-8")
    except urllib.error.HTTPError as e:
        raise ScrapeError(f"{url}: HTTP {e.code} {e.reason}") from None
    except urllib.error.URLError as e:
        raise ScrapeError(f"{url}: {e.reason}") from None
    except (OSError, UnicodeDecodeError) as e:  # timeouts, resets mid-answer, bad bytes
        raise ScrapeError(f"{url}: {e}") from None


# --- what the view shows ---------------------------------------------------------------------


@dataclass(frozen=True)
class Column:
    title: str
    metric: str  # the metric summed into this column (over every label but the row's)
    kind: str  # "rate": per second between scrapes; "gauge": the value now; "count": total and change


@dataclass(frozen=True)
class Table:
    title: str
    keys: Tuple[str, ...]  # the labels a row is keyed by, shown as columns; the last one required
    columns: Tuple[Column, ...]


# The engine's metrics (docs/api.md, "Metrics reference"). A row sums its series over the labels
# that are not its keys (kind, code, scope).
TABLES = (
    Table("WORKER", ("worker",), (
        Column("xfer/s", "fabric_transfers_completed_total", "rate"),
        Column("in flight", "fabric_transfers_in_flight", "gauge"),
        Column("failures", "fabric_transfer_failures_total", "count"),
        Column("peers", "fabric_peers", "gauge"),
        Column("peers lost", "fabric_peers_lost_total", "count"),
        Column("stalled", "fabric_worker_stalled", "gauge"),
    )),
    Table("NIC", ("worker", "rail", "nic"), (
        Column("WRITE/s", "fabric_nic_writes_total", "rate"),
        Column("bytes/s", "fabric_nic_write_bytes_total", "rate"),
        Column("in flight", "fabric_nic_in_flight", "gauge"),
        Column("retries", "fabric_nic_retries_total", "count"),
        Column("errors", "fabric_nic_errors_total", "count"),
    )),
    Table("PEER", ("worker", "peer"), (
        Column("WRITE/s", "fabric_peer_writes_total", "rate"),
        Column("bytes/s", "fabric_peer_write_bytes_total", "rate"),
        Column("in flight", "fabric_peer_in_flight", "gauge"),
        Column("errors", "fabric_peer_errors_total", "count"),
    )),
)


@dataclass
class Scrape:
    at: float  # the clock when the scrape went out
    exposition: Optional[Exposition] = None
    error: Optional[str] = None


@dataclass
class Cell:
    """One column of one row: `value` (a rate, a gauge, a count), None when not known yet or not
    exposed; `reset` when a counter went down since the last scrape; `delta` for counts."""

    value: Optional[float] = None
    reset: bool = False
    delta: Optional[float] = None


@dataclass
class Row:
    endpoint: str
    key: Tuple[str, ...]  # the values of the table's keys ("" where a series lacks one)
    cells: List[Cell]


def _row_key(labels: Labels, keys: Tuple[str, ...]) -> Optional[Tuple[str, ...]]:
    d = dict(labels)
    if keys[-1] not in d:
        return None  # an engine-wide or other series: not a row of this table
    return tuple(d.get(k, "") for k in keys)


def _by_row(exp: Exposition, table: Table, column: Column) -> Dict[Tuple[str, ...], Dict[SeriesKey, float]]:
    """The column's series of each row, by row key."""
    out: Dict[Tuple[str, ...], Dict[SeriesKey, float]] = {}
    for key, v in exp.samples.items():
        if key[0] != column.metric:
            continue
        row = _row_key(key[1], table.keys)
        if row is not None:
            out.setdefault(row, {})[key] = v
    return out


def _cell(column: Column, series: Dict[SeriesKey, float], before: Optional[Dict[SeriesKey, float]],
          dt: float) -> Cell:
    """`before`: the row's series at the endpoint's previous scrape, None when there was none."""
    cell = Cell()
    if not series:
        return cell
    total = sum(series.values())
    if column.kind == "gauge":
        cell.value = total
        return cell
    if before is None:  # the endpoint's first answer: totals only, no change known yet
        if column.kind == "count":
            cell.value = total
        return cell
    # A series the previous scrape of the same process lacked was born since, from 0 (the engine
    # creates a peer's or a transfer kind's series at its first use).
    known = [(v, before.get(k, 0.0)) for k, v in series.items()]
    if any(v < b for v, b in known):
        cell.reset = True  # the process restarted: no rate for this interval, never a negative one
        if column.kind == "count":
            cell.value = total
    elif column.kind == "count":
        cell.value = total
        cell.delta = sum(v - b for v, b in known)
    elif dt > 0:
        cell.value = sum(v - b for v, b in known) / dt
    return cell


def table_rows(endpoint: str, prev: Optional[Scrape], cur: Scrape, table: Table) -> List[Row]:
    """The rows of `table` for one endpoint's scrape `cur`, rates against `prev` (its scrape one
    interval before; None for the first)."""
    assert cur.exposition is not None
    old = prev.exposition if prev is not None else None
    dt = cur.at - prev.at if prev is not None else 0.0
    cols = [_by_row(cur.exposition, table, c) for c in table.columns]
    old_cols = [_by_row(old, table, c) if old else {} for c in table.columns]
    keys = sorted({r for col in cols for r in col}, key=_natural)
    return [Row(endpoint, key, [_cell(c, col.get(key, {}), old_col.get(key, {}) if old else None, dt)
                                for c, col, old_col in zip(table.columns, cols, old_cols)])
            for key in keys]


def _natural(key: Tuple[str, ...]):
    """Worker 2 before worker 10."""
    return tuple((0, int(v), "") if v.isdigit() else (1, 0, v) for v in key)


# --- text ------------------------------------------------------------------------------------


def si(v: float, unit: str = "") -> str:
    """1e3 steps (GB/s is 1e9 bytes a second, as everywhere in fabric-lib)."""
    if math.isnan(v) or math.isinf(v):
        return f"{v} {unit}".strip()
    for prefix in ("", "k", "M", "G", "T"):
        if abs(v) < 1000 or prefix == "T":
            break
        v /= 1000
    text = f"{v:.0f}" if prefix == "" and float(v).is_integer() else f"{v:.2f}"
    return f"{text} {prefix}{unit}".strip()


def format_cell(column: Column, cell: Cell) -> str:
    if cell.reset and column.kind != "count":
        return "reset"
    if cell.value is None:
        return "-"
    if column.kind == "rate":
        return si(cell.value, "B/s" if "bytes" in column.title else "")
    if column.kind == "count":
        text = si(cell.value)
        if cell.reset:
            return f"{text} (reset)"
        return f"{text} (+{si(cell.delta)})" if cell.delta else text
    return si(cell.value)


def frame_tables(endpoints: Sequence[str], prev: Dict[str, Scrape],
                 cur: Dict[str, Scrape]) -> Dict[str, List[Row]]:
    """Every table's rows (by table title) for the endpoints that answered, in endpoint order."""
    out: Dict[str, List[Row]] = {}
    for table in TABLES:
        out[table.title] = [r for e in endpoints if cur[e].exposition is not None
                            for r in table_rows(_short(e), prev.get(e), cur[e], table)]
    return out


def render(endpoints: Sequence[str], cur: Dict[str, Scrape], tables: Dict[str, List[Row]],
           interval: float, frame: int) -> str:
    """One frame: a line per unreachable endpoint, then each table."""
    lines = [f"fabric-top: {len(endpoints)} endpoint{'s' if len(endpoints) != 1 else ''}, "
             f"every {interval:g} s, frame {frame}"]
    width = max([len(_short(e)) for e in endpoints] + [8])
    for e in endpoints:
        if cur[e].error:
            lines.append(f"{_short(e):<{width}}  DOWN: {cur[e].error}")
    for table in TABLES:
        rows = tables[table.title]
        if not rows:
            continue
        # A key column only where some row has a value for it (no rail column without rails).
        shown = [i for i in range(len(table.keys)) if any(r.key[i] for r in rows)]
        widths = {i: max([len(r.key[i]) for r in rows] + [len(table.keys[i])]) for i in shown}
        header = f"{'ENDPOINT':<{width}}" + "".join(
            f"  {(table.title if i == len(table.keys) - 1 else table.keys[i]).upper():<{widths[i]}}"
            for i in shown) + "".join(f"  {c.title:>12}" for c in table.columns)
        lines += ["", header]
        for r in rows:
            lines.append(f"{r.endpoint:<{width}}" + "".join(
                f"  {r.key[i] or '-':<{widths[i]}}" for i in shown) + "".join(
                f"  {format_cell(c, cell):>12}" for c, cell in zip(table.columns, r.cells)))
    if all(cur[e].exposition is not None for e in endpoints) and len(lines) == 1:
        lines.append("(no per-worker, per-NIC or per-peer metrics yet)")
    return "\n".join(lines) + "\n"


def _short(url: str) -> str:
    p = urllib.parse.urlsplit(url)
    return p.netloc + (p.path if p.path not in ("", "/metrics") else "")


# --- the loop --------------------------------------------------------------------------------


class Top:
    """Scrapes `endpoints` every `interval` seconds and yields frames. `clock`, `sleep` and `fetch`
    are injectable (tests drive rates exactly with a fake clock)."""

    def __init__(self, endpoints: Sequence[str], interval: float = 1.0, timeout: float = 2.0,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep,
                 fetch: Callable[[str, float], str] = fetch):
        self.endpoints = [normalize_endpoint(e) for e in endpoints]
        self.interval, self.timeout = interval, timeout
        self.clock, self.sleep, self.fetch = clock, sleep, fetch
        self.last: Dict[str, Scrape] = {}  # each endpoint's last good scrape
        self.frame = 0
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=min(16, len(self.endpoints)))

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def scrape_all(self) -> Dict[str, Scrape]:
        """Every endpoint at once, so one slow rank delays no other; each within the timeout."""
        at = self.clock()

        def one(url: str) -> Scrape:
            try:
                return Scrape(at, exposition=parse_exposition(self.fetch(url, self.timeout)))
            except (ScrapeError, ExpositionError) as e:
                return Scrape(at, error=str(e))

        return dict(zip(self.endpoints, self._pool.map(one, self.endpoints)))

    def start(self) -> None:
        """The first scrape, the baseline of the first rates; raises ScrapeError when an endpoint
        cannot be read at all (a wrong address or a port the engine does not serve)."""
        first = self.scrape_all()
        bad = [s.error for s in first.values() if s.error]
        if bad:
            raise ScrapeError("; ".join(bad))
        self.last = first
        self._next = self.clock() + self.interval

    def step(self) -> "Frame":
        """Waits for the next tick, scrapes every endpoint and returns the frame."""
        self.sleep(max(0.0, self._next - self.clock()))
        self._next = max(self._next + self.interval, self.clock())
        cur = self.scrape_all()
        self.frame += 1
        tables = frame_tables(self.endpoints, self.last, cur)
        text = render(self.endpoints, cur, tables, self.interval, self.frame)
        for e, s in cur.items():
            if s.exposition is not None:
                self.last[e] = s
            else:
                self.last.pop(e, None)  # its next answer starts a new baseline
        return Frame(text, all(s.error is None for s in cur.values()), tables)


@dataclass
class Frame:
    text: str  # what is printed
    ok: bool  # every endpoint answered
    tables: Dict[str, List[Row]]  # the rows by table title ("WORKER", "NIC", "PEER"), for scripts


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(
        prog="fabric-top",
        description="Live per-NIC and per-peer rates from fabric-lib metrics endpoints "
                    "(EngineConfig's metrics port), one endpoint per rank.")
    ap.add_argument("endpoints", nargs="+",
                    help="http://HOST:PORT/metrics, HOST:PORT or a port on 127.0.0.1")
    ap.add_argument("-n", "--interval", type=float, default=1.0, help="seconds between scrapes")
    ap.add_argument("--timeout", type=float, default=2.0,
                    help="seconds an endpoint has to answer each scrape")
    ap.add_argument("--iterations", type=int, default=0,
                    help="print this many frames and exit (0: until interrupted)")
    ap.add_argument("--once", action="store_true", help="one frame: --iterations 1")
    args = ap.parse_args(argv)
    if args.interval <= 0 or args.timeout <= 0 or args.iterations < 0:
        ap.error("--interval and --timeout must be positive, --iterations at least 0")
    frames = 1 if args.once else args.iterations
    # In place on a terminal (a screen redrawn each second); appended otherwise (logs, tests).
    redraw = sys.stdout.isatty() and frames != 1
    top = Top(args.endpoints, interval=args.interval, timeout=args.timeout)
    try:
        top.start()
        all_ok = True
        while frames == 0 or top.frame < frames:
            frame = top.step()
            all_ok &= frame.ok
            if redraw:
                sys.stdout.write("\x1b[H\x1b[2J")
            elif top.frame > 1:
                sys.stdout.write("\n")
            sys.stdout.write(frame.text)
            sys.stdout.flush()
        return 0 if all_ok else 1
    except ScrapeError as e:
        print(f"fabric-top: cannot read the metrics: {e}. Is the engine's metrics port set "
              "(EngineConfig) and the address right?", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0
    finally:
        top.close()


if __name__ == "__main__":
    sys.exit(main())
