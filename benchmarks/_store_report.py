"""bench_store's results: one ``Row`` per figure, its ratio and target, the table and JSON form.

A row holds every repetition of shmbuf and of its baseline; ``print_table``
prints the median and min-max of each side, the ratio shmbuf / baseline and
whether the target was met, and ``Row.to_json`` gives the same for the JSON file.
"""
from __future__ import annotations

import dataclasses
import statistics


def summarize(values) -> dict:
    vals = [float(v) for v in values]
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals),
            "n": len(vals), "values": vals}


@dataclasses.dataclass
class Row:
    key: str
    label: str
    unit: str               # "s", "/s", "MiB", "s/GiB"
    shmbuf: list
    baseline: list
    baseline_label: str
    target: tuple | None = None   # (what, op, value): what in {"ratio", "shmbuf"}
    paired: bool = True           # repetitions were interleaved: ratio per pair
    error: str | None = None
    extra: dict = dataclasses.field(default_factory=dict)

    def ratio(self) -> dict | None:
        s, b = self.shmbuf, self.baseline
        if not s or not b or self.unit == "flag":
            return None
        if self.paired and len(s) == len(b):
            return summarize([x / y for x, y in zip(s, b)])
        out = summarize([statistics.median(s) / statistics.median(b)])
        out.update(min=min(s) / max(b), max=max(s) / min(b), n=0, values=[])
        return out

    def met(self) -> bool | None:
        if self.error or self.target is None:
            return None
        what, op, value = self.target
        got = (self.ratio() or {}).get("median") if what == "ratio" else \
            statistics.median(self.shmbuf)
        return None if got is None else (got <= value if op == "<=" else got >= value)

    def target_text(self) -> str:
        if self.target is None:
            return "-"
        what, op, value = self.target
        if self.unit == "flag":
            return "absent"
        return f"{op} {value:g}x" if what == "ratio" else f"{op} {_fmt_one(value, self.unit)}"

    def to_json(self) -> dict:
        return {"key": self.key, "measurement": self.label, "unit": self.unit,
                "baseline_is": self.baseline_label, "error": self.error,
                "shmbuf": summarize(self.shmbuf) if self.shmbuf else None,
                "baseline": summarize(self.baseline) if self.baseline else None,
                "ratio": self.ratio(), "ratio_is": "shmbuf / baseline",
                "ratio_paired": self.paired, "target": self.target_text(), "met": self.met(),
                **self.extra}


def _scale(value: float, unit: str) -> tuple[float, str]:
    if unit == "s":
        for factor, name in ((1.0, "s"), (1e-3, "ms"), (1e-6, "us")):
            if abs(value) >= factor:
                return factor, name
        return 1e-9, "ns"
    if unit == "/s":
        for factor, name in ((1e6, "M/s"), (1e3, "k/s")):
            if abs(value) >= factor:
                return factor, name
        return 1.0, "/s"
    return 1.0, unit


def _fmt_one(value: float, unit: str) -> str:
    factor, name = _scale(value, unit)
    return f"{value / factor:.3g} {name}"


def _cell(values: list, unit: str) -> str:
    if not values:
        return "-"
    if unit == "flag":
        hits = sum(1 for v in values if v)
        return f"{'yes' if hits else 'no'} ({hits}/{len(values)} procs)"
    med = statistics.median(values)
    factor, name = _scale(med, unit)
    return f"{med / factor:.3g} [{min(values) / factor:.3g}-{max(values) / factor:.3g}] {name}"


def print_table(rows: list[Row]) -> None:
    widths = (50, 27, 27, 20, 11, 4)
    heads = ("measurement", "shmbuf", "baseline", "ratio", "target", "met?")
    line = "  ".join(f"{h:<{w}}" for h, w in zip(heads, widths))
    print(line)
    print("-" * len(line))
    for row in rows:
        if row.error:
            cells = (row.label, "ERROR", row.error[:27], "-", row.target_text(), "ERR")
        else:
            r = row.ratio()
            ratio = "-" if r is None else f"{r['median']:.3g} [{r['min']:.3g}-{r['max']:.3g}]"
            met = {True: "yes", False: "NO", None: "n/a"}[row.met()]
            cells = (row.label, _cell(row.shmbuf, row.unit), _cell(row.baseline, row.unit),
                     ratio, row.target_text(), met)
        print("  ".join(f"{c:<{w}}" for c, w in zip(cells, widths)))
    print()
    for row in rows:
        print(f"  {row.key}: " + (f"ERROR {row.error}" if row.error else
                                  f"baseline = {row.baseline_label}"))
