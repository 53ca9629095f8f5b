"""The command line's promises: one table from verify, DCP checkpoints inspected too,
convert refusing to replace a checkpoint without --force, and every error one line that
names the path and the fix."""

from pathlib import Path

import pytest
import torch

import leanstate
import leanstate.dcp as kvdcp
from leanstate._tools.cli import main


def filled(n=50):
    store = leanstate.KVStore(4, optimizer_state_dim=1, backend="reference")
    store.set(torch.arange(n) * 7, torch.randn(n, 4))
    return store


def test_inspect_verifies_a_dcp_checkpoint_and_names_a_bad_chunk(tmp_path, capsys):
    kvdcp.save({"t": filled(), "dense": torch.ones(3)}, checkpoint_id=tmp_path / "d", chunk_bytes=256)
    assert main(["inspect", str(tmp_path / "d")]) == 0
    out = capsys.readouterr().out
    assert "DCP checkpoint" in out and "table t: 50 rows" in out
    chunks = int(out.split("OK: ")[1].split()[0])
    assert chunks > 3
    data = next(p for p in (tmp_path / "d").iterdir() if p.suffix == ".distcp")
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    data.write_bytes(bytes(raw))
    assert main(["inspect", str(tmp_path / "d")]) == 1
    bad = [line for line in capsys.readouterr().out.splitlines() if line.startswith("BAD")]
    assert len(bad) == 1 and str(tmp_path / "d") in bad[0], bad


def test_convert_refuses_to_replace_a_checkpoint_unless_forced(tmp_path, capsys):
    leanstate.save_checkpoint(tmp_path / "native", {"t": filled()})
    leanstate.save_checkpoint(tmp_path / "other", {"t": filled(5)})
    before = (tmp_path / "other" / "t.rows").read_bytes()
    assert main(["convert", str(tmp_path / "native"), str(tmp_path / "other")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(tmp_path / "other") in err[0] and "--force" in err[0], err
    assert (tmp_path / "other" / "t.rows").read_bytes() == before  # untouched
    assert main(["convert", str(tmp_path / "native"), str(tmp_path / "other"), "--force"]) == 0
    assert (tmp_path / "other" / ".metadata").is_file()


def test_convert_errors_are_one_line_naming_the_path(tmp_path, capsys):
    assert main(["convert", str(tmp_path / "missing"), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(tmp_path / "missing") in err[0] and "checkpoint directory" in err[0], err
    leanstate.save_checkpoint(tmp_path / "native", {"t": filled()})
    (tmp_path / "file").write_text("x")
    assert main(["convert", str(tmp_path / "native"), str(tmp_path / "file" / "sub")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "rank 0" not in err[0] and "Error:" not in err[0], err
    assert str(tmp_path / "file" / "sub") in err[0]


def test_table_config_defaults_agree():
    config = leanstate.KVTableConfig("t", 4, optimizer="rowwise_adagrad", optimizer_offloading=False)
    assert config.return_whole_row is False
    bag = leanstate.KVEmbeddingBag.from_config(config)
    assert bag.state_store is not None and not bag.return_whole_row
    assert leanstate.KVTableConfig("t", 4).return_whole_row is True
    assert leanstate.KVTableConfig("t", 4, return_whole_row=False).return_whole_row is False


def test_inspect_shows_each_link_of_a_chain_and_compact_merges_it(tmp_path, capsys):
    store = filled()
    leanstate.save_checkpoint(tmp_path / "c0", {"t": store}, chunk_bytes=256)
    store.set(torch.tensor([1, 7]), torch.ones(2, 4))
    store.delete(torch.tensor([14, 21, 28]))
    leanstate.save_checkpoint(tmp_path / "c1", {"t": store}, base=tmp_path / "c0", chunk_bytes=256)
    assert main(["inspect", str(tmp_path / "c1")]) == 0
    out = capsys.readouterr().out
    assert "a delta chain of 2 links" in out and "2 rows x 12 float32" in out and "3 ids removed" in out
    assert "link 1 verified" in out and out.rstrip().endswith("OK: 2 links verified")
    assert main(["compact", str(tmp_path / "c1"), str(tmp_path / "full"), "--chunk-bytes", "256"]) == 0
    leanstate.save_checkpoint(tmp_path / "saved", {"t": store}, chunk_bytes=256)
    for name in ("manifest.json", "t.rows"):
        assert (tmp_path / "full" / name).read_bytes() == (tmp_path / "saved" / name).read_bytes()
    removed = tmp_path / "c1" / "t.removed"
    raw = bytearray(removed.read_bytes())
    raw[17] ^= 0x01  # the last id grows: still ascending, only the CRC tells
    removed.write_bytes(bytes(raw))
    capsys.readouterr()
    assert main(["inspect", str(tmp_path / "c1")]) == 1
    bad = capsys.readouterr().out.splitlines()[-1]
    assert bad.startswith("BAD: link 0") and "t.removed fails its crc32c check" in bad
    assert main(["compact", str(tmp_path / "c1"), str(tmp_path / "again")]) == 1
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and "t.removed" in error and not (tmp_path / "again").exists()


@pytest.mark.parametrize(
    "argv, says",
    [
        (["bench", "--rows", "-5"], "argument --rows: -5 is not >= 1"),
        (["bench", "--dim", "x"], "argument --dim: 'x' is not an integer"),
        (["bench", "--backend", "nosuch"], "argument --backend: invalid choice: 'nosuch'"),
        (["demo", "--nproc", "0"], "argument --nproc: 0 is not >= 1"),
        (["compact", "a", "b", "--chunk-bytes", "0"], "argument --chunk-bytes: 0 is not >= 1"),
        (["verify", "--backend", "nosuch"], "argument --backend: invalid choice"),
        (["follow", "d", "--interval", "0"], "argument --interval: 0.0 is not > 0"),
        (["follow", "d", "--into", "x", "--print"], "not allowed with argument --into"),
    ],
)
def test_a_bad_argument_is_a_usage_error_not_a_traceback(argv, says, capsys):
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err


def test_bench_names_a_missing_compare_or_history_file(tmp_path, capsys):
    assert main(["bench", "--compare", str(tmp_path / "old.json"), str(tmp_path / "new.json")]) == 1
    assert "--compare file" in capsys.readouterr().err
    assert main(["bench", "--html", str(tmp_path / "page"), "--history", str(tmp_path / "h.json")]) == 1
    assert "--history file" in capsys.readouterr().err and not (tmp_path / "page").exists()


def test_convert_onto_an_existing_file_is_refused(tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    source = Path(__file__).parents[2] / "spec" / "vectors" / "checkpoint_v1"
    assert main(["convert", str(source), str(tmp_path / "afile")]) == 1
    assert "is not a directory" in capsys.readouterr().err
    assert (tmp_path / "afile").read_text() == "x"


def test_convert_of_a_delta_says_to_compact_it_first(tmp_path, capsys):
    store = filled()
    leanstate.save_checkpoint(tmp_path / "c0", {"t": store})
    store.set(torch.tensor([1]), torch.zeros(1, store.dim))
    leanstate.save_checkpoint(tmp_path / "d1", {"t": store}, base=tmp_path / "c0")
    assert main(["convert", str(tmp_path / "d1"), str(tmp_path / "out")]) == 1
    assert f"python -m leanstate compact {tmp_path / 'd1'} FULL" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    assert main(["compact", str(tmp_path / "d1"), str(tmp_path / "full")]) == 0
    assert main(["convert", str(tmp_path / "full"), str(tmp_path / "out")]) == 0


def test_inspect_names_an_unsupported_version_before_any_missing_key(tmp_path, capsys):
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "manifest.json").write_text('{"format": "leanstate-whole-row", "version": 99}')
    assert main(["inspect", str(tmp_path / "c")]) == 1
    out = capsys.readouterr().out
    assert "BAD:" in out and "format version 99 is not supported" in out and "views" not in out


def test_follow_once_applies_each_new_link_says_so_and_keeps_a_full_copy(tmp_path, capsys):
    store = filled()
    folder = tmp_path / "ckpts"
    leanstate.save_checkpoint(folder / "c0", {"t": store})
    store.set(torch.tensor([7, 1000]), torch.zeros(2, 4))
    store.delete(torch.tensor([14]))
    leanstate.save_checkpoint(folder / "d1", {"t": store}, base=folder / "c0")
    assert (
        main(["follow", str(folder), "--once", "--into", str(tmp_path / "copy"), "--backend", "numba"]) == 0
    )
    out = capsys.readouterr().out
    assert "applied c0 (full): 50 rows" in out and "applied d1 (delta): 2 rows, 1 removed" in out
    assert "lag" in out and "now holds d1" in out
    copy = leanstate.KVStore(4, optimizer_state_dim=1)
    leanstate.load_checkpoint(tmp_path / "copy", {"t": copy})
    assert torch.equal(copy.keys(), store.keys())
    assert torch.equal(copy.get_rows(copy.keys()), store.get_rows(store.keys()))


def test_follow_once_without_a_full_checkpoint_or_with_a_refused_link_exits_1(tmp_path, capsys):
    assert main(["follow", str(tmp_path / "none"), "--once"]) == 1
    assert "no complete full checkpoint" in capsys.readouterr().err
    store = filled()
    leanstate.save_checkpoint(tmp_path / "c" / "c0", {"t": store})
    (tmp_path / "c" / "bad").mkdir()
    (tmp_path / "c" / "bad" / "manifest.json").write_text("[]")
    assert main(["follow", str(tmp_path / "c"), "--once", "--print"]) == 1
    captured = capsys.readouterr()
    assert "applied c0 (full)" in captured.out and "refused" in captured.err and "bad" in captured.err
