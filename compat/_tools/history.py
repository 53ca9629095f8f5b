"""The bench's and asv's figures in one pandas frame: what got slower or faster between
two runs, and a history page that opens offline (``bench`` extra: pandas, matplotlib).

A row of the frame is one figure of one run: ``source`` (``bench`` or ``asv``),
``figure`` (component, measure and backend; or benchmark and parameters), ``run`` (the
commit, or the bench file's name), ``date``, ``value`` and its spread ``low``..``high``.
Bench values are ratios against the peer, higher is better; asv values are what asv
recorded (seconds, or the ``track_*`` costs: smaller is better).
"""

from __future__ import annotations

import html
import json
import math
import re
from pathlib import Path

COLUMNS = ["source", "figure", "run", "date", "value", "low", "high", "higher_is_better", "rounds"]


def _pandas():
    try:
        import pandas
    except ImportError as exc:
        raise SystemExit("this needs pandas: pip install 'leanstate[bench]'") from exc
    return pandas


def bench_rows(path: Path) -> list[dict]:
    """The figures of one ``leanstate bench --json`` file."""
    data = json.loads(Path(path).read_text())
    rows = []
    for r in data["rows"]:
        ratios = r.get("ratios") or [r["ratio"]]
        rows.append(
            {
                "source": "bench",
                "figure": f"{r['component']}: {r['measure']} vs {r['peer']} [{r['backend']}]",
                "run": data.get("commit") or Path(path).stem,
                "date": data.get("date", 0),
                "value": r["ratio"],
                "low": min(ratios),
                "high": max(ratios),
                "higher_is_better": True,
                "rounds": len(ratios),
            }
        )
    return rows


def asv_rows(results: Path) -> list[dict]:
    """The figures of every asv result file under ``results`` (one folder per machine)."""
    rows = []
    for file in sorted(Path(results).glob("*/*.json")):
        if file.name == "machine.json":
            continue
        data = json.loads(file.read_text())
        columns = data.get("result_columns", [])
        for name, values in data.get("results", {}).items():
            entry = dict(zip(columns, values, strict=False))
            params = entry.get("params") or []
            combos = _product(params)
            results = entry.get("result") or []
            q25 = entry.get("stats_q_25") or [None] * len(results)
            q75 = entry.get("stats_q_75") or [None] * len(results)
            for combo, value, low, high in zip(combos, results, q25, q75, strict=False):
                if value is None or (isinstance(value, float) and math.isnan(value)):
                    continue
                label = f"{name}({', '.join(combo)})" if combo else name
                rows.append(
                    {
                        "source": "asv",
                        "figure": label,
                        "run": data.get("commit_hash", file.stem)[:8],
                        "date": data.get("date", 0),
                        "value": value,
                        "low": value if low is None else low,
                        "high": value if high is None else high,
                        "higher_is_better": False,
                        "rounds": 1,
                    }
                )
    return rows


def _product(params: list[list[str]]) -> list[tuple[str, ...]]:
    combos: list[tuple[str, ...]] = [()]
    for values in params:
        combos = [c + (str(v),) for c in combos for v in values]
    return combos


def frame(bench_files: list[Path] = (), asv_results: Path | None = None):
    """One pandas frame of every figure of the given bench files and asv results."""
    pd = _pandas()
    rows = [row for path in bench_files for row in bench_rows(path)]
    if asv_results is not None and Path(asv_results).is_dir():
        rows += asv_rows(asv_results)
    return pd.DataFrame(rows, columns=COLUMNS)


def compare(old: Path, new: Path):
    """Per figure of two bench files: the old and new ratio and whether it got slower or
    faster beyond the spread of the rounds (the two spreads do not overlap), else same; a
    figure measured in one round has no spread and is not judged ("one round")."""
    table = frame([old]).merge(frame([new]), on="figure", suffixes=(" old", " new"))
    judged = (table["rounds old"] > 1) & (table["rounds new"] > 1)
    slower = judged & (table["high new"] < table["low old"])
    faster = judged & (table["low new"] > table["high old"])
    table["change"] = table["value new"] / table["value old"]
    table["verdict"] = "same"
    table.loc[~judged, "verdict"] = "one round"
    table.loc[slower, "verdict"] = "slower"
    table.loc[faster, "verdict"] = "faster"
    return table[["figure", "value old", "value new", "change", "verdict"]]


def format_compare(table) -> str:
    """The comparison as text: the slower figures first."""
    order = {"slower": 0, "faster": 1, "same": 2, "one round": 3}
    table = table.sort_values(by="verdict", key=lambda v: v.map(order), kind="stable")
    legend = "ratio: leanstate against its peer, higher is better; slower/faster: the rounds' spreads do not overlap"
    return legend + "\n" + table.to_string(index=False, float_format=lambda x: f"{x:.3g}")


def write_page(table, folder: Path) -> Path:
    """A static history page in ``folder``: one PNG per figure (value over runs, spread as
    a band) and ``index.html`` showing them, with no script and nothing from the network."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    sections = []
    for (source, figure), runs in table.groupby(["source", "figure"], sort=True):
        runs = runs.sort_values("date")
        image = re.sub(r"[^A-Za-z0-9]+", "-", f"{source}-{figure}").strip("-")[:120] + ".png"
        fig, axes = plt.subplots(figsize=(6, 2.6))
        x = range(len(runs))
        axes.plot(x, runs["value"], marker="o")
        axes.fill_between(x, runs["low"], runs["high"], alpha=0.25)
        axes.set_xticks(list(x), list(runs["run"]), rotation=30, fontsize=7)
        better = "higher is better" if runs["higher_is_better"].iloc[0] else "smaller is better"
        axes.set_title(f"{figure} ({better})", fontsize=8)
        fig.tight_layout()
        fig.savefig(folder / image, dpi=90)
        plt.close(fig)
        sections.append(
            f'<h3>{html.escape(source)}: {html.escape(figure)}</h3>\n<img src="{image}" alt="{html.escape(figure)}">'
        )
    page = folder / "index.html"
    page.write_text(
        "<!doctype html>\n<html><head><meta charset='utf-8'><title>leanstate benchmark history</title></head>\n"
        "<body>\n<h1>leanstate benchmark history</h1>\n"
        f"<p>{len(sections)} figures. Bench figures are ratios against the peer (higher is better); "
        "asv figures are as recorded (times and costs: smaller is better).</p>\n"
        + "\n".join(sections)
        + "\n</body></html>\n"
    )
    return page
