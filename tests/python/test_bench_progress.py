"""fabric-bench's progress line: shown with --progress=always, absent when piped in auto mode, and
the table on stdout the same whatever the mode. ctest runs this file as a script with the binary
(`fabric_bench_progress`); pytest finds the binary in $FABRIC_BENCH or build/."""

import os
import re
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Tiny sizes: each step prints one row, and the run takes a second or two.
ARGS = ["local", "--peers", "2", "--buffer-mib", "8", "--peer-buffer-mib", "1", "--target-mib", "1",
        "--max-iters", "50", "--warmup", "1", "--single-sizes", "1024", "65536", "--page-sizes", "4096",
        "--page-counts", "10", "--scatter-len", "4096", "--only", "single", "paged", "scatter", "imm",
        "msg"]


def run_bench(binary, mode):
    env = dict(os.environ, FI_OFI_RXM_MSG_RX_SIZE="64")
    args = [binary, *ARGS] + ([f"--progress={mode}"] if mode else [])
    p = subprocess.run(args, capture_output=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr.decode(errors="replace")
    return p.stdout.decode(), p.stderr.decode()


def rows(stdout):
    """The table without its timings: test, bytes, writes, iters of every row."""
    out = []
    for line in stdout.splitlines()[1:]:
        m = re.match(r"(.+?)\s+(\d+)\s+(\d+)\s+(\d+)\s", line)
        assert m, f"not a table row: {line!r}"
        out.append(m.groups())
    return out


def check_always(binary):
    stdout, stderr = run_bench(binary, "always")
    table = rows(stdout)
    assert "\r" not in stdout and "\x1b" not in stdout, "the progress line leaked into stdout"
    # Redrawn in place: every line but the summary starts with a carriage return.
    drawn = [s.replace("\x1b[K", "") for s in stderr.split("\r")[1:]]
    lines = [s for s in drawn if s.startswith("[")]
    assert lines, f"no progress line on stderr: {stderr!r}"
    steps = len(table)
    for line in lines:
        assert re.match(rf"\[\d+/{steps}\]", line), line
    # The summary counts every step the table has a row for, and the bytes the steps moved.
    m = re.search(rf"fabric-bench: {steps}/{steps} steps, ([\d.]+) (\w?)B moved in \d+:\d\d", stderr)
    assert m, stderr
    assert float(m.group(1)) > 0


def check_auto_piped_is_quiet(binary):
    auto_out, auto_err = run_bench(binary, None)  # auto is the default
    never_out, never_err = run_bench(binary, "never")
    # Nothing of the line (the engine may log a warning to stderr in any mode).
    for err in (auto_err, never_err):
        assert "\r" not in err and "\x1b" not in err and " steps, " not in err, err
    assert rows(auto_out) == rows(never_out)
    assert auto_out.splitlines()[0] == never_out.splitlines()[0]  # the header, byte for byte


def bench_binary():
    path = os.environ.get("FABRIC_BENCH") or os.path.join(REPO, "build/tools/fabric-bench/fabric-bench")
    if not os.access(path, os.X_OK):
        import pytest  # here: ctest runs this file without pytest

        pytest.skip(f"no fabric-bench at {path} (make build; or set FABRIC_BENCH); ctest runs it")
    return path


def test_progress_always_draws_and_summarizes():
    check_always(bench_binary())


def test_progress_auto_is_quiet_when_piped():
    check_auto_piped_is_quiet(bench_binary())


if __name__ == "__main__":
    # ctest: the binary is the argument, and a missing one fails instead of skipping.
    check_always(sys.argv[1])
    check_auto_piped_is_quiet(sys.argv[1])
    print("fabric-bench progress: ok")
