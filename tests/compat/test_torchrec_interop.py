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


def test_a_variable_batch_kjt_is_refused_rather_than_misread():
    kv_ebc = KVEmbeddingBagCollection(configs())
    variable = KeyedJaggedTensor(
        keys=KEYS, values=torch.tensor([1, 2, 3, 4, 5, 6]), lengths=torch.tensor([1, 1, 1, 1, 1, 1]),
        stride_per_key_per_rank=[[1], [2], [3]],
    )  # fmt: skip
    assert variable.variable_stride_per_key()
    with pytest.raises(ValueError, match="variable-batch KeyedJaggedTensors"):
        kv_ebc(variable)


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
