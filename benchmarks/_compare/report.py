"""Figures, targets, the fixed-format table, the markdown tables and the chart of compare.py.

A figure is a plain dict (it goes to JSON as it is): workload, measure,
config, backend, unit ("s" per call or "rows/s"), status ("ok", "n/a",
"unavailable", "error") and reason, stats (median, min, max, n, values) and
ratio (backend / shmbuf in the figure's unit, per repetition when
``paired``).
"""
from __future__ import annotations

import statistics
import traceback

from .backends import BACKENDS, ORDER
from .base import NotApplicable, Unavailable
from .history import AB, N_ENVS

LABELS = {c.key: c.label for c in BACKENDS}
PEERS = ("queue", "cpprb", "torchrl", "seed_ring")


# -- figures ------------------------------------------------------------------------------------
def summarize(values) -> dict:
    vals = [float(v) for v in values]
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals),
            "n": len(vals), "values": vals}


def figure(wl, measure, config, backend, unit, values=(), status="ok", reason="",
           ratios=None, note="") -> dict:
    """One result row; ``ratios`` are per-repetition backend / shmbuf values."""
    fig = {"workload": wl, "measure": measure, "config": config, "backend": backend.key,
           "label": backend.label, "unit": unit, "status": status, "reason": reason,
           "note": note or backend.note.get(wl, ""), "stats": None, "ratio": None}
    if len(values):
        fig["stats"] = summarize(values)
    if ratios:
        fig["ratio"] = dict(summarize(ratios), paired=True)
    return fig


def set_ratio_of_medians(fig: dict, ref: dict) -> None:
    """Ratio of medians, its range min/max .. max/min (the two were not interleaved)."""
    s = fig["stats"]
    fig["ratio"] = {"median": s["median"] / ref["median"], "min": s["min"] / ref["max"],
                    "max": s["max"] / ref["min"], "paired": False}


def failure(exc) -> tuple[str, str]:
    if isinstance(exc, NotApplicable):
        return "n/a", str(exc)
    if isinstance(exc, Unavailable):
        return "unavailable", str(exc)
    traceback.print_exc()
    return "error", f"{type(exc).__name__}: {exc}"[:300]


def find(figs, wl, measure, config, backend):
    for f in figs:
        if (f["workload"], f["measure"], f["config"], f["backend"]) == (wl, measure, config,
                                                                         backend):
            return f
    return None


# -- formatting ------------------------------------------------------------------------------------
def fmt(value: float, unit: str) -> str:
    if unit == "s":
        for factor, name in ((1.0, "s"), (1e-3, "ms"), (1e-6, "us")):
            if abs(value) >= factor:
                return f"{value / factor:.3g} {name}"
        return f"{value / 1e-9:.3g} ns"
    for factor, name in ((1e6, "M/s"), (1e3, "k/s")):
        if abs(value) >= factor:
            return f"{value / factor:.3g}{name}"
    return f"{value:.3g}/s"


def stat_cell(fig, spread=True) -> str:
    if fig is None:
        return "-"
    if fig["status"] != "ok":
        return fig["status"]
    s, unit = fig["stats"], fig["unit"]
    if not spread:
        return fmt(s["median"], unit)
    return f"{fmt(s['median'], unit)} [{fmt(s['min'], unit)} - {fmt(s['max'], unit)}]"


def ratio_cell(fig, spread=True) -> str:
    r = fig and fig.get("ratio")
    if not r:
        return "-"
    core = f"{r['median']:.3g}x"
    return f"{core} [{r['min']:.3g}-{r['max']:.3g}]" if spread else core


def verdict(fig) -> str:
    """How shmbuf compares, in words: time ratios > 1 and rate ratios < 1 favour it."""
    r = fig and fig.get("ratio")
    if not r or fig["backend"] in ("shmbuf", "shmbuf_history"):
        return ""
    speed = r["median"] if fig["unit"] == "s" else 1 / r["median"]
    return f"shmbuf {speed:.2g}x faster" if speed >= 1 else f"shmbuf {1 / speed:.2g}x slower"


def table(figs, targets, meta) -> str:
    widths = (8, 14, 34, 34, 36, 22, 22)
    heads = ("workload", "measure", "config", "backend", "median [min - max]",
             "backend/shmbuf", "")
    lines = ["  ".join(f"{h:<{w}}" for h, w in zip(heads, widths))]
    lines.append("-" * len(lines[0]))
    for f in figs:
        if f["status"] == "ok":
            tail = (stat_cell(f), ratio_cell(f), verdict(f))
        else:
            tail = (f"{f['status'].upper()}: {f['reason']}", "", "")
        cells = (f["workload"], f["measure"], f["config"], f["label"]) + tail
        lines.append("  ".join(f"{c:<{w}}" for c, w in zip(cells, widths)))
    lines += ["", "targets:"]
    for t in targets:
        met = {True: "met", False: "MISSED", None: "n/a"}[t["met"]]
        lines.append(f"  [{met:>6}] {t['target']}: {t['detail']}")
    lines += ["", "notes:"]
    seen = set()
    for f in figs:
        if f["note"] and (f["backend"], f["workload"]) not in seen:
            seen.add((f["backend"], f["workload"]))
            lines.append(f"  {f['workload']} {f['label']}: {f['note']}")
    m = meta
    lines.append(f"\nmode={m['mode']}  wall={m['wall_seconds']} s  cpus={m['machine']['cpus']}  "
                 f"load1 before/after={m['load1_before_after'][0]:.2f}/"
                 f"{m['load1_before_after'][1]:.2f}  "
                 f"leaked segments={m['leaked_segments'] or 'none'}")
    return "\n".join(lines)


# -- targets ---------------------------------------------------------------------------------------
def _target(text, value, limit, met, detail) -> dict:
    return {"target": text, "value": value, "limit": limit, "met": met, "detail": detail}


def targets(figs) -> list[dict]:
    out = []
    g = find(figs, "W1", "sample", "50 x 50 (L x B)", "numpy_gather")
    if g and g["ratio"]:
        v = 1 / g["ratio"]["median"]
        out.append(_target("W1 sample within 1.3x of the numpy gather", v, "<= 1.3", v <= 1.3,
                           f"shmbuf / numpy gather = {v:.3g}x (paired per repetition)"))
    peers = [f for f in figs if f["workload"] == "W1" and f["measure"] == "sample"
             and f["backend"] in PEERS]
    ok = [f for f in peers if f["ratio"]]
    if ok:
        worst = min(ok, key=lambda f: f["ratio"]["median"])
        v = worst["ratio"]["median"]
        missing = [f["label"] + f" ({f['status']})" for f in peers if not f["ratio"]]
        out.append(_target("W1 sample no slower than any peer", v, ">= 1 (peer / shmbuf)",
                           v >= 1, f"closest peer: {worst['label']} at {v:.3g}x shmbuf's time"
                           + (f"; not measured: {', '.join(missing)}" if missing else "")))
    ran_ingest = any(f["workload"] == "W1" and f["measure"] == "ingest" for f in figs)
    if ran_ingest:
        out += _ingest_targets(figs)
    for mode in ("add, 1 step/call", "16 env rows/call", "500-step episode/call") \
            if ran_ingest else ():
        for peer, limit in (("queue", 5.0), ("cpprb", 2.0)):
            f = find(figs, "W1", "ingest", f"{mode}, 2 writers", peer)
            text = f"W1 ingest, 2 writers, {mode}: >= {limit:g}x {LABELS[peer]}"
            if f and f["ratio"]:
                v = 1 / f["ratio"]["median"]
                out.append(_target(text, v, f">= {limit:g}", v >= limit,
                                   f"shmbuf / {peer} = {v:.3g}x (ratio of medians)"))
            else:
                why = f"{f['status']}: {f['reason']}" if f else "not run"
                out.append(_target(text, None, f">= {limit:g}", None, f"{peer}: {why}"))
    small = find(figs, "W2", "sample", "capacity 10,000", "shmbuf")
    big = find(figs, "W2", "sample", "capacity 10,000,000", "shmbuf")
    if small and big and small["stats"] and big["stats"]:
        v = big["stats"]["median"] / small["stats"]["median"]
        out.append(_target("W2 sample time growth 10k -> 10M < 1.2x", v, "< 1.2", v < 1.2,
                           f"{fmt(small['stats']['median'], 's')} -> "
                           f"{fmt(big['stats']['median'], 's')} = {v:.3g}x"))
        g_small = find(figs, "W2", "sample", "capacity 10,000", "numpy_gather")
        g_big = find(figs, "W2", "sample", "capacity 10,000,000", "numpy_gather")
        if g_small and g_big and g_small["stats"] and g_big["stats"]:
            g = g_big["stats"]["median"] / g_small["stats"]["median"]
            out.append(_target(
                "W2 growth 10k -> 10M <= 1.2x the numpy gather's growth (same run)", v / g,
                "<= 1.2", v / g <= 1.2, f"shmbuf grows {v:.3g}x, the numpy gather of the same "
                f"rows {g:.3g}x: {v / g:.3g}x"))
    get = find(figs, "W3", "get", f"{N_ENVS} envs, get(8), action_block {AB}", "numpy_copy")
    if get and get["ratio"]:
        v = 1 / get["ratio"]["median"]
        out.append(_target("W3 HistoryBuffer get within 1.5x of a bare copy of its bytes", v,
                           "<= 1.5", v <= 1.5, f"get / contiguous copy = {v:.3g}x (paired per "
                           "repetition)"))
    for config in ("2 writers", "2 writers, pinned apart"):
        p50 = find(figs, "W1", "latency p50", config, "shmbuf")
        p99 = find(figs, "W1", "latency p99", config, "shmbuf")
        if p50 and p99 and p50["stats"] and p99["stats"]:
            v = p99["stats"]["median"] / p50["stats"]["median"]
            text = f"sample p99 <= 2x p50 under writes ({config})"
            out.append(_target(text, v, "<= 2", v <= 2,
                               f"p50 {fmt(p50['stats']['median'], 's')}, "
                               f"p99 {fmt(p99['stats']['median'], 's')}: {v:.3g}x"))
    return out


def _ingest_targets(figs) -> list[dict]:
    """Issue 13's ingest targets: per-writer add vs an in-process ring; episodes vs memcpy."""
    out = []
    two = find(figs, "W1", "ingest", "add, 1 step/call, 2 writers", "shmbuf")
    ring = find(figs, "W1", "ingest", "add, 1 step/call, 1 writer", "seed_ring")
    text = "W1 add, 2 writers: each writer >= an in-process numpy ring's add (1 stream)"
    if two and ring and two["stats"] and ring["stats"]:
        v = two["stats"]["median"] / 2 / ring["stats"]["median"]
        out.append(_target(text, v, ">= 1", v >= 1,
                           f"{fmt(two['stats']['median'] / 2, '/s')} per writer / "
                           f"{fmt(ring['stats']['median'], '/s')} = {v:.3g}x (ratio of medians)"))
    else:
        out.append(_target(text, None, ">= 1", None, "not run"))
    ep = find(figs, "W1", "ingest", "500-step episode/call, 2 writers", "shmbuf")
    cp = find(figs, "W1", "ingest", "500-step episode/call, 2 writers", "numpy_copy")
    text = ("W1 extend of 500-step episodes, 2 writers: >= 60% of 2 processes copying the same "
            "bytes")
    if ep and cp and ep["stats"] and cp["stats"]:
        v = ep["stats"]["median"] / cp["stats"]["median"]
        out.append(_target(text, v, ">= 0.6", v >= 0.6,
                           f"{fmt(ep['stats']['median'], '/s')} / "
                           f"{fmt(cp['stats']['median'], '/s')} = {v:.3g}x (ratio of medians)"))
    else:
        out.append(_target(text, None, ">= 0.6", None, "not run"))
    return out


# -- markdown --------------------------------------------------------------------------------
def _backends_in(figs):
    keys = {f["backend"] for f in figs}
    return [k for k in dict.fromkeys(ORDER) if k in keys]


def _md_matrix(figs, wl, measure, configs, spread=False) -> list[str]:
    rows = [f for f in figs if f["workload"] == wl and f["measure"] in measure]
    head = ["backend"] + [c for c in configs]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key in _backends_in(rows):
        cells = []
        for config in configs:
            m = [f for f in rows if f["backend"] == key and f["config"] == config]
            if not m:
                cells.append("-")
                continue
            f = m[0]
            cell = stat_cell(f, spread)
            if f["status"] == "ok" and f["ratio"] and key not in ("shmbuf", "shmbuf_history"):
                cell += f" ({ratio_cell(f, False)})"
            cells.append(cell)
        if all(c in ("n/a", "-") for c in cells):
            continue     # listed under the table with the reason
        label = next(f["label"] for f in rows if f["backend"] == key)
        lines.append("| " + " | ".join([label] + cells) + " |")
    return lines


def _md_reasons(figs, wl, measures) -> list[str]:
    """One line per backend and reason that has no figure: failures, then n/a."""
    out, seen = [], set()
    for f in sorted(figs, key=lambda f: f["status"] == "n/a"):
        if (f["workload"] != wl or f["measure"] not in measures or f["status"] == "ok"
                or (f["backend"], f["reason"]) in seen):
            continue
        seen.add((f["backend"], f["reason"]))
        status = f["status"] if f["status"] == "n/a" else f"**{f['status']}**"
        out.append(f"- {f['label']}: {status} ({f['reason']})")
    return out


def markdown(figs, targets_, meta) -> str:
    out = []
    cfgs = list(dict.fromkeys(f["config"] for f in figs if f["workload"] == "W1"
                              and f["measure"] == "ingest"))
    if cfgs:
        out += ["**W1 ingest**, rows/s, median of the rounds (backend / shmbuf; < 1 means "
                "shmbuf is faster):", ""]
        out += _md_matrix(figs, "W1", ("ingest",), cfgs) + [""]
        out += _md_reasons(figs, "W1", ("ingest",)) + [""]
    for wl, measures, title in (("W1", ("sample",), "**W1 sample** 50 x 50, time per call"),
                                ("W2", ("sample",), "**W2 sample** 256 x 4, time per call"),
                                ("W3", ("append", "get"), "**W3 history**, time per call")):
        rows = [f for f in figs if f["workload"] == wl and f["measure"] in measures]
        if not rows:
            continue
        cfgs = list(dict.fromkeys(f["config"] if wl != "W3" else f["measure"] for f in rows))
        out += [f"{title} (backend / shmbuf, paired; > 1 means shmbuf is faster):", ""]
        if wl == "W3":
            view = [dict(f, config=f["measure"]) for f in rows]
            out += _md_matrix(view, wl, measures, cfgs, spread=True)
        else:
            out += _md_matrix(rows, wl, measures, cfgs, spread=(wl == "W1"))
        out += [""] + _md_reasons(figs, wl, measures) + [""]
    lat = [f for f in figs if f["measure"].startswith("latency")]
    if lat:
        out += ["**W1 sample latency** (single calls, pooled percentiles):", "",
                "| condition | shmbuf p50 | shmbuf p99 | p99/p50 | numpy gather p50 | "
                "numpy gather p99 |", "|---|---|---|---|---|---|"]
        for config in dict.fromkeys(f["config"] for f in lat):
            got = {(f["backend"], f["measure"]): f for f in lat if f["config"] == config}
            c = [stat_cell(got.get((b, f"latency p{q}")), False)
                 for b in ("shmbuf",) for q in (50, 99)]
            s50, s99 = got.get(("shmbuf", "latency p50")), got.get(("shmbuf", "latency p99"))
            ratio = (f"{s99['stats']['median'] / s50['stats']['median']:.2f}"
                     if s50 and s99 and s50["stats"] and s99["stats"] else "-")
            n = [stat_cell(got.get(("numpy_gather", f"latency p{q}")), False) for q in (50, 99)]
            out.append(f"| {config} | {c[0]} | {c[1]} | {ratio} | {n[0]} | {n[1]} |")
        out += [""]
    out += ["**Targets**:", "", "| target | result | met? |", "|---|---|---|"]
    for t in targets_:
        met = {True: "yes", False: "**no**", None: "n/a"}[t["met"]]
        out.append(f"| {t['target']} | {t['detail']} | {met} |")
    mach = meta["machine"]
    out += ["", f"Run: `{meta['command']}`, {meta['mode']} mode, {meta['wall_seconds']} s, "
            f"shmbuf {mach.get('shmbuf_commit')}, "
            f"{mach['cpus']} cores, {mach['ram_gib']} GiB RAM, Python {mach['python']}, "
            f"numpy {mach['numpy']}, cpprb {mach['cpprb']}, torch {mach['torch']}, "
            f"torchrl {mach['torchrl']}, tensordict {mach['tensordict']}; 1-min load "
            f"{meta['load1_before_after'][0]:.2f} before, {meta['load1_before_after'][1]:.2f} "
            f"after; per workload (start/end): "
            + ", ".join(f"{s['section']} {s['load1_start']:.2f}/{s['load1_end']:.2f}"
                        for s in meta.get("sections", [])) + ".", ""]
    return "\n".join(out)


# -- chart -----------------------------------------------------------------------------------------
def chart(figs, path):
    """Write the PNG; return None, or why there is no chart."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        return f"matplotlib not importable: {exc}"
    from .chart import draw

    fig = draw(plt, figs)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
