"""Local ranks: every rank runs once with its index, forked from the server, not the caller."""

import json
import os
import socket
from pathlib import Path

from leanstate._tools.ranks import free_port, start_ranks


def _report(rank: int, folder: str) -> None:
    Path(folder, f"rank{rank}.json").write_text(json.dumps({"parent": os.getppid()}))


def test_each_rank_runs_once_forked_from_one_server(tmp_path):
    servers = set()
    for _ in range(2):  # the second start reuses the server the first one started
        start_ranks(_report, (str(tmp_path),), 3)
        reports = sorted(tmp_path.iterdir())
        assert [p.name for p in reports] == ["rank0.json", "rank1.json", "rank2.json"]
        parents = {json.loads(p.read_text())["parent"] for p in reports}
        # one server is the parent of every rank; a spawned rank's parent would be this process
        assert len(parents) == 1 and os.getpid() not in parents
        servers |= parents
        for p in reports:
            p.unlink()
    assert len(servers) == 1


def test_free_port_can_be_bound():
    with socket.socket() as s:
        s.bind(("127.0.0.1", free_port()))
