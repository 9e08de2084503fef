#!/usr/bin/env python3
"""What the soak's memory figures do without the plugin: the baseline its slack comes from.

    soak_baseline.py REPORT.json...     reports of `scripts/soak.sh --mode default` (and, to
                                        compare, of plugin runs: each report names its mode)

Per report and executor, for the figure the soak checks with an absolute slack (native_rss_kb:
RSS outside the Java heap less the NMT categories the JVM holds for its JIT and collector), for
each of those categories and for the other checked quantities: the growth the soak's rule
measures (median of the last 5 samples less the median of the 5 from shuffle 100) and the
largest move between two consecutive samples from shuffle 100 on. Then, per quantity and mode,
the range of those growths and the largest move; and the slack the default runs call for:
Spark's own shuffle and the JVM with no plugin at all move native_rss_kb this much between the
two windows, so a plugin run is allowed that much (scripts/soak.sh SLACK) and no more. The
slack is the one-sided 99.9 % upper prediction bound of one more executor's growth from the
default runs' growths (mean + t(0.999, n-1) x sd x sqrt(1 + 1/n): a handful of runs, so
Student's t, not the largest seen), rounded up to a MiB. 99.9 %: CI checks two executors a run,
and a run failed for nothing should be rarer than one in 500.
"""
import json
import math
import statistics
import sys

# What scripts/soak.sh takes out of native_rss_kb (its JVM_HELD), and what it leaves in.
KEYS = ["native_rss_kb", "non_heap_rss_kb", "nmt.code_kb", "nmt.compiler_kb", "nmt.arena_chunk_kb",
        "nmt.gc_kb", "nmt.metaspace_kb", "heap_used_kb", "fds", "maps", "threads"]
WINDOW, BASE_SHUFFLE = 5, 100
# Student's t, one-sided 0.999, by degrees of freedom 1..30 (beyond: the normal's 3.090).
T999 = [318.31, 22.327, 10.215, 7.173, 5.893, 5.208, 4.785, 4.501, 4.297, 4.144, 4.025, 3.930,
        3.852, 3.787, 3.733, 3.686, 3.646, 3.610, 3.579, 3.552, 3.527, 3.505, 3.485, 3.467, 3.450,
        3.435, 3.421, 3.408, 3.396, 3.385]


def stats(report: dict) -> list:
    out = []
    for ex, ss in sorted(report["samples"].items()):
        base = [s for s in ss if s["shuffle"] >= BASE_SHUFFLE][:WINDOW]
        last = ss[-WINDOW:]
        for k in KEYS:
            if not all(k in s for s in ss):
                continue
            vals = [s[k] for s in ss if s["shuffle"] >= BASE_SHUFFLE]
            growth = statistics.median(s[k] for s in last) - statistics.median(s[k] for s in base)
            step = max((abs(b - a) for a, b in zip(vals, vals[1:])), default=0)
            out.append({"executor": ex, "quantity": k, "growth": growth, "largest_step": step,
                        "at_100": statistics.median(s[k] for s in base)})
    return out


def prediction_bound(growths: list) -> float:
    """The one-sided 99.9 % upper prediction bound of one more growth (kB)."""
    n = len(growths)
    t = T999[n - 2] if n - 1 <= len(T999) else 3.090
    return statistics.mean(growths) + t * statistics.stdev(growths) * math.sqrt(1 + 1 / n)


def slack_kb(growths: list) -> int:
    """The slack (kB, whole MiB) covering every growth seen and the prediction bound."""
    bound = max(growths) if len(growths) < 2 else max(max(growths), prediction_bound(growths))
    return int(math.ceil(bound / 1024) * 1024)


def main(paths: list) -> int:
    if not paths:
        print(__doc__, file=sys.stderr)
        return 2
    rows = []
    for p in paths:
        with open(p) as f:
            r = json.load(f)
        rows += [{"report": p, "mode": r["mode"], "shuffles": r["shuffles"], **s} for s in stats(r)]
    print(f"{'mode':7s} {'report':32s} {'ex':>2s} {'quantity':20s} {'@100':>10s} {'growth':>9s} {'largest step':>12s}")
    for r in rows:
        print(f"{r['mode']:7s} {r['report'][-32:]:32s} {r['executor']:>2s} {r['quantity']:20s} "
              f"{r['at_100']:10.0f} {r['growth']:+9.0f} {r['largest_step']:12.0f}")
    print(f"\n{'mode':7s} {'quantity':20s} {'runs x ex':>9s} {'growth min':>11s} {'growth max':>11s} {'largest step':>12s}")
    for mode in ("default", "plugin"):
        for k in KEYS:
            sel = [r for r in rows if r["mode"] == mode and r["quantity"] == k]
            if sel:
                g = [r["growth"] for r in sel]
                print(f"{mode:7s} {k:20s} {len(sel):9d} {min(g):+11.0f} {max(g):+11.0f} "
                      f"{max(r['largest_step'] for r in sel):12.0f}")
    base = [r["growth"] for r in rows if r["mode"] == "default" and r["quantity"] == "native_rss_kb"]
    plugin = [r["growth"] for r in rows if r["mode"] == "plugin" and r["quantity"] == "native_rss_kb"]
    summary = {"default_runs": len({r["report"] for r in rows if r["mode"] == "default"}),
               "plugin_runs": len({r["report"] for r in rows if r["mode"] == "plugin"}),
               "native_rss_kb_growth_default": base, "native_rss_kb_growth_plugin": plugin,
               "prediction_bound_999_kb": round(prediction_bound(base)) if len(base) > 1 else None,
               "slack_kb": slack_kb(base) if base else None}
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
