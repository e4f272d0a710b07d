"""torch.distributed.checkpoint's async_save of fo.torch's state (issue 35: "dcp.save /
dcp.async_save"), on the host without a process group (`no_dist=True`): the checkpoint holds
the state of the call while training goes on, and resuming from it continues the run that
never stopped, bit for bit (fp32 state; quant8 state is requantized on load, so there the
parameters are compared)."""
import pytest

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")
import fo.torch  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict  # noqa: E402


def build(fmt):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 40), torch.nn.Linear(40, 5))
    return model, fo.torch.AdamW(model.parameters(), lr=1e-2, state_format=fmt)


def steps(model, opt, start, n):
    for s in range(start, start + n):
        g = torch.Generator().manual_seed(s)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()


def bits(model, opt):
    params = [p.detach().clone() for p in model.parameters()]
    state = {(i, k): v.clone() for i, s in opt.state_dict()["state"].items() for k, v in s.items()}
    return params, state


@pytest.mark.parametrize("fmt", ["fp32", "quant8"])
def test_dcp_async_save_keeps_its_calls_state_and_resumes_bit_for_bit(tmp_path, fmt):
    straight, s_opt = build(fmt)
    steps(straight, s_opt, 0, 6)
    saved, opt = build(fmt)
    steps(saved, opt, 0, 3)
    at_call = bits(saved, opt)
    msd, osd = get_state_dict(saved, opt)
    fut = dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    steps(saved, opt, 100, 2)  # training goes on while the save is in flight
    fut.result()
    resumed, r_opt = build(fmt)
    msd, osd = get_state_dict(resumed, r_opt)  # a fresh optimizer: DCP initializes its state
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    set_state_dict(resumed, r_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    loaded = bits(resumed, r_opt)
    assert all(torch.equal(a, b) for a, b in zip(at_call[0], loaded[0]))
    if fmt == "fp32":
        assert at_call[1].keys() == loaded[1].keys()
        assert all(torch.equal(at_call[1][k], loaded[1][k]) for k in at_call[1])
    steps(resumed, r_opt, 3, 3)
    assert all(torch.equal(a, b) for a, b in zip(straight.parameters(), resumed.parameters()))
