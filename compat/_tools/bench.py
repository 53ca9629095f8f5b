"""``python -m leanstate bench``: every figure of ``workloads`` beside its peer, in rounds,
with the ratio, its spread, the target and a verdict; the table, JSON, CSV and plot.

Every ratio reads one way: how many times better leanstate does than its peer, higher
is better (see :data:`LEGEND`). A target is always a floor on that ratio.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch

import leanstate
from leanstate import _backends
from leanstate._tools.delta_workloads import delta_figures
from leanstate._tools.follower_workloads import follower_figures
from leanstate._tools.load_workloads import TablesLoad, sharded_load_comparison
from leanstate._tools.workloads import (
    CheckpointIO,
    EmbeddingStep,
    KVGetSet,
    WrapperStep,
    load_peak_extra_bytes,
    samples,
    sharded_comparison,
    threads_under_load,
    zero_comparison,
)

DCP_TARGETS = {"save": 0.85, "load": 0.8}  # DCP's save and load beside the whole-row ones
V2_LOAD_TARGET = 0.8  # each rank's version-2 load beside a version-1 load of its rows
TRACKING_TARGET = 0.95  # a training step with change tracking on beside the step with it off
TABLES_THREADS_TARGET = 1.5  # two tables' load on torch's threads beside one thread
LEGEND = (
    "ratio: how many times better leanstate does than its peer, higher is better (peer time / "
    "leanstate time; peer cost / leanstate cost for memory, bytes and collectives; leanstate rate / "
    "peer rate for rates). met: yes = every round >= target, no = none, noisy = some; - = no target."
)


def _target(component: str, op: str, backend: str) -> float | None:
    """The floor on the ratio of ``op`` declared by ``backend``'s engine module of
    ``component`` (``BENCH_TARGETS``: ``(">=", r)`` on the throughput ratio, or
    ``("<=", c)`` on a cost ratio leanstate / peer, read here as ``>= 1 / c``); None:
    reported, no target."""
    module, _ = _backends.load(component, backend)
    declared = getattr(module, "BENCH_TARGETS", {}).get(op)
    if declared is None:
        return None
    kind, value = declared
    return value if kind == ">=" else 1 / value


def _verdict(ratios: list[float], target: float | None) -> str:
    """ "yes" when every sample meets the target, "no" when none does, else "noisy"."""
    if target is None:
        return "-"
    meets = [r >= target for r in ratios]
    return "yes" if all(meets) else "no" if not any(meets) else "noisy"


def _line(component, measure, backend, ours, peer_name, peer, target, *, rate=False) -> tuple:
    """One row of the bench table from samples of leanstate's figure and its peer's (lists
    of the same length, or one number): medians, the median ratio (peer / leanstate for
    times and costs, leanstate / peer for ``rate`` figures: higher is always better), every
    round's ratio, the target (a floor) and the verdict."""
    ours = ours if isinstance(ours, list) else [ours]
    peer = peer if isinstance(peer, list) else [peer] * len(ours)
    ratios = [(o / p if rate else p / o) for o, p in zip(ours, peer, strict=True)]
    shown = "-" if target is None else f">= {target:.3g}"
    return (
        component, measure, backend, statistics.median(ours), peer_name, statistics.median(peer),
        statistics.median(ratios), ratios, shown, _verdict(ratios, target),
    )  # fmt: skip


def store_figures(
    rows: int, dim: int, batch: int, backends: list[str] | None = None, rounds: int = 5
) -> list[tuple]:
    """The store's rows of the bench table (get, get into ``out``, set, insert with and
    without ``reserve``, memory) for every available store backend of the registry (or
    ``backends``), each beside the dense peer."""
    lines = []
    for name in _backends.available("kv_store") if backends is None else backends:
        kv = KVGetSet(rows, dim, batch, name)
        for op, label, peer_name, ours, peer in (
            ("get", "get", "dense index_select", kv.get, kv.dense_get),
            ("get_out", "get(out=)", "index_select(out=)", kv.get_out, kv.dense_get_out),
            ("set", "set", "dense index_copy_", kv.set, kv.dense_set),
            ("insert", "insert", "dense index_copy_", kv.insert, kv.dense_set),
            ("insert_reserved", "reserve+insert", "dense index_copy_", (kv.reserve_next, kv.insert), kv.dense_set),
        ):  # fmt: skip
            (ours[1] if isinstance(ours, tuple) else ours)()  # warm-up
            times = samples({"ours": ours, "peer": peer}, rounds, inner=3)
            target = _target("kv_store", op, name)
            lines.append(
                _line(
                    "kv_store",
                    f"{label} {batch} ids s",
                    name,
                    times["ours"],
                    peer_name,
                    times["peer"],
                    target,
                )
            )
        per_row = kv.store.memory_bytes() / len(kv.store)
        target = _target("kv_store", "memory", name)
        row_bytes = kv.store.layout.row_bytes
        lines.append(_line("kv_store", "memory bytes/row", name, per_row, "row bytes", row_bytes, target))
        del kv
    return lines


# A load's peer: the fastest plain read of its bytes measured in the same rounds
CEILING = "plain read (readinto a faulted buffer, or an mmap copy: the faster)"


def checkpoint_figures(rows: int, dim: int, backends: list[str], rounds: int) -> list[tuple]:
    """The checkpoint's I/O rows of the bench table for each store backend of ``backends``:
    a whole-row save and load of ``rows`` rows beside a plain write and read of the same
    bytes, the load beside the legacy load, DCP's save and load beside the whole-row ones,
    the load at dim 16 beside its plain read (unless ``dim`` is 16), and a load of two
    tables of ``rows // 2`` rows on torch's threads beside one thread. All figures of a
    backend are interleaved in the same rounds."""
    lines = []
    threads = torch.get_num_threads()
    for name in backends:
        io = CheckpointIO(rows, dim, name)
        narrow = CheckpointIO(rows, 16, name) if dim != 16 else None
        tables = TablesLoad(2, rows // 2, dim, name)
        try:
            io.dcp_save()
            for warm_up in (io.load, io.dcp_load, io.legacy_load, tables.load):  # imports, compiles
                warm_up()
            fns = {
                "save": io.save,
                "write": io.write_plain,
                "load": io.load,
                "readinto": io.read_plain,
                "mmap copy": io.read_mapped,
                "np.fromfile": io.read_fresh,
                "memcpy": io.copy_memory,
                "dcp save": io.dcp_save,
                "dcp load": io.dcp_load,
                "legacy load": io.legacy_load,
                "tables load": tables.load,
                "tables load, 1 thread": tables.load_one_thread,
            }
            if narrow is not None:
                narrow.load()
                fns |= {"load dim 16": narrow.load, "read dim 16": narrow.read_plain}
                fns |= {"mmap copy dim 16": narrow.read_mapped}
            times = samples(fns, rounds)
            # the ceiling, round by round: the faster of the two plain reads of the same bytes
            times["read"] = [min(pair) for pair in zip(times["readinto"], times["mmap copy"], strict=True)]
            if narrow is not None:
                times["read dim 16"] = [
                    min(pair) for pair in zip(times["read dim 16"], times["mmap copy dim 16"], strict=True)
                ]
        finally:
            for workload in (io, narrow, tables):
                if workload is not None:
                    workload.close()

        figures = [  # measure, leanstate's side, the peer's name, its side, the target
            (f"save {rows} rows s", "save", "plain write+fsync", "write", _target("kv_store", "save", name)),
            (f"load {rows} rows s", "load", CEILING, "read", _target("kv_store", "load", name)),
        ]
        if narrow is not None:
            load16 = _target("kv_store", "load_dim16", name)
            figures.append((f"load {rows} rows s, dim 16", "load dim 16", CEILING, "read dim 16", load16))
        figures += [  # reported beside the ceiling, without a target
            (
                f"load {rows} rows s",
                "load",
                "np.fromfile (fresh pages: not the ceiling)",
                "np.fromfile",
                None,
            ),
            (f"load {rows} rows s", "load", "memcpy of as many bytes (the memory limit)", "memcpy", None),
        ]
        figures.append(
            (f"load {rows} rows s", "load", "legacy load (all rows held, then applied)", "legacy load", 1.0)
        )
        for op in ("save", "load"):  # the same table through torch.distributed.checkpoint
            figures.append((f"dcp {op} {rows} rows s", f"dcp {op}", f"whole-row {op}", op, DCP_TARGETS[op]))
        figures.append(
            (
                f"load 2 tables x {rows // 2} rows s, {threads} threads",
                "tables load",
                "torch.set_num_threads(1)",
                "tables load, 1 thread",
                TABLES_THREADS_TARGET if threads > 1 else None,  # one thread cannot beat itself
            )
        )
        for measure, ours, peer_name, peer, target in figures:
            lines.append(_line("checkpoint", measure, name, times[ours], peer_name, times[peer], target))
    return lines


def tracking_figure(rows: int, dim: int, backend: str, rounds: int) -> tuple:
    """The bench row of change tracking: a row-wise Adagrad training step of a KV bag on
    ``backend`` with tracking on, beside the same bag's step with it off (each round
    runs both, the best of three steps each)."""
    bag = EmbeddingStep("kv", "rowwise_adagrad", rows, dim, backend=backend)
    bag.step()  # warm-up
    on, off = (lambda: bag.track(True), bag.step), (lambda: bag.track(False), bag.step)
    times = samples({"on": on, "off": off}, rounds, inner=3)
    return _line(
        "embedding", "step s, change tracking on (B=4096x20)", backend, times["on"], "tracking off",
        times["off"], TRACKING_TARGET,
    )  # fmt: skip


def _sharded_load_lines(ranks: list[dict], rows: int, backend: str) -> list[tuple]:
    """The bench rows of :func:`sharded_load_comparison`'s ``ranks``: each rank's version-2
    load of its share of a ``rows``-row table beside a version-1 load of the same rows."""
    return [
        _line(
            "checkpoint",
            f"v2 load s, rank {rank} of {len(ranks)} ({result['rows']} of {rows} rows)",
            backend,
            result["times"]["v2"],
            "v1 load of its rows, 1 process",
            result["times"]["v1"],
            V2_LOAD_TARGET,
        )
        for rank, result in enumerate(ranks)
    ]


class Setting(NamedTuple):
    """What every section of :func:`report` measures at: the sizes, the backend of the
    checkpoint, embedding-tracking and load rows, and the rounds."""

    rows: int
    dim: int
    batch: int
    backend: str
    wrapper_batch: int
    quick: bool
    checkpoint_rows: int
    rounds: int


class Figure(NamedTuple):
    """One row of a section, declared: the measure, leanstate's side, the peer, its side and
    the target (a floor on the ratio; None: reported, no target). ``rate``: leanstate / peer."""

    measure: str
    ours: float | list[float]
    peer_name: str
    peer: float | list[float]
    target: float | None
    rate: bool = False


def _lines(component: str, backend: str, figures: list[Figure]) -> list[tuple]:
    """The bench rows of ``figures``, in order, all of ``component`` on ``backend``."""
    return [
        _line(component, f.measure, backend, f.ours, f.peer_name, f.peer, f.target, rate=f.rate)
        for f in figures
    ]


def _engines() -> list[str]:
    return [b for b in _backends.available("kv_store") if b != "reference"]  # no targets


def _store_section(s: Setting) -> list[tuple]:
    """The store's rows on every accelerated store backend."""
    return store_figures(s.rows, s.dim, s.batch, backends=_engines(), rounds=s.rounds)


def _checkpoint_section(s: Setting) -> list[tuple]:
    """The checkpoint's I/O rows on every accelerated store backend."""
    return checkpoint_figures(s.checkpoint_rows, s.dim, _engines(), s.rounds)


def _sharded_load_section(s: Setting) -> list[tuple]:
    """Each rank's version-2 load beside a version-1 load of its rows."""
    ranks = sharded_load_comparison(s.checkpoint_rows, s.dim, s.backend, s.rounds)
    return _sharded_load_lines(ranks, s.checkpoint_rows, s.backend)


def _delta_section(s: Setting) -> list[tuple]:
    """The delta checkpoint's rows, at the size their targets are stated for: a delta's
    fixed cost (five fsyncs) would dominate a smaller table's."""
    return delta_figures(DELTA_ROWS, s.dim, s.backend, s.rounds, _line)


def _follower_section(s: Setting) -> list[tuple]:
    """The follower's rows: deltas of 1% of the table its targets are stated for (fewer
    links when quick), each applied while a reader reads."""
    return follower_figures(DELTA_ROWS, s.dim, s.backend, 6 if s.quick else 12, _line)


def _load_memory_section(s: Setting) -> list[tuple]:
    """The whole-row load's extra memory beside its budget and beside the legacy load's."""
    chunk = 16 * 2**20
    memory = load_peak_extra_bytes(s.rows, s.dim, s.backend, chunk)
    table = s.rows * (8 + (s.dim + 1) * 4)  # ids, weights and optimizer state: what legacy holds
    whole = memory["whole"] / 2**20
    return _lines("checkpoint", s.backend, [
        Figure("whole-row load extra MiB", whole, "budget: 2 x chunk + 64 MiB", (2 * chunk + 64 * 2**20) / 2**20, 1.0),
        Figure(f"whole-row load extra MiB (table {table / 2**20:.0f} MiB)", whole, "legacy load extra MiB", memory["legacy"] / 2**20, 2.0),
    ])  # fmt: skip


def _wrappers_section(s: Setting) -> list[tuple]:
    """The checkpoint and offload wrappers' step time and saved bytes beside torch's."""
    steps = {v: WrapperStep(v, batch=s.wrapper_batch) for v in WrapperStep.VARIANTS}
    for w in steps.values():
        w.step()  # warm-up
    times = samples({v: w.step for v, w in steps.items()}, s.rounds)
    mib = {v: w.saved_bytes() / 2**20 for v, w in steps.items()}
    del steps
    return _lines("wrappers", "reference", [
        Figure(f"checkpoint step s (batch {s.wrapper_batch})", times["checkpoint"], "torch checkpoint_wrapper", times["torch_checkpoint"], 0.95),
        Figure("checkpoint saved MiB", mib["checkpoint"], "torch checkpoint_wrapper", mib["torch_checkpoint"], 1.0),
        Figure("offload saved MiB", mib["offload"], "no wrapper", mib["none"], 1.0),
        Figure("offload saved MiB", mib["offload"], "torch offload_wrapper", mib["torch_offload"], 1.0),
    ])  # fmt: skip


def _embedding_section(s: Setting) -> list[tuple]:
    """A KV bag's SGD and row-wise Adagrad steps on every embedding backend beside a sparse
    EmbeddingBag's."""
    lines = []
    for name, (optimizer, peer) in itertools.product(
        _backends.available("embedding"), (("sgd", "sgd"), ("rowwise_adagrad", "adagrad"))
    ):
        ours = EmbeddingStep("kv", optimizer, s.rows, s.dim, backend=name)
        dense = EmbeddingStep("dense", peer, s.rows, s.dim)
        ours.step()
        dense.step()
        times = samples({"ours": ours.step, "peer": dense.step}, s.rounds)
        target = _target("embedding", optimizer, name)
        lines += _lines("embedding", name, [
            Figure(f"{optimizer} step s (B=4096x20)", times["ours"], f"EmbeddingBag(sparse)+{peer}", times["peer"], target),
        ])  # fmt: skip
        del ours, dense
    return lines


def _tracking_section(s: Setting) -> list[tuple]:
    """A training step with change tracking on beside the same step with it off."""
    return [tracking_figure(s.rows, s.dim, s.backend, s.rounds)]


def _threads_section(s: Setting) -> list[tuple]:
    """The numba kernels beside a CPU-bound neighbour, on their default threads and on one."""
    if "numba" not in _backends.available("embedding"):
        return []
    loaded = threads_under_load(2 if s.quick else 3)
    return _lines("threads", "numba", [
        Figure(measure, loaded[f"{figure} default"], "NUMBA_NUM_THREADS=1", loaded[f"{figure} one"], 0.8)
        for figure, measure in (
            ("step", "256x20 step s, CPU-bound neighbour"),
            ("set_rows", "set_rows 2 rows s, CPU-bound neighbour"),
        )
    ])  # fmt: skip


def _zero_section(s: Setting) -> list[tuple]:
    """leanstate's ZeRO beside torch's: step, broadcasts, consolidation and state share."""
    zero = zero_comparison(steps=4 if s.quick else 10)
    consolidate = zero["consolidate"]
    return _lines("zero", "reference", [
        Figure("step s (2 ranks, buckets)", zero["steps"]["leanstate"], "torch ZeRO", zero["steps"]["torch"], 1.05),
        Figure("broadcasts per step", zero["broadcasts"], "world size", 2, 1.0),
        Figure("consolidate s (~32 MiB/rank)", consolidate["leanstate"], "torch ZeRO", consolidate["torch"], 1.0),
        Figure("consolidate s (~32 MiB/rank)", consolidate["leanstate"], "budget s", 0.1, 1.0),
        Figure("state MiB on rank 0", zero["state_bytes"] / 2**20, "total / world", zero["even_share"] / 2**20, 1 / 1.001),
    ])  # fmt: skip


def _sharded_section(s: Setting) -> list[tuple]:
    """The sharded collection at 1, 2 (and 3) ranks beside 1 rank: rate, CPU per id, bytes
    exchanged, and at 2 ranks where a step's time goes."""
    ids = 4096 if s.quick else 16_384
    exchange = {"steps": 2, "ids": ids} if s.quick else {}
    embedding = leanstate.backend_info().chosen["embedding"]
    single = sharded_comparison(1, **exchange)
    figures = []
    for world in (1, 2) if s.quick else (1, 2, 3):
        run = single if world == 1 else sharded_comparison(world, **exchange)
        figures.append(
            Figure(f"lookups+updates/s, {world} rank(s) x {ids}", world * ids / run["step"], "1 rank", ids / single["step"], None, rate=True)
        )  # fmt: skip
        if world == 1:
            continue
        figures += [
            Figure(f"CPU s per lookup+update, all {world} ranks", run["cpu_per_id"], "1 rank", single["cpu_per_id"], 1 / 1.5 if world == 2 else None),
            Figure(f"bytes exchanged / minimum, {world} ranks", run["bytes"], "distinct ids x (row + grad)", run["min_bytes"], 1 / 1.1),
        ]  # fmt: skip
        if world == 2:  # where a step's time goes, per rank (the 1-rank run beside it)
            figures += [
                Figure(f"{phase} s per step, 2 ranks", seconds, "1 rank", single["phases"].get(phase, float("nan")), None)
                for phase, seconds in run["phases"].items()
            ]  # fmt: skip
    return _lines("sharded", embedding, figures)


# The bench table's sections, run in this order; each measures and returns its rows.
SECTIONS: tuple[Callable[[Setting], list[tuple]], ...] = (
    _store_section,
    _checkpoint_section,
    _sharded_load_section,
    _delta_section,
    _follower_section,
    _load_memory_section,
    _wrappers_section,
    _embedding_section,
    _tracking_section,
    _threads_section,
    _zero_section,
    _sharded_section,
)


def report(
    rows: int = 200_000,
    dim: int = 128,
    batch: int = 16_384,
    backend: str | None = None,
    wrapper_batch: int = 2,
    quick: bool = False,
    checkpoint_rows: int | None = None,
) -> list[dict]:
    """Run the benchmarks (``quick``: fewer rounds, steps and ranks); rows (dicts of ``COLUMNS``)
    of leanstate beside its peer, with targets.

    Every figure is measured in several rounds, leanstate's and the peer's interleaved;
    the row gives the medians, the median ratio and the ratios' spread. ``ratio`` is a
    throughput ratio for times (peer time / leanstate time: 1.0 = as fast as the peer,
    higher is better) and the plain ratio leanstate / peer for sizes. ``met`` is "yes"
    when every round meets the target, "no" when none does, and "noisy" otherwise. The
    store rows run on every registered backend; the rest on ``backend`` (default: the
    import-time choice). Targets apply to the accelerated backends; the reference is
    reported beside them. ``checkpoint_rows``: the table of the checkpoint figures
    (default ``rows``). The rows are those of :data:`SECTIONS`, in order.
    """
    setting = Setting(
        rows=rows,
        dim=dim,
        batch=batch,
        backend=backend or leanstate.backend_info().chosen["kv_store"],
        wrapper_batch=wrapper_batch,
        quick=quick,
        checkpoint_rows=checkpoint_rows or rows,
        rounds=3 if quick else 5,
    )
    lines = [line for section in SECTIONS for line in section(setting)]
    rows_out = [dict(zip(FIELDS, line, strict=True)) for line in lines]
    for row in rows_out:
        row["spread"] = f"{min(row['ratios']):.3g}..{max(row['ratios']):.3g}"
    return [r for r in rows_out if not (r["backend"] == "reference" and r["target"] == "-")]


FIELDS = (
    "component", "measure", "backend", "leanstate", "peer", "peer value", "ratio", "ratios", "target", "met",
)  # fmt: skip
COLUMNS = (
    "component", "measure", "backend", "leanstate", "peer", "peer value", "ratio", "spread", "target", "met",
)  # fmt: skip


def format_table(rows: list[dict]) -> str:
    """The rows as a plain-text table, numbers to three significant digits, and the legend."""

    def cell(value) -> str:
        return f"{value:.3g}" if isinstance(value, float) else str(value)

    cells = [list(COLUMNS)] + [[cell(row[c]) for c in COLUMNS] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(COLUMNS))]
    numeric = {"leanstate", "peer value", "ratio"}
    out = []
    for line in cells:
        out.append(
            " ".join(
                value.rjust(width) if COLUMNS[i] in numeric else value.ljust(width)
                for i, (value, width) in enumerate(zip(line, widths, strict=True))
            ).rstrip()
        )
    return "\n".join(out) + "\n\n" + LEGEND


def plot(rows: list[dict], path: Path) -> None:
    """A PNG of each figure's ratio beside its target (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['component']}: {r['measure']} [{r['backend']}]" for r in rows]
    figure, axes = plt.subplots(figsize=(10, 0.28 * len(rows) + 1.5))
    colours = {"yes": "tab:green", "no": "tab:red", "noisy": "tab:orange", "-": "tab:gray"}
    axes.barh(range(len(rows)), [r["ratio"] for r in rows], color=[colours[r["met"]] for r in rows])
    for i, r in enumerate(rows):
        if r["target"] != "-":
            axes.plot([float(r["target"].split()[1])] * 2, [i - 0.4, i + 0.4], color="black")
    axes.set_yticks(range(len(rows)), labels, fontsize=7)
    axes.invert_yaxis()
    axes.set_xscale("log")
    axes.set_xlabel(
        "times better than the peer, higher is better (black: target; green met, red missed, orange noisy)"
    )
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


DELTA_ROWS = 1_000_000
QUICK_SIZES = {"rows": 100_000, "checkpoint_rows": 300_000, "batch": 8192, "dim": 128}
FULL_SIZES = {"rows": 200_000, "checkpoint_rows": 1_000_000, "batch": 16_384, "dim": 128}


def main(args) -> int:
    """``python -m leanstate bench``: the table (``--quick``: smaller sizes, fewer rounds),
    or ``--gate`` / ``--against REV`` (this tree against a commit, rounds interleaved),
    ``--compare OLD NEW`` (two ``--json`` files) or ``--html DIR``."""
    import csv
    import json
    import subprocess
    import sys
    import time
    import warnings

    if args.gate or args.against:
        from leanstate._tools import gate

        record = Path(args.json) if args.json else None
        return gate.main(args.against, gate=args.gate, rounds=args.rounds, record=record)
    if args.compare:
        from leanstate._tools import history

        print(history.format_compare(history.compare(*map(Path, args.compare))))
        return 0
    if args.html:
        from leanstate._tools import history

        table = history.frame([Path(p) for p in args.history], Path(args.asv_results))
        if table.empty:
            print(f"bench --html: no figures in {args.asv_results} or --history files; run make bench first")
            return 1
        page = history.write_page(table, Path(args.html))
        print(f"{page} ({table['figure'].nunique()} figures): open it in a browser, no network needed")
        return 0
    sizes = dict(QUICK_SIZES if args.quick else FULL_SIZES)
    if args.rows is not None and args.checkpoint_rows is None:
        sizes["checkpoint_rows"] = 3 * args.rows
    for key in sizes:
        if getattr(args, key, None) is not None:
            sizes[key] = getattr(args, key)
    with warnings.catch_warnings():  # torch's sparse-invariant notice, from the peer's Adagrad
        warnings.filterwarnings("ignore", message="Sparse invariant checks are implicitly disabled")
        rows = report(**sizes, backend=args.backend, quick=args.quick)
    print(format_table(rows))
    if args.json:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
        record = {"sizes": sizes, "commit": commit or None, "date": int(time.time() * 1000), "rows": rows}
        Path(args.json).write_text(json.dumps(record, indent=1))
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(rows)
    if args.plot:
        try:
            plot(rows, Path(args.plot))
        except ImportError:
            print("bench --plot needs matplotlib: pip install 'leanstate[bench]'", file=sys.stderr)
            return 2
    missed = [r for r in rows if r["met"] == "no"]
    if args.check and missed:
        for r in missed:
            print(
                f"missed: {r['component']} {r['measure']} [{r['backend']}]: {r['ratio']:.3g} vs {r['target']}"
            )
        return 1
    return 0
