"""The 2 x 2 chart of compare.py: W1 ingest, W1 sample, W2 sample vs capacity, W3."""
from __future__ import annotations

import numpy as np

from .backends import ORDER

COLORS = {"numpy_gather": "#999999", "numpy_copy": "#cccccc", "queue": "#8c564b",
          "cpprb": "#ff7f0e", "torchrl": "#d62728", "seed_ring": "#9467bd",
          "seed_deque": "#9467bd", "shmbuf": "#1f77b4", "shmbuf_dreamer": "#17becf",
          "shmbuf_history": "#1f77b4"}


SHORT = {"numpy_gather": "numpy gather\n(ceiling)", "numpy_copy": "numpy contig.\ncopy",
         "queue": "DIY Queue\n+ numpy ring", "cpprb": "cpprb\nMPReplayBuffer",
         "torchrl": "TorchRL\nReplayBuffer", "seed_ring": "seed: Dreamer\nring (1 proc)",
         "seed_deque": "seed: deque\nHistory (1 proc)", "shmbuf": "shmbuf\ncore",
         "shmbuf_dreamer": "shmbuf\nDreamer facade", "shmbuf_history": "shmbuf\nHistoryBuffer"}


def _failed(figs, wl, measure):
    """Backends whose figures failed (not n/a): shown by name, never dropped."""
    out = {}
    for f in figs:
        if f["workload"] == wl and f["measure"] == measure and f["status"] in ("unavailable",
                                                                                 "error"):
            out.setdefault(f["backend"], f["status"])
    return out


def _mark_failed(ax, figs, wl, measure, keys):
    bad = {k: s for k, s in _failed(figs, wl, measure).items()
           if not any(f["backend"] == k and f["status"] == "ok" for f in figs
                      if f["workload"] == wl and f["measure"] == measure)}
    for i, (k, status) in enumerate(bad.items()):
        ax.text(0.99, 0.02 + 0.06 * i, f"{k}: {status}", transform=ax.transAxes, ha="right",
                fontsize=7, color="crimson")


def _ok(figs, wl, measure):
    return [f for f in figs if f["workload"] == wl and f["measure"] == measure
            and f["status"] == "ok"]


def _keys(rows):
    present = {f["backend"] for f in rows}
    return [k for k in dict.fromkeys(ORDER) if k in present]


def _label(rows, key):
    return next(f["label"] for f in rows if f["backend"] == key)


def _bars(ax, rows, groups, series, value, scale, ylabel, title):
    """Grouped bars: one group per entry of ``groups``, one bar per ``series``."""
    width = 0.8 / max(len(series), 1)
    for j, (name, pick) in enumerate(series):
        xs, ys, lo, hi = [], [], [], []
        for i, g in enumerate(groups):
            f = pick(g)
            if f is None:
                continue
            s = f["stats"]
            xs.append(i + (j - (len(series) - 1) / 2) * width)
            ys.append(s[value] * scale)
            lo.append((s[value] - s["min"]) * scale if value == "median" else 0)
            hi.append((s["max"] - s[value]) * scale if value == "median" else 0)
        ax.bar(xs, ys, width, yerr=[lo, hi], capsize=2, label=name,
               color=COLORS.get(name) if name in COLORS else None)
    ax.set_xticks(range(len(groups)))
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.set_yscale("log")
    ax.grid(axis="y", alpha=0.3, which="both")


def _w1_ingest(ax, figs):
    rows = _ok(figs, "W1", "ingest")
    keys = _keys(rows)
    configs = list(dict.fromkeys(f["config"] for f in rows))
    series = [(c.replace(", 1 step/call", "").replace(" rows/call", "")
               .replace("500-step episode/call", "ep 500"),
               lambda k, c=c: next((f for f in rows if f["backend"] == k and f["config"] == c),
                                   None)) for c in configs]
    _bars(ax, rows, keys, series, "median", 1e-3, "k rows/s (log)",
          "W1 ingest: rows/s into the buffer, by writer processes (higher is better)")
    names = dict(SHORT, numpy_copy="memcpy into\n/dev/shm (ceiling)")
    ax.set_xticklabels([names.get(k, k) for k in keys], fontsize=6.5)
    if rows:
        ax.legend(fontsize=5.5, ncol=3)   # nine series (3 modes x 3 writer counts)
    _mark_failed(ax, figs, "W1", "ingest", keys)


def _w1_sample(ax, figs):
    rows = _ok(figs, "W1", "sample")
    keys = _keys(rows)
    for i, k in enumerate(keys):
        s = next(f for f in rows if f["backend"] == k)["stats"]
        ax.bar(i, s["median"] * 1e3, 0.7, yerr=[[(s["median"] - s["min"]) * 1e3],
                                                [(s["max"] - s["median"]) * 1e3]],
               capsize=3, color=COLORS.get(k), hatch="//" if k == "cpprb" else None)
    ceiling = [f for f in rows if f["backend"] == "numpy_gather"]
    if ceiling:
        ax.axhline(ceiling[0]["stats"]["median"] * 1.3e3, ls="--", lw=1, color="gray",
                   label="1.3 x numpy gather (target)")
        ax.legend(fontsize=7, loc="upper left")
    ax.set_xticks(range(len(keys)))
    ax.set_xticklabels([SHORT.get(k, k) for k in keys], fontsize=6.5)
    _mark_failed(ax, figs, "W1", "sample", keys)
    ax.set_ylabel("ms per call (log)")
    ax.set_yscale("log")
    ax.grid(axis="y", alpha=0.3, which="both")
    ax.set_title("W1 sample 50 x 50 (cpprb, hatched: 2500 single steps); lower is better",
                 fontsize=10)


def _w2(ax, figs):
    rows = _ok(figs, "W2", "sample")
    for k in _keys(rows):
        mine = sorted((int(f["config"].split()[-1].replace(",", "")), f["stats"])
                      for f in rows if f["backend"] == k)
        caps = np.array([c for c, _ in mine])
        med = np.array([s["median"] for _, s in mine]) * 1e3
        ax.errorbar(caps, med, yerr=[med - np.array([s["min"] for _, s in mine]) * 1e3,
                                     np.array([s["max"] for _, s in mine]) * 1e3 - med],
                    marker="o", capsize=3, label=_label(rows, k), color=COLORS.get(k))
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xticks([1e4, 1e5, 1e6, 1e7], ["10k", "100k", "1M", "10M"])
    ax.set_xlabel("capacity (steps)")
    ax.set_ylabel("ms per sample(256 x 4) (log)")
    ax.set_title("W2: sample time vs capacity (flat is the goal)", fontsize=10)
    ax.grid(alpha=0.3, which="both")
    if rows:
        ax.legend(fontsize=6)
    _mark_failed(ax, figs, "W2", "sample", [])


def _w3(ax, figs):
    rows = [f for f in figs if f["workload"] == "W3" and f["status"] == "ok"]
    keys = _keys(rows)
    series = [(m, lambda k, m=m: next((f for f in rows if f["backend"] == k
                                       and f["measure"] == m), None))
              for m in ("append", "get")]
    _bars(ax, rows, keys, series, "median", 1e6, "us per call (log)",
          "W3 history: append (16 envs) and get(8) (lower is better)")
    ax.set_xticklabels([SHORT.get(k, k) for k in keys], fontsize=6.5)
    if rows:
        ax.legend(fontsize=7)
    _mark_failed(ax, figs, "W3", "get", keys)


def _plain_ticks(ax):
    from matplotlib.ticker import FuncFormatter

    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(FuncFormatter(
        lambda v, _: f"{v:g}" if f"{v:.0e}"[0] in "25" else ""))
    ax.tick_params(axis="y", which="minor", labelsize=7)


def draw(plt, figs):
    fig, axes = plt.subplots(2, 2, figsize=(14, 9.5))
    for ax, part in zip(axes.flat, (_w1_ingest, _w1_sample, _w2, _w3)):
        try:
            part(ax, figs)
            if ax.get_yscale() == "log":
                _plain_ticks(ax)
        except (StopIteration, ValueError) as exc:   # a workload that was not run
            ax.set_title(f"{part.__name__.strip('_')}: not drawn ({type(exc).__name__})")
    fig.tight_layout()
    return fig
