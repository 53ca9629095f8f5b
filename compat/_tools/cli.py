"""Command line: ``python -m leanstate {demo,info,bench,verify,inspect,compact,convert,follow,gpu-check}``."""

from __future__ import annotations

import argparse
import re
import secrets
import shutil
import sys
from pathlib import Path

import leanstate
from leanstate._backends import backends

BACKENDS = backends()  # the registry's names, for --backend's choices


def _positive(text: str) -> int:
    """An argument that must be an integer >= 1 (argparse says so, not a traceback later)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not >= 1")
    return value


def _seconds(text: str) -> float:
    """An argument that must be a number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{value} is not > 0")
    return value


def _missing_files(paths: list[str], what: str) -> str | None:
    """The message for the first of ``paths`` that is not a file, or None."""
    missing = next((p for p in paths if not Path(p).is_file()), None)
    return None if missing is None else f"bench: {what} {missing} does not exist (or is not a file)"


def _demo(args: argparse.Namespace) -> int:
    from leanstate._tools.demo import main as demo

    return demo(args)


def _inspect(args: argparse.Namespace) -> int:
    from leanstate._tools.inspect import main as inspect

    return inspect(args.path)


def _bench(args: argparse.Namespace) -> int:
    from leanstate._tools.bench import main as bench

    problem = _missing_files(args.compare or [], "--compare file") or _missing_files(
        args.history, "--history file"
    )
    if problem is not None:
        print(problem, file=sys.stderr)
        return 1
    return bench(args)


def _gpu_check(args: argparse.Namespace) -> int:
    import dataclasses

    from leanstate._tools.gpu_check import GPU_SIZES, SIMULATED_SIZES, run

    sizes = SIMULATED_SIZES if args.simulate else GPU_SIZES
    chosen = {name: value for name, value in (("rows", args.rows), ("batch", args.batch)) if value}
    return run(Path(args.out), simulate=args.simulate, sizes=dataclasses.replace(sizes, **chosen))


def _convert(args: argparse.Namespace) -> int:
    from leanstate.checkpoint.core import replace_directory
    from leanstate.dcp import convert

    source, target = Path(args.source), Path(args.target)
    if not ((source / "manifest.json").is_file() or (source / ".metadata").is_file()):
        print(
            f"convert: {source} is not a checkpoint (no manifest.json, no .metadata); pass a whole-row or DCP "
            "checkpoint directory",
            file=sys.stderr,
        )
        return 1
    if target.exists() and not target.is_dir():
        print(f"convert: {target} exists and is not a directory; choose another target", file=sys.stderr)
        return 1
    if target.exists() and any(target.iterdir()) and not args.force:
        print(
            f"convert: {target} exists; pass --force to replace it, or choose another target", file=sys.stderr
        )
        return 1
    # --force: convert beside the target, then swap (a failed conversion leaves it as it was)
    out = target.parent / f".{target.name}.converting-{secrets.token_hex(4)}" if target.exists() else target
    try:
        written = convert(source, out)
        if out != target:
            previous = target.parent / f".{target.name}.replaced-{secrets.token_hex(4)}"
            replace_directory(out, target, previous)
            shutil.rmtree(previous)
    except (leanstate.CheckpointError, OSError, ValueError) as exc:
        if out != target:
            shutil.rmtree(out, ignore_errors=True)
        print(f"convert: {source} -> {target} failed: {_one_line(exc)}", file=sys.stderr)
        return 1
    print(f"{args.source} -> {args.target} ({'DCP' if written == 'dcp' else 'whole-row, version 1'})")
    return 0


def _compact(args: argparse.Namespace) -> int:
    try:
        leanstate.compact_checkpoint(
            args.source, args.target, chunk_bytes=args.chunk_bytes, overwrite=args.force
        )
    except (leanstate.CheckpointError, OSError, ValueError, TypeError) as exc:
        print(f"compact: {args.source} -> {args.target} failed: {_one_line(exc)}", file=sys.stderr)
        return 1
    print(f"{args.source} -> {args.target} (one full checkpoint)")
    return 0


def _one_line(exc: BaseException) -> str:
    """An error's first line without the internal prefixes of the layers it passed through
    (``leanstate.dcp.save: rank 0: ValueError: ...``)."""
    message = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return re.sub(r"^(?:[\w.]+: )?(?:rank \d+: )?(?:\w+Error: )?", "", message)


def _verify(args: argparse.Namespace) -> int:
    from leanstate._tools.verify import main as verify

    return verify(args)


def _info(args: argparse.Namespace) -> int:
    print(leanstate.backend_info())
    return 0


def _add_demo(commands) -> None:
    """``leanstate demo``: the main job, on its built-in data."""
    demo = commands.add_parser(
        "demo", help="train a click model across gloo ranks, checkpoint, resume and reshard it, prove it"
    )
    demo.add_argument(
        "--nproc", type=_positive, default=2, help="gloo ranks (the elastic proofs use 1 and 2)"
    )
    demo.add_argument("--steps", type=_positive, default=60, help="training steps")
    demo.add_argument(
        "--every", type=_positive, default=10, help="a whole-row checkpoint every this many steps"
    )
    demo.add_argument(
        "--full-every",
        type=_positive,
        default=3,
        help="every this many checkpoints a full one; the ones between are deltas (1: all full)",
    )
    demo.add_argument("--batch", type=_positive, default=1024, help="samples per global batch")
    demo.add_argument(
        "--ids", type=_positive, default=200_000, help="distinct raw ids per feature (Zipf-drawn)"
    )
    demo.add_argument("--dim", type=_positive, default=16, help="embedding dim")
    demo.add_argument(
        "--backend",
        default=None,
        choices=BACKENDS,
        help="store and embedding backend (default: the import-time choice)",
    )
    demo.add_argument("--out", default="demo-out", help="folder for the checkpoints and demo.png")
    demo.add_argument(
        "--memory-rows",
        type=_positive,
        default=1_000_000,
        help="rows of the table the load-memory proof loads",
    )
    demo.set_defaults(run=_demo)


def _add_bench(commands) -> None:
    """``leanstate bench``: the table of figures beside their peers, the gate, comparisons and history."""
    bench = commands.add_parser("bench", help="quick benchmarks with ratios against peers")
    bench.add_argument(
        "--rows",
        type=_positive,
        default=None,
        metavar="N",
        help="rows in each table (200,000; quick 100,000)",
    )
    bench.add_argument(
        "--checkpoint-rows",
        type=_positive,
        default=None,
        metavar="N",
        help="checkpointed rows (1,000,000; quick 300,000)",
    )
    bench.add_argument("--dim", type=_positive, default=None, metavar="N", help="embedding dim (128)")
    bench.add_argument(
        "--batch", type=_positive, default=None, help="ids per store get/set batch (16,384; quick 8,192)"
    )
    bench.add_argument(
        "--backend", default=None, choices=BACKENDS, help="backend of the checkpoint and embedding rows"
    )
    bench.add_argument(
        "--quick", action="store_true", help="smaller sizes, fewer rounds, steps and ranks (3-7 min)"
    )
    bench.add_argument("--check", action="store_true", help="exit 1 if any target is missed in every round")
    bench.add_argument("--json", metavar="FILE", help="also write the table as JSON")
    bench.add_argument("--csv", metavar="FILE", help="also write the table as CSV")
    bench.add_argument("--plot", metavar="PNG", help="also draw each ratio beside its target (matplotlib)")
    bench.add_argument(
        "--gate",
        action="store_true",
        help="the regression gate of make test: this tree against a baseline commit; exit 1 on a FAIL",
    )
    bench.add_argument(
        "--against",
        metavar="REV",
        help="with --gate, the baseline (default HEAD if the sources changed, else HEAD~1); "
        "alone: what got slower or faster than REV, the two trees' rounds interleaved",
    )
    bench.add_argument(
        "--rounds", type=_positive, default=7, metavar="N", help="paired rounds of --gate/--against (7)"
    )
    bench.add_argument(
        "--compare",
        nargs=2,
        metavar=("OLD", "NEW"),
        help="what got slower or faster between two --json files",
    )
    bench.add_argument("--html", metavar="DIR", help="write the offline history page there")
    bench.add_argument(
        "--asv-results", default="asv_bench/results", metavar="DIR", help="asv's results folder for --html"
    )
    bench.add_argument(
        "--history", nargs="*", default=[], metavar="JSON", help="bench --json files for --html"
    )
    bench.set_defaults(run=_bench)


def _add_inspect(commands) -> None:
    """``leanstate inspect PATH``."""
    inspect = commands.add_parser("inspect", help="print a checkpoint's manifest and verify every chunk")
    inspect.add_argument("path", help="the checkpoint directory")
    inspect.set_defaults(run=_inspect)


def _add_verify(commands) -> None:
    """``leanstate verify``."""
    verify = commands.add_parser("verify", help="check every installed backend against the reference")
    verify.add_argument("--backend", default=None, choices=BACKENDS, help="only this backend's checks")
    verify.add_argument("--quick", action="store_true", help="fewer random workloads (about a minute)")
    verify.set_defaults(run=_verify)


def _add_convert(commands) -> None:
    """``leanstate convert SRC DST``."""
    convert = commands.add_parser(
        "convert", help="convert a whole-row checkpoint to torch.distributed.checkpoint (DCP) or back"
    )
    convert.add_argument("source", help="a whole-row checkpoint directory, or a DCP one")
    convert.add_argument("target", help="the directory to write, in the other format")
    convert.add_argument("--force", action="store_true", help="replace the target if it exists")
    convert.set_defaults(run=_convert)


def _add_compact(commands) -> None:
    """``leanstate compact SRC DST``."""
    compact = commands.add_parser("compact", help="merge a delta chain into one full checkpoint")
    compact.add_argument("source", help="the head of the chain (a delta checkpoint directory)")
    compact.add_argument("target", help="the full checkpoint to write (atomically)")
    compact.add_argument(
        "--chunk-bytes",
        type=_positive,
        default=64 * 2**20,
        help="chunk size of the written file (default 64 MiB)",
    )
    compact.add_argument("--force", action="store_true", help="replace the target if it exists")
    compact.set_defaults(run=_compact)


def _follow(args: argparse.Namespace) -> int:
    from leanstate._tools.follow import main as follow

    return follow(args)


def _add_follow(commands) -> None:
    """``leanstate follow DIRECTORY``."""
    follow = commands.add_parser(
        "follow", help="follow a trainer's checkpoints: apply each new delta as it lands, and say so"
    )
    follow.add_argument("directory", help="where the trainer saves its checkpoints (one sub-directory each)")
    mode = follow.add_mutually_exclusive_group()
    mode.add_argument(
        "--into", metavar="CHECKPOINT", help="also keep the followed state there, as a full checkpoint"
    )
    mode.add_argument("--print", action="store_true", help="only print each applied link (the default)")
    follow.add_argument("--interval", type=_seconds, default=5.0, help="seconds between polls (5)")
    follow.add_argument("--once", action="store_true", help="poll once, then exit (1 if a link was refused)")
    follow.add_argument(
        "--backend", default=None, choices=BACKENDS, help="store backend (default: the import-time choice)"
    )
    follow.set_defaults(run=_follow)


def _add_gpu_check(commands) -> None:
    """``leanstate gpu-check``."""
    gpu = commands.add_parser(
        "gpu-check", help="the GPU bench and the gpu-marked tests (needs a CUDA device, or --simulate)"
    )
    gpu.add_argument("--out", default="gpu-check", help="folder for the bench table and the test report")
    gpu.add_argument("--rows", type=_positive, default=None, help="rows in each device store (default 2**22)")
    gpu.add_argument("--batch", type=_positive, default=None, help="ids per batch (default 2**20)")
    gpu.add_argument(
        "--simulate", action="store_true", help="run the same script in numba's CUDA simulator, at tiny sizes"
    )
    gpu.set_defaults(run=_gpu_check)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m leanstate`` and the ``leanstate`` script."""
    parser = argparse.ArgumentParser(prog="leanstate", description=leanstate.__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    _add_demo(commands)
    commands.add_parser("info", help="print the backend choice and why").set_defaults(run=_info)
    for add in (
        _add_bench,
        _add_inspect,
        _add_verify,
        _add_compact,
        _add_convert,
        _add_follow,
        _add_gpu_check,
    ):
        add(commands)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
