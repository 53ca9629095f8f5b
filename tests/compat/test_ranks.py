"""Local ranks: every rank runs once with its index, forked from the server, not the caller."""

import json
import os
import socket
from pathlib import Path

from leanstate._tools.ranks import free_port, start_ranks


def _report(rank: int, folder: str) -> None:
    Path(folder, f"rank{rank}.json").write_text(json.dumps({"parent": os.getppid()}))


def test_each_rank_runs_once_forked_from_one_server():
    import tempfile

    servers = set()
    with tempfile.TemporaryDirectory() as folder:
        for _ in range(2):  # the second start reuses the server the first one started
            start_ranks(_report, (folder,), 3)
            assert sorted(p.name for p in Path(folder).iterdir()) == [
                "rank0.json",
                "rank1.json",
                "rank2.json",
            ]
            parents = {json.loads(p.read_text())["parent"] for p in Path(folder).iterdir()}
            assert len(parents) == 1 and os.getpid() not in parents  # spawned ranks are the caller's
            servers |= parents
            for p in Path(folder).iterdir():
                p.unlink()
    assert len(servers) == 1


def test_free_port_can_be_bound():
    with socket.socket() as s:
        s.bind(("127.0.0.1", free_port()))
