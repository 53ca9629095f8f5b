"""The offline history page in a real headless browser: with no network, it renders and
shows a graph (matplotlib's first line colour appears in the screenshot)."""

import json
import shutil
import subprocess

import pytest

pytest.importorskip("pandas")
pytest.importorskip("matplotlib")

from leanstate._tools import history  # noqa: E402

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (apt install chromium)")
def test_the_history_page_shows_a_graph_offline(tmp_path):
    import matplotlib.image

    runs = []
    for i in range(3):
        path = tmp_path / f"run{i}.json"
        row = {"component": "kv_store", "measure": "get", "backend": "numba", "ratio": 0.8 + i / 20,
               "ratios": [0.75 + i / 20, 0.85 + i / 20]}  # fmt: skip
        path.write_text(json.dumps({"commit": f"c{i}", "date": i, "rows": [row]}))
        runs.append(path)
    page = history.write_page(history.frame(runs), tmp_path / "html")
    shot = tmp_path / "shot.png"
    subprocess.run(
        [
            CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--proxy-server=127.0.0.1:9",
            "--proxy-bypass-list=<-loopback>", f"--screenshot={shot}", "--window-size=900,900",
            page.as_uri(),
        ],
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    pixels = matplotlib.image.imread(shot)[..., :3]
    blue = (abs(pixels[..., 0] - 0x1F / 255) < 0.05) & (abs(pixels[..., 1] - 0x77 / 255) < 0.05)
    blue &= abs(pixels[..., 2] - 0xB4 / 255) < 0.05
    assert blue.sum() > 50  # the plotted line, drawn from the PNG next to the page
