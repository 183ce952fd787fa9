#!/usr/bin/env python
"""``anomaly-hooks`` commands end to end in fresh processes: what a user waits for, imports
included, for one or more versions of the code.

Usage::

    python benchmarks/bench_cli.py [--code REV_OR_DIR ...] [--repeats 7] [--json out.json] \\
        -- update --model v1.safetensors --good new/ --out v2.safetensors --quiet

Each ``--code`` is a folder holding an ``anomaly_hooks`` package or a git revision of this
repository (its ``anomaly_hooks`` exported to a temporary folder); the default is this
checkout. The command after ``--`` runs as ``anomaly_hooks.cli.main(ARGS)`` in a new Python
process with that code first on ``sys.path`` (ahead of the working folder and of an installed
copy), from the caller's working folder, the versions in turns, ``--repeats`` times each.
Printed per version: the process's wall seconds (median, min-max) and CPU seconds (median),
and, from one more run under ``python -X importtime``, the seconds its largest top-level
imports took. A command that fails stops the benchmark with its output.
"""
from __future__ import annotations

import argparse
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Sequence, Tuple

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.measure import code_version, machine, write_json  # noqa: E402

RUN = ("import sys; sys.path.insert(0, sys.argv.pop(1)); "
       "from anomaly_hooks.cli import main; sys.exit(main(sys.argv[1:]))")
IMPORT_LINE = re.compile(r"import time:\s+\d+ \|\s+(\d+) \| (\s*)(\S+)")


def run_once(folder: Path, args: Sequence[str], *flags: str) -> Tuple[float, float, str]:
    """(wall seconds, CPU seconds, stderr) of one run of the command with ``folder``'s code."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, *flags, "-c", RUN, str(folder), *args],
                          capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode:
        raise SystemExit(f"the command failed with {folder}'s code (exit {done.returncode}):\n"
                         f"{done.stdout[-2000:]}{done.stderr[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, done.stderr


def top_imports(stderr: str, n: int = 8) -> Dict[str, float]:
    """The ``n`` top-level imports of ``-X importtime`` output that took longest (seconds,
    cumulative), and their ``total``."""
    top: List[Tuple[float, str]] = []
    for line in stderr.splitlines():
        m = IMPORT_LINE.match(line)
        if m and not m.group(2):  # not indented: imported by the program, not by a module
            top.append((int(m.group(1)) / 1e6, m.group(3)))
    out = {name: round(s, 3) for s, name in sorted(top, reverse=True)[:n]}
    out["total"] = round(sum(s for s, _ in top), 3)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--code", action="append",
                        help="a folder with anomaly_hooks/ or a git revision (repeatable; "
                             "default: this checkout)")
    parser.add_argument("--repeats", type=int, default=7, help="runs of each version")
    parser.add_argument("--json", help="write the figures here")
    opts = parser.parse_args(argv[:cut])
    args = argv[cut + 1:]
    if not args:
        parser.error("give the command after --, e.g. -- layers resnet18")
    if opts.repeats < 1:
        parser.error("--repeats must be at least 1")
    specs = opts.code or [str(REPO)]
    out: Dict[str, Any] = {"machine": machine(), "command": args, "repeats": opts.repeats}
    with tempfile.TemporaryDirectory(prefix="bench_cli_") as scratch:
        folders = [code_version(s, Path(scratch)) for s in specs]
        runs: Dict[str, List[Tuple[float, float]]] = {s: [] for s in specs}
        for _ in range(opts.repeats):  # in turns: drifting load shares out
            for spec, folder in zip(specs, folders):
                runs[spec].append(run_once(folder, args)[:2])
        imports = {s: top_imports(run_once(f, args, "-X", "importtime")[2])
                   for s, f in zip(specs, folders)}
    print(f"anomaly-hooks {' '.join(args)}: fresh processes, {opts.repeats} runs of each "
          "version in turns")
    print("| code | wall s, median (min-max) | CPU s, median | largest imports (s) |")
    print("|---|---|---|---|")
    for spec in specs:
        wall = [w for w, _ in runs[spec]]
        cpu = [c for _, c in runs[spec]]
        imp = ", ".join(f"{k} {v:.2f}" for k, v in imports[spec].items())
        print(f"| {spec} | {statistics.median(wall):.2f} ({min(wall):.2f}-{max(wall):.2f}) | "
              f"{statistics.median(cpu):.2f} | {imp} |")
        out[spec] = {"wall_s": wall, "cpu_s": cpu, "imports_s": imports[spec]}
    if opts.json:
        write_json(opts.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
