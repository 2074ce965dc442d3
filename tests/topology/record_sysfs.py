#!/usr/bin/env python3
"""Records the part of a live sysfs that fabric::detect_topology reads, as a fixture
(tests/topology/fixtures/<machine>.sysfs), and materialises a fixture back into a directory tree.

Record on the machine itself (root is not needed; sysfs is world-readable):

    python3 tests/topology/record_sysfs.py -o tests/topology/fixtures/p5.48xlarge.sysfs \\
        --machine p5.48xlarge --note "recorded on a p5.48xlarge, us-east-2, 2026-12-01"

Materialise one (what the tests do; `fabric-bench topo --sysfs DIR` then reads it):

    python3 tests/topology/record_sysfs.py --materialize tests/topology/fixtures/dgx-h100.sysfs /tmp/dgx

What is recorded, following each path the way detect_topology does (every symlink on the way is
recorded as a link, every file at its physical path):
  - bus/pci/devices/<bdf>: the link into devices/pci..., and class, vendor, numa_node of every
    NVIDIA device and of every RDMA NIC's PCI device (--all-pci: of every PCI device);
  - class/infiniband/<name>: its links (the entry itself, device, device/driver), device/numa_node,
    ports/1/rate and ports/1/state;
  - devices/system/node/node<N>/cpulist, devices/system/cpu/online, and for every CPU of a node
    devices/system/cpu/cpu<N>/topology/{core_id,physical_package_id}.

The format, one entry per line ('#' lines are comments):
    d <path>             a directory (one that may be empty)
    f <path> <content>   a file; the content is the rest of the line (backslash escapes \\n and \\\\),
                         written back with the newline sysfs ends each value with
    l <path> <target>    a symlink, its target as stored (relative)
Paths are relative to the sysfs root and never pass through a recorded link.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import sys
from typing import Iterable, Optional

FORMAT_LINE = "# fabric-lib sysfs fixture (tests/topology/record_sysfs.py; format in its docstring)"
PCI_ADDRESS = re.compile(r"^[0-9a-f]{4,}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
MAX_LINKS = 40


def _escape(s: str) -> str:
    return s.replace("\\", "\\\\").replace("\n", "\\n")


def _unescape(s: str) -> str:
    out, i = [], 0
    while i < len(s):
        if s[i] == "\\" and i + 1 < len(s):
            out.append("\n" if s[i + 1] == "n" else s[i + 1])
            i += 2
        else:
            out.append(s[i])
            i += 1
    return "".join(out)


def _natural(path: str) -> list:
    """Sort key: cpu2 before cpu10, mlx5_2 before mlx5_10, PCI addresses in bus order."""
    key = []
    for comp in path.split("/"):
        if PCI_ADDRESS.match(comp):
            key.append([(1, 0, comp)])
        else:
            key.append([(0, int(t), "") if t.isdigit() else (1, 0, t) for t in re.split(r"(\d+)", comp)])
    return key


class Fixture:
    """An ordered set of directories, files and links, relative to a sysfs root."""

    def __init__(self) -> None:
        self.comments: list[str] = []
        self.dirs: dict[str, None] = {}
        self.files: dict[str, str] = {}
        self.links: dict[str, str] = {}

    def add_dir(self, path: str) -> None:
        self.dirs.setdefault(path, None)

    def add_file(self, path: str, content: str) -> None:
        self.files[path] = content

    def add_link(self, path: str, target: str) -> None:
        self.links[path] = target

    def dump(self) -> str:
        lines = [FORMAT_LINE] + [f"# {c}" if c else "#" for c in self.comments]
        lines += [f"d {p}" for p in sorted(self.dirs, key=_natural)]
        lines += [f"l {p} {self.links[p]}" for p in sorted(self.links, key=_natural)]
        for p in sorted(self.files, key=_natural):
            content = self.files[p]
            lines.append(f"f {p} {_escape(content)}" if content else f"f {p}")
        return "\n".join(lines) + "\n"

    def write(self, out_path: str) -> None:
        with open(out_path, "w", encoding="utf-8") as f:
            f.write(self.dump())

    @staticmethod
    def load(path: str) -> "Fixture":
        fx = Fixture()
        with open(path, encoding="utf-8") as f:
            for n, raw in enumerate(f, 1):
                line = raw.rstrip("\n")
                if not line.strip() or line.startswith("#"):
                    continue
                parts = line.split(" ", 2)
                kind, rel = parts[0], parts[1] if len(parts) > 1 else ""
                if not rel or rel.startswith("/") or ".." in rel.split("/"):
                    raise ValueError(f"{path}:{n}: bad path {rel!r}")
                if kind == "d":
                    fx.add_dir(rel)
                elif kind == "f":
                    fx.add_file(rel, _unescape(parts[2]) if len(parts) > 2 else "")
                elif kind == "l" and len(parts) == 3:
                    fx.add_link(rel, parts[2])
                else:
                    raise ValueError(f"{path}:{n}: cannot parse {line!r}")
        return fx

    def materialize(self, dest: str) -> None:
        """Builds the tree under dest (which may exist)."""
        for rel in self.dirs:
            os.makedirs(os.path.join(dest, rel), exist_ok=True)
        for rel, content in self.files.items():
            p = os.path.join(dest, rel)
            os.makedirs(os.path.dirname(p), exist_ok=True)
            with open(p, "w", encoding="utf-8") as f:
                f.write(content + "\n")
        for rel, target in self.links.items():
            p = os.path.join(dest, rel)
            os.makedirs(os.path.dirname(p), exist_ok=True)
            os.symlink(target, p)


def materialize(fixture_path: str, dest: str) -> None:
    Fixture.load(fixture_path).materialize(dest)


class Recorder:
    """Follows paths in a live sysfs the way src/topology/sysfs.cpp does, recording what it meets."""

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)
        self.fx = Fixture()
        self.warnings: list[str] = []

    def _abs(self, parts: list[str]) -> str:
        return os.path.join(self.root, *parts)

    def walk(self, rel: str, follow_last: bool = True) -> Optional[list[str]]:
        """The physical path of rel, recording every link on the way; None if it leaves the root."""
        todo = [p for p in rel.split("/") if p]
        done: list[str] = []
        links = 0
        while todo:
            part = todo.pop(0)
            if part == ".":
                continue
            if part == "..":
                if done:
                    done.pop()
                continue
            done.append(part)
            if not todo and not follow_last:
                break
            here = self._abs(done)
            if not os.path.islink(here):
                continue
            links += 1
            if links > MAX_LINKS:
                return None
            target = os.readlink(here)
            link_dir = done[:-1]
            if os.path.isabs(target):
                if os.path.commonpath([self.root, target]) != self.root:
                    self.warnings.append(f"{'/'.join(done)} -> {target}: outside the root, not followed")
                    return None
                target = os.path.relpath(target, os.path.join(self.root, *link_dir))
            self.fx.add_link("/".join(done), target)
            done.pop()
            todo = [p for p in target.split("/") if p] + todo
        return done

    def link(self, rel: str) -> None:
        parts = self.walk(rel, follow_last=False)
        if parts and os.path.islink(self._abs(parts)):
            target = os.readlink(self._abs(parts))
            if os.path.isabs(target):
                target = os.path.relpath(target, self._abs(parts[:-1]))
            self.fx.add_link("/".join(parts), target)

    def read(self, rel: str) -> Optional[str]:
        parts = self.walk(rel)
        if parts is None:
            return None
        p = self._abs(parts)
        if not os.path.isfile(p):
            return None
        try:
            with open(p, encoding="utf-8", errors="backslashreplace") as f:
                content = f.read(1 << 16)
        except OSError:
            return None  # an attribute the device cannot report (EIO, EINVAL)
        if content.endswith("\n"):
            content = content[:-1]
        self.fx.add_file("/".join(parts), content)
        return content

    def peek(self, rel: str) -> Optional[str]:
        """Reads without recording."""
        try:
            with open(os.path.join(self.root, rel), encoding="utf-8", errors="backslashreplace") as f:
                return f.read(1 << 16).rstrip("\n")
        except OSError:
            return None

    def listdir(self, rel: str) -> list[str]:
        parts = self.walk(rel)
        if parts is None or not os.path.isdir(self._abs(parts)):
            return []
        self.fx.add_dir("/".join(parts))
        return sorted(os.listdir(self._abs(parts)))


def parse_cpulist(s: str) -> list[int]:
    cpus: list[int] = []
    for piece in s.strip().split(","):
        piece = piece.strip()
        if not piece:
            continue
        lo, _, hi = piece.partition("-")
        try:
            cpus.extend(range(int(lo), int(hi or lo) + 1))
        except ValueError:
            pass
    return sorted(set(cpus))


def record(root: str, all_pci: bool) -> Recorder:
    r = Recorder(root)
    # RDMA NICs first: their PCI devices are kept even when not NVIDIA's.
    nic_pci: set[str] = set()
    for name in r.listdir("class/infiniband"):
        base = f"class/infiniband/{name}"
        r.link(f"{base}/device/driver")
        r.read(f"{base}/device/numa_node")
        r.read(f"{base}/ports/1/rate")
        r.read(f"{base}/ports/1/state")
        dev = r.walk(f"{base}/device")
        if dev and PCI_ADDRESS.match(dev[-1]):
            nic_pci.add(dev[-1])
    for bdf in r.listdir("bus/pci/devices"):
        base = f"bus/pci/devices/{bdf}"
        vendor = (r.peek(f"{base}/vendor") or "").strip().lower()
        if not (all_pci or vendor == "0x10de" or bdf in nic_pci):
            continue
        r.link(base)
        for attr in ("class", "vendor", "numa_node"):
            r.read(f"{base}/{attr}")
    cpus: list[int] = []
    nodes = [n for n in r.listdir("devices/system/node") if re.fullmatch(r"node\d+", n)]
    for node in nodes:
        cpus += parse_cpulist(r.read(f"devices/system/node/{node}/cpulist") or "")
    online = r.read("devices/system/cpu/online")
    if not nodes:
        cpus = parse_cpulist(online or "")
    for cpu in sorted(set(cpus)):
        for attr in ("core_id", "physical_package_id"):
            r.read(f"devices/system/cpu/cpu{cpu}/topology/{attr}")
    return r


def main(argv: Iterable[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sysfs", default="/sys", help="the sysfs root to record (default /sys)")
    ap.add_argument("-o", "--output", help="the fixture to write ('-': stdout)")
    ap.add_argument("--machine", default="", help="what the machine is (goes into the header)")
    ap.add_argument("--note", action="append", default=[], help="a header comment line (repeatable)")
    ap.add_argument("--all-pci", action="store_true",
                    help="record every PCI device, not only NVIDIA's and the RDMA NICs'")
    ap.add_argument("--materialize", nargs=2, metavar=("FIXTURE", "DIR"),
                    help="build the tree a fixture describes under DIR instead of recording")
    args = ap.parse_args(list(argv))
    if args.materialize:
        materialize(*args.materialize)
        return 0
    if not args.output:
        ap.error("-o/--output is required when recording")
    if not os.path.isdir(os.path.join(args.sysfs, "bus/pci/devices")):
        print(f"record_sysfs: {args.sysfs} has no bus/pci/devices: not a sysfs tree", file=sys.stderr)
        return 1
    r = record(args.sysfs, args.all_pci)
    r.fx.comments = [f"machine: {args.machine or os.uname().nodename}",
                     f"recorded from {args.sysfs} on {datetime.date.today().isoformat()}"
                     f"{' (every PCI device)' if args.all_pci else ''}"] + args.note
    text = r.fx.dump()
    if args.output == "-":
        sys.stdout.write(text)
    else:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(text)
    for w in r.warnings:
        print(f"record_sysfs: warning: {w}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
