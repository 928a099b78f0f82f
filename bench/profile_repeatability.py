"""How far two profiles of the same thing differ on this host: the floor under any
time prediction checked here (issue 10 item 5).

    OMP_NUM_THREADS=1 python bench/profile_repeatability.py            # ~1-2 min on 2 cores

Runs ``tools/profile_ops.py`` on the same (mbs, tp) entry of the tiny model ``--times``
times in a row, nothing changed between them (a fresh process each, as a user runs it and
as bench/predictor_accuracy.py's adjacent profiles do), and prints each profile's op
time (forward + backward summed over the entry's ops, the measure of
``predictor_profiles.host_drift``) against the median of all, and the spread
(max - min) / median, with the load average around each profile.  A cost model that
predicts from one such profile cannot be checked to better than this spread.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from predictor_profiles import host_drift, profile_cpu  # noqa: E402
from run_context import add_output_args, commit, loadavg, output_path  # noqa: E402


def spread_of(values) -> float:
    """(max - min) / median."""
    return (max(values) - min(values)) / statistics.median(values)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--times", type=int, default=6, help="profiles in a row")
    ap.add_argument("--mbs", type=int, default=4)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=20, help="the profiler's timed rounds (as the adjacent profiles)")
    add_output_args(ap, "the JSON file")
    args = ap.parse_args(argv)
    if args.times < 2 or args.mbs < 1 or args.tp not in (1, 2) or args.repeats < 1:
        print(f"error: --times must be >= 2, --mbs >= 1, --tp 1 or 2, --repeats >= 1, got "
              f"{args.times}, {args.mbs}, {args.tp}, {args.repeats}", file=sys.stderr)
        return 2
    start = time.time()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        paths = [Path(tmp) / f"p{i}.json" for i in range(args.times)]
        for i, path in enumerate(paths):
            load = loadavg()
            t = time.time()
            cmd = profile_cpu(path, str(args.mbs), str(args.tp), args.repeats)
            rows.append({"start_s": round(t - start, 1), "loadavg": f"{load} -> {loadavg()}"})
            print(f"profile {i + 1}/{args.times} done ({time.time() - t:.0f} s)", file=sys.stderr, flush=True)
        ratios = [host_drift(paths[0], p) for p in paths]   # op time / the first profile's
    med = statistics.median(ratios)
    lines = [f"command: OMP_NUM_THREADS=1 python bench/profile_repeatability.py "
             f"{' '.join(argv if argv is not None else sys.argv[1:])}".rstrip(),
             f"each: {cmd}", f"commit: {commit()}",
             f"date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(start))}", ""]
    for i, (row, r) in enumerate(zip(rows, ratios)):
        row["op_time_vs_median"] = r / med
        lines.append(f"profile {i + 1}: started at +{row['start_s']:.0f} s, op time / median {r / med:.3f}, "
                     f"load {row['loadavg']}")
    spread = spread_of(ratios)
    lines += ["", f"spread of the same profile taken {args.times} times in a row ((max - min) / median): "
                  f"{spread:.1%}; largest ratio between two of them {max(ratios) / min(ratios):.3f}"]
    print("\n".join(lines))
    out = output_path(args, "profile_repeatability.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    from eth.fileio import atomic_write_text

    atomic_write_text(out, json.dumps({"lines": lines, "profiles": rows, "spread": spread}, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
