"""The reference embedding rules and pooling (``leanstate.reference.embedding``) on their own:
each rule against the formula it states, written out in float64 where the reference
rounds once, and pooling and row gradients against a loop over positions."""

import pytest
import torch

from leanstate.reference import embedding as ref

HYPER = dict(lr=0.1, eps=1e-8, beta1=0.9, beta2=0.999, weight_decay=0.0)


def test_sgd_subtracts_lr_times_the_decayed_gradient():
    weights, grad = torch.tensor([[1.0, -2.0]]), torch.tensor([[0.5, 0.25]])
    ref.sgd(weights, torch.zeros(1, 0), grad, **{**HYPER, "weight_decay": 0.5}, step=1)
    # g' = g + 0.5 * w = [1.0, -0.75]; w - 0.1 * g'
    assert torch.equal(weights, torch.tensor([[1.0 - 0.1 * 1.0, -2.0 + 0.1 * 0.75]]))


def test_rowwise_adagrad_keeps_one_accumulator_per_row_the_mean_of_g_squared():
    weights = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]])
    state = torch.tensor([[0.5], [0.0]])
    grad = torch.tensor([[1.0, 2.0, 2.0], [0.0, 0.0, 0.0]])
    ref.rowwise_adagrad(weights, state, grad, **HYPER, step=1)
    assert state[:, 0].tolist() == [0.5 + 9.0 / 3, 0.0]
    expected = torch.tensor([1.0, 2.0, 3.0]) - 0.1 * (grad[0] / (torch.tensor(3.5).sqrt() + 1e-8))
    assert torch.equal(weights[0], expected) and torch.equal(weights[1], torch.zeros(3))


def test_adam_matches_torch_adam_on_one_row():
    torch.manual_seed(0)
    start, grads = torch.randn(1, 5), [torch.randn(1, 5) for _ in range(4)]
    ours, state = start.clone(), torch.zeros(1, 10)
    theirs = start.clone().requires_grad_(True)
    optimizer = torch.optim.Adam([theirs], lr=0.1, betas=(0.9, 0.999), eps=1e-8)
    for step, grad in enumerate(grads, start=1):
        ref.adam(ours, state, grad, **HYPER, step=step)
        theirs.grad = grad.clone()
        optimizer.step()
    torch.testing.assert_close(ours, theirs.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(state[:, :5], optimizer.state[theirs]["exp_avg"], rtol=1e-6, atol=1e-7)


def test_every_rule_has_one_signature_and_its_state_fields():
    for name, rule in ref.RULES.items():
        fields = ref.state_fields(name, 4)
        width = sum(w for _, w in fields.values())
        weights, state = torch.ones(2, 4), torch.zeros(2, width)
        rule(weights, state, torch.ones(2, 4), **HYPER, step=1)
        assert bool((weights < 1).all()), name  # a positive gradient lowers every weight
    assert ref.state_elements("adam", 4, torch.float16) == 16  # 8 float32 values, 2 elements each


@pytest.mark.parametrize("mean", [False, True])
@pytest.mark.parametrize("weighted", [False, True])
def test_pooling_and_row_gradients_match_a_loop_over_positions(mean, weighted):
    torch.manual_seed(1)
    rows = torch.randn(4, 3)
    inverse = torch.tensor([0, 1, 1, 3, 2, 0])
    offsets = torch.tensor([0, 2, 2, 6])  # bags: [0, 2), empty, [2, 6)
    weights = torch.rand(6) if weighted else None
    grad_output = torch.randn(3, 3)
    pooled = ref.pool_rows(rows, inverse, offsets, weights, mean)
    grads = ref.row_gradients(4, inverse, offsets, weights, mean, grad_output)
    want_pooled, want_grads = torch.zeros(3, 3), torch.zeros(4, 3)
    for b in range(3):
        start, end = int(offsets[b]), int(offsets[b + 1])
        scale = 1.0 / max(1, end - start) if mean else 1.0
        for p in range(start, end):
            w = float(weights[p]) if weighted else 1.0
            want_pooled[b] += rows[inverse[p]] * w
            want_grads[inverse[p]] += grad_output[b] * scale * w
        want_pooled[b] *= scale
    torch.testing.assert_close(pooled, want_pooled)
    torch.testing.assert_close(grads, want_grads)
    assert torch.equal(pooled[1], torch.zeros(3))  # an empty bag pools to zero, even as a mean
