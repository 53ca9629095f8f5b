"""The three code folders install as one package and nothing else is importable."""

import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {
    "compat": "leanstate",
    "reference": "leanstate.reference",
    "accelerated": "leanstate.accelerated",
}


def test_every_package_folder_is_listed():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    for folder, package in FOLDERS.items():
        assert config["package-dir"][package] == folder
        for init in (ROOT / folder).rglob("__init__.py"):
            sub = init.parent.relative_to(ROOT / folder).parts
            name = ".".join((package, *sub))
            assert name in listed, (
                f"{init.parent} has an __init__.py but {name} is not in [tool.setuptools] packages"
            )


def test_folders_are_not_importable_bare(tmp_path):
    # A fresh interpreter away from the repo root (pytest puts the root on sys.path).
    code = "import importlib.util as u; print([u.find_spec(n) is None for n in ('compat', 'reference', 'accelerated')])"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[True, True, True]"
    assert subprocess.run([sys.executable, "-c", "import leanstate.reference"], cwd=tmp_path).returncode == 0


def test_make_test_installs_the_pinned_cpu_torch_before_the_package():
    """The package's own range (torch>=2.4) would pull a multi-GB CUDA build if it came first."""
    import torch

    dry_run = subprocess.run(
        ["make", "-n", "-B", "install"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    installs = [line for line in dry_run if "pip install" in line and "--upgrade pip" not in line]
    first_torch = next(i for i, line in enumerate(installs) if "torch" in line)
    package = next(i for i, line in enumerate(installs) if " -e " in line)
    assert "torch==2.13.0" in installs[first_torch].split() and first_torch < package, installs
    assert torch.__version__.split("+")[0] == "2.13.0" and torch.version.cuda is None


@pytest.mark.slow
def test_a_plain_install_without_extras_runs_the_quick_bench(tmp_path):
    """``pip install .`` (no dev, bench or demo extras: no pandas, no matplotlib) runs the bench."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    pip = [python, "-m", "pip", "install", "-q"]
    subprocess.run([*pip, "torch==2.13.0"], check=True, timeout=1800)
    subprocess.run([*pip, str(ROOT)], check=True, timeout=1800)
    missing = subprocess.run(
        [python, "-c", "import importlib.util as u; print([u.find_spec(n) is None for n in ('pandas', 'matplotlib')])"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert missing.stdout.strip() == "[True, True]"
    done = subprocess.run(
        [python, "-m", "leanstate", "bench", "--quick", "--rows", "3000", "--dim", "16", "--batch", "512"],
        cwd=tmp_path, capture_output=True, text=True, timeout=3600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "component" in done.stdout and "plain write+fsync" in done.stdout
