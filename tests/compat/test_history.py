"""pandas over the bench's JSON and asv's results: what got slower between two runs, and
the history page, which loads nothing from the network."""

import json
import re

import pytest

pytest.importorskip("pandas")

from leanstate._tools import history  # noqa: E402


def bench_file(path, ratios_by_figure, commit):
    rows = [
        {
            "component": "kv_store",
            "measure": measure,
            "backend": "numba",
            "peer": "dense",
            "ratio": sorted(ratios)[len(ratios) // 2],
            "ratios": ratios,
        }
        for measure, ratios in ratios_by_figure.items()
    ]
    path.write_text(json.dumps({"commit": commit, "date": 1, "rows": rows}))
    return path


def test_compare_flags_only_changes_beyond_the_spread(tmp_path):
    old = bench_file(
        tmp_path / "old.json", {"get": [0.8, 0.85, 0.9], "set": [0.5, 0.6, 0.7], "insert": [1, 1.1, 1.2]}, "a"
    )
    new = bench_file(
        tmp_path / "new.json",
        {"get": [0.25, 0.27, 0.3], "set": [0.55, 0.65, 0.9], "insert": [2, 2.1, 2.2]},
        "b",
    )
    table = history.compare(old, new).set_index("figure")["verdict"].to_dict()
    assert table == {
        "kv_store: get vs dense [numba]": "slower",
        "kv_store: set vs dense [numba]": "same",
        "kv_store: insert vs dense [numba]": "faster",
    }
    one = bench_file(tmp_path / "one.json", {"get": [0.8]}, "c")
    assert (
        history.compare(one, new).set_index("figure")["verdict"]["kv_store: get vs dense [numba]"]
        == "one round"
    )
    text = history.format_compare(history.compare(old, new))
    assert text.splitlines()[2].split()[0:2] == ["kv_store:", "get"]  # the slower figure first


def test_asv_results_and_bench_files_make_one_frame(tmp_path):
    machine = tmp_path / "results" / "box"
    machine.mkdir(parents=True)
    (machine / "machine.json").write_text("{}")
    (machine / "abc12345-existing.json").write_text(
        json.dumps(
            {
                "commit_hash": "abc12345ffff",
                "date": 5,
                "result_columns": ["result", "params", "version", "started_at", "duration", "stats_ci_99_a",
                                   "stats_ci_99_b", "stats_q_25", "stats_q_75"],
                "results": {
                    "kv_store.KVStoreGetSet.time_get": [[0.1, 0.2], [["'numba'", "'torch'"]], "v", 0, 1, None, None,
                                                        [0.09, 0.19], [0.11, 0.21]],
                    "zero.ZeroVersusTorch.track_broadcasts_per_step": [[2], [], "v"],
                },
            }
        )
    )  # fmt: skip
    bench = bench_file(tmp_path / "b.json", {"get": [0.8, 0.9]}, "abc12345")
    table = history.frame([bench], tmp_path / "results")
    assert sorted(table["figure"]) == [
        "kv_store.KVStoreGetSet.time_get('numba')",
        "kv_store.KVStoreGetSet.time_get('torch')",
        "kv_store: get vs dense [numba]",
        "zero.ZeroVersusTorch.track_broadcasts_per_step",
    ]
    row = table.set_index("figure").loc["kv_store.KVStoreGetSet.time_get('torch')"]
    assert (row["value"], row["low"], row["high"], row["run"]) == (0.2, 0.19, 0.21, "abc12345")


def test_the_page_has_one_picture_per_figure_and_nothing_to_fetch(tmp_path):
    pytest.importorskip("matplotlib")
    runs = [
        bench_file(tmp_path / f"{i}.json", {"get": [0.8 + i / 10, 0.9 + i / 10]}, f"c{i}") for i in range(3)
    ]
    page = history.write_page(history.frame(runs), tmp_path / "html")
    text = page.read_text()
    images = re.findall(r'<img src="([^"]+)"', text)
    assert len(images) == 1 and (tmp_path / "html" / images[0]).stat().st_size > 1000
    assert "<script" not in text and "http" not in text
