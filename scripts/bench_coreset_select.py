#!/usr/bin/env python
"""Time the greedy coreset selection on the cached banks of scripts/bench_coreset_banks.py.

Methods, each on the same projected, centred float32 bank (what greedy_coreset selects on):

* ``plain``: :func:`greedy_dense` on the CPU (torch, float32 distances, one pass over all points per
  centre; memory-bound). Its cost per centre is constant, so it is timed over ``--plain-steps``
  centres and its centres/s extrapolated.
* ``legacy``: the former CPU method (triangle-inequality blocks around selected centres,
  re-grouped at each doubling), copied below as it was, instrumented to count the points whose
  distance it evaluates. Stopped after ``--legacy-seconds`` (centres/s over what it did).
* ``batched``: :func:`greedy_batched` (the new CPU method): full selections of 1 % and 10 %.

Exactness: the batched selection is compared with the plain loop's first centres, the legacy
method's, and (``--reference``) with a float64 brute-force selection saved by ``--make-reference``
(one full float64 pass per centre; slow, run it on small banks or small k).

    PYTHONPATH=. python scripts/bench_coreset_select.py --bank weld222 --bank bottle [--json out.json]

Times: wall and CPU seconds of this process; on a shared machine the CPU seconds are the
steadier figure (the table also gives the load average during the run).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from anomaly_hooks.scorers.patchcore.coreset import greedy_batched, greedy_dense  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


# -- the former CPU method (anomaly_hooks/scorers/patchcore/coreset.py before this change), instrumented -------
TOLERANCE = 1e-4
MIN_BLOCK_REBUILD = 16


class _Blocks:
    def __init__(self, x, assign, centres, m):
        self.order = np.argsort(assign, kind="stable")
        self.xs = x[self.order]
        self.sq = np.einsum("ij,ij->i", self.xs, self.xs)
        self.m = m[self.order]
        block_ids, self.start = np.unique(assign[self.order], return_index=True)
        self.stop = np.append(self.start[1:], len(self.order))
        self.centre = x[centres[block_ids]]
        self.centre_sq = np.einsum("ij,ij->i", self.centre, self.centre)
        self.max = np.maximum.reduceat(self.m, self.start)
        self.rho = self.max.copy()
        self.arg = self.start + _segment_argmax(self.m, self.start, self.max)
        self.evaluated = 0

    def update(self, c, c_sq, tol):
        dcb = np.sqrt(np.maximum(self.centre_sq - 2.0 * (self.centre @ c) + c_sq, 0.0))
        cand = np.flatnonzero(dcb - self.rho <= self.max + tol)
        if cand.size == 0:
            return None
        pos = _ranges(self.start[cand], self.stop[cand])
        self.evaluated += len(pos)
        d = np.sqrt(np.maximum(self.sq[pos] - 2.0 * (self.xs[pos] @ c) + c_sq, 0.0))
        closer = d < self.m[pos]
        moved = pos[closer]
        self.m[moved] = d[closer]
        seg = np.concatenate(([0], np.cumsum(self.stop[cand] - self.start[cand])[:-1]))
        sub = self.m[pos]
        self.max[cand] = np.maximum.reduceat(sub, seg)
        self.arg[cand] = pos[seg + _segment_argmax(sub, seg, self.max[cand])]
        return moved


def _ranges(starts, stops):
    lengths = stops - starts
    total = int(lengths.sum())
    offsets = np.repeat(starts - np.concatenate(([0], np.cumsum(lengths)[:-1])), lengths)
    return np.arange(total) + offsets


def _segment_argmax(values, seg_start, seg_max):
    seg_len = np.diff(np.append(seg_start, len(values)))
    local = np.arange(len(values)) - np.repeat(seg_start, seg_len)
    is_max = values == np.repeat(seg_max, seg_len)
    return np.minimum.reduceat(np.where(is_max, local, np.iinfo(np.int64).max), seg_start)


def legacy_pruned(x, k, start, seconds=math.inf, stats=None):
    """The former greedy_pruned; stops after ``seconds`` of CPU time (returns the centres
    selected)."""
    t0 = time.process_time()
    x = np.ascontiguousarray(x, dtype=np.float32)
    n = x.shape[0]
    sq = np.einsum("ij,ij->i", x, x)
    tol = TOLERANCE * float(np.sqrt(sq.max())) + 1e-12
    m = np.sqrt(np.maximum(sq - 2.0 * (x @ x[start]) + sq[start], 0.0)).astype(np.float32)
    assign = np.zeros(n, dtype=np.int64)
    centres = np.array([start], dtype=np.int64)
    selected = np.empty(k, dtype=np.int64)
    selected[0] = start
    m[start] = -1.0
    blocks = _Blocks(x, assign, centres, m)
    evaluated = n
    next_rebuild = MIN_BLOCK_REBUILD
    done = 1
    for i in range(1, k):
        if time.process_time() - t0 > seconds:
            break
        b = int(np.argmax(blocks.max))
        p = int(blocks.arg[b])
        idx = int(blocks.order[p])
        selected[i] = idx
        c = blocks.xs[p]
        moved = blocks.update(c, float(blocks.sq[p]), tol)
        blocks.m[p] = -1.0
        blocks.max[b] = np.max(blocks.m[blocks.start[b]:blocks.stop[b]])
        blocks.arg[b] = blocks.start[b] + int(np.argmax(blocks.m[blocks.start[b]:blocks.stop[b]]))
        if moved is not None and moved.size:
            assign[blocks.order[moved]] = i
        done = i + 1
        if i + 1 >= next_rebuild and i + 1 < k:
            evaluated += blocks.evaluated
            centres = selected[:i + 1]
            m = np.empty(n, dtype=np.float32)
            m[blocks.order] = blocks.m
            assign[centres] = np.arange(i + 1)
            blocks = _Blocks(x, assign, centres, m)
            next_rebuild *= 2
    evaluated += blocks.evaluated
    if stats is not None:
        stats["evaluated_fraction"] = evaluated / done / n
    return selected[:done]


# -- the brute-force reference -----------------------------------------------------------------
def brute_force(x: np.ndarray, k: int, start: int) -> np.ndarray:
    """The greedy rule with float64 distances, one full pass per centre."""
    x64 = torch.from_numpy(x).double()
    m = torch.full((len(x),), float("inf"), dtype=torch.float64)
    sel = np.empty(k, dtype=np.int64)
    idx = start
    for i in range(k):
        sel[i] = idx
        diff = x64 - x64[idx]
        torch.minimum(m, torch.einsum("ij,ij->i", diff, diff), out=m)
        m[idx] = -1.0
        idx = int(torch.argmax(m))
    return sel


# -- timing ------------------------------------------------------------------------------------
def timed(fn, *args, **kwargs):
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - wall, time.process_time() - cpu


def first_diff(a: np.ndarray, b: np.ndarray) -> Optional[int]:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else None


def bench_bank(name: str, banks: Path, ratios, plain_steps: int, legacy_seconds: float,
               reference: Optional[Path]) -> dict:
    x = np.load(banks / f"{name}.npy")
    meta = json.loads((banks / f"{name}.json").read_text())
    n = len(x)
    start = meta["first_index"]
    out = {"bank": name, "n": n, "dim": x.shape[1], "meta": meta, "runs": []}
    load0 = os.getloadavg()[0]

    k_plain = min(plain_steps, n)
    sel_plain, wall, cpu = timed(greedy_dense, torch.from_numpy(x), k_plain, start,
                                 dtype=torch.float32)
    sel_plain = sel_plain.numpy()
    out["runs"].append({"method": "plain", "k": k_plain, "done": k_plain, "wall_s": wall,
                        "cpu_s": cpu, "centres_per_s": k_plain / wall,
                        "cpu_ms_per_centre": 1000 * cpu / k_plain, "touched_fraction": 1.0})
    print(f"{name}: plain {k_plain} centres {wall:.1f} s wall, {cpu:.1f} s CPU", flush=True)

    selections = {}
    for ratio in ratios:
        k = max(1, math.ceil(ratio * n))
        st: dict = {}
        sel, wall, cpu = timed(greedy_batched, x, k, start, stats=st)
        selections[ratio] = sel
        run = {"method": "batched", "ratio": ratio, "k": k, "done": k, "wall_s": wall,
               "cpu_s": cpu, "centres_per_s": k / wall, "cpu_ms_per_centre": 1000 * cpu / k,
               **st, "same_as_plain_prefix": first_diff(sel, sel_plain) is None}
        out["runs"].append(run)
        print(f"{name}: batched {ratio:.0%} k={k}: {wall:.1f} s wall, {cpu:.1f} s CPU, "
              f"{k / wall:.0f} centres/s; {st}", flush=True)

    kmax = max(math.ceil(r * n) for r in ratios)
    st = {}
    sel_legacy, wall, cpu = timed(legacy_pruned, x, kmax, start, legacy_seconds, stats=st)
    done = len(sel_legacy)
    out["runs"].append({"method": "legacy", "k": kmax, "done": done, "wall_s": wall,
                        "cpu_s": cpu, "centres_per_s": done / wall,
                        "cpu_ms_per_centre": 1000 * cpu / done,
                        "touched_fraction": st["evaluated_fraction"],
                        "first_diff_vs_batched": first_diff(sel_legacy, selections[max(ratios)])})
    print(f"{name}: legacy {done} of {kmax} centres in {wall:.1f} s wall, {cpu:.1f} s CPU; "
          f"{st}", flush=True)
    if reference is not None and reference.exists():
        ref = np.load(reference)
        big = selections[max(ratios)]
        n_cmp = min(len(ref), len(big))
        out["reference"] = {"file": str(reference), "compared": n_cmp,
                            "first_diff": first_diff(ref[:n_cmp], big[:n_cmp])}
        print(f"{name}: vs float64 brute force ({n_cmp} centres): first difference "
              f"{out['reference']['first_diff']}", flush=True)
    out["load_average"] = [load0, os.getloadavg()[0]]
    return out


def format_table(results) -> str:
    lines = [f"{'bank':<8} {'N':>7} {'method':<8} {'k':>6} {'done':>6} {'wall s':>8} "
             f"{'CPU s':>8} {'centres/s':>9} {'CPU ms/c':>8} {'touched':>8} {'exact/c':>8}"]
    for r in results:
        for run in r["runs"]:
            touched = run.get("touched_fraction")
            lines.append(
                f"{r['bank']:<8} {r['n']:>7} {run['method']:<8} {run['k']:>6} {run['done']:>6} "
                f"{run['wall_s']:8.1f} {run['cpu_s']:8.1f} {run['centres_per_s']:9.0f} "
                f"{run['cpu_ms_per_centre']:8.2f} "
                f"{'-' if touched is None else f'{touched:.3f}':>8} "
                f"{run.get('exact_per_centre', float('nan')):8.0f}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--banks", type=Path, default=ROOT / "bench_out" / "banks")
    parser.add_argument("--bank", action="append")
    parser.add_argument("--ratio", type=float, action="append")
    parser.add_argument("--plain-steps", type=int, default=200)
    parser.add_argument("--legacy-seconds", type=float, default=120.0,
                        help="CPU seconds after which the legacy method is stopped")
    parser.add_argument("--threads", type=int, default=None,
                        help="BLAS/torch threads (default: all cores); 1 gives steadier CPU "
                             "seconds on a shared machine (no spinning helper threads)")
    parser.add_argument("--reference", type=Path, default=None,
                        help="a float64 brute-force selection (.npy) to compare with")
    parser.add_argument("--make-reference", type=int, default=None, metavar="K",
                        help="only compute the float64 brute-force selection of K centres of "
                             "the (first) bank and save it to --reference")
    parser.add_argument("--json", type=Path, default=Path("coreset_select.json"))
    args = parser.parse_args()
    names = args.bank or ["weld222", "bottle", "mix610"]
    if args.threads is not None:
        from threadpoolctl import threadpool_limits  # a scikit-learn dependency

        threadpool_limits(args.threads)
        torch.set_num_threads(args.threads)
    if args.make_reference is not None:
        x = np.load(args.banks / f"{names[0]}.npy")
        meta = json.loads((args.banks / f"{names[0]}.json").read_text())
        sel, wall, cpu = timed(brute_force, x, args.make_reference, meta["first_index"])
        np.save(args.reference, sel)
        print(f"reference {names[0]} k={args.make_reference}: {wall:.0f} s -> {args.reference}")
        return 0
    ratios = args.ratio or [0.01, 0.1]
    results = [bench_bank(b, args.banks, ratios, args.plain_steps, args.legacy_seconds,
                          args.reference) for b in names]
    report = {"threads": torch.get_num_threads(), "cpus": os.cpu_count(), "results": results}
    args.json.write_text(json.dumps(report, indent=2))
    print(format_table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
