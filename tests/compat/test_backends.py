import abc
import os
import subprocess
import sys

import pytest
import torch

import leanstate
from leanstate import _backends


def run_python(code: str, **env: str) -> str:
    environment = {k: v for k, v in os.environ.items() if k != _backends.ENV_VAR} | env
    done = subprocess.run(
        [sys.executable, "-c", code], env=environment, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


INFO = "import leanstate; i = leanstate.backend_info(); print(i.chosen['kv_store']); print(i)"


@pytest.mark.parametrize(
    "value, chosen",
    [
        ("auto", "numba"),
        ("reference", "reference"),
        ("numba", "numba"),
        ("torch", "torch"),
        ("bogus", "numba"),
        ("", "numba"),
    ],
)
def test_every_env_value_imports_and_explains(value, chosen):
    out = run_python(INFO, LEANSTATE_BACKEND=value)
    got, report = out.split("\n", 1)
    assert got == chosen
    assert f"LEANSTATE_BACKEND={value or 'auto'}" in report and f"chose {chosen}" in report
    if value == "bogus":
        assert "unknown backend 'bogus'" in report


def test_unimportable_numba_falls_back_with_the_reason():
    code = "import sys; sys.modules['numba'] = None\n" + INFO
    out = run_python(code, LEANSTATE_BACKEND="auto")
    assert "numba: cannot import its dependency (ModuleNotFoundError: import of numba halted" in out
    assert out.startswith("torch")  # the next in the auto order on a machine without CUDA
    store = run_python(
        "import sys; sys.modules['numba'] = None\nimport leanstate; print(leanstate.KVStore(4).backend)"
    )
    assert store.strip() == "torch"


def test_broken_numba_does_not_break_import(tmp_path):
    (tmp_path / "numba").mkdir()
    (tmp_path / "numba" / "__init__.py").write_text("raise RuntimeError('half-installed numba')\n")
    out = run_python(INFO, PYTHONPATH=str(tmp_path))
    assert out.startswith("torch") and "RuntimeError: half-installed numba" in out


def test_auto_order_follows_each_modules_priority_per_device(monkeypatch):
    monkeypatch.setattr(_backends, "cuda_present", lambda: False)
    assert _backends.auto_order("kv_store")[:2] == ["numba", "torch"]
    assert _backends.auto_order("kv_store")[-1] == "reference"
    assert _backends.select("kv_store", "reference")[0] == "reference"
    # on a CUDA machine the GPU engines come first (spec/backends.md states the default order)
    monkeypatch.setattr(_backends, "cuda_present", lambda: True)
    order = _backends.auto_order("kv_store")
    assert order.index("torch") < order.index("numba") and order[-1] == "reference"
    assert _backends.auto_order("embedding").index("torch") < _backends.auto_order("embedding").index("numba")
    assert _backends.select("kv_store", "auto")[0] == order[0]


def test_an_explicit_backend_that_cannot_load_falls_back_and_says_why(monkeypatch):
    monkeypatch.setitem(_backends.REGISTRY, ("kv_store", "ghost"), "leanstate.accelerated.no_such_module")
    monkeypatch.delitem(_backends._PROBED, "leanstate.accelerated.no_such_module", raising=False)
    backend, reasons = _backends.select("kv_store", "ghost")
    assert backend == "numba"
    assert any(r.startswith("ghost: cannot import its dependency (ModuleNotFoundError") for r in reasons)
    with pytest.raises(ValueError, match="backend='ghost' is unavailable here"):
        leanstate.KVStore(4, backend="ghost")


def test_public_class_builds_the_chosen_backend_and_accepts_backend():
    store = leanstate.KVStore(4, backend="reference")
    assert isinstance(store, leanstate.KVStore) and store.engine.backend == "reference"
    assert leanstate.KVStore(4).backend == leanstate.backend_info().chosen["kv_store"]
    assert leanstate.KVStore(4, backend="numba").engine.backend == "numba"
    with pytest.raises(ValueError, match="no implementation of offload"):
        leanstate.offload_wrapper(torch.nn.Linear(2, 2), backend="numba")
    with pytest.raises(ValueError, match="not one of"):
        leanstate.KVStore(4, backend="fast")
    with pytest.raises(ValueError, match="the numba engine runs on cpu"):
        leanstate.KVStore(4, backend="numba", device="meta")
    assert leanstate.KVStore(4, dtype=torch.float16).dtype == torch.float16


def test_import_loads_no_engine_module_until_a_component_is_used():
    code = (
        "import sys, leanstate\n"
        "print(any(m.startswith('leanstate.accelerated') for m in sys.modules), 'numba' in sys.modules)\n"
        "leanstate.KVStore(4)\n"
        "print(leanstate.backend_info().chosen['kv_store'], 'numba' in sys.modules)"
    )
    assert run_python(code).split() == ["False", "False", "numba", "True"]


def test_zero_is_one_real_optimizer_class():
    assert issubclass(leanstate.ZeroRedundancyOptimizer, torch.optim.Optimizer)
    assert type(leanstate.ZeroRedundancyOptimizer) is abc.ABCMeta  # Joinable's, no dispatch metaclass
    for name in ("join_hook", "join_device", "join_process_group", "overlap_with"):
        assert hasattr(leanstate.ZeroRedundancyOptimizer, name)
    code = """
import os, socket, torch, torch.distributed as dist, leanstate
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
dist.init_process_group("gloo", rank=0, world_size=1)
params = [torch.nn.Parameter(torch.ones(3))]
fast = leanstate.ZeroRedundancyOptimizer(params, torch.optim.SGD, parameters_as_bucket_view=True,
                                         overlap_broadcast=True, lr=0.1)
print(isinstance(fast, torch.optim.Optimizer), fast.overlap_broadcast)
try:
    leanstate.ZeroRedundancyOptimizer(params, torch.optim.SGD, overlap_broadcast=True, lr=0.1)
except ValueError as exc:
    print("refused:", "parameters_as_bucket_view=True" in str(exc))
dist.destroy_process_group()
"""
    assert run_python(code).split() == ["True", "True", "refused:", "True"]


def test_import_zero_and_wrappers_work_without_numpy():
    """torch needs no numpy; neither do ``import leanstate``, ZeRO (consolidation too) and the wrappers."""
    code = """
import sys
sys.modules["numpy"] = None  # as if numpy were not installed
import os, socket, warnings
warnings.simplefilter("ignore")
import torch, torch.distributed as dist
from torch import nn
import leanstate
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
dist.init_process_group("gloo", rank=0, world_size=1)
model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
zero = leanstate.ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, parameters_as_bucket_view=True, lr=0.1)
model(torch.ones(2, 4)).sum().backward()
zero.step()
zero.consolidate_state_dict(to=0)
wrapped = leanstate.offload_wrapper(leanstate.checkpoint_wrapper(nn.Linear(4, 4)))
wrapped(torch.ones(2, 4, requires_grad=True)).sum().backward()
dist.destroy_process_group()
store = leanstate.KVStore(4)  # numba needs numpy: auto takes the torch engine
store.set(torch.tensor([3]), torch.ones(1, 4))
print(leanstate.backend_info().chosen["kv_store"], len(zero.state_dict()["state"]), float(store.get(torch.tensor([3])).sum()))
"""
    assert run_python(code).split() == ["torch", "4", "4.0"]


def test_checkpoints_without_numpy_name_the_fix_and_write_nothing(tmp_path):
    """Without numpy a checkpoint call says what to install before it touches a file; the
    rest of leanstate (the chain's modules among what ``import leanstate`` loads) imports."""
    code = f"""
import sys
sys.modules["numpy"] = None
import warnings
warnings.simplefilter("ignore")
import torch, leanstate
store = leanstate.KVStore(4)
store.set(torch.tensor([3]), torch.ones(1, 4))
calls = {{
    "save_checkpoint": lambda: leanstate.save_checkpoint({str(tmp_path / "c")!r}, {{"t": store}}),
    "load_checkpoint": lambda: leanstate.load_checkpoint({str(tmp_path / "c")!r}, {{"t": store}}),
    "compact_checkpoint": lambda: leanstate.compact_checkpoint({str(tmp_path / "c")!r}, {str(tmp_path / "d")!r}),
}}
for method, call in calls.items():
    try:
        call()
    except ModuleNotFoundError as exc:
        print(str(exc).startswith(method + ":") and "pip install numpy" in str(exc))
print(leanstate.Follower.__name__, len(store))
"""
    assert run_python(code).split() == ["True", "True", "True", "Follower", "1"]
    assert list(tmp_path.iterdir()) == []


def test_backend_info_is_a_snapshot_that_changes_nothing():
    info = leanstate.backend_info()
    chosen = info.chosen["kv_store"]
    info.chosen["kv_store"] = "nonsense"
    info.reasons.clear()
    again = leanstate.backend_info()
    assert again.chosen["kv_store"] == chosen and again.reasons["kv_store"]
    assert leanstate.KVStore(4).backend == chosen


def test_checkpoint_backend_argument_is_deprecated_and_ignored(tmp_path):
    store = leanstate.KVStore(4, backend="reference")
    store.set(torch.tensor([3, 8]), torch.ones(2, 4))
    with pytest.warns(DeprecationWarning, match="deprecated and ignored"):
        leanstate.save_checkpoint(tmp_path / "c", {"t": store}, backend="numba")
    fresh = leanstate.KVStore(4, backend="reference")
    with pytest.warns(DeprecationWarning, match="deprecated and ignored"):
        leanstate.load_checkpoint(tmp_path / "c", {"t": fresh}, backend="torch")
    assert torch.equal(fresh.get_rows(store.keys()), store.get_rows(store.keys()))


def test_an_unknown_backend_in_the_environment_warns_at_import():
    environment = {k: v for k, v in os.environ.items() if k != _backends.ENV_VAR} | {
        "LEANSTATE_BACKEND": "bogus"
    }
    done = subprocess.run(
        [sys.executable, "-c", "import leanstate"],
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and "LEANSTATE_BACKEND='bogus' is not a backend" in done.stderr
    quiet = subprocess.run(
        [sys.executable, "-W", "error", "-c", "import leanstate"],
        env=environment | {"LEANSTATE_BACKEND": "numba"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert quiet.returncode == 0, quiet.stderr
