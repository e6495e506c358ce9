"""XPipe's weight prediction: Ŵ = W − lr·s·Δ from the optimizer's own state."""

from __future__ import annotations

import pytest
import torch

from autosplit.errors import ConstraintError
from autosplit.runtime.prediction import predicted, update_direction


def quadratic_steps(opt_cls, steps, **kw):
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(16, dtype=torch.float64))
    target = torch.randn(16, dtype=torch.float64)
    opt = opt_cls([w], **kw)
    history = []
    for _ in range(steps):
        opt.zero_grad()
        ((w - target) ** 2).sum().backward()
        opt.step()
        history.append(w.detach().clone())
    return w, opt, history


def test_no_version_difference_is_no_prediction():
    w, opt, _ = quadratic_steps(torch.optim.Adam, 3, lr=0.1)
    assert predicted(opt, 0)[w] is w


@pytest.mark.parametrize("cls", [torch.optim.Adam, torch.optim.AdamW])
def test_adam_direction_by_hand(cls):
    w, opt, _ = quadratic_steps(cls, 3, lr=0.05, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.01)
    st = opt.state[w]
    m_hat = st["exp_avg"] / (1 - 0.8**3)
    v_hat = st["exp_avg_sq"] / (1 - 0.9**3)
    expected = m_hat / (v_hat.sqrt() + 1e-6) + (0.01 * w.detach() if cls is torch.optim.AdamW else 0)
    torch.testing.assert_close(update_direction(opt, w), expected)
    torch.testing.assert_close(predicted(opt, 2)[w], w.detach() - 0.05 * 2 * expected)


def test_sgd_momentum_direction_is_its_buffer():
    w, opt, _ = quadratic_steps(torch.optim.SGD, 2, lr=0.01, momentum=0.9)
    torch.testing.assert_close(predicted(opt, 3)[w], w.detach() - 0.01 * 3 * opt.state[w]["momentum_buffer"])


@pytest.mark.parametrize(("cls", "kw"), [(torch.optim.Adam, {"lr": 0.02}), (torch.optim.SGD, {"lr": 0.01, "momentum": 0.9})])
def test_prediction_lands_nearer_the_future_weights_than_the_stale_ones(cls, kw):
    s = 3
    w, opt, history = quadratic_steps(cls, 10 + s, **kw)
    # Re-run to step 10, predict s ahead, compare with where training actually went.
    w, opt, _ = quadratic_steps(cls, 10, **kw)
    future = history[10 + s - 1]
    guess = predicted(opt, s)[w].detach()
    assert (guess - future).norm() < 0.5 * (w.detach() - future).norm()


def test_gradient_through_the_predicted_weights_reaches_the_parameter():
    w, opt, _ = quadratic_steps(torch.optim.Adam, 2, lr=0.1)
    opt.zero_grad()
    w_hat = predicted(opt, 2)[w]
    (w_hat**2).sum().backward()
    torch.testing.assert_close(w.grad, 2 * w_hat.detach())


def test_before_the_first_step_and_unsupported_optimizers():
    w = torch.nn.Parameter(torch.ones(3))
    assert predicted(torch.optim.Adam([w], lr=0.1), 2)[w] is w
    with pytest.raises(ConstraintError, match="without momentum"):
        predicted(torch.optim.SGD([w], lr=0.1), 1)
    with pytest.raises(ConstraintError, match="RMSprop"):
        predicted(torch.optim.RMSprop([w], lr=0.1), 1)
    with pytest.raises(ConstraintError, match="integer ≥ 0"):
        predicted(torch.optim.Adam([w], lr=0.1), -1)
