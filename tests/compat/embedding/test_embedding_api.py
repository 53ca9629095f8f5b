"""The embedding API as torch and TorchRec users call it: names, input checks, shapes, dtypes, copies."""

import copy
import enum
import functools

import pytest
import torch
from torch import nn

import leanstate
from leanstate import (
    KeyedJaggedTensor,
    KVEmbeddingBag,
    KVEmbeddingBagCollection,
    KVTableConfig,
    load_checkpoint,
    save_checkpoint,
)
from tests.harness import FakeClock

D, VOCAB = 4, 30
BACKENDS = sorted(leanstate._backends.available("embedding"))


def test_constructor_takes_torchs_names_and_positions():
    bag = KVEmbeddingBag(VOCAB, D)
    assert (bag.num_embeddings, bag.embedding_dim) == (VOCAB, D)
    keyword = KVEmbeddingBag(num_embeddings=None, embedding_dim=D)
    assert keyword.num_embeddings is None
    assert repr(bag).startswith(f"KVEmbeddingBag({VOCAB}, {D}, mode='sum'")
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="num_embeddings must be a positive int"):
            KVEmbeddingBag(bad, D)
    with pytest.raises(ValueError, match="embedding_dim"):
        KVEmbeddingBag(VOCAB, 0)


def test_ids_outside_num_embeddings_are_an_error_naming_the_id_and_change_nothing():
    bag = KVEmbeddingBag(VOCAB, D)
    with pytest.raises(ValueError, match=f"id {VOCAB + 5} is outside \\[0, num_embeddings={VOCAB}\\)"):
        bag(torch.tensor([1, VOCAB + 5, 2]), torch.tensor([0]))
    assert bag.stats["batches"] == 0
    hashed = KVEmbeddingBag(None, D)
    out = hashed(torch.tensor([2**62, 7]), torch.tensor([0, 1]))
    out.sum().backward()
    assert hashed.store.keys().tolist() == [7, 2**62]


@pytest.mark.parametrize(
    "argument, value",
    [("lr", -1.0), ("lr", float("nan")), ("eps", -1e-8), ("weight_decay", -0.1), ("betas", (1.0, 0.9))],
)
def test_hyperparameters_are_checked_as_torch_optim_does(argument, value):
    with pytest.raises(
        ValueError, match=f"invalid {argument.split('s')[0] if argument == 'betas' else argument}"
    ):
        KVEmbeddingBag(VOCAB, D, optimizer="adam", **{argument: value})


def test_int32_ids_and_offsets_pool_as_int64_and_other_dtypes_say_how_to_convert():
    bag = KVEmbeddingBag(VOCAB, D, seed=4)
    ids, offsets = torch.tensor([1, 2, 7]), torch.tensor([0, 2])
    want = bag(ids, offsets)
    assert torch.equal(bag(ids.int(), offsets.int()), want)  # nn.EmbeddingBag takes int32 too
    assert torch.equal(bag(ids.int(), offsets), want)
    with pytest.raises(
        TypeError,
        match=r"torch.int64 or torch.int32; got torch.int16 \(convert them with ids.to\(torch.int64\)\)",
    ):
        bag(ids.to(torch.int16), offsets)


def test_offsets_none_needs_2d_input_like_nn_embedding_bag():
    bag = KVEmbeddingBag(VOCAB, D, mode="mean", seed=3)
    with pytest.raises(ValueError, match="offsets is required for 1-D input"):
        bag(torch.tensor([1, 2, 3]))
    table = nn.EmbeddingBag(VOCAB, D, mode="mean")
    with torch.no_grad():
        table.weight.copy_(bag.store.get(torch.arange(VOCAB), width=D))
    ids = torch.tensor([[1, 2, 3], [4, 4, 9]])
    assert torch.equal(bag(ids), table(ids))
    with pytest.raises(ValueError, match="offsets must be None for 2-D input"):
        bag(ids, torch.tensor([0]))


@pytest.mark.parametrize("offsets", [[1, 2], [0, 3, 2], [0, 9]])
def test_bad_offsets_are_an_error_naming_them(offsets):
    with pytest.raises(ValueError, match="offsets must start at 0"):
        KVEmbeddingBag(VOCAB, D)(torch.tensor([1, 2, 3]), torch.tensor(offsets))


def test_padding_ids_are_counted_in_the_stats():
    bag = KVEmbeddingBag(VOCAB, D)
    bag(torch.tensor([1, -1, 2, 2, -5]), torch.tensor([0, 2]))
    bag(torch.tensor([3]), torch.tensor([0]))
    assert bag.stats == {"batches": 2, "ids": 6, "padding_ids": 2, "unique_ids": 3}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("offloading", [True, False])
def test_deepcopy_is_an_independent_copy(backend, offloading):
    bag = KVEmbeddingBag(
        VOCAB, D, optimizer="adam", lr=0.1, optimizer_offloading=offloading, return_whole_row=offloading,
        clock=FakeClock(), backend=backend,
    )  # fmt: skip
    bag(torch.tensor([1, 2, 3]), torch.tensor([0, 1])).sum().backward()
    clone = copy.deepcopy(bag)
    keys = bag.store.keys()
    assert torch.equal(clone.store.get_rows(keys), bag.store.get_rows(keys))
    assert clone.optimizer_step == bag.optimizer_step == 1 and clone.backend == backend
    before = bag.store.get_rows(keys)
    clone(torch.tensor([1, 2, 5]), torch.tensor([0])).sum().backward()
    assert torch.equal(bag.store.get_rows(keys), before) and len(bag.store) == 3
    assert len(clone.store) == 4 and bag.optimizer_step == 1
    if not offloading:
        assert not torch.equal(clone.state_store.get_rows(keys), bag.state_store.get_rows(keys))


def test_pickling_a_kv_state_dict_points_to_save_checkpoint(tmp_path):
    bag = KVEmbeddingBag(VOCAB, D, optimizer="rowwise_adagrad")
    bag(torch.tensor([1]), torch.tensor([0])).sum().backward()
    with pytest.raises(TypeError, match="save_checkpoint"):
        torch.save(bag.state_dict(), tmp_path / "bag.pt")
    with pytest.raises(TypeError, match="save_checkpoint"):
        torch.save(bag.store, tmp_path / "store.pt")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16_bit_rows_pool_and_train_in_float32_rounded_once(dtype):
    bag = KVEmbeddingBag(VOCAB, D, dtype=dtype, optimizer="sgd", lr=0.5, seed=2)
    assert bag.store.dtype == dtype
    rows = bag.store.get(torch.arange(VOCAB), width=D)
    assert rows.dtype == dtype
    table = nn.EmbeddingBag(VOCAB, D, mode="sum")
    with torch.no_grad():
        table.weight.copy_(rows.float())
    ids, offsets = torch.tensor([3, 5, 3, 8]), torch.tensor([0, 2])
    out = bag(ids, offsets)
    assert out.dtype == torch.float32 and torch.equal(out, table(ids, offsets))
    upstream = torch.arange(2 * D, dtype=torch.float32).reshape(2, D) / 8
    (out * upstream).sum().backward()
    (table(ids, offsets) * upstream).sum().backward()
    expected = (table.weight.detach() - 0.5 * table.weight.grad).to(dtype)
    assert torch.equal(bag.store.get(torch.tensor([3, 5, 8]), width=D), expected[[3, 5, 8]])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16_bit_adagrad_keeps_its_float32_state_as_bytes_in_the_row(dtype, tmp_path):
    bag = KVEmbeddingBag(VOCAB, D, dtype=dtype, optimizer="rowwise_adagrad", lr=0.1, clock=FakeClock())
    grad = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    bag(torch.tensor([6]), torch.tensor([0])).backward(grad)
    layout = bag.store.layout
    assert layout.state_dim == 2  # one float32 value, two 16-bit elements
    state = bag.store.get_rows(torch.tensor([6]))[:, layout.state_offset : layout.state_offset + 2]
    assert state.contiguous().view(torch.float32).item() == (1 + 4 + 9 + 16) / 4
    save_checkpoint(tmp_path / "ckpt", bag.checkpoint_tables(), extra=bag.extra_state())
    fresh = KVEmbeddingBag(VOCAB, D, dtype=dtype, optimizer="rowwise_adagrad", lr=0.1)
    fresh.load_extra_state(load_checkpoint(tmp_path / "ckpt", fresh.checkpoint_tables()))
    assert torch.equal(fresh.store.get_rows(torch.tensor([6])), bag.store.get_rows(torch.tensor([6])))


class PoolingType(enum.Enum):  # TorchRec's enums are read by member name
    SUM = "SUM"
    MEAN = "MEAN"


class DataType(enum.Enum):
    FP32 = "FP32"
    FP16 = "FP16"


def two_tables(**kwargs):
    return KVEmbeddingBagCollection(
        [
            KVTableConfig(
                "items", D, num_embeddings=VOCAB, feature_names=["clicked", "bought"], lr=0.5, seed=1
            ),
            KVTableConfig("users", 2, pooling=PoolingType.MEAN, data_type=DataType.FP16, seed=2),
        ],
        clock=FakeClock(),
        **kwargs,
    )


# three features, batch of 2; key-major: clicked [1, 2] [3], bought [] [3, 4], users [7] [8, 9]
KEYS = ["clicked", "bought", "users"]
VALUES = torch.tensor([1, 2, 3, 3, 4, 7, 8, 9])
LENGTHS = torch.tensor([2, 1, 0, 2, 1, 2])


def test_collection_of_configs_shares_tables_and_returns_a_keyed_tensor():
    ebc = two_tables()
    items, users = ebc.embedding_bags["items"], ebc.embedding_bags["users"]
    assert users.mode == "mean" and users.dtype == torch.float16 and items.num_embeddings == VOCAB
    out = ebc(KeyedJaggedTensor(KEYS, VALUES, lengths=LENGTHS))
    assert type(out).__name__ == "KeyedTensor"  # TorchRec's when it imports, else leanstate's
    assert out.keys() == KEYS and out.length_per_key() == [D, D, 2] and out.values().shape == (2, 2 * D + 2)
    expected = {
        "clicked": items(torch.tensor([1, 2, 3]), torch.tensor([0, 2])),
        "bought": items(torch.tensor([3, 4]), torch.tensor([0, 0])),
        "users": users(torch.tensor([7, 8, 9]), torch.tensor([0, 1])),
    }
    for key, value in expected.items():
        assert torch.equal(out[key], value) and torch.equal(out.to_dict()[key], value)
    assert torch.equal(out.values(), torch.cat(list(expected.values()), dim=1))


def test_features_sharing_a_table_update_it_once_with_their_summed_gradients():
    ebc, bag = two_tables(), two_tables().embedding_bags["items"]
    upstream = torch.randn(2, 2 * D + 2, generator=torch.Generator().manual_seed(0))
    (ebc(KeyedJaggedTensor(KEYS, VALUES, lengths=LENGTHS)).values() * upstream).sum().backward()
    # by hand: one call over both features' bags (4 bags), as the collection dedupes per table
    out = bag(torch.tensor([1, 2, 3, 3, 4]), torch.tensor([0, 2, 3, 3]))
    (out * torch.cat([upstream[:, :D], upstream[:, D : 2 * D]])).sum().backward()
    keys = bag.store.keys()
    assert keys.tolist() == [1, 2, 3, 4]
    items = ebc.embedding_bags["items"]
    assert torch.equal(items.store.get_rows(keys), bag.store.get_rows(keys))
    assert items.store.metadata(torch.tensor([3])).item() >> 32 & 0x7FFFFFFF == 1  # one write, not two


def test_weights_of_the_input_are_per_sample_weights_when_is_weighted():
    ebc = KVEmbeddingBagCollection([KVTableConfig("t", D, feature_names=["f"])], is_weighted=True)
    assert ebc.is_weighted()
    weights = torch.tensor([0.5, 2.0, -1.0])
    values, lengths = torch.tensor([1, 2, 3]), torch.tensor([2, 1])
    out = ebc(KeyedJaggedTensor(["f"], values, weights=weights, lengths=lengths))
    bag = ebc.embedding_bags["t"]
    assert torch.equal(out["f"], bag(values, torch.tensor([0, 2]), weights))
    assert not torch.equal(out["f"], bag(values, torch.tensor([0, 2])))
    with pytest.raises(ValueError, match="is_weighted=True but the features carry no weights"):
        ebc(KeyedJaggedTensor(["f"], values, lengths=lengths))


@pytest.mark.parametrize("pooling", ["sum", "mean"])
def test_an_unweighted_collection_ignores_the_inputs_weights_as_torchrec_does(pooling):
    ebc = KVEmbeddingBagCollection([KVTableConfig("t", D, feature_names=["f"], pooling=pooling)])
    assert not ebc.is_weighted()
    values, lengths = torch.tensor([1, 2, 3]), torch.tensor([2, 1])
    weighted = KeyedJaggedTensor(["f"], values, weights=torch.tensor([0.5, 2.0, -1.0]), lengths=lengths)
    out = ebc(weighted)  # a mean table would refuse weights: they never reach it
    assert torch.equal(out["f"], ebc.embedding_bags["t"](values, torch.tensor([0, 2])))
    out.values().sum().backward()  # the update is the unweighted one too
    reference = KVEmbeddingBagCollection([KVTableConfig("t", D, feature_names=["f"], pooling=pooling)])
    reference(KeyedJaggedTensor(["f"], values, lengths=lengths)).values().sum().backward()
    keys = torch.tensor([1, 2, 3])
    assert torch.equal(
        ebc.embedding_bags["t"].store.get_rows(keys), reference.embedding_bags["t"].store.get_rows(keys)
    )


def test_offsets_only_input_is_read_too():
    class OffsetsOnly:  # any object with the KeyedJaggedTensor surface
        def keys(self):
            return ["f"]

        def values(self):
            return torch.tensor([1, 2, 3])

        def offsets(self):
            return torch.tensor([0, 2, 3])

    ebc = KVEmbeddingBagCollection([KVTableConfig("t", D, feature_names=["f"])])
    assert torch.equal(
        ebc(OffsetsOnly())["f"], ebc.embedding_bags["t"](torch.tensor([1, 2, 3]), torch.tensor([0, 2]))
    )


@pytest.mark.parametrize(
    "lengths, weights, message",
    [
        (torch.tensor([2, 1, 0, 2, 1]), None, "not a multiple of the 3 keys"),
        (torch.tensor([2, 1, 0, 2, 1, 1]), None, "sum to len\\(values\\)=8; they sum to 7"),
        (LENGTHS, torch.ones(3), "weights_or_none\\(\\) has 3 entries"),
    ],
)
def test_jagged_input_is_checked_against_its_keys(lengths, weights, message):
    with pytest.raises(ValueError, match=message):
        two_tables(is_weighted=weights is not None)(
            KeyedJaggedTensor(KEYS, VALUES, weights=weights, lengths=lengths)
        )


def test_missing_features_are_a_key_error_and_unknown_ones_are_skipped():
    with pytest.raises(KeyError, match="missing features \\['users'\\]"):
        two_tables()(KeyedJaggedTensor(KEYS[:2], VALUES[:5], lengths=LENGTHS[:4]))
    ebc = two_tables()
    want = ebc(KeyedJaggedTensor(KEYS, VALUES, lengths=LENGTHS)).values()
    extra = KeyedJaggedTensor(
        ["other", *KEYS],
        torch.cat([torch.tensor([99]), VALUES]),
        lengths=torch.cat([torch.tensor([1, 0]), LENGTHS]),
    )
    assert torch.equal(ebc(extra).values(), want)


def test_config_checks():
    assert KVTableConfig("t", 4).feature_names == ["t"]
    with pytest.raises(ValueError, match="pooling"):
        KVTableConfig("t", 4, pooling="max")
    with pytest.raises(TypeError, match="data_type"):
        KVTableConfig("t", 4, data_type="int8")
    with pytest.raises(ValueError, match="table 'a' lists a feature twice"):
        KVEmbeddingBagCollection([KVTableConfig("a", 4, feature_names=["f", "g", "f"])])


def test_a_feature_feeding_two_tables_is_pooled_by_each_and_named_feature_at_table():
    """TorchRec's rule (the real TorchRec in test_torchrec_interop.py): ``f@table`` for a
    feature several tables read, the plain name otherwise."""
    ebc = KVEmbeddingBagCollection(
        [KVTableConfig("a", 4, feature_names=["f", "g"]), KVTableConfig("b", 2, feature_names=["f"], seed=1)]
    )
    kjt = KeyedJaggedTensor(["f", "g"], torch.tensor([1, 2, 3, 4]), lengths=torch.tensor([2, 1, 0, 1]))
    out = ebc(kjt)
    assert out.keys() == ["f@a", "g", "f@b"] and out.length_per_key() == [4, 4, 2]
    offsets = torch.tensor([0, 2])
    for key, table in (("f@a", "a"), ("f@b", "b")):
        assert torch.equal(out[key], ebc.embedding_bags[table](torch.tensor([1, 2, 3]), offsets))


@pytest.mark.parametrize("backend", BACKENDS)
def test_collection_saves_and_loads_in_one_call(tmp_path, backend):
    ebc = two_tables(backend=backend)
    for step in range(3):
        ebc(KeyedJaggedTensor(KEYS, VALUES + step, lengths=LENGTHS)).values().sum().backward()
    tables = ebc.checkpoint_tables()
    assert set(tables) == {"items.weight", "users.weight"}
    save_checkpoint(tmp_path / "ckpt", tables, extra=ebc.extra_state())
    fresh = two_tables(backend=backend)
    fresh.load_extra_state(load_checkpoint(tmp_path / "ckpt", fresh.checkpoint_tables()))
    assert (
        fresh.extra_state()
        == ebc.extra_state()
        == {"items": {"optimizer_step": 3}, "users": {"optimizer_step": 3}}
    )
    for name in ("items", "users"):
        a, b = ebc.embedding_bags[name].store, fresh.embedding_bags[name].store
        assert torch.equal(a.get_rows(a.keys()), b.get_rows(a.keys())) and len(a) == len(b)


def test_collection_state_dict_goes_through_nn_module():
    ebc, fresh = two_tables(), two_tables()
    ebc(KeyedJaggedTensor(KEYS, VALUES, lengths=LENGTHS)).values().sum().backward()
    state = ebc.state_dict()
    assert set(state) == {
        "embedding_bags.items.weight",
        "embedding_bags.items._extra_state",
        "embedding_bags.users.weight",
        "embedding_bags.users._extra_state",
    }
    fresh.load_state_dict(state)
    store = ebc.embedding_bags["items"].store
    assert torch.equal(
        fresh.embedding_bags["items"].store.get_rows(store.keys()), store.get_rows(store.keys())
    )
    with pytest.raises(RuntimeError, match="Unexpected key.*embedding_bags.items.extra"):
        fresh.load_state_dict({**state, "embedding_bags.items.extra": torch.zeros(1)})


def test_the_tables_are_a_mapping_whatever_their_names():
    from leanstate import KVEmbeddingBagCollection, KVTableConfig

    names = ["items", "keys", "values", "update", "t"]
    ebc = KVEmbeddingBagCollection([KVTableConfig(name, 4) for name in names])
    tables = ebc.embedding_bags
    assert list(tables) == names and len(tables) == 5 and list(tables.keys()) == names
    assert [name for name, _ in tables.items()] == names
    assert all(type(bag).__name__ == "KVEmbeddingBag" for bag in tables.values())
    assert "items" in tables and "nope" not in tables
    assert tables["items"] is dict(tables.items())["items"]
    with pytest.raises(KeyError, match="no table 'nope'"):
        tables["nope"]


def test_an_lr_scheduler_drives_the_fused_optimizer():
    from leanstate import KeyedJaggedTensor, KVEmbeddingBagCollection, KVTableConfig

    ebc = KVEmbeddingBagCollection([KVTableConfig("t", 4, lr=0.4), KVTableConfig("u", 4, lr=0.2)])
    optimizer = ebc.fused_optimizer
    assert isinstance(optimizer, torch.optim.Optimizer) and ebc.fused_optimizer is optimizer
    assert [g["table"] for g in optimizer.param_groups] == ["t", "u"]
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    features = KeyedJaggedTensor(["t", "u"], torch.tensor([3, 5]), lengths=torch.tensor([1, 1]))
    deltas = []
    for _ in range(3):
        before = ebc.embedding_bags["t"].store.get(torch.tensor([3])).clone()
        ebc(features).values().sum().backward()  # SGD: the row moves by -lr * 1
        deltas.append(float((ebc.embedding_bags["t"].store.get(torch.tensor([3])) - before)[0, 0]))
        optimizer.step()
        scheduler.step()
    torch.testing.assert_close(torch.tensor(deltas), torch.tensor([-0.4, -0.2, -0.1]))
    assert ebc.embedding_bags["u"].lr == pytest.approx(0.2 / 8)
    state = scheduler.state_dict()
    fresh = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    fresh.load_state_dict(state)
    assert fresh.last_epoch == 3


def test_empty_inputs_keep_nn_embedding_bags_shapes():
    from leanstate import KeyedJaggedTensor, KVEmbeddingBag, KVEmbeddingBagCollection, KVTableConfig

    bag = KVEmbeddingBag(None, 4)
    out = bag(torch.empty(3, 0, dtype=torch.int64))
    assert out.shape == (3, 4) and not out.any()  # three empty bags, as nn.EmbeddingBag
    ebc = KVEmbeddingBagCollection([KVTableConfig("t", 4, feature_names=["a", "b"]), KVTableConfig("u", 3)])
    empty = KeyedJaggedTensor(
        ["a", "b", "u"], torch.empty(0, dtype=torch.int64), lengths=torch.zeros(0, dtype=torch.int64)
    )
    kt = ebc(empty)
    assert kt.values().shape == (0, 11) and [kt[k].shape for k in ("a", "b", "u")] == [(0, 4), (0, 4), (0, 3)]


@pytest.mark.parametrize(
    "call, error",
    [
        (
            lambda bag: bag(torch.tensor([[1, 2]]), per_sample_weights=[[0.5, 0.5]]),
            "per_sample_weights must be a tensor",
        ),
        (
            lambda bag: bag(torch.tensor([1, 2]).to_sparse(), torch.tensor([0])),
            "input must be a dense tensor",
        ),
        (
            lambda bag: bag(torch.empty(2, dtype=torch.int64, device="meta"), torch.tensor([0])),
            "input is a meta tensor",
        ),
        (
            lambda bag: bag(
                torch.tensor([1, 2]), torch.tensor([0]), per_sample_weights=torch.empty(2, device="meta")
            ),
            "per_sample_weights is a meta tensor",
        ),
        (
            lambda bag: bag(torch.tensor([1, 2]), torch.tensor([True, False])),
            "offsets must be a 1-D integer tensor; got torch.bool",
        ),
        (
            lambda bag: bag(
                torch.tensor([1, 2]),
                torch.tensor([0]),
                per_sample_weights=torch.ones(2, dtype=torch.complex64),
            ),
            "per_sample_weights must be a real floating tensor",
        ),
    ],
)
def test_nonsense_inputs_are_named_errors(call, error):
    bag = KVEmbeddingBag(None, 4)
    with pytest.raises(TypeError, match=error):
        call(bag)
    assert len(bag.store) == 0


def test_the_id_num_embeddings_is_outside_the_table():
    bag = KVEmbeddingBag(10, 4)
    bag(torch.tensor([9, 0]), torch.tensor([0]))  # the last id inside
    with pytest.raises(ValueError, match=r"id 10 is outside \[0, num_embeddings=10\)"):
        bag(torch.tensor([10]), torch.tensor([0]))


def test_each_feature_pools_with_its_own_weights():
    """Weights are sliced per feature at that feature's own offset, in every table."""
    from leanstate import KeyedJaggedTensor, KVEmbeddingBagCollection, KVTableConfig

    ebc = KVEmbeddingBagCollection(
        [KVTableConfig("t", 4, feature_names=["a", "b"]), KVTableConfig("u", 3, feature_names=["c"])],
        is_weighted=True,
    )
    keys = ["a", "b", "c"]
    values = torch.tensor([1, 2, 3, 4, 5, 6, 7])
    lengths = torch.tensor([2, 1, 1, 0, 2, 1])  # two samples per feature
    weights = torch.tensor([0.5, 2.0, -1.0, 3.0, 0.25, 4.0, 1.5])
    rows = {
        name: bag.store.get(torch.arange(8), width=bag.embedding_dim).float()
        for name, bag in ebc.embedding_bags.items()
    }
    out = ebc(KeyedJaggedTensor(keys, values, weights=weights, lengths=lengths))
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    for k, (key, table) in enumerate(zip(keys, ["t", "t", "u"], strict=True)):
        for sample in range(2):
            bag = 2 * k + sample
            ids, w = values[starts[bag] : starts[bag + 1]], weights[starts[bag] : starts[bag + 1]]
            want = (rows[table][ids] * w[:, None]).sum(0)
            torch.testing.assert_close(out[key][sample], want, rtol=1e-6, atol=1e-6, msg=f"{key}[{sample}]")


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_include_last_offset_reads_the_end_of_the_last_bag_as_nn_embedding_bag(mode):
    bag = KVEmbeddingBag(VOCAB, D, mode=mode, include_last_offset=True, seed=5)
    table = nn.EmbeddingBag(VOCAB, D, mode=mode, include_last_offset=True)
    with torch.no_grad():
        table.weight.copy_(bag.store.get(torch.arange(VOCAB), width=D))
    ids, offsets = torch.tensor([1, 2, 7, 7, 3]), torch.tensor([0, 2, 2, 5])  # three bags, one empty
    out = bag(ids, offsets)
    assert out.shape == (3, D) and torch.equal(out, table(ids, offsets))
    plain = KVEmbeddingBag(VOCAB, D, mode=mode, seed=5)
    assert torch.equal(out, plain(ids, offsets[:-1]))
    assert torch.equal(bag(ids.reshape(1, 5)), table(ids.reshape(1, 5)))  # 2-D input: the flag is moot
    with pytest.raises(ValueError, match="include_last_offset=True needs B \\+ 1 offsets"):
        bag(ids, torch.tensor([], dtype=torch.int64))
    with pytest.raises(ValueError, match="offsets must start at 0.*got \\[0, 2, 6\\]"):
        bag(ids, torch.tensor([0, 2, 6]))


def test_include_last_offset_leaves_ids_after_the_last_bag_out_and_untouched():
    bag = KVEmbeddingBag(VOCAB, D, include_last_offset=True, lr=0.5, seed=6)
    ids, weights = torch.tensor([1, 2, 9, -1, 8]), torch.tensor([1.0, 2.0, 3.0, 1.0, 4.0], requires_grad=True)
    out = bag(ids, torch.tensor([0, 1, 3]), per_sample_weights=weights)  # ids 9's padding and 8: no bag
    table = nn.EmbeddingBag(VOCAB, D, mode="sum", include_last_offset=True)
    with torch.no_grad():
        table.weight.copy_(bag.store.get(torch.arange(VOCAB), width=D))
    torch.testing.assert_close(
        out, table(ids.clamp(min=0), torch.tensor([0, 1, 3]), weights), rtol=0, atol=1e-7
    )
    out.sum().backward()
    assert bag.store.keys().tolist() == [1, 2, 9] and bag.stats["ids"] == 3
    assert weights.grad[3:].tolist() == [0.0, 0.0]


@pytest.mark.parametrize("offloading", [True, False])
def test_the_optimizer_step_travels_in_every_state_dict(offloading):
    make = functools.partial(
        KVEmbeddingBag, VOCAB, D, optimizer="adam", lr=0.1, optimizer_offloading=offloading,
        return_whole_row=offloading, clock=FakeClock(),
    )  # fmt: skip
    straight, first = make(), make()
    for step in range(4):
        ids = torch.tensor([step % 3, 5])
        for bag in (straight, first) if step < 2 else (straight,):
            bag(ids, torch.tensor([0])).sum().backward()
    state = first.state_dict()
    assert torch.equal(state["_extra_state"], torch.tensor(2)) and first.get_extra_state() == 2
    resumed = make()
    resumed.load_state_dict(state)  # strict: the step is one of the keys
    assert resumed.optimizer_step == 2
    for step in (2, 3):
        resumed(torch.tensor([step % 3, 5]), torch.tensor([0])).sum().backward()
    keys = straight.store.keys()
    assert torch.equal(resumed.store.get(keys), straight.store.get(keys))
    collection = KVEmbeddingBagCollection({"t": first})
    assert collection.state_dict()["embedding_bags.t._extra_state"] == 2
    resumed.set_extra_state({"optimizer_step": 7})  # extra_state()'s dict works too
    assert resumed.optimizer_step == 7


def test_a_plain_weight_loads_as_rows_0_to_n_minus_1_and_is_readable_by_attribute():
    source = nn.EmbeddingBag(VOCAB, D, mode="sum")
    bag = KVEmbeddingBag(VOCAB, D, optimizer="rowwise_adagrad")
    assert bag.load_state_dict({"weight": source.weight.detach()}).missing_keys == []  # nothing else to bring
    ids, offsets = torch.tensor([0, 3, VOCAB - 1]), torch.tensor([0, 1])
    assert torch.equal(bag(ids, offsets), source(ids, offsets)) and len(bag.store) == VOCAB
    assert bag.weight.whole_rows and bag.weight.shape == (VOCAB, bag.store.layout.width)
    assert bag.momentum1.read_only and bag.momentum1.shape == (VOCAB, 1)
    assert not hasattr(bag, "exp_avg")  # Adam's fields only on Adam bags
    with pytest.raises(ValueError, match="plain weight of 31 rows does not fit num_embeddings=30"):
        bag.load_state_dict({"weight": torch.zeros(VOCAB + 1, D)})


def test_kv_table_config_takes_torchrecs_default_init_range():
    config = KVTableConfig("t", D, num_embeddings=400, weight_init_min=None, weight_init_max=None)
    assert (config.weight_init_min, config.weight_init_max) == (-0.05, 0.05)
    assert KVTableConfig("t", D, num_embeddings=400).weight_init_max == 0.01  # leanstate's own default
    with pytest.raises(ValueError, match="has no num_embeddings"):
        KVTableConfig("t", D, weight_init_max=None)


def test_the_collection_has_torchrecs_accessors_for_its_tables_given_either_way():
    ebc = two_tables(device="cpu")
    assert [c.name for c in ebc.embedding_bag_configs()] == ["items", "users"]
    assert ebc.device == torch.device("cpu") and not ebc.is_weighted()
    bags = KVEmbeddingBagCollection({"u": KVEmbeddingBag(VOCAB, D, mode="mean", seed=3)})
    (config,) = bags.embedding_bag_configs()
    assert (config.name, config.num_embeddings, config.feature_names, config.pooling) == (
        "u",
        VOCAB,
        ["u"],
        "mean",
    )
    rebuilt = KVEmbeddingBagCollection([config])
    ids = torch.arange(VOCAB)
    assert torch.equal(rebuilt.embedding_bags["u"].store.get(ids), bags.embedding_bags["u"].store.get(ids))


def _adam_collection(backend):
    config = KVTableConfig("t", 4, feature_names=["f"], optimizer="adam", lr=0.05)
    return KVEmbeddingBagCollection([config], clock=FakeClock(), backend=backend)


def _train(ebc, steps, start=0):
    for step in range(start, start + steps):
        ids = torch.tensor([1, 2, 3, 5 + step])
        ebc(KeyedJaggedTensor(["f"], ids, lengths=torch.tensor([2, 2]))).values().pow(2).sum().backward()


def _rows(ebc):
    store = ebc.embedding_bags["t"].store
    return store.get_rows(store.keys()).view(torch.int32)


@pytest.mark.parametrize("path", ["save_checkpoint without extra", "dcp in place"])
def test_adam_resumes_bit_identically_on_either_path_without_extra(tmp_path, path):
    """The optimizer step (Adam's bias correction) comes back on the two paths that lost it:
    ``save_checkpoint(p, ebc.checkpoint_tables())`` with no ``extra=``, and ``dcp.save`` /
    ``dcp.load`` of ``model.state_dict()`` in place with no ``load_state_dict``. Kills: the
    step kept in a copy, the module's extra state left out of its tables' save."""
    import leanstate.dcp as kvdcp

    straight = _adam_collection("reference")
    _train(straight, 6)
    first = _adam_collection("reference")
    _train(first, 3)
    resumed = _adam_collection("reference")
    if path == "dcp in place":
        kvdcp.save({"m": first.state_dict()}, checkpoint_id=tmp_path / "c")
        kvdcp.load({"m": resumed.state_dict()}, checkpoint_id=tmp_path / "c")
    else:
        save_checkpoint(tmp_path / "c", first.checkpoint_tables())
        load_checkpoint(tmp_path / "c", resumed.checkpoint_tables())
    assert resumed.extra_state() == {"t": {"optimizer_step": 3}}
    _train(resumed, 3, start=3)
    assert torch.equal(_rows(resumed), _rows(straight))


def test_the_modules_step_and_the_callers_extra_are_saved_together(tmp_path):
    ebc = _adam_collection("reference")
    _train(ebc, 2)
    save_checkpoint(tmp_path / "c", ebc.checkpoint_tables(), extra={"epoch": 4})
    fresh = _adam_collection("reference")
    assert load_checkpoint(tmp_path / "c", fresh.checkpoint_tables()) == {
        "epoch": 4,
        "t": {"optimizer_step": 2},
    }
    assert fresh.embedding_bags["t"].optimizer_step == 2
    with pytest.raises(ValueError, match=r"extra\['t'\].*leave that key out"):
        save_checkpoint(tmp_path / "d", ebc.checkpoint_tables(), extra={"t": {"optimizer_step": 9}})
    bag = ebc.embedding_bags["t"]
    save_checkpoint(tmp_path / "b", bag.checkpoint_tables())
    again = KVEmbeddingBag(None, 4, optimizer="adam", lr=0.05, clock=FakeClock())
    load_checkpoint(tmp_path / "b", again.checkpoint_tables())
    assert again.optimizer_step == 2
