#!/usr/bin/env python3
"""Checks a benchmark report for completeness and draws it beside the JSON (matplotlib).

    plot_bench.py KIND REPORT.json [OUT.png] [--check-only]

KIND is one of
  engine  target/bench/engine.json        (scripts/bench-engine.sh): throughput against block
          size per system (iperf3, Spark's Netty transfer, the engine), and 4 KiB blocks/s,
          p50/p99 latency and CPU per GiB side by side;
  scale   target/bench/scale.json         (scripts/bench-scale.sh): threads, fds, RSS and
          registered memory of one engine against its number of peers, tcp and verbs;
  spark   target/bench/spark.json         (scripts/bench-spark.sh): plugin vs default per job,
          every round's time as a dot;
  verbs   target/bench/engine-verbs.json  (scripts/bench-engine.sh --provider verbs): SEND and
          READ throughput and p50 latency against block size;
  tpcds   target/bench/tpcds*.json        (scripts/bench-tpcds.sh): plugin/default time per
          query, sorted, with the spread over rounds, and each query's shuffle bytes beside it.

Before drawing, the report is checked: every key the report promises is present and every
number in it is finite (speeds are never asserted). A failed check prints what is missing and
exits 1. OUT.png defaults to the report's name with .png. Needs matplotlib (Debian's
python3-matplotlib; the bench scripts install it).
"""
import json
import math
import sys
from pathlib import Path


class Incomplete(Exception):
    pass


def finite(v, where):
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise Incomplete(f"{where} is {v!r}, not a finite number")
    return v


def need(obj, keys, where, positive=False):
    for k in keys:
        if k not in obj:
            raise Incomplete(f"{where}: key '{k}' is missing")
        v = finite(obj[k], f"{where}.{k}")
        if positive and v <= 0:
            raise Incomplete(f"{where}.{k} is {v}, expected > 0")


ENGINE_KEYS = ["iperf3_gbps", "netty_gbps", "engine_gbps", "ratio_vs_iperf3", "small_blocks_per_s",
               "netty_small_blocks_per_s", "small_p50_us", "small_p99_us", "netty_small_p50_us",
               "netty_small_p99_us", "cpu_s_per_gib_engine", "cpu_s_per_gib_netty"]
SCALE_ROW_KEYS = ["peers", "threads", "registered_bytes", "rss_bytes", "fds"]


def check_engine(r):
    need(r, ENGINE_KEYS, "engine.json", positive=True)
    rounds = r.get("rounds") or []
    if not rounds:
        raise Incomplete("engine.json: no per-round values ('rounds')")
    for i, x in enumerate(rounds):
        need(x, [k for k in ENGINE_KEYS if k != "ratio_vs_iperf3"], f"engine.json rounds[{i}]", positive=True)
    sizes = r.get("sizes") or []
    if not any(s.get("bytes") == 1 << 20 for s in sizes):
        raise Incomplete("engine.json: no 1 MiB entry in 'sizes'")
    for s in sizes:
        need(s, ["bytes", "engine_gbps", "netty_gbps"], f"engine.json sizes[{s.get('bytes')}]", positive=True)
    for t in r.get("targets") or []:
        need(t, ["value", "goal"], f"engine.json target '{t.get('target')}'")
    issues = [t.get("issue") for t in r.get("targets") or []]
    if issues.count(13) + issues.count(21) != 10:
        raise Incomplete("engine.json: expected the 10 targets of issues 13 and 21")
    if issues.count(40) < 5:
        raise Incomplete("engine.json: expected issue 40's targets (1 MiB against Netty and iperf3, 4 KiB p50/p99)")
    for s in sizes:
        need(s, ["ratio_vs_netty", "cpu_ratio_vs_netty"], f"engine.json sizes[{s.get('bytes')}]", positive=True)
    for sys in ("engine", "netty"):
        for mode in ("one_at_a_time", "in_flight_64"):
            x = ((r.get("scheduler") or {}).get(sys) or {}).get(mode)
            if x is None:
                raise Incomplete(f"engine.json: no scheduler counts for {sys} {mode}")
            need(x.get("switches_per_1000") or {}, ["median"], f"engine.json scheduler {sys} {mode}", positive=True)


def check_scale(r):
    sections = [k for k in ("peers", "verbs_peers") if k in r]
    if not sections:
        raise Incomplete("scale.json: neither 'peers' nor 'verbs_peers'")
    for sec in sections:
        rows = r[sec]
        if not rows:
            raise Incomplete(f"scale.json: '{sec}' is empty")
        for row in rows:
            need(row, SCALE_ROW_KEYS, f"scale.json {sec}[peers={row.get('peers')}]")
            need(row, ["peers", "threads", "rss_bytes", "fds"], f"scale.json {sec}[peers={row.get('peers')}]",
                 positive=True)
            if row.get("blocks_fetched_in_window", 0) <= 0 or row.get("blocks_served_in_window", 0) <= 0:
                raise Incomplete(f"scale.json {sec}[peers={row['peers']}]: no traffic in the window")


def check_spark(r):
    jobs = r.get("jobs") or []
    if not jobs:
        raise Incomplete("spark.json: no jobs")
    for j in jobs:
        need(j, ["default_s", "plugin_s", "ratio"], f"spark.json job {j.get('name')}", positive=True)
        for k in ("default_runs_s", "plugin_runs_s"):
            if not j.get(k):
                raise Incomplete(f"spark.json job {j.get('name')}: '{k}' is empty")
            for v in j[k]:
                finite(v, f"spark.json job {j.get('name')}.{k}")


def check_verbs(r):
    sizes = r.get("sizes") or []
    if not sizes:
        raise Incomplete("engine-verbs.json: no sizes")
    for s in sizes:
        need(s, ["bytes", "send_mbps", "read_mbps", "send_p50_us", "read_p50_us"],
             f"engine-verbs.json sizes[{s.get('bytes')}]", positive=True)
    for k in ("crossover_bytes", "device", "note"):
        if k not in r:
            raise Incomplete(f"engine-verbs.json: key '{k}' is missing")


def human(b):
    b = int(b)
    if b >= 1 << 20:
        return f"{b >> 20} MiB"
    if b >= 1 << 10:
        return f"{b >> 10} KiB"
    return f"{b} B"


def errbars(med, lo, hi):
    return [[m - l for m, l in zip(med, lo)], [h - m for m, h in zip(med, hi)]]


def plot_engine(r, plt):
    fig, ax = plt.subplots(2, 2, figsize=(12, 8.5))
    sizes = sorted(r["sizes"], key=lambda s: s["bytes"])
    x = [s["bytes"] for s in sizes]

    def by_size(a, series, ylabel, title):
        """One line per (key, label, color) of `series` against block size, min..max bars."""
        for key, label, color in series:
            med = [s[key] for s in sizes]
            spread = [s.get(f"{key}_spread") or {} for s in sizes]
            lo = [sp.get("min", m) for sp, m in zip(spread, med)]
            hi = [sp.get("max", m) for sp, m in zip(spread, med)]
            a.errorbar(x, med, yerr=errbars(med, lo, hi), marker="o", capsize=3, label=label, color=color)
        a.set_xscale("log", base=2)
        a.set_xticks(x, [human(b) for b in x])
        a.set_xlabel("block size")
        a.set_ylabel(ylabel)
        a.set_title(title)

    a = ax[0][0]
    ip = r["spread"].get("iperf3_gbps") or {}
    a.axhline(r["iperf3_gbps"], color="gray", ls="--", label="iperf3 -l 1M (ceiling)")
    if ip:
        a.axhspan(ip["min"], ip["max"], color="gray", alpha=0.12)
    by_size(a, (("engine_gbps", "engine (tcp)", "tab:blue"), ("netty_gbps", "Spark (Netty)", "tab:orange")),
            "Gbit/s (median, bars: min..max)", "throughput, loopback, two processes per system")
    a.legend()
    a.grid(alpha=0.3)

    def bars(a, keys, labels, title, ylabel, log=False):
        sp = r["spread"]
        med = [r[k] for k in keys]
        lo = [(sp.get(k) or {}).get("min", m) for k, m in zip(keys, med)]
        hi = [(sp.get(k) or {}).get("max", m) for k, m in zip(keys, med)]
        colors = ["tab:orange" if "netty" in k else "tab:blue" for k in keys]
        a.bar(range(len(keys)), med, yerr=errbars(med, lo, hi), capsize=4, color=colors)
        a.set_xticks(range(len(keys)), labels)
        a.set_title(title)
        a.set_ylabel(ylabel)
        if log:
            a.set_yscale("log")
        a.grid(alpha=0.3, axis="y")
        for i, m in enumerate(med):
            a.annotate(f"{m:,.0f}" if m >= 100 else f"{m:.2f}", (i, m), ha="center", va="bottom", fontsize=8)

    bars(ax[0][1], ["netty_small_blocks_per_s", "small_blocks_per_s"], ["Spark (Netty)", "engine"],
         "4 KiB blocks/s, 64 in flight", "blocks/s")
    bars(ax[1][0], ["netty_small_p50_us", "small_p50_us", "netty_small_p99_us", "small_p99_us"],
         ["Spark p50", "engine p50", "Spark p99", "engine p99"], "4 KiB fetch latency, one at a time",
         "µs (log)", log=True)
    a = ax[1][1]
    a.axhline(1.0, color="gray", ls="--")
    by_size(a, (("ratio_vs_netty", "throughput, engine ÷ Netty", "tab:blue"),
                ("cpu_ratio_vs_netty", "CPU s/GiB, engine ÷ Netty", "tab:green")),
            "ratio (median of per-round ratios)", "engine ÷ Spark (Netty) by block size (both processes' CPU)")
    a.legend()
    a.grid(alpha=0.3)
    fig.suptitle(f"engine vs Spark {r.get('spark_version', '')} block transfer vs iperf3 — "
                 f"{r.get('rounds_timed')} interleaved rounds, medians")
    return fig


def plot_scale(r, plt):
    fig, ax = plt.subplots(2, 2, figsize=(11, 8))
    panels = [("threads", "threads", 1), ("fds", "open fds", 1), ("rss_bytes", "RSS MiB", 1 << 20),
              ("registered_bytes", "registered MiB", 1 << 20)]
    for sec, label, style in (("peers", "tcp", "-o"), ("verbs_peers", "verbs (SoftRoCE)", "--s")):
        rows = r.get(sec) or []
        if not rows:
            continue
        p = [row["peers"] for row in rows]
        for a, (k, title, div) in zip(ax.flat, panels):
            a.plot(p, [row[k] / div for row in rows], style, label=label)
    counts = sorted({row["peers"] for sec in ("peers", "verbs_peers") for row in r.get(sec) or []})
    for a, (k, title, _) in zip(ax.flat, panels):
        a.set_title(title)
        a.set_xlabel("peer engines")
        a.set_xscale("log", base=2)
        a.set_xticks(counts, [str(c) for c in counts])
        a.grid(alpha=0.3)
        a.legend()
        a.set_ylim(bottom=0)
    fig.suptitle("one engine serving and fetching with N peers (processes), traffic flowing")
    return fig


def plot_spark(r, plt):
    jobs = r["jobs"]
    fig, a = plt.subplots(figsize=(max(6, 2.6 * len(jobs)), 5))
    w = 0.38
    for i, j in enumerate(jobs):
        for off, mode, color in ((-w / 2, "default", "tab:orange"), (w / 2, "plugin", "tab:blue")):
            runs = j[f"{mode}_runs_s"]
            a.bar(i + off, j[f"{mode}_s"], w, color=color, alpha=0.75,
                  yerr=[[j[f"{mode}_s"] - min(runs)], [max(runs) - j[f"{mode}_s"]]], capsize=4,
                  label=("Spark default shuffle" if mode == "default" else "plugin") if i == 0 else None)
            a.scatter([i + off] * len(runs), runs, color="black", s=10, zorder=3)
        a.annotate(f"plugin/default {j['ratio']:.2f}", (i, max(j["default_s"], j["plugin_s"])), ha="center",
                   va="bottom", fontsize=9)
    a.set_xticks(range(len(jobs)), [j["name"] for j in jobs])
    a.set_ylabel("job wall time, s (bar: mean; dots: rounds; whiskers: min..max)")
    wl = r.get("workload", {})
    a.set_title(f"{wl.get('records', '?')} records, {wl.get('master', '')}, {wl.get('rounds', '?')} rounds, "
                f"Spark {wl.get('spark_version', '')}")
    a.legend()
    a.grid(alpha=0.3, axis="y")
    return fig


def plot_verbs(r, plt):
    sizes = sorted(r["sizes"], key=lambda s: s["bytes"])
    x = [s["bytes"] for s in sizes]
    fig, ax = plt.subplots(1, 2, figsize=(12, 4.5))
    for k, label, color in (("send", "eager SEND", "tab:green"), ("read", "rendezvous RDMA READ", "tab:purple")):
        ax[0].plot(x, [s[f"{k}_mbps"] for s in sizes], "-o", label=label, color=color)
        ax[1].plot(x, [s[f"{k}_p50_us"] for s in sizes], "-o", label=label, color=color)
    if r.get("crossover_bytes"):
        for a in ax:
            a.axvline(r["crossover_bytes"], color="gray", ls=":", label="crossover")
    for a, yl in zip(ax, ("Mbit/s", "p50 µs, one block alone (log)")):
        a.set_xscale("log", base=2)
        a.set_xticks(x, [human(b) for b in x])
        a.set_xlabel("block size")
        a.set_ylabel(yl)
        a.grid(alpha=0.3)
        a.legend()
    ax[1].set_yscale("log")
    fig.suptitle(f"SEND vs READ on {r.get('device', '?')} (kernel {r.get('kernel', '?')}): "
                 "SoftRoCE under emulation, compare within the run")
    return fig


def check_tpcds(r):
    need(r, ["equal", "total", "sum_ratio", "geomean_ratio"], "tpcds.json", positive=True)
    qs = r.get("queries") or []
    if len(qs) != r["total"]:
        raise Incomplete(f"tpcds.json: {len(qs)} queries, 'total' says {r['total']}")
    for q in qs:
        need(q, ["default_s", "plugin_s", "ratio"], f"tpcds.json query {q.get('query')}", positive=True)
        need(q, ["shuffle_bytes"], f"tpcds.json query {q.get('query')}")
        if not isinstance(q.get("equal"), bool) or not q.get("ratio_per_round"):
            raise Incomplete(f"tpcds.json query {q.get('query')}: 'equal' or 'ratio_per_round' missing")
    if "generator" not in r.get("workload", {}):
        raise Incomplete("tpcds.json: the data generator is not recorded (workload.generator)")


def plot_tpcds(r, plt):
    qs = sorted(r["queries"], key=lambda q: q["ratio"])
    n = len(qs)
    fig, ax = plt.subplots(1, 2, figsize=(13, max(6, 0.16 * n + 1.5)), sharey=True,
                           gridspec_kw={"width_ratios": [3, 2]})
    y = list(range(n))
    med = [q["ratio"] for q in qs]
    lo = [min(q["ratio_per_round"]) for q in qs]
    hi = [max(q["ratio_per_round"]) for q in qs]
    colors = ["tab:red" if q.get("slow") else ("tab:gray" if not q["equal"] else "tab:blue") for q in qs]
    a = ax[0]
    a.barh(y, [m - 1 for m in med], left=1, color=colors, alpha=0.75)
    a.errorbar(med, y, xerr=[[max(0, m - l) for m, l in zip(med, lo)], [max(0, h - m) for m, h in zip(med, hi)]],
               fmt="none", ecolor="black", capsize=2, lw=0.8)
    a.axvline(1.0, color="black", lw=0.8)
    a.axvline(1.10, color="tab:red", ls=":", lw=0.8, label="1.10x")
    a.set_yticks(y, [q["query"] for q in qs], fontsize=6)
    a.set_xlabel("plugin / default time (median over rounds; whiskers: per-round min..max)")
    a.legend(loc="lower right")
    a.grid(alpha=0.3, axis="x")
    b = ax[1]
    b.barh(y, [q["shuffle_bytes"] / 2**20 for q in qs], color="tab:green", alpha=0.75)
    b.set_xscale("symlog", linthresh=1)
    b.set_xlabel("shuffle bytes written by the query, MiB")
    b.grid(alpha=0.3, axis="x")
    wl = r.get("workload", {})
    fig.suptitle(f"TPC-DS SF {wl.get('sf', '?')}, Spark {wl.get('spark_version', '?')}, {wl.get('where', '')}, "
                 f"{wl.get('rounds', '?')} rounds: {r['equal']}/{r['total']} equal, sum ratio "
                 f"{r['sum_ratio']}, geomean {r['geomean_ratio']}")
    return fig


KINDS = {"tpcds": (check_tpcds, plot_tpcds), "engine": (check_engine, plot_engine), "scale": (check_scale, plot_scale),
         "spark": (check_spark, plot_spark), "verbs": (check_verbs, plot_verbs)}


def main(argv):
    args = [a for a in argv if a != "--check-only"]
    check_only = len(args) != len(argv)
    if len(args) not in (2, 3) or args[0] not in KINDS:
        print(__doc__, file=sys.stderr)
        return 2
    kind, report = args[0], Path(args[1])
    out = Path(args[2]) if len(args) == 3 else report.with_suffix(".png")
    check, draw = KINDS[kind]
    try:
        r = json.loads(report.read_text())
        check(r)
    except (OSError, ValueError, Incomplete, KeyError, TypeError) as e:
        print(f"plot_bench: {report} is incomplete: {e}", file=sys.stderr)
        return 1
    print(f"plot_bench: {report}: complete")
    if check_only:
        return 0
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig = draw(r, plt)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"plot_bench: drew {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
