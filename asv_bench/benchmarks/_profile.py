"""The sizes every asv suite runs at, chosen by ``LEANSTATE_ASV`` (read at import):

- ``full`` (default): the design's sizes (1M rows x 128, batches of 65,536), every backend;
- ``quick``: 100,000 rows, the backend ``auto`` chooses here only (``make bench``,
  under ten minutes on 2 cores: each benchmark is a fresh process, about ten seconds
  each at two backends was twenty minutes);
- ``tiny``: seconds per benchmark, for the test that runs each one in a fresh process.

Tracked values are rounded to three significant digits (:func:`rounded`).
"""

import os

from leanstate import _backends

PROFILE = os.environ.get("LEANSTATE_ASV", "full")
SIZES = {
    "full": {
        "rows": 1_000_000,
        "dim": 128,
        "batch": 65_536,
        "embedding_rows": 1_000_000,
        "steps": 10,
        "ids": 16_384,
    },
    "quick": {
        "rows": 300_000,
        "dim": 128,
        "batch": 16_384,
        "embedding_rows": 200_000,
        "steps": 4,
        "ids": 4096,
    },
    "tiny": {"rows": 4096, "dim": 16, "batch": 512, "embedding_rows": 4096, "steps": 2, "ids": 256},
}[PROFILE]


# asv's timing: ``repeat`` samples in each of ``ROUNDS`` fresh processes (asv reports
# their spread); quick: one process, three samples.
ROUNDS, REPEAT = (2, 5) if PROFILE == "full" else (1, 3)


def backends(component: str) -> list[str]:
    """The backends a suite runs: every available one at ``full``, else the one ``auto`` picks."""
    if PROFILE == "full":
        return sorted(_backends.available(component))
    return [_backends.CHOSEN.choice(component)]


def rounded(value: float) -> float:
    """``value`` to three significant digits: what a tracked figure can claim."""
    return float(f"{value:.3g}")
