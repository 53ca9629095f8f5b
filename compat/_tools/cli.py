"""Command line: ``python -m leanstate {demo,info,bench,verify,inspect,convert,gpu-check}``."""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import leanstate


def _demo(args: argparse.Namespace) -> int:
    from leanstate._tools.demo import main as demo

    return demo(args)


def _inspect_sharded(path: str, manifest: dict) -> int:
    """``inspect`` of a checkpoint saved across ranks (format version 2)."""
    from leanstate.reference.checkpoint import CheckpointError
    from leanstate.reference.sharding import describe_bucketing
    from leanstate.sharded_checkpoint import verify_sharded

    print(f"  saved by {manifest['world_size']} ranks")
    for name, t in manifest["tables"].items():
        b = t["bucketing"]
        print(
            f"  table {name}: {t['rows']} rows x {t['width']} {t['dtype']} (dim {t['dim']}, "
            f"state {t['optimizer_state_dim']}), {describe_bucketing(b['buckets'], b['bucket_size'])}"
        )
        for f in t["files"]:
            print(f"    {f['file']} (rank {f['rank']}): {f['bytes']} bytes in {len(f['chunks'])} chunks")
    if manifest["extra"]:
        print(f"  extra state: {manifest['extra']}")
    try:
        checked = sum(1 for _ in verify_sharded(path))
    except (OSError, CheckpointError) as exc:
        print(f"BAD: {exc}")
        return 1
    print(f"OK: {checked} chunks verified" + (", extra state verified" if manifest["extra"] else ""))
    return 0


def _inspect(args: argparse.Namespace) -> int:
    """Print the manifest of a checkpoint and verify every chunk and the extra state; one BAD
    line names the fault, whatever the input."""
    try:
        return _inspect_manifest(args)
    except Exception as exc:  # a manifest the schema checks let through: still one line
        message = (str(exc).strip().splitlines() or [""])[0][:300]
        print(f"BAD: {args.path}: cannot be inspected ({type(exc).__name__}: {message})")
        return 1


def _inspect_manifest(args: argparse.Namespace) -> int:
    from leanstate.checkpoint import verify_checkpoint
    from leanstate.reference.checkpoint import CheckpointError
    from leanstate.sharded_checkpoint import read_manifest_v2

    try:
        manifest = read_manifest_v2(Path(args.path))
    except (OSError, CheckpointError) as exc:
        print(f"BAD: {exc}")
        return 1
    print(f"{args.path}: {manifest['format']} version {manifest['version']}")
    if manifest["version"] == 2:
        return _inspect_sharded(args.path, manifest)
    for name, t in manifest["tables"].items():
        print(
            f"  table {name}: {t['rows']} rows x {t['width']} {t['dtype']} (dim {t['dim']}, "
            f"state {t['optimizer_state_dim']}), {t['bytes']} bytes in {len(t['chunks'])} chunks, "
            f"ids {t['min_id']}..{t['max_id']}, file {t['file']}"
        )
    for name, v in manifest["views"].items():
        kind = "read-only view" if v["read_only"] else "view"
        first, last = v["width_offset"], v["width_offset"] + v["width"]
        print(
            f"  {kind} {name}: of {v['table']}, {v['width']} columns ({first} to {last - 1}), {v['rows']} rows"
        )
    if manifest["extra"]:
        print(f"  extra state: {manifest['extra']}")
    checked = 0
    try:
        for _ in verify_checkpoint(args.path):
            checked += 1
    except (OSError, CheckpointError) as exc:
        print(f"BAD: {exc}")
        return 1
    print(f"OK: {checked} chunks verified" + (", extra state verified" if manifest["extra"] else ""))
    return 0


def _bench(args: argparse.Namespace) -> int:
    """Quick benchmarks: each figure beside its peer, with the ratio and the target."""
    import csv
    import json

    from leanstate._tools.bench import COLUMNS, format_table, plot, report

    sizes = {"rows": args.rows, "dim": args.dim, "batch": args.batch}
    sizes["checkpoint_rows"] = args.checkpoint_rows or 5 * args.rows
    with warnings.catch_warnings():  # torch's sparse-invariant notice, from the peer's Adagrad
        warnings.filterwarnings("ignore", message="Sparse invariant checks are implicitly disabled")
        rows = report(**sizes, backend=args.backend, quick=args.quick)
    print(format_table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"sizes": sizes, "rows": rows}, indent=1))
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=COLUMNS)
            writer.writeheader()
            writer.writerows(rows)
    if args.plot:
        try:
            plot(rows, Path(args.plot))
        except ImportError:
            print("--plot needs matplotlib: pip install 'leanstate[bench]'", file=sys.stderr)
            return 2
    missed = [r for r in rows if r["met"] == "no"]
    if args.check and missed:
        for r in missed:
            print(
                f"missed: {r['component']} {r['measure']} [{r['backend']}]: {r['ratio']:.3g} vs {r['target']}"
            )
        return 1
    return 0


def _gpu_check(args: argparse.Namespace) -> int:
    from leanstate._tools.gpu_check import run

    return run(Path(args.out), rows=args.rows, batch=args.batch)


def _convert(args: argparse.Namespace) -> int:
    from leanstate.dcp import convert

    try:
        written = convert(args.source, args.target)
    except (leanstate.CheckpointError, FileNotFoundError) as exc:
        print(f"convert failed: {exc}", file=sys.stderr)
        return 1
    print(f"{args.source} -> {args.target} ({'DCP' if written == 'dcp' else 'whole-row, version 1'})")
    return 0


def _verify(args: argparse.Namespace) -> int:
    from leanstate._tools.verify import main as verify

    return verify(args)


def _info(args: argparse.Namespace) -> int:
    print(leanstate.backend_info())
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m leanstate`` and the ``leanstate`` script."""
    parser = argparse.ArgumentParser(prog="leanstate", description=leanstate.__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser(
        "demo", help="train a click model across gloo ranks, checkpoint, resume and reshard it, prove it"
    )
    demo.add_argument("--nproc", type=int, default=2, help="gloo ranks (the elastic proofs use 1 and 2)")
    demo.add_argument("--steps", type=int, default=60, help="training steps")
    demo.add_argument("--every", type=int, default=10, help="a whole-row checkpoint every this many steps")
    demo.add_argument("--batch", type=int, default=1024, help="samples per global batch")
    demo.add_argument("--ids", type=int, default=200_000, help="distinct raw ids per feature (Zipf-drawn)")
    demo.add_argument("--dim", type=int, default=16, help="embedding dim")
    demo.add_argument(
        "--backend", default=None, help="store and embedding backend (default: the import-time choice)"
    )
    demo.add_argument("--out", default="demo-out", help="folder for the checkpoints and demo.png")
    demo.add_argument(
        "--memory-rows", type=int, default=1_000_000, help="rows of the table the load-memory proof loads"
    )
    demo.set_defaults(run=_demo)
    commands.add_parser("info", help="print the backend choice and why").set_defaults(run=_info)
    bench = commands.add_parser("bench", help="quick benchmarks with ratios against peers")
    bench.add_argument("--rows", type=int, default=200_000, help="rows in each table")
    bench.add_argument(
        "--checkpoint-rows",
        type=int,
        default=None,
        help="rows of the checkpointed table (default 5 x --rows)",
    )
    bench.add_argument("--dim", type=int, default=128, help="embedding dim")
    bench.add_argument("--batch", type=int, default=16_384, help="ids per store get/set batch")
    bench.add_argument("--backend", default=None, help="backend of the checkpoint and embedding rows")
    bench.add_argument("--quick", action="store_true", help="fewer repeats, steps and ranks; the same sizes")
    bench.add_argument("--check", action="store_true", help="exit 1 if any target is missed in every round")
    bench.add_argument("--json", metavar="FILE", help="also write the table as JSON")
    bench.add_argument("--csv", metavar="FILE", help="also write the table as CSV")
    bench.add_argument("--plot", metavar="PNG", help="also draw each ratio beside its target (matplotlib)")
    bench.set_defaults(run=_bench)
    inspect = commands.add_parser("inspect", help="print a checkpoint's manifest and verify every chunk")
    inspect.add_argument("path", help="the checkpoint directory")
    inspect.set_defaults(run=_inspect)
    verify = commands.add_parser("verify", help="check every installed backend against the reference")
    verify.add_argument("--backend", default=None, help="only this backend's checks")
    verify.add_argument("--quick", action="store_true", help="fewer random workloads (about a minute)")
    verify.set_defaults(run=_verify)
    convert = commands.add_parser(
        "convert", help="convert a whole-row checkpoint to torch.distributed.checkpoint (DCP) or back"
    )
    convert.add_argument("source", help="a whole-row checkpoint directory, or a DCP one")
    convert.add_argument("target", help="the directory to write, in the other format")
    convert.set_defaults(run=_convert)
    gpu = commands.add_parser(
        "gpu-check", help="the gpu-marked tests and the GPU bench (needs a CUDA device)"
    )
    gpu.add_argument("--out", default="gpu-check", help="folder for the bench table and the test report")
    gpu.add_argument("--rows", type=int, default=2**23, help="rows in each device store")
    gpu.add_argument("--batch", type=int, default=2**20, help="ids per batch")
    gpu.set_defaults(run=_gpu_check)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
