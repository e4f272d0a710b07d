"""fo.torch's float32 state is handed out live, as torch's is (issue 38): `state_dict()` and
`opt.state[p]` give fo's own buffers (no decode, no copy), which follow every step, load and
rollback in place, take edits as torch's state tensors do, and stay valid after the
optimizer is gone; compressed state is still handed out as decoded copies."""
import copy
import gc

import pytest

torch = pytest.importorskip("torch")
import fo  # noqa: E402
import fo.torch  # noqa: E402


def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(7, 40), torch.nn.Tanh(), torch.nn.Linear(40, 3))


def train(model, opt, steps, start=0):
    for s in range(start, start + steps):
        g = torch.Generator().manual_seed(100 + s)
        x, y = torch.randn(16, 7, generator=g), torch.randn(16, 3, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def moments(sd):
    return {(i, k): v for i, st in sd["state"].items() for k, v in st.items() if k != "step"}


def trained_pair():
    """Two copies of one model after two steps: torch's AdamW on one, fo's fp32 on the other."""
    a, b = make_model(), make_model()
    ta = torch.optim.AdamW(a.parameters(), lr=1e-2)
    fb = fo.torch.AdamW(b.parameters(), lr=1e-2, state_format="fp32")
    train(a, ta, 2)
    train(b, fb, 2)
    return a, ta, b, fb


def test_fp32_state_dict_is_live_like_torchs_and_quant8_is_a_copy():
    a, ta, b, fb = trained_pair()
    sa, sb = ta.state_dict(), fb.state_dict()
    again = moments(fb.state_dict())
    for key, t in moments(sb).items():
        assert t.data_ptr() == again[key].data_ptr(), f"{key}: one buffer, not a copy per call"
    before = {k: v.clone() for k, v in moments(sb).items()}
    train(a, ta, 1, start=2)
    train(b, fb, 1, start=2)
    for key, t in moments(sb).items():
        assert not torch.equal(t, before[key]), f"{key} did not follow the step"
        # held since before the step, it shows the step, as torch's own does
        torch.testing.assert_close(t, moments(sa)[key], rtol=1e-5, atol=1e-7)
        assert torch.equal(t, fb.state[list(b.parameters())[key[0]]][key[1]])
    # quant8 hands out decoded copies: holding one costs a refresh, and it is no alias
    c = make_model()
    fc = fo.torch.AdamW(c.parameters(), lr=1e-2, state_format="quant8")
    train(c, fc, 1)
    assert all(t.data_ptr() != u.data_ptr() for t, u in
               zip(moments(fc.state_dict()).values(), moments(fc.state_dict()).values()))


def test_edits_of_live_state_step_exactly_as_torchs_and_loads_write_in_place():
    a, ta, b, fb = trained_pair()
    pa, pb = next(a.parameters()), next(b.parameters())
    ta.state[pa]["exp_avg"].mul_(0.5)
    held = fb.state[pb]["exp_avg"]
    held.mul_(0.5)  # the edit is fo's state already: nothing is loaded for it
    train(a, ta, 2, start=2)
    train(b, fb, 2, start=2)
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(held, ta.state[pa]["exp_avg"], rtol=1e-5, atol=1e-7)
    # a load (from a copy, as from a file) lands in the same buffer
    ptr = held.data_ptr()
    fb.load_state_dict(copy.deepcopy(ta.state_dict()))
    assert held.data_ptr() == ptr and torch.equal(held, ta.state[pa]["exp_avg"])


def test_live_state_outlives_the_optimizer_and_a_rebuild_turns_it_into_a_following_copy():
    m = make_model()
    opt = fo.torch.AdamW(m.parameters(), lr=1e-2, state_format="fp32")
    train(m, opt, 2)
    p = next(m.parameters())
    held = opt.state[p]["exp_avg_sq"]
    kept = held.clone()
    # the storage moves (a module reloaded): fo registers anew, the held tensor is detached
    # from fo's new buffers and, like any tensor handed out, refreshed after each step
    p.data = p.data.clone()
    train(m, opt, 1, start=2)
    assert not torch.equal(held, kept)
    assert torch.equal(held, opt.state[p]["exp_avg_sq"])
    assert held.data_ptr() != opt.state_dict()["state"][0]["exp_avg_sq"].data_ptr()
    sd = opt.state_dict()
    want = {k: v.clone() for k, v in moments(sd).items()}
    del opt
    gc.collect()
    for k, v in moments(sd).items():
        assert torch.equal(v, want[k]), f"{k}: fo's buffer outlives the optimizer"


def test_an_overlapped_step_rolled_back_leaves_live_state_as_it_was():
    m = make_model()
    opt = fo.torch.AdamW(m.parameters(), lr=1e-2, state_format="fp32", overlap="always")
    train(m, opt, 2)
    live = moments(opt.state_dict())
    before = {k: v.clone() for k, v in live.items()}
    x = torch.randn(16, 7)
    m(x).sum().backward()  # hands gradients over: fo steps early, in fo's buffers
    opt.zero_grad()  # no step(): the early steps roll back, into the same buffers
    for k, v in live.items():
        assert torch.equal(v, before[k]), k
        assert v.data_ptr() == moments(opt.state_dict())[k].data_ptr()


def test_live_state_held_across_overlapped_steps_follows_them_in_place():
    # An early step swaps an f32 moment's buffer with its undo record's unless the buffer
    # is lent out: a held state_dict() tensor keeps its address and sees every step.
    ref_m = make_model()
    ref = fo.torch.AdamW(ref_m.parameters(), lr=1e-2, state_format="fp32")
    m = make_model()
    opt = fo.torch.AdamW(m.parameters(), lr=1e-2, state_format="fp32", overlap="always")
    train(ref_m, ref, 2)
    train(m, opt, 2)
    live = moments(opt.state_dict())
    ptrs = {k: v.data_ptr() for k, v in live.items()}
    # An odd number of steps: a buffer swapped at every step would be back in place after
    # an even number.
    train(ref_m, ref, 3, start=2)
    train(m, opt, 3, start=2)
    assert opt.last_step_stats["speculative"] == 4  # stepped early, during backward
    now, want = moments(opt.state_dict()), moments(ref.state_dict())
    for k, v in live.items():
        assert v.data_ptr() == ptrs[k] == now[k].data_ptr(), k
        assert torch.equal(v, want[k]), k
    del live, now  # no borrower left: the next steps swap buffers, same bits
    train(ref_m, ref, 3, start=5)
    train(m, opt, 3, start=5)
    assert all(torch.equal(a, b) for a, b in zip(ref_m.parameters(), m.parameters()))
    want = moments(ref.state_dict())
    assert all(torch.equal(v, want[k]) for k, v in moments(opt.state_dict()).items())


def test_a_live_tensor_assigned_as_another_params_state_is_loaded_but_never_overwritten():
    def run(share):
        torch.manual_seed(0)
        w1, w2 = torch.nn.Parameter(torch.randn(5)), torch.nn.Parameter(torch.randn(5))
        opt = fo.torch.AdamW([w1, w2], lr=1e-2, state_format="fp32")
        for k in range(3):
            w1.grad, w2.grad = torch.full((5,), 0.1 * k + 0.1), torch.full((5,), -0.2 * k - 0.1)
            opt.step()
            if k == 0:
                mine = opt.state[w1]["exp_avg"]
                # w1's live buffer as w2's state (torch would now share one tensor); fo
                # loads its values into w2 and never writes w2's state back into it
                opt.state[w2]["exp_avg"] = mine if share else mine.clone()
        return [t.clone() for t in (w1, w2, opt.state[w1]["exp_avg"], opt.state[w2]["exp_avg"])]

    for got, want in zip(run(True), run(False)):
        assert torch.equal(got, want)
