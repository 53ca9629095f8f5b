"""leanstate's collections inside TorchRec's own code, against the real TorchRec (the
``torchrec`` extra; skipped without it): its DLRM built on them trains bit for bit as on
TorchRec's tables, eagerly and under ``torch.compile``; its KeyedTensor, KeyedJaggedTensor,
configs, CombinedOptimizer and state-dict utilities work with them."""

import functools

import pytest
import torch
import torch.distributed.checkpoint

torchrec = pytest.importorskip("torchrec", exc_type=ImportError)  # absent, or broken (no fbgemm)

from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict  # noqa: E402
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, KeyedTensor  # noqa: E402
from torchrec.models.dlrm import DLRM  # noqa: E402
from torchrec.modules.embedding_configs import DataType, PoolingType  # noqa: E402
from torchrec.modules.regroup import KTRegroupAsDict  # noqa: E402
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper  # noqa: E402

import leanstate  # noqa: E402
import leanstate.dcp  # noqa: E402
from leanstate import KVEmbeddingBagCollection, KVTableConfig  # noqa: E402

N, D, B, DENSE = 50, 8, 16, 4
KEYS = ["f1", "f2", "f3"]


def configs() -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(num_embeddings=N, embedding_dim=D, name="t1", feature_names=["f1"]),
        EmbeddingBagConfig(num_embeddings=N, embedding_dim=D, name="t2", feature_names=["f2", "f3"]),
    ]


def dlrm(ebc) -> DLRM:
    """TorchRec's DLRM on ``ebc``, its dense layers drawn from the same seed whatever ``ebc`` is
    (TorchRec's collection draws its rows from the global generator as it is built)."""
    torch.manual_seed(0)
    return DLRM(
        embedding_bag_collection=ebc,
        dense_in_features=DENSE,
        dense_arch_layer_sizes=[16, D],
        over_arch_layer_sizes=[16, 1],
    )


def batch(step: int, dtype: torch.dtype = torch.int64):
    """Step ``step``'s dense features, KJT (0-3 ids a bag, repeated ids) and labels."""
    generator = torch.Generator().manual_seed(step)
    lengths = torch.randint(0, 4, (len(KEYS) * B,), generator=generator)
    values = torch.randint(0, N, (int(lengths.sum()),), generator=generator)
    dense = torch.randn(B, DENSE, generator=generator)
    labels = torch.randint(0, 2, (B,), generator=generator).float()
    return dense, KeyedJaggedTensor.from_lengths_sync(KEYS, values.to(dtype), lengths.to(dtype)), labels


def train(model, steps: range, *, compile: bool = False) -> list[float]:
    """SGD on the dense parameters (and on TorchRec's tables, which are parameters); leanstate's
    tables update in backward. One loss per step."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    forward = torch.compile(model) if compile else model
    losses = []
    for step in steps:
        dense, features, labels = batch(step)
        logits = forward(dense, features).squeeze(1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def same_rows(kv_ebc, torchrec_ebc) -> None:
    """TorchRec's tables start from leanstate's initial rows of ids 0..N-1."""
    with torch.no_grad():
        for name, bag in kv_ebc.embedding_bags.items():
            torchrec_ebc.embedding_bags[name].weight.copy_(bag.store.get(torch.arange(N), width=D))


@functools.cache
def eager_leanstate_losses() -> tuple[float, ...]:
    return tuple(
        train(dlrm(KVEmbeddingBagCollection(tables=configs(), device=torch.device("cpu"))), range(20))
    )


def test_torchrecs_dlrm_trains_on_leanstates_tables_bit_for_bit_as_on_torchrecs():
    kv_ebc = KVEmbeddingBagCollection(tables=configs(), device=torch.device("cpu"))
    torchrec_ebc = EmbeddingBagCollection(tables=configs(), device=torch.device("cpu"))
    same_rows(kv_ebc, torchrec_ebc)
    ours, theirs = train(dlrm(kv_ebc), range(20)), train(dlrm(torchrec_ebc), range(20))
    assert ours == theirs
    assert len(set(ours)) == 20  # it trains: every step's loss differs
    assert tuple(ours) == eager_leanstate_losses()  # built afresh, the same run


def test_the_dlrm_under_torch_compile_gives_the_eager_losses():
    model = dlrm(KVEmbeddingBagCollection(tables=configs(), device=torch.device("cpu")))
    assert tuple(train(model, range(20), compile=True)) == eager_leanstate_losses()


def test_the_collection_answers_what_dlrm_and_torchrec_ask():
    tables = configs()
    ebc = KVEmbeddingBagCollection(tables, False, torch.device("cpu"))  # TorchRec's positions
    assert all(given is config for given, config in zip(ebc.embedding_bag_configs(), tables, strict=True))
    assert not ebc.is_weighted() and ebc.device == torch.device("cpu")
    assert ebc.embedding_bags["t2"].num_embeddings == N and ebc.embedding_bags["t2"].mode == "sum"
    # TorchRec's default init range: +-sqrt(1 / num_embeddings)
    rows = ebc.embedding_bags["t1"].store.get(torch.arange(N), width=D)
    assert rows.abs().max() <= N**-0.5 and rows.abs().max() > 0.5 * N**-0.5


def test_from_torchrec_reads_the_config_and_takes_kv_options():
    config = EmbeddingBagConfig(
        num_embeddings=100, embedding_dim=4, name="t", feature_names=["a", "b"], pooling=PoolingType.MEAN,
        data_type=DataType.FP16, weight_init_min=-0.5, weight_init_max=0.25,
    )  # fmt: skip
    kv = KVTableConfig.from_torchrec(config, optimizer="adam", lr=0.1, num_embeddings=None)
    assert (kv.name, kv.embedding_dim, kv.num_embeddings, kv.feature_names) == ("t", 4, None, ["a", "b"])
    assert (kv.pooling, kv.data_type, kv.optimizer, kv.lr) == ("mean", torch.float16, "adam", 0.1)
    assert (kv.weight_init_min, kv.weight_init_max) == (-0.5, 0.25)
    default = KVTableConfig.from_torchrec(EmbeddingBagConfig(num_embeddings=400, embedding_dim=4, name="u"))
    assert (default.weight_init_min, default.weight_init_max, default.feature_names) == (-0.05, 0.05, ["u"])
    custom = EmbeddingBagConfig(num_embeddings=10, embedding_dim=4, name="v", init_fn=torch.nn.init.normal_)
    with pytest.raises(ValueError, match="init_fn=.*cannot run"):
        KVTableConfig.from_torchrec(custom)


@pytest.mark.parametrize("weighted", [False, True])
def test_a_weighted_kjt_gives_torchrecs_outputs_whether_or_not_the_collection_is_weighted(weighted):
    kv_ebc = KVEmbeddingBagCollection(configs(), is_weighted=weighted)
    torchrec_ebc = EmbeddingBagCollection(configs(), is_weighted=weighted)
    same_rows(kv_ebc, torchrec_ebc)
    _, features, _ = batch(3)
    weights = torch.rand(len(features.values()), generator=torch.Generator().manual_seed(1)) + 0.5
    features = KeyedJaggedTensor.from_lengths_sync(KEYS, features.values(), features.lengths(), weights)
    ours, theirs = kv_ebc(features).values(), torchrec_ebc(features).values()
    if weighted:  # torch fuses the weighted multiply-add (spec/embedding.md)
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-7)
        assert not torch.equal(
            ours, kv_ebc.embedding_bags["t1"](features["f1"].values(), features["f1"].offsets()[:-1])
        )
    else:
        assert torch.equal(ours, theirs)


def test_int32_kjts_and_keys_no_table_reads_are_taken_as_torchrec_takes_them():
    kv_ebc = KVEmbeddingBagCollection(configs())
    _, features, _ = batch(4)
    _, narrow, _ = batch(4, torch.int32)
    assert narrow.values().dtype == torch.int32
    want = kv_ebc(features).values()
    assert torch.equal(kv_ebc(narrow).values(), want)
    extra = KeyedJaggedTensor.from_lengths_sync(
        ["other", *KEYS], torch.cat([torch.tensor([7, 8]), features.values()]),
        torch.cat([torch.tensor([1] * 2 + [0] * (B - 2)), features.lengths()]),
    )  # fmt: skip
    assert torch.equal(kv_ebc(extra).values(), want)


def test_the_output_is_torchrecs_keyed_tensor_and_regroups_with_torchrecs():
    kv_ebc = KVEmbeddingBagCollection(configs())
    other = EmbeddingBagCollection(
        [EmbeddingBagConfig(num_embeddings=N, embedding_dim=2, name="g", feature_names=["g1"])]
    )
    _, features, _ = batch(5)
    ours = kv_ebc(features)
    theirs = other(
        KeyedJaggedTensor.from_lengths_sync(
            ["g1"], torch.tensor([1, 2]), torch.tensor([1] * 2 + [0] * (B - 2))
        )
    )
    assert isinstance(ours, KeyedTensor) and ours.device() == torch.device("cpu")
    assert ours.keys() == KEYS and ours.length_per_key() == [D, D, D]
    grouped = KeyedTensor.regroup([ours, theirs], [["f3", "g1"], ["f1"]])
    assert torch.equal(grouped[0], torch.cat([ours["f3"], theirs["g1"]], dim=1))
    assert torch.equal(grouped[1], ours["f1"])
    as_dict = KTRegroupAsDict(groups=[["f1", "g1"], ["f2"]], keys=["a", "b"])([ours, theirs])
    assert torch.equal(as_dict["b"], ours["f2"]) and as_dict["a"].shape == (B, D + 2)
    assert torch.equal(ours.to(torch.device("cpu")).values(), ours.values())


def adam_model():
    tables = [KVTableConfig.from_torchrec(c, optimizer="adam", lr=0.05) for c in configs()]
    return dlrm(KVEmbeddingBagCollection(tables))


def test_adam_tables_resumed_through_the_model_state_dict_alone_match_an_uninterrupted_run(tmp_path):
    straight = adam_model()
    losses = train(straight, range(20))
    first = adam_model()
    assert train(first, range(10)) == losses[:10]
    leanstate.dcp.save(first.state_dict(), checkpoint_id=tmp_path / "ckpt")
    resumed = adam_model()
    state = resumed.state_dict()
    leanstate.dcp.load(state, checkpoint_id=tmp_path / "ckpt")
    resumed.load_state_dict(state)
    assert train(resumed, range(10, 20)) == losses[10:]
    for name, bag in straight.sparse_arch.embedding_bag_collection.embedding_bags.items():
        mine = resumed.sparse_arch.embedding_bag_collection.embedding_bags[name]
        keys = bag.store.keys()
        assert torch.equal(mine.store.get(keys), bag.store.get(keys)) and mine.optimizer_step == 20
    # without the step the bias correction restarts: the run diverges (what the state carries)
    restarted = adam_model()
    restarted.load_state_dict(
        {k: v for k, v in state.items() if not k.endswith("_extra_state")}, strict=False
    )
    assert train(restarted, range(10, 20)) != losses[10:]


def test_get_and_set_model_state_dict_read_and_write_the_tables():
    model = adam_model()
    train(model, range(2))
    state = get_model_state_dict(model)
    assert set(state) == set(model.state_dict())
    weight = state["sparse_arch.embedding_bag_collection.embedding_bags.t1.weight"]
    assert isinstance(weight, leanstate.KVTensor) and len(weight) > 0
    bag = model.sparse_arch.embedding_bag_collection.embedding_bags["t1"]
    assert bag.exp_avg.shape == (len(bag.store), D) and bag.weight.shape == weight.shape
    fresh = adam_model()
    assert not set_model_state_dict(fresh, state).missing_keys  # and back, the step included
    mine = fresh.sparse_arch.embedding_bag_collection.embedding_bags["t1"]
    assert mine.optimizer_step == 2 and torch.equal(
        mine.store.get_rows(bag.store.keys()), bag.store.get_rows(bag.store.keys())
    )


def test_trained_torchrec_weights_load_by_load_state_dict_as_rows_0_to_n_minus_1():
    torchrec_ebc = EmbeddingBagCollection(configs())
    kv_ebc = KVEmbeddingBagCollection(configs())
    _, features, _ = batch(6)
    torchrec_ebc(features).values().sum().backward()
    with torch.no_grad():
        for bag in torchrec_ebc.embedding_bags.values():
            bag.weight -= 0.1 * bag.weight.grad
    result = kv_ebc.load_state_dict(torchrec_ebc.state_dict())  # strict: nothing else is missing
    assert not result.missing_keys and not result.unexpected_keys
    kv_ebc.eval()
    assert torch.equal(kv_ebc(features).values(), torchrec_ebc(features).values())
    assert len(kv_ebc.embedding_bags["t1"].store) == N


def test_the_fused_optimizer_composes_with_combined_optimizer():
    model = dlrm(KVEmbeddingBagCollection(configs()))
    ebc = model.sparse_arch.embedding_bag_collection
    dense = KeyedOptimizerWrapper(
        dict(model.named_parameters()), lambda params: torch.optim.Adam(params, lr=0.01)
    )
    combined = CombinedOptimizer([("dense", dense), ("sparse", ebc.fused_optimizer)])
    assert "sparse.embedding_bags.t1.weight" in combined.params
    scheduler = torch.optim.lr_scheduler.StepLR(combined, step_size=1, gamma=0.5)
    for step in range(2):
        dense_features, features, labels = batch(step)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(
            model(dense_features, features).squeeze(1), labels
        )
        combined.zero_grad()
        loss.backward()
        combined.step()
        scheduler.step()
    assert ebc.embedding_bags["t1"].lr == pytest.approx(0.01 / 4)
    state = combined.state_dict()
    assert set(state["state"]) == {f"dense.{name}" for name in dict(model.named_parameters())}
    combined.load_state_dict(state)


def variable_batch(step: int, *, weighted: bool = False) -> KeyedJaggedTensor:
    """Step ``step``'s KJT as a variable-batch one (VBE): each key's bags from two ranks at
    their own strides, expanded to the batch of ``B`` by inverse indices."""
    generator = torch.Generator().manual_seed(100 + step)
    per_rank = [torch.randint(1, B // 2 + 1, (2,), generator=generator).tolist() for _ in KEYS]
    strides = [sum(ranks) for ranks in per_rank]
    lengths = torch.randint(0, 4, (sum(strides),), generator=generator)
    values = torch.randint(0, N, (int(lengths.sum()),), generator=generator)
    inverse = torch.stack([torch.randint(0, stride, (B,), generator=generator) for stride in strides])
    weights = torch.rand(len(values), generator=generator) + 0.5 if weighted else None
    return KeyedJaggedTensor(
        keys=KEYS, values=values, weights=weights, lengths=lengths,
        stride_per_key_per_rank=per_rank, inverse_indices=(KEYS, inverse),
    )  # fmt: skip


def train_variable_batch(model, steps: range) -> list[float]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    losses = []
    for step in range(steps.start, steps.stop):
        dense, _, labels = batch(step)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(
            model(dense, variable_batch(step)).squeeze(1), labels
        )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def test_torchrecs_dlrm_trains_on_variable_batch_kjts_bit_for_bit_as_on_torchrecs_tables():
    """Each key pooled at its own stride, then expanded by the inverse indices to the batch,
    as TorchRec's CPU collection does; the gradient of a repeated bag sums before the update."""
    features = variable_batch(0)
    assert features.variable_stride_per_key() and len(set(features.stride_per_key())) > 1
    kv_ebc, torchrec_ebc = KVEmbeddingBagCollection(configs()), EmbeddingBagCollection(configs())
    same_rows(kv_ebc, torchrec_ebc)
    assert torch.equal(kv_ebc(features).values(), torchrec_ebc(features).values())
    ours, theirs = (
        train_variable_batch(dlrm(kv_ebc), range(10)),
        train_variable_batch(dlrm(torchrec_ebc), range(10)),
    )
    assert ours == theirs and len(set(ours)) == 10
    for name, bag in kv_ebc.embedding_bags.items():
        assert torch.equal(
            bag.store.get(torch.arange(N), width=D), torchrec_ebc.embedding_bags[name].weight.detach()
        )


def test_a_weighted_variable_batch_kjt_gives_torchrecs_outputs():
    kv_ebc = KVEmbeddingBagCollection(configs(), is_weighted=True)
    torchrec_ebc = EmbeddingBagCollection(configs(), is_weighted=True)
    same_rows(kv_ebc, torchrec_ebc)
    features = variable_batch(1, weighted=True)
    ours, theirs = kv_ebc(features), torchrec_ebc(features)
    assert ours.keys() == theirs.keys() and ours.values().shape == (B, 3 * D)
    torch.testing.assert_close(ours.values(), theirs.values(), rtol=0, atol=1e-7)  # fused multiply-add


def test_variable_batch_kjts_that_make_no_batch_are_refused_with_the_reason():
    kv_ebc = KVEmbeddingBagCollection(configs())
    values, lengths = torch.tensor([1, 2, 3, 4, 5, 6]), torch.tensor([1, 1, 1, 1, 1, 1])
    no_inverse = KeyedJaggedTensor(
        keys=KEYS, values=values, lengths=lengths, stride_per_key_per_rank=[[1], [2], [3]]
    )
    with pytest.raises(ValueError, match="without inverse_indices"):
        kv_ebc(no_inverse)
    outside = KeyedJaggedTensor(
        keys=KEYS, values=values, lengths=lengths, stride_per_key_per_rank=[[1], [2], [3]],
        inverse_indices=(KEYS, torch.tensor([[0, 0], [0, 1], [2, 3]])),
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"inverse_indices of 'f3' must lie in \[0, 3\)"):
        kv_ebc(outside)
    # one stride for every key without inverse indices is a plain batch, as TorchRec reads it
    same = KeyedJaggedTensor(
        keys=KEYS, values=values, lengths=lengths, stride_per_key_per_rank=[[2], [2], [2]]
    )
    plain = KeyedJaggedTensor.from_lengths_sync(KEYS, values, lengths)
    assert torch.equal(kv_ebc(same).values(), kv_ebc(plain).values())


def shared_configs() -> list[EmbeddingBagConfig]:
    """``f1`` feeds ``t1`` and ``t3``, ``f2`` feeds ``t1`` and ``t2``: TorchRec names them ``f@t``."""
    return [
        EmbeddingBagConfig(num_embeddings=N, embedding_dim=D, name="t1", feature_names=["f1", "f2"]),
        EmbeddingBagConfig(num_embeddings=N, embedding_dim=4, name="t2", feature_names=["f2", "f3"]),
        EmbeddingBagConfig(num_embeddings=N, embedding_dim=2, name="t3", feature_names=["f1"]),
    ]


def synced(tables) -> tuple[KVEmbeddingBagCollection, EmbeddingBagCollection]:
    kv_ebc, torchrec_ebc = KVEmbeddingBagCollection(tables()), EmbeddingBagCollection(tables())
    with torch.no_grad():
        for name, bag in kv_ebc.embedding_bags.items():
            torchrec_ebc.embedding_bags[name].weight.copy_(
                bag.store.get(torch.arange(N), width=bag.embedding_dim)
            )
    return kv_ebc, torchrec_ebc


@pytest.mark.parametrize("variable", [False, True])
def test_a_feature_feeding_two_tables_is_named_and_pooled_as_torchrec_does(variable):
    kv_ebc, torchrec_ebc = synced(shared_configs)
    features = variable_batch(2) if variable else batch(2)[1]
    ours, theirs = kv_ebc(features), torchrec_ebc(features)
    assert ours.keys() == theirs.keys() == ["f1@t1", "f2@t1", "f2@t2", "f3", "f1@t3"]
    assert ours.length_per_key() == theirs.length_per_key() and torch.equal(ours.values(), theirs.values())
    assert kv_ebc.feature_names() == ["f1", "f2", "f2", "f3", "f1"]
    twice = EmbeddingBagConfig(num_embeddings=N, embedding_dim=D, name="t", feature_names=["f1", "f1"])
    with pytest.raises(ValueError, match="table 't' lists a feature twice"):
        KVEmbeddingBagCollection([twice])


@pytest.mark.parametrize("variable", [False, True])
def test_tables_sharing_a_feature_train_bit_for_bit_as_torchrecs(variable):
    """``f1`` feeds ``a`` and ``b``: each table's update sees its own pooled gradient. Against
    TorchRec's tables updated by ``w - (lr * g)``, the rounding of the fused SGD; the rows
    agree to the last unit: torch's embedding-bag backward sums an id's repeats in the
    order of an unstable sort, the fused update in position order."""

    def tables():
        return [
            EmbeddingBagConfig(num_embeddings=N, embedding_dim=D, name="a", feature_names=["f1"]),
            EmbeddingBagConfig(num_embeddings=N, embedding_dim=4, name="b", feature_names=["f1"]),
            EmbeddingBagConfig(num_embeddings=N, embedding_dim=2, name="c", feature_names=["f3"]),
        ]

    kv_ebc, torchrec_ebc = synced(tables)
    for step in range(5):
        features = variable_batch(step) if variable else batch(step)[1]
        ours, theirs = kv_ebc(features), torchrec_ebc(features)
        assert ours.keys() == ["f1@a", "f1@b", "f3"]
        torch.testing.assert_close(ours.values(), theirs.values(), rtol=0, atol=1e-8)
        target = torch.linspace(-1, 1, ours.values().numel()).view_as(ours.values())
        torchrec_ebc.zero_grad()
        ((theirs.values() - target) ** 2).sum().backward()
        with torch.no_grad():  # torch.optim.SGD would fuse the multiply-add
            for parameter in torchrec_ebc.parameters():
                parameter -= 0.01 * parameter.grad
        ((ours.values() - target) ** 2).sum().backward()
    for name, bag in kv_ebc.embedding_bags.items():
        rows, start = bag.store.get(torch.arange(N), width=bag.embedding_dim), synced(tables)[1]
        theirs = torchrec_ebc.embedding_bags[name].weight.detach()
        torch.testing.assert_close(rows, theirs, rtol=0, atol=1e-8)
        assert (theirs - start.embedding_bags[name].weight).abs().max() > 1e-3  # they trained


def test_a_torchrec_dcp_checkpoint_migrates_through_a_template_state_dict(tmp_path):
    """Stock ``dcp.load`` into the state dict of a TorchRec collection of the same configs
    (plain tensors of the right shapes), then ``load_state_dict``."""
    trained = EmbeddingBagCollection(configs())
    torch.distributed.checkpoint.save(trained.state_dict(), checkpoint_id=tmp_path / "torchrec", no_dist=True)
    template = EmbeddingBagCollection(configs()).state_dict()
    torch.distributed.checkpoint.load(template, checkpoint_id=tmp_path / "torchrec", no_dist=True)
    kv_ebc = KVEmbeddingBagCollection(configs())
    kv_ebc.load_state_dict(template)
    kv_ebc.eval()
    _, features, _ = batch(7)
    assert torch.equal(kv_ebc(features).values(), trained(features).values())


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"])
def test_leanstate_dcp_load_takes_a_torchrec_dcp_checkpoint_directly(tmp_path, optimizer):
    """A DLRM trained on TorchRec's tables and saved by stock ``dcp.save``: ``leanstate.dcp.load``
    puts each table's rows in as ids ``0..N-1`` bit for bit (the optimizer state the
    checkpoint lacks starts fresh), and the model trains on as TorchRec's does."""
    trained = dlrm(EmbeddingBagCollection(configs()))
    train(trained, range(3))
    torch.distributed.checkpoint.save(trained.state_dict(), checkpoint_id=tmp_path / "torchrec", no_dist=True)
    tables = [KVTableConfig.from_torchrec(c, optimizer=optimizer) for c in configs()]
    model = dlrm(KVEmbeddingBagCollection(tables))
    state = model.state_dict()
    stats = leanstate.dcp.load(state, checkpoint_id=tmp_path / "torchrec")
    assert not model.load_state_dict(state).missing_keys
    ebc = model.sparse_arch.embedding_bag_collection
    for name, bag in trained.sparse_arch.embedding_bag_collection.embedding_bags.items():
        kv = ebc.embedding_bags[name]
        assert torch.equal(kv.store.keys().sort().values, torch.arange(N))
        assert torch.equal(kv.store.get(torch.arange(N), width=D), bag.weight.detach())
        assert stats[f"sparse_arch.embedding_bag_collection.embedding_bags.{name}.weight"]["rows"] == N
        assert kv.optimizer_step == 0 and all(not torch.any(v[:]) for v in kv._field_views().values())
    if optimizer == "sgd":
        assert train(model, range(3, 8)) == train(trained, range(3, 8))


@pytest.fixture
def one_rank():
    """A one-rank gloo group for this test only (DMP and the sharded collection need one)."""
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    try:
        yield torch.distributed.group.WORLD
    finally:
        torch.distributed.destroy_process_group()


def test_dmps_fused_optimizer_includes_the_tables_and_drives_them(one_rank):
    """``DistributedModelParallel`` collects the fused optimizers of ``FusedOptimizerModule``s:
    the collections are registered as such, so DMP's ``fused_optimizer`` holds the tables,
    its scheduler drives their ``lr``, and ``step``/``zero_grad``/``state_dict`` work."""
    from torchrec.distributed import DistributedModelParallel
    from torchrec.optim.fused import FusedOptimizerModule

    model = dlrm(KVEmbeddingBagCollection(configs()))
    ebc = model.sparse_arch.embedding_bag_collection
    assert isinstance(ebc, FusedOptimizerModule)
    dmp = DistributedModelParallel(model, device=torch.device("cpu"))
    fused = dmp.fused_optimizer
    assert isinstance(fused, CombinedOptimizer)
    assert set(fused.params) == {
        f"sparse_arch.embedding_bag_collection.embedding_bags.{t}.weight" for t in ("t1", "t2")
    }
    scheduler = torch.optim.lr_scheduler.StepLR(fused, step_size=1, gamma=0.5)
    dense_optimizer = torch.optim.SGD(dmp.parameters(), lr=0.01)
    straight = dlrm(KVEmbeddingBagCollection(configs()))
    straight_optimizer = torch.optim.SGD(straight.parameters(), lr=0.01)
    for step in range(3):
        dense, features, labels = batch(step)
        losses = []
        for net, optimizer in ((dmp, dense_optimizer), (straight, straight_optimizer)):
            loss = torch.nn.functional.binary_cross_entropy_with_logits(
                net(dense, features).squeeze(1), labels
            )
            optimizer.zero_grad()
            fused.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        fused.step()
        scheduler.step()
        for bag in straight.sparse_arch.embedding_bag_collection.embedding_bags.values():
            bag.lr *= 0.5  # what the scheduler did to the DMP model's tables
        assert losses[0] == losses[1]
    assert (
        ebc.embedding_bags["t1"].lr == pytest.approx(0.01 / 8)
        and ebc.embedding_bags["t1"].optimizer_step == 3
    )
    state = fused.state_dict()
    fused.load_state_dict(state)
    assert state["state"] == {}  # the tables' state is in their rows (the module's state dict)


def test_the_sharded_collection_refuses_variable_batch_kjts(one_rank):
    sharded = leanstate.ShardedKVEmbeddingBagCollection(configs(), process_group=one_rank)
    with pytest.raises(ValueError, match="ShardedKVEmbeddingBagCollection: variable-batch"):
        sharded(variable_batch(0))
    _, features, _ = batch(0)
    assert sharded(features).keys() == KEYS
