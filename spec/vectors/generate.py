"""Regenerate the golden vectors from the specs, with the standard library alone.

This restates the byte formats independently of leanstate (struct and Python ints
only), so the vectors check the code rather than echo it. Run from the repo root:
``python spec/vectors/generate.py``; it rewrites the JSON files next to it.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
import zlib
from pathlib import Path

HERE = Path(__file__).parent
MASK64 = 2**64 - 1


def fnv64_broken(key: int) -> int:
    h = 0xCBF29CE484222325
    for byte in struct.pack("<q", key):
        h = (h * 0x100000001B3) & MASK64
        h ^= (byte - 256 if byte >= 128 else byte) & MASK64
    return h


def splitmix64(x: int) -> int:
    z = (x + 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def f32(x: float) -> float:
    """Round a double to the nearest float32 (ties to even)."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


def init_value(seed: int, key: int, column: int, low: float, high: float) -> float:
    bits = splitmix64(splitmix64(splitmix64(seed & MASK64) ^ (key & MASK64)) ^ column)
    u = (bits >> 40) / 2**24
    return f32(f32(f32(f32(high) - f32(low)) * u) + f32(low))


def bf16_bits(x: float) -> int:
    """bfloat16 bits of a float32 value: the top 16 bits, rounded to nearest even."""
    bits = struct.unpack("<I", struct.pack("<f", x))[0]
    return (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16


def pack(fmt: str, values) -> bytes:
    """Little-endian values of one row dtype: "f" float32, "e" float16, "b" bfloat16."""
    values = list(values)
    if fmt == "b":
        return struct.pack(f"<{len(values)}H", *(bf16_bits(v) for v in values))
    return struct.pack(f"<{len(values)}{fmt}", *values)


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli): reflected polynomial 0x82F63B78, init and final xor 0xFFFFFFFF."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def pad4(n: int) -> int:
    return (n + 3) // 4 * 4


def row_bytes(fmt: str, key: int, ts: int, count: int, used: int, weight, state) -> bytes:
    """One whole row: header, weight padded to pad4, state padded to pad4."""
    header = struct.pack("<qII", key, ts, count | (used << 31))
    body = list(weight) + [0.0] * (pad4(len(weight)) - len(weight))
    body += list(state) + [0.0] * (pad4(len(state)) - len(state)) if state else []
    return header + pack(fmt, body)


def golden_checkpoint(folder: Path, fmt: str, checksum: str) -> dict:
    """A tiny whole-row checkpoint: dim 3, state 1, five rows in chunks of two."""
    folder.mkdir(exist_ok=True)
    dim, state_dim, rows_per_chunk = 3, 1, 2
    itemsize = 4 if fmt == "f" else 2
    width = 16 // itemsize + pad4(dim) + pad4(state_dim)
    ids = [2, 3, 10, 11, 40]
    records = [row_bytes(fmt, k, 1_700_000_000 + k, k % 7, 1, [k + 0.5, -k / 4, 1.0], [k / 8]) for k in ids]
    data = b"".join(records)
    crc = {"crc32": zlib.crc32, "crc32c": crc32c}[checksum]
    chunks = []
    for first in range(0, len(ids), rows_per_chunk):
        part = b"".join(records[first : first + rows_per_chunk])
        group = ids[first : first + rows_per_chunk]
        chunks.append(
            {
                "offset": first * width * itemsize,
                "rows": len(group),
                "min_id": group[0],
                "max_id": group[-1],
                "crc": crc(part),
            }
        )
    manifest = {
        "format": "leanstate-whole-row",
        "version": 1,
        "tables": {
            "t": {
                "file": "t.rows",
                "dim": dim,
                "optimizer_state_dim": state_dim,
                "dtype": {"f": "float32", "e": "float16", "b": "bfloat16"}[fmt],
                "header_elems": 16 // itemsize,
                "width": width,
                "row_bytes": width * itemsize,
                "rows": len(ids),
                "bytes": len(data),
                "min_id": ids[0],
                "max_id": ids[-1],
                "checksum": checksum,
                "chunks": chunks,
            }
        },
        "views": {},
        "extra": None,
    }
    (folder / "t.rows").write_bytes(data)
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return manifest


def whole_row_table(name: str, records: list[tuple[int, bytes]], dim: int, state_dim: int, chunk_bytes: int):
    """A float32 crc32c table as a save writes it: its rows file's bytes and its manifest entry.
    ``records`` are (id, whole row bytes), ascending by id."""
    width = 4 + pad4(dim) + pad4(state_dim)
    row = width * 4
    per_chunk = max(1, chunk_bytes // row)
    chunks = []
    for first in range(0, len(records), per_chunk):
        group = records[first : first + per_chunk]
        chunks.append(
            {
                "offset": first * row,
                "rows": len(group),
                "min_id": group[0][0],
                "max_id": group[-1][0],
                "crc": crc32c(b"".join(r for _, r in group)),
            }
        )
    data = b"".join(r for _, r in records)
    entry = {
        "file": f"{name}.rows",
        "dim": dim,
        "optimizer_state_dim": state_dim,
        "dtype": "float32",
        "header_elems": 4,
        "width": width,
        "row_bytes": row,
        "rows": len(records),
        "bytes": len(data),
        "min_id": records[0][0] if records else None,
        "max_id": records[-1][0] if records else None,
        "checksum": "crc32c",
        "chunks": chunks,
    }
    return data, entry


def golden_delta(folder: Path) -> None:
    """``delta_v1/``: ``base/`` (a full checkpoint of two tables and a read-only view),
    ``delta/`` (a delta of it: in ``t`` two rows changed, one new, two removed; in ``u`` one
    row changed and nothing removed) and ``compacted/`` (the chain as one full checkpoint).
    Every save uses chunk_bytes 96 (two rows of ``t``, three of ``u``)."""
    shutil.rmtree(folder, ignore_errors=True)
    chunk_bytes = 96
    t_old = {
        k: row_bytes("f", k, 1_700_000_000 + k, k % 7, 1, [k + 0.5, -k / 4, 1.0], [k / 8])
        for k in (2, 3, 10, 11, 40)
    }
    t_new = {
        k: row_bytes("f", k, 1_700_000_500 + k, k % 7 + 1, 1, [k + 0.25, k / 2, -2.0], [k / 16])
        for k in (3, 11, 25)
    }
    u_old = {k: row_bytes("f", k, 1_700_000_100, 1, 1, [k * 1.5, -1.0], []) for k in (1, 5)}
    u_new = {5: row_bytes("f", 5, 1_700_000_600, 2, 1, [0.75, 8.0], [])}
    removed = {"t": [2, 40], "u": []}
    links = {
        "base": ({"t": t_old, "u": u_old}, None),
        "delta": ({"t": t_new, "u": u_new}, removed),
        "compacted": (
            {
                "t": {k: v for k, v in {**t_old, **t_new}.items() if k not in removed["t"]},
                "u": {**u_old, **u_new},
            },
            None,
        ),
    }
    digests = {}
    for link, (tables, removals) in links.items():
        (folder / link).mkdir(parents=True)
        entries = {}
        for name, rows in tables.items():
            dim, state_dim = (3, 1) if name == "t" else (2, 0)
            data, entry = whole_row_table(name, sorted(rows.items()), dim, state_dim, chunk_bytes)
            (folder / link / f"{name}.rows").write_bytes(data)
            if removals is not None:
                ids = removals[name]
                gone = struct.pack(f"<{len(ids)}q", *ids)
                (folder / link / f"{name}.removed").write_bytes(gone)
                entry["removed"] = {
                    "file": f"{name}.removed",
                    "ids": len(ids),
                    "bytes": len(gone),
                    "min_id": ids[0] if ids else None,
                    "max_id": ids[-1] if ids else None,
                    "crc": crc32c(gone),
                }
            entries[name] = entry
        view = {"table": "t", "whole_rows": False, "width_offset": 4, "width": 1, "read_only": True}
        view["rows"] = len(tables["t"]) if removals is None else len(links["compacted"][0]["t"])
        manifest = {"format": "leanstate-whole-row", "version": 1}
        if removals is not None:
            manifest["format"] = "leanstate-whole-row-delta"
            manifest["base"] = {"path": "../base", "manifest_sha256": digests["base"]}
        manifest.update(tables=entries, views={"t.opt": view}, extra=None)
        text = json.dumps(manifest, indent=1).encode()
        (folder / link / "manifest.json").write_bytes(text)
        digests[link] = hashlib.sha256(text).hexdigest()


def damaged_manifests(manifest: dict) -> dict:
    """Manifests that break one reader rule each (``spec/checkpoint_format.md``, R2-R8), beside
    the sound rows of ``checkpoint_v1/``: each must be refused with a CheckpointError whose
    message contains ``names``."""

    def edited(edit) -> str:
        copy = json.loads(json.dumps(manifest))
        edit(copy)
        return json.dumps(copy, indent=1)

    table = lambda edit: edited(lambda m: edit(m["tables"]["t"]))  # noqa: E731
    view = {
        "table": "missing",
        "whole_rows": False,
        "width_offset": 0,
        "width": 1,
        "read_only": True,
        "rows": 5,
    }
    sound = json.dumps(manifest, indent=1)
    cases = [
        ("last chunk dropped", "R6", table(lambda t: t["chunks"].pop()), "tables['t']"),
        ("gap between chunks", "R6", table(lambda t: t["chunks"][1].update(offset=144)), "chunks[1].offset"),
        (
            "file outside the checkpoint",
            "R4",
            table(lambda t: t.update(file="../checkpoint_v1/t.rows")),
            "file",
        ),
        ("version 1.0", "R3", edited(lambda m: m.update(version=1.0)), "version"),
        ("extra key missing", "R3", edited(lambda m: m.pop("extra")), "'extra'"),
        ("table max_id off by one", "R7", table(lambda t: t.update(max_id=41)), "max_id"),
        ("unknown checksum", "R3", table(lambda t: t.update(checksum="md5")), "checksum"),
        ("view of a missing table", "R8", edited(lambda m: m.update(views={"v": view})), "views['v']"),
        ("NaN", "R2", table(lambda t: t.update(note=float("nan"))), "NaN"),
        (
            "repeated key",
            "R2",
            sound.replace('"format"', '"version": 1,\n "format"', 1),
            "'version' appears twice",
        ),
    ]
    return {
        "rows_file": "checkpoint_v1/t.rows",
        "error": "CheckpointError",
        "cases": [{"name": n, "rule": r, "manifest": text, "names": names} for n, r, text, names in cases],
    }


def damaged_chains(folder: Path) -> dict:
    """The golden chain of ``delta_v1/`` (``base``, then ``delta``) with one link's manifest
    breaking one rule of the chain (``spec/checkpoint_format.md``: R2, R3, R11, R12, D1, D5);
    where the base is edited, the delta's ``base.manifest_sha256`` is re-pinned, so only the
    rule can refuse the chain. Each must be refused with a CheckpointError whose message
    contains ``names``, by every load and compaction of ``delta``."""
    sound = {link: json.loads((folder / link / "manifest.json").read_text()) for link in ("base", "delta")}

    def edited(link: str, edit) -> dict:
        copy = json.loads(json.dumps(sound[link]))
        edit(copy)
        text = json.dumps(copy, indent=1)
        if link == "delta":
            return {"delta": text}
        delta = json.loads(json.dumps(sound["delta"]))
        delta["base"]["manifest_sha256"] = hashlib.sha256(text.encode()).hexdigest()
        return {"base": text, "delta": json.dumps(delta, indent=1)}

    def nested(manifest: dict) -> None:
        value: object = 0
        for _ in range(62):  # under tables['t'], three levels down: 65 in all
            value = [value]
        manifest["tables"]["t"]["note"] = value

    long_int = edited("delta", lambda m: m["tables"]["t"].update(note="LONG"))
    long_int["delta"] = long_int["delta"].replace('"LONG"', "9" * 4301)
    cases = [
        (
            "delta relabelled as a full checkpoint",
            "R12",
            edited("delta", lambda m: m.update(format="leanstate-whole-row")),
            "base is a delta's key",
        ),
        (
            "full base with a base key",
            "R12",
            edited("base", lambda m: m.update(base={"path": "../delta", "manifest_sha256": "0" * 64})),
            "base is a delta's key",
        ),
        (
            "full base table with a removed entry",
            "R12",
            edited(
                "base", lambda m: m["tables"]["t"].update(removed=sound["delta"]["tables"]["t"]["removed"])
            ),
            "removed is a delta's key",
        ),
        (
            "removed entry without min_id",
            "D5",
            edited("delta", lambda m: m["tables"]["u"]["removed"].pop("min_id")),
            "'min_id' is missing",
        ),
        (
            "removed min_id a float",
            "R3",
            edited("delta", lambda m: m["tables"]["t"]["removed"].update(min_id=2.0)),
            "min_id",
        ),
        (
            "base table min_id true",
            "R3",
            edited("base", lambda m: m["tables"]["u"].update(min_id=True)),
            "min_id",
        ),
        (
            "base view rows a float",
            "R3",
            edited("base", lambda m: m["views"]["t.opt"].update(rows=5.0)),
            "views['t.opt']",
        ),
        (
            "delta version 3 without base",
            "D1",
            edited("delta", lambda m: (m.update(version=3), m.pop("base"))),
            "version",
        ),
        (
            "base names an extra.pt it lacks",
            "R11",
            edited("base", lambda m: m.update(extra={"file": "extra.pt", "bytes": 4, "crc": 0})),
            "extra.pt",
        ),
        ("delta nested 65 deep", "R2", edited("delta", nested), "JSON"),
        ("delta with a 4,301-digit integer", "R2", long_int, "JSON"),
    ]
    return {
        "chain": "delta_v1/ (base, delta; compacted/ is not a link)",
        "error": "CheckpointError",
        "cases": [
            {"name": n, "rule": r, "manifests": manifests, "names": names} for n, r, manifests, names in cases
        ],
    }


def main() -> None:
    ids = [0, 1, 2, 7, 255, 256, 1000, 123456789, -1 & MASK64 >> 1, -(2**63), 2**62 + 12345]
    ids = [i - 2**64 if i >= 2**63 else i for i in ids]
    shards = {
        "rule": "shard = (num_shards * fnv64_broken(id)) >> 64",
        "cases": [
            {
                "id": i,
                "fnv64": f"{fnv64_broken(i):016x}",
                "shards": {str(n): (n * fnv64_broken(i)) >> 64 for n in (1, 3, 8, 64)},
            }
            for i in ids
        ],
    }
    init = {
        "seed": 1234,
        "init_range": [-0.05, 0.05],
        "dim": 5,
        "rows": [
            {
                "id": i,
                **{
                    f"{name}_hex": pack(fmt, (init_value(1234, i, c, -0.05, 0.05) for c in range(5))).hex()
                    for name, fmt in (("float32", "f"), ("float16", "e"), ("bfloat16", "b"))
                },
            }
            for i in (0, 1, 42, 2**40 + 3, 9_999_999_999)
        ],
    }
    weight = [0.5, -1.25, 2.0, 3.0, -0.125, 1.5]
    rows = {
        "note": "dim 6 (padded to 8), optimizer_state_dim 1 (padded to 4); key 0x0102030405060708",
        "header": {"key": 0x0102030405060708, "timestamp": 1_700_000_000, "count": 5, "used": 1},
        "weight": weight,
        "state": [0.25],
        "float32_hex": row_bytes("f", 0x0102030405060708, 1_700_000_000, 5, 1, weight, [0.25]).hex(),
        "float16_hex": row_bytes("e", 0x0102030405060708, 1_700_000_000, 5, 1, weight, [0.25]).hex(),
        "bfloat16_hex": row_bytes("b", 0x0102030405060708, 1_700_000_000, 5, 1, weight, [0.25]).hex(),
    }
    checksums = {
        "crc32c": "reflected polynomial 0x82F63B78, init 0xFFFFFFFF, final xor 0xFFFFFFFF",
        "crc32": "zlib's CRC-32: reflected polynomial 0xEDB88320, init 0xFFFFFFFF, final xor 0xFFFFFFFF",
        "sha256": "FIPS 180-4 SHA-256 as 64 lowercase hex digits (a delta's base.manifest_sha256)",
        "cases": [
            {
                "ascii": text,
                "crc32c": crc32c(text.encode()),
                "crc32": zlib.crc32(text.encode()),
                "sha256": hashlib.sha256(text.encode()).hexdigest(),
            }
            for text in ("", "123456789", "leanstate")
        ],
    }
    for name, payload in (
        ("shard_hash.json", shards),
        ("initial_rows.json", init),
        ("rows.json", rows),
        ("checksums.json", checksums),
    ):
        (HERE / name).write_text(json.dumps(payload, indent=1) + "\n")
    golden = golden_checkpoint(HERE / "checkpoint_v1", "f", "crc32")
    golden_checkpoint(HERE / "checkpoint_v1_bf16_crc32c", "b", "crc32c")
    damaged = damaged_manifests(golden)
    (HERE / "checkpoint_v1_damaged.json").write_text(json.dumps(damaged, indent=1) + "\n")
    golden_delta(HERE / "delta_v1")
    chains = damaged_chains(HERE / "delta_v1")
    (HERE / "delta_v1_damaged.json").write_text(json.dumps(chains, indent=1) + "\n")


if __name__ == "__main__":
    main()
