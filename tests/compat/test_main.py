import subprocess
import sys


def run(*args: str, stderr: list | None = None, timeout: int = 300) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "leanstate", *args], capture_output=True, text=True, timeout=timeout
    )
    verdicts = "\n".join(line for line in done.stdout.splitlines() if line.startswith(("PASS", "FAIL")))
    assert done.returncode == 0, f"{verdicts}\n{done.stderr[-3000:]}"
    if stderr is not None:
        stderr.append(done.stderr)
    return done.stdout


def test_demo_trains_checkpoints_and_proves_its_claims(tmp_path):
    out = run(
        "demo", "--steps", "12", "--every", "4", "--batch", "128", "--ids", "2000", "--dim", "8",
        "--memory-rows", "400000", "--out", str(tmp_path / "demo"), timeout=1200,
    )  # fmt: skip
    # step 4 is full, step 8 a delta of it: the resume loads the chain
    assert "PASS  resume from step 8 at 2 rank(s) (a chain of 2 checkpoints) is bit-exact" in out, out
    assert "bytes written: 1 full checkpoints of" in out and "1 deltas of" in out, out
    assert "PASS  load at step 4, 2->1 ranks, trains on to the same losses" in out, out
    assert "1->2 ranks, trains on to the same losses" in out and "FAIL" not in out, out
    assert "PASS  whole-row load needs a fraction of the legacy load's memory" in out, out
    assert "PASS  a serving copy follows the run's checkpoints as they land: 2 links applied" in out, out
    for name in ("uninterrupted", "resumed", "2->1 ranks", "1->2 ranks"):
        assert any(line.startswith(name) for line in out.splitlines()), name
    png = tmp_path / "demo" / "demo.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    manifest = (tmp_path / "demo" / "uninterrupted" / "step8" / "manifest.json").read_text()
    assert '"format": "leanstate-whole-row-delta"' in manifest


def test_version_and_help_texts():
    import leanstate

    assert leanstate.__version__ == "0.1.0"
    for command in ("demo", "bench", "inspect", "follow"):
        text = run(command, "--help")
        options = [
            line for line in text.splitlines() if line.strip().startswith("--") or line.startswith("  path")
        ]
        assert options and all(len(line.split(None, 1)) == 2 for line in options), (
            text
        )  # each has a help text


def test_info_explains_the_choice_for_every_component():
    import leanstate
    from leanstate import _backends

    out = run("info").splitlines()
    chosen = leanstate.backend_info().chosen["kv_store"]  # this machine's choice, not a fixed name
    assert f"  kv_store: {chosen} (registered: reference, numba, numba-cuda, torch)" in out
    for component in _backends.components():  # every registered component: its choice and why
        line = next(i for i, text in enumerate(out) if text.startswith(f"  {component}: "))
        chosen = out[line].split()[1]
        reasons = []
        for text in out[line + 1 :]:
            if not text.startswith("    - "):
                break
            reasons.append(text)
        assert f"    - chose {chosen}" in reasons, (component, reasons)


def test_bench_prints_each_figure_beside_its_peer_with_a_verdict():
    errors = []
    # Generous: the bench spawns gloo ranks, and a busy 2-core machine may take minutes.
    out = run(
        "bench", "--quick", "--rows", "3000", "--dim", "16", "--batch", "512", stderr=errors, timeout=1800
    )
    out = out.splitlines()
    assert out[-1].startswith("ratio: how many times better leanstate does than its peer, higher is better")
    assert "Warning" not in errors[0], errors[0]  # the table is the whole output
    header = out.index(next(line for line in out if line.split()[:2] == ["component", "measure"]))
    rows = out[header + 1 : out.index("", header)]
    for needle in (
        "dense index_select",
        "dense index_copy_",
        "plain write+fsync",
        "plain read (readinto a faulted buffer",
        "whole-row save",
        "whole-row load",
        "whole-row load extra MiB",
        "torch checkpoint_wrapper",
        "EmbeddingBag(sparse)+sgd",
        "EmbeddingBag(sparse)+adagrad",
        "torch ZeRO",
        "broadcasts per step",
    ):
        found = [line for line in rows if needle in line]
        assert found, needle
        for line in found:
            words = line.split()
            verdict = words[-1]  # the target is "-" or two words ("op value")
            spread = words[-3] if verdict == "-" else words[-4]
            ratio = words[-4] if verdict == "-" else words[-5]
            assert verdict in ("yes", "no", "noisy", "-"), line
            low, high = (float(x) for x in spread.split("..")) if ".." in spread else (float(spread),) * 2
            assert 0 < low <= float(ratio) <= high, line  # both to 3 significant digits
            assert verdict == "-" or words[-3] == ">=", line  # every target is a floor on the ratio
    # the accelerated store backends are measured with targets; the reference, without, is not shown
    assert sum(" numba " in line and "index_" in line for line in rows) == 5
    assert not any(" reference " in line and "-" == line.split()[-1] for line in rows)
    assert all(
        line.split()[-1] in ("yes", "no", "noisy") for line in rows if " numba " in line and "index_" in line
    )
