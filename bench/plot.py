"""Plots fabric-bench JSON results: bandwidth and latency against transfer size, one line per
file (provider), with the raw-loop and ucx_perftest figures of `make bench-compare` as markers.
Bandwidth in GB/s (1e9 bytes per second): each row's `gb_per_s`; files written before that field
carry `gbps`, gigabits per second, divided by 8 here.

Usage: python3 bench/plot.py OUT_DIR RESULT.json [RESULT.json ...] [--compare COMPARE.json]
"""

import argparse
import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def load(path):
    with open(path) as f:
        return json.load(f)


def gb_per_s(row):
    """A row's or point's bandwidth in GB/s (older files: `gbps`, in Gbit/s)."""
    return row["gb_per_s"] if "gb_per_s" in row else row["gbps"] / 8


def series(result, prefix):
    rows = [r for r in result["results"] if r["test"].startswith(prefix) and r["bytes"] > 0]
    return sorted(rows, key=lambda r: r["bytes"])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out_dir")
    ap.add_argument("results", nargs="+")
    ap.add_argument("--compare", help="JSON written by bench/compare.sh")
    args = ap.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    results = [load(p) for p in args.results]

    fig, (bw, lat) = plt.subplots(1, 2, figsize=(12, 4.5))
    for res in results:
        single = series(res, "single")
        label = f"engine, {res['provider']}, {res['nics']} NIC"
        bw.plot([r["bytes"] for r in single], [gb_per_s(r) for r in single], "o-", label=label)
        lat.plot([r["bytes"] for r in single], [r["p50_us"] for r in single], "o-", label=label + " p50")
        lat.plot([r["bytes"] for r in single], [r["p99_us"] for r in single], "x:", label=label + " p99")
    if args.compare:
        cmp = load(args.compare)
        for p in cmp["points"]:
            bw.plot([p["bytes"]], [gb_per_s(p)], p.get("marker", "s"), markersize=9,
                    label=f"{p['what']}, {p['provider']}")
    for ax, ylabel, title in ((bw, "GB/s", "Single WRITE bandwidth"),
                              (lat, "us (submit to local completion)", "Single WRITE latency")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("bytes per transfer")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    lat.set_yscale("log")
    fig.tight_layout()
    fig.savefig(os.path.join(args.out_dir, "single_write.png"), dpi=110)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for res in results:
        for count in sorted({r["writes"] for r in series(res, "paged")}):
            rows = [r for r in series(res, "paged") if r["writes"] == count]
            ax.plot([r["bytes"] // count for r in rows], [gb_per_s(r) for r in rows], "o-",
                    label=f"{res['provider']}, x{count} pages")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("page size (bytes)")
    ax.set_ylabel("GB/s")
    ax.set_title("Paged WRITEs (random pages, stride > page)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(args.out_dir, "paged_write.png"), dpi=110)
    print(f"wrote {args.out_dir}/single_write.png and paged_write.png")


if __name__ == "__main__":
    main()
