"""ZeRO on real torch.distributed process groups (gloo on 127.0.0.1), world sizes 1-4.

Each world is spawned once and runs every scenario; each rank writes what happened,
and each scenario is one test. Gradients are averaged with an all-reduce per gradient
(DistributedDataParallel's arithmetic); the ZeRO model and a plain-optimizer replica see
the same gradients, so their parameters must stay bitwise equal.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from leanstate.reference import zero as textbook
from leanstate.zero import ZeroRedundancyOptimizer
from tests.harness import Worlds
from tests.zero_models import (
    OPTIMIZERS,
    assert_equal_across_ranks,
    assert_same,
    backward,
    batch,
    inner,
    make_model,
    train_pair,
)

# -- scenarios ---------------------------------------------------------------------------


def parity(name: str, bucket: bool):
    def scenario(rank, world, folder):
        cls, kwargs = OPTIMIZERS[name]
        # DistributedDataParallel on both sides (unused parameters: the flips freeze one)
        zero_model, plain_model = (DDP(make_model(), find_unused_parameters=True) for _ in range(2))
        zero = ZeroRedundancyOptimizer(
            zero_model.parameters(), cls, parameters_as_bucket_view=bucket, **kwargs
        )
        plain = cls(plain_model.parameters(), **kwargs)
        train_pair(zero_model, plain_model, zero, plain, 20, rank)
        local = sum(p.numel() for g in zero.optim.param_groups for p in g["params"])
        total = sum(p.numel() for p in zero_model.parameters())
        assert local <= total // world + max(p.numel() for p in zero_model.parameters())

    return scenario


def held_to_the_reference(name: str, bucket: bool):
    """The production class against the textbook (``leanstate.reference.zero``): the same
    parameters bit for bit at every step (trainability flips included), and the same
    consolidated state dict, which each loads from the other."""

    def scenario(rank, world, folder):
        cls, kwargs = OPTIMIZERS[name]
        ours_model, ref_model = (DDP(make_model(), find_unused_parameters=True) for _ in range(2))
        ours = ZeroRedundancyOptimizer(
            ours_model.parameters(), cls, parameters_as_bucket_view=bucket, **kwargs
        )
        ref = textbook.ZeroRedundancyOptimizer(ref_model.parameters(), cls, **kwargs)
        train_pair(ours_model, ref_model, ours, ref, 20, rank)
        target = world - 1
        for optimizer in (ours, ref):
            optimizer.consolidate_state_dict(to=target)
        if rank == target:
            a, b = ours.state_dict(), ref.state_dict()
            assert a["param_groups"] == b["param_groups"]
            assert a["state"].keys() == b["state"].keys()
            for key, fields in a["state"].items():
                assert fields.keys() == b["state"][key].keys()
                assert all(torch.equal(fields[f], b["state"][key][f]) for f in fields), key
            saved = (a, b)
        else:
            saved = None
        box = [saved]
        dist.broadcast_object_list(box, src=target)
        ours.load_state_dict(box[0][1])  # each takes the other's state and they step on together
        ref.load_state_dict(box[0][0])
        train_pair(ours_model, ref_model, ours, ref, 3, rank, start=20, flips=False)

    return scenario


def closure_and_scheduler(rank, world, folder):
    cls, kwargs = OPTIMIZERS["adam"]
    zero_model, plain_model = make_model(), make_model()
    zero = ZeroRedundancyOptimizer(zero_model.parameters(), cls, **kwargs)
    plain = cls(plain_model.parameters(), **kwargs)
    schedulers = [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5) for o in (zero, plain)]
    for step in range(6):
        losses = [
            optimizer.step(lambda m=model, s=step: backward(m, batch(s, rank)))
            for model, optimizer in ((zero_model, zero), (plain_model, plain))
        ]
        assert torch.equal(losses[0], losses[1])
        for s in schedulers:
            s.step()
        assert_same(zero_model, plain_model, f"step {step}")
    assert zero.param_groups[0]["lr"] == plain.param_groups[0]["lr"] == 0.01 * 0.5**3


def add_param_group(rank, world, folder):
    cls, kwargs = OPTIMIZERS["sgd"]
    zero_model, plain_model = make_model(), make_model()
    zero = ZeroRedundancyOptimizer(
        list(zero_model[:3].parameters()), cls, parameters_as_bucket_view=True, **kwargs
    )
    plain = cls(list(plain_model[:3].parameters()), **kwargs)
    train_pair(zero_model, plain_model, zero, plain, 3, rank, flips=False)
    zero.add_param_group({"params": list(zero_model[4].parameters()), "lr": 0.2})
    plain.add_param_group({"params": list(plain_model[4].parameters()), "lr": 0.2})
    train_pair(zero_model, plain_model, zero, plain, 4, rank, start=3, flips=False)


def clipping(rank, world, folder):
    zero_model, plain_model = make_model(), make_model()
    zero = ZeroRedundancyOptimizer(zero_model.parameters(), torch.optim.SGD, lr=0.1)
    for norm_type in (2.0, 1.0, float("inf")):
        for model in (zero_model, plain_model):
            backward(model, batch(0, rank) * 10)
        for max_norm in (0.5, 1e9):  # 1e9: the norm is below it, so the gradients stay as they are
            ours = zero.clip_grad_norm_(max_norm, norm_type)
            theirs = torch.nn.utils.clip_grad_norm_(plain_model.parameters(), max_norm, norm_type)
            assert torch.equal(ours, theirs), (norm_type, ours, theirs)
            for p, q in zip(zero_model.parameters(), plain_model.parameters(), strict=True):
                assert torch.equal(p.grad, q.grad)


def state_dicts(rank, world, folder):
    cls, kwargs = OPTIMIZERS["adam"]
    zero_model, plain_model = make_model(), make_model()
    zero = ZeroRedundancyOptimizer(zero_model.parameters(), cls, parameters_as_bucket_view=True, **kwargs)
    plain = cls(plain_model.parameters(), **kwargs)
    train_pair(zero_model, plain_model, zero, plain, 5, rank, flips=False)
    target = world - 1
    zero.consolidate_state_dict(to=target)
    if rank == target:
        ours, theirs = zero.state_dict(), plain.state_dict()
        assert ours["state"].keys() == theirs["state"].keys()
        for key in theirs["state"]:
            for field, value in theirs["state"][key].items():
                assert torch.equal(ours["state"][key][field], value), (key, field)
        assert [g["params"] for g in ours["param_groups"]] == [g["params"] for g in theirs["param_groups"]]
        # it loads into a plain optimizer, which then matches: same state, same next step
        other_model = copy.deepcopy(plain_model)
        other = cls(other_model.parameters(), **kwargs)
        other.load_state_dict(copy.deepcopy(ours))
        for key, entry in plain.state_dict()["state"].items():
            for field, value in entry.items():
                assert torch.equal(other.state_dict()["state"][key][field], value), (key, field)
        probe_model = copy.deepcopy(plain_model)
        probe = cls(probe_model.parameters(), **kwargs)
        probe.load_state_dict(copy.deepcopy(plain.state_dict()))
        for model, optimizer in ((other_model, other), (probe_model, probe)):
            model.zero_grad(set_to_none=True)
            model(batch(99, rank)).square().mean().backward()  # this rank alone: no all-reduce
            optimizer.step()
        assert_same(other_model, probe_model, "a plain optimizer loaded from the consolidated state")
    else:
        try:
            zero.state_dict()
        except RuntimeError as exc:
            assert "consolidate_state_dict" in str(exc)
        else:
            raise AssertionError("state_dict() without consolidation must raise")
    # plain -> ZeRO, the caller's dict untouched, no None in .state
    given = copy.deepcopy(plain.state_dict())  # independent of plain, which trains on
    pristine = copy.deepcopy(given)
    fresh_model = copy.deepcopy(zero_model)
    fresh = ZeroRedundancyOptimizer(fresh_model.parameters(), cls, **kwargs)
    fresh.load_state_dict(given)
    assert given.keys() == pristine.keys() and given["param_groups"] == pristine["param_groups"]
    assert given["state"].keys() == pristine["state"].keys()
    assert all(v is not None for v in fresh.state.values())
    owned = {p for g in fresh.optim.param_groups for p in g["params"]}
    assert set(fresh.optim.state) <= owned
    train_pair(fresh_model, plain_model, fresh, plain, 5, rank, start=5, flips=False)
    for key, entry in given["state"].items():  # the loaded optimizer did not write into it
        for field, value in entry.items():
            assert torch.equal(value, pristine["state"][key][field])
    # the consolidated state is a snapshot: a later step leaves it (this rank's part too) as it was
    if rank == target:
        before = copy.deepcopy(zero.state_dict())
    backward(zero_model, batch(7, rank))
    zero.step()
    if rank == target:
        after = zero.state_dict()
        for key, entry in before["state"].items():
            for field, value in entry.items():
                assert torch.equal(after["state"][key][field], value), ("changed by a later step", key, field)


def assert_same_state(ours: dict, theirs: dict, what: str) -> None:
    assert [g["params"] for g in ours["param_groups"]] == [g["params"] for g in theirs["param_groups"]], what
    assert ours["state"].keys() == theirs["state"].keys(), what
    for key, entry in theirs["state"].items():
        assert entry.keys() == ours["state"][key].keys(), (what, key)
        for field, value in entry.items():
            assert torch.equal(ours["state"][key][field], value), (what, key, field)


def consolidation_moves(rank, world, folder):
    """A consolidation to another rank takes the consolidated state away from the rank that
    held it: consolidated to rank 0, a step, then to the last rank, rank 0's ``state_dict()``
    raises ``RuntimeError`` (torch's class where nothing is consolidated) instead of
    returning the state of before the step, and the last rank's is the state after it; and
    back to rank 0 after one more step. The textbook is held to the same. A rank notes what
    is wrong and goes on, so that the ranks' collectives stay in step."""
    cls, kwargs = OPTIMIZERS["adam"]
    problems = []
    for implementation in (ZeroRedundancyOptimizer, textbook.ZeroRedundancyOptimizer):
        zero_model, plain_model = make_model(), make_model()
        zero = implementation(zero_model.parameters(), cls, **kwargs)
        plain = cls(plain_model.parameters(), **kwargs)
        name = implementation.__module__
        for moves, to in enumerate((0, world - 1, 0)):
            train_pair(zero_model, plain_model, zero, plain, 2, rank, start=2 * moves, flips=False)
            zero.consolidate_state_dict(to=to)
            try:
                if rank == to:
                    assert_same_state(zero.state_dict(), plain.state_dict(), f"consolidated to {to}")
                    continue
                zero.state_dict()
            except RuntimeError as exc:
                if "consolidate_state_dict" not in str(exc):
                    problems.append(f"{name}: rank {rank}, consolidated to {to}: {exc}")
            except AssertionError as exc:
                problems.append(f"{name}: {exc}")
            else:
                problems.append(f"{name}: rank {rank} kept a state consolidated before to={to}")
    assert not problems, problems


def empty_shard(rank, world, folder):
    cls, kwargs = OPTIMIZERS["sgd"]
    torch.manual_seed(0)
    zero_model = nn.Sequential(nn.Linear(3, 2))
    plain_model = copy.deepcopy(zero_model)
    zero = ZeroRedundancyOptimizer(zero_model.parameters(), cls, parameters_as_bucket_view=True, **kwargs)
    plain = cls(plain_model.parameters(), **kwargs)
    assert sum(len(g["params"]) for g in zero.optim.param_groups) == (1 if rank < 2 else 0)
    for step in range(3):
        for model in (zero_model, plain_model):
            backward(model, batch(step, rank)[:, :3])
        zero.step()
        plain.step()
        assert_same(zero_model, plain_model, f"step {step}")


def subgroup(rank, world, folder):
    group = dist.new_group([1, 2, 3])
    if rank == 0:
        return
    cls, kwargs = OPTIMIZERS["adam"]
    for bucket in (False, True):
        zero_model, plain_model = make_model(), make_model()
        zero = ZeroRedundancyOptimizer(
            zero_model.parameters(), cls, process_group=group, parameters_as_bucket_view=bucket, **kwargs
        )
        plain = cls(plain_model.parameters(), **kwargs)
        train_pair(zero_model, plain_model, zero, plain, 4, rank, flips=False, group=group)
        zero.consolidate_state_dict(to=1)  # group rank 1 = global rank 2
        if rank == 2:
            assert len(zero.state_dict()["state"]) == 6


def elastic_save(rank, world, folder):
    cls, kwargs = OPTIMIZERS["adamw"]
    model, plain_model = make_model(), make_model()
    zero = ZeroRedundancyOptimizer(model.parameters(), cls, **kwargs)
    plain = cls(plain_model.parameters(), **kwargs)
    for step in range(6):
        for m in (model, plain_model):
            backward(m, batch(step, 0))  # the same data on every rank
        zero.step()
        plain.step()
    assert_same(model, plain_model, "after 6 steps")
    zero.consolidate_state_dict(to=0)
    if rank == 0:
        saved = zero.state_dict()
        expected = plain.state_dict()
        assert saved["state"].keys() == expected["state"].keys()
        for key, entry in expected["state"].items():
            for field, value in entry.items():
                assert torch.equal(saved["state"][key][field], value), (key, field)
        torch.save({"model": model.state_dict(), "optim": saved}, Path(folder) / "elastic.pt")


def join(rank, world, folder):
    """Uneven inputs under ``Join([model, zero])``: the same parameters as torch's ZeRO, bit for bit."""
    from torch.distributed.algorithms.join import Join
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero

    results = []
    for implementation in (ZeroRedundancyOptimizer, TorchZero):
        for bucket in (False, True):
            model = DDP(make_model())
            zero = implementation(
                model.parameters(), torch.optim.Adam, parameters_as_bucket_view=bucket, lr=0.01
            )
            with Join([model, zero]):
                for step in range(3 + 2 * rank):  # rank r has 3 + 2r batches
                    backward(model, batch(step, rank))
                    zero.step()
            assert_equal_across_ranks(model)
            results.append([p.detach().clone() for p in model.parameters()])
    for ours, theirs in zip(results[:2], results[2:], strict=True):
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(results[0], make_model().parameters(), strict=True))


def dense_types(rank, world, folder):
    """Sparse parameters, or parameters of two dense types, are refused at construction (as torch's)."""
    sparse = nn.Parameter(torch.zeros(4, 4).to_sparse())
    mixed = [nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(3, dtype=torch.float64))]
    for params, message in (([sparse], "only supports dense parameters"), (mixed, "one dense type")):
        try:
            ZeroRedundancyOptimizer(params, torch.optim.SGD, lr=0.1)
        except ValueError as exc:
            assert message in str(exc), exc
        else:
            raise AssertionError(f"{message}: not refused")


def partition(rank, world, folder):
    """Sorted-greedy by numel: largest first, each to the rank holding the fewest elements."""
    sizes = [3, 200, 40, 120, 7, 90, 90, 1]
    params = [nn.Parameter(torch.zeros(n)) for n in sizes]
    zero = ZeroRedundancyOptimizer(params, torch.optim.SGD, lr=0.1)
    totals, expected = [0] * world, [[] for _ in range(world)]
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        owner = totals.index(min(totals))
        expected[owner].append(i)
        totals[owner] += sizes[i]
    mine = [next(i for i, p in enumerate(params) if p is q) for q in zero.optim.param_groups[0]["params"]]
    assert mine == expected[rank], (mine, expected[rank])


def rebuild(rank, world, folder):
    """A parameter frozen or thawed between steps leaves or rejoins this rank's bucket at the next step."""
    cls, kwargs = OPTIMIZERS["sgd"]
    model = make_model()
    zero = ZeroRedundancyOptimizer(model.parameters(), cls, parameters_as_bucket_view=True, **kwargs)

    def in_a_bucket(param):
        storages = {b.untyped_storage().data_ptr() for b in zero._buckets[param.device]}
        return param.untyped_storage().data_ptr() in storages

    weight = inner(model)[2].weight
    backward(model, batch(0, rank))
    zero.step()
    assert in_a_bucket(weight)
    weight.requires_grad_(False)
    backward(model, batch(1, rank))
    zero.step()
    assert not in_a_bucket(weight)
    weight.requires_grad_(True)
    backward(model, batch(2, rank))
    zero.step()
    assert in_a_bucket(weight)


def frozen_apart(bucket: bool):
    """Frozen parameters end equal on every rank in both bucket modes, even when one rank
    alone freezes a parameter, or each rank re-initialises a frozen one its own way."""

    def scenario(rank, world, folder):
        cls, kwargs = OPTIMIZERS["adam"]
        model = make_model()
        zero = ZeroRedundancyOptimizer(model.parameters(), cls, parameters_as_bucket_view=bucket, **kwargs)
        for step in range(6):
            if step == 2 and rank == 1:
                model[2].weight.requires_grad_(False)  # this rank only: the bucket layouts must agree
            if step == 3:
                model[0].bias.requires_grad_(False)
                with torch.no_grad():
                    model[0].bias.fill_(float(rank))  # a different value on every rank
            model.zero_grad(set_to_none=True)
            model(batch(step, rank)).square().mean().backward()  # local gradients: ranks differ
            zero.step()
            assert_equal_across_ranks(model)

    return scenario


def elastic_resume(rank, world, folder):
    cls, kwargs = OPTIMIZERS["adamw"]
    saved = torch.load(Path(folder) / "elastic.pt", weights_only=True)
    zero_model, plain_model = make_model(), make_model()
    zero_model.load_state_dict(saved["model"])
    plain_model.load_state_dict(saved["model"])
    zero = ZeroRedundancyOptimizer(zero_model.parameters(), cls, parameters_as_bucket_view=True, **kwargs)
    plain = cls(plain_model.parameters(), **kwargs)
    zero.load_state_dict(copy.deepcopy(saved["optim"]))
    plain.load_state_dict(copy.deepcopy(saved["optim"]))
    for step in range(6, 12):
        for model in (zero_model, plain_model):
            backward(model, batch(step, 0))
        zero.step()
        plain.step()
        assert_same(zero_model, plain_model, f"step {step}")


SCENARIOS = {
    **{
        f"parity-{name}-{'bucket' if bucket else 'per-param'}": parity(name, bucket)
        for name in OPTIMIZERS
        for bucket in (False, True)
    },
    "reference-adam-bucket": held_to_the_reference("adam", True),
    "reference-sgd-per-param": held_to_the_reference("sgd", False),
    "closure-and-scheduler": closure_and_scheduler,
    "add-param-group": add_param_group,
    "clipping": clipping,
    "state-dicts": state_dicts,
    "consolidation-moves": consolidation_moves,
    "elastic-save": elastic_save,
    "partition": partition,
    "dense-types": dense_types,
    "join": join,
    "rebuild": rebuild,
    "elastic-resume": elastic_resume,
    "empty-shard": empty_shard,
    "subgroup": subgroup,
    "frozen-apart-bucket": frozen_apart(True),
    "frozen-apart-per-param": frozen_apart(False),
}
COMMON = [
    name for name in SCENARIOS if name.startswith(("parity", "closure", "add-param", "clipping", "state"))
]
# held to the textbook where sharding happens: 2 ranks both ways, 3 ranks (uneven shares) once
BY_WORLD = {
    1: [*COMMON, "elastic-resume", "dense-types"],
    2: [*COMMON, "reference-adam-bucket", "reference-sgd-per-param", "elastic-save", "partition", "rebuild"]
    + ["dense-types", "join", "frozen-apart-bucket", "consolidation-moves"],
    3: [*COMMON, "reference-adam-bucket", "empty-shard", "elastic-resume", "partition", "join"]
    + ["frozen-apart-bucket", "consolidation-moves"],
    4: ["parity-adam-bucket", "parity-sgd-per-param", "state-dicts", "subgroup", "frozen-apart-per-param"],
}


@pytest.fixture(scope="module")
def worlds(tmp_path_factory, request):
    # the selected scenarios only (a mutant's one test runs one); world 2 saves the
    # checkpoint that worlds 1 and 3 resume
    return Worlds(
        tmp_path_factory.mktemp("zero"), __name__, request, needs={"elastic-resume": (2, "elastic-save")}
    )


CASES = [(world, name) for world, names in BY_WORLD.items() for name in names]


@pytest.mark.parametrize("world, scenario", CASES, ids=[f"world{w}-{n}" for w, n in CASES])
def test_zero(worlds, world, scenario):
    failures = worlds.outcome(world, scenario)
    assert not failures, "\n".join(failures)
