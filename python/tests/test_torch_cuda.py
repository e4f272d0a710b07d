"""fo.torch with CUDA parameters, on a GPU: trajectories with the host's bits (arithmetic exact,
every state format), fp32 AdamW beside torch's fused CUDA AdamW, state where torch keeps it
(on the parameter's device), checkpoints that cross devices, host and CUDA parameters in one
optimizer, a non-default current stream, DCP resume under FSDP2, copies, schedulers, groups
added later and a compiled step. Runs where torch sees a GPU and libfo was built with the
`cuda` feature; python/tests/test_torch_cuda_host.py checks the device-free logic anywhere.

Gradients are given, not computed: they are drawn on the host and copied to each device, so
the step (fo's kernels against fo's host kernels) is what the bit comparisons see."""
import copy
import pickle

import pytest

torch = pytest.importorskip("torch")
import fo  # noqa: E402
import fo.torch  # noqa: E402

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (torch.cuda.is_available() is False)", allow_module_level=True)


_WHY = fo._torch_cuda.device_support()
if _WHY is not None:
    pytest.skip(f"the loaded libfo cannot step CUDA tensors: {_WHY.message}", allow_module_level=True)

CUDA = torch.device("cuda", 0)
SHAPES = [(24, 16), (24,), (3, 24), (3,), (1000,)]  # the last: several quant8 groups and a short one

RULES = {
    "adamw": lambda ps, **kw: fo.torch.AdamW(ps, lr=1e-2, weight_decay=0.1, **kw),
    "sgd": lambda ps, **kw: fo.torch.SGD(ps, lr=1e-2, momentum=0.9, weight_decay=1e-3, **kw),
    "lion": lambda ps, **kw: fo.torch.Lion(ps, lr=1e-3, weight_decay=0.1, **kw),
}
FORMATS = {  # state format -> (param dtype, fo's storage arguments)
    "fp32": (torch.float32, dict(state_format="fp32")),
    "param_dtype": (torch.bfloat16, dict(state_format="param_dtype")),
    "quant8": (torch.bfloat16, dict(state_format="quant8")),
    "quant8_master24": (torch.bfloat16, dict(state_format="quant8", master_weight_bits=24)),
}


def params(device, dtype=torch.float32, shapes=SHAPES, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype).to(device)) for s in shapes]


def give_grads(ps, step, seed=0):
    """The same gradients on every device: drawn on the host, copied to each parameter's."""
    g = torch.Generator().manual_seed(1000 * seed + step)
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype).to(p.device)


def run(opt, ps, steps, start=0):
    for s in range(start, start + steps):
        give_grads(ps, s)
        opt.step()
    torch.cuda.synchronize()


def bits(t):
    t = t.detach().cpu()
    return t.view(torch.int16) if t.dtype in (torch.bfloat16, torch.float16) else t.view(torch.int32)


def assert_same_bits(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.shape == y.shape and torch.equal(bits(x), bits(y))


def state_of(opt):
    return {(i, k): v for i, s in opt.state_dict()["state"].items() for k, v in s.items()}


def assert_same_state(a, b):
    sa, sb = state_of(a), state_of(b)
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k].cpu(), sb[k].cpu()), k


# -- trajectories ----------------------------------------------------------------------------
@pytest.mark.parametrize("arithmetic", [None, "exact"])
@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("rule", sorted(RULES))
def test_cuda_steps_have_the_bits_of_the_host_steps(rule, fmt, arithmetic):
    """Both arithmetics: fast (the default, fo_fast.cuh) and exact give the host step's
    bits."""
    dtype, kw = FORMATS[fmt]
    host, dev = params("cpu", dtype), params(CUDA, dtype)
    h = RULES[rule](host, arithmetic=arithmetic or "fast", **kw)
    d = RULES[rule](dev, arithmetic=arithmetic, **kw)
    assert d.param_groups[0]["arithmetic"] == (arithmetic or "fast")  # None: the default
    run(h, host, 5)
    run(d, dev, 5)
    assert_same_bits(host, dev)
    assert_same_state(h, d)
    mem = d.state_memory()
    assert mem["device_bytes"] > 0 and mem["host_bytes"] == 0, mem


def test_fp32_adamw_follows_torchs_fused_cuda_adamw():
    fo_ps, fused_ps, foreach_ps = params(CUDA), params(CUDA), params(CUDA)
    mine = fo.torch.AdamW(fo_ps, lr=1e-3, weight_decay=0.01, state_format="fp32")
    fused = torch.optim.AdamW(fused_ps, lr=1e-3, weight_decay=0.01, fused=True)
    foreach = torch.optim.AdamW(foreach_ps, lr=1e-3, weight_decay=0.01, foreach=True)
    for o, ps in ((mine, fo_ps), (fused, fused_ps), (foreach, foreach_ps)):
        run(o, ps, 20)
    torch_gap = max((a - b).abs().max().item() for a, b in zip(fused_ps, foreach_ps))
    fo_gap = max((a - b).abs().max().item() for a, b in zip(fused_ps, fo_ps))
    print(f"after 20 steps on {torch.cuda.get_device_name()}: fo vs fused {fo_gap:.3g}, "
          f"torch foreach vs fused {torch_gap:.3g}")
    for a, b in zip(fo_ps, fused_ps):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    for p, q in zip(fo_ps, fused_ps):  # state as torch keeps it: moments on the parameter's device
        st = mine.state[p]
        assert st["exp_avg"].device == p.device and st["exp_avg_sq"].device == p.device
        torch.testing.assert_close(st["exp_avg"], fused.state[q]["exp_avg"], rtol=1e-5, atol=1e-7)


# -- state and checkpoints ---------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["quant8", "fp32"])
def test_state_lives_on_the_parameters_device_and_edits_reach_fo(fmt):
    ps = params(CUDA)
    opt = fo.torch.AdamW(ps, lr=1e-2, state_format=fmt)
    run(opt, ps, 2)
    for p in ps:
        st = opt.state[p]
        assert st["step"].device.type == "cpu" and st["step"].item() == 2  # torch's non-fused place
        assert st["exp_avg"].device == p.device and st["exp_avg"].dtype == torch.float32
    held = opt.state[ps[0]]["exp_avg_sq"]
    run(opt, ps, 1, start=2)
    torch.testing.assert_close(held, opt.state_dict()["state"][0]["exp_avg_sq"], rtol=0, atol=0)  # refreshed
    opt.state[ps[0]]["exp_avg"].zero_()
    assert opt.state_dict()["state"][0]["exp_avg"].abs().max().item() == 0  # the edit reached fo


@pytest.mark.parametrize("fmt", ["fp32", "quant8"])
@pytest.mark.parametrize("direction", ["cuda_to_cuda", "cuda_to_host", "host_to_cuda"])
def test_state_dict_round_trip_across_devices(direction, fmt):
    src_dev, dst_dev = {"cuda_to_cuda": (CUDA, CUDA), "cuda_to_host": (CUDA, "cpu"),
                        "host_to_cuda": ("cpu", CUDA)}[direction]
    src = params(src_dev)
    a = fo.torch.AdamW(src, lr=1e-2, state_format=fmt, arithmetic="exact")
    run(a, src, 3)
    sd = a.state_dict()
    dst = [torch.nn.Parameter(p.detach().to(dst_dev)) for p in src]
    b = fo.torch.AdamW(dst, lr=1e-2, state_format=fmt, arithmetic="exact")
    b.load_state_dict(copy.deepcopy(sd))
    for p in dst:
        assert b.state[p]["exp_avg"].device == p.device
    run(a, src, 3, start=3)
    run(b, dst, 3, start=3)
    assert_same_bits(src, dst)
    if fmt == "fp32":  # quant8 is requantized on load: its round trip is checked by what it steps
        assert_same_state(a, b)


@pytest.mark.parametrize("frm,to", [("cuda", "cuda"), ("cuda", "cpu"), ("cpu", "cuda")])
def test_fos_compressed_checkpoint_moves_between_devices_with_the_same_bits(tmp_path, frm, to):
    dev = params(CUDA if frm == "cuda" else "cpu", torch.bfloat16)
    a = fo.torch.AdamW(dev, lr=1e-2, state_format="quant8", master_weight_bits=24, arithmetic="exact")
    run(a, dev, 3)
    a.save_checkpoint(tmp_path / "sync")
    a.save_checkpoint_async(tmp_path / "async").wait()
    for where in ("sync", "async"):
        other = [torch.nn.Parameter(p.detach().to(to)) for p in dev]
        b = fo.torch.AdamW(other, lr=1e-2, state_format="quant8", master_weight_bits=24, arithmetic="exact")
        b.load_checkpoint(tmp_path / where)
        c = copy.deepcopy(a)  # continues beside b from the same state
        c_ps = [p for g in c.param_groups for p in g["params"]]
        run(c, c_ps, 2, start=3)
        run(b, other, 2, start=3)
        assert_same_bits(c_ps, other)
        assert_same_state(c, b)


# -- mixed, streams, copies, schedulers, compile -------------------------------------------------
def test_host_and_cuda_parameters_in_one_optimizer_step_as_each_alone():
    shapes = SHAPES + [(0, 3)]  # an empty parameter too
    host_ref, dev_ref = params("cpu", shapes=shapes), params("cpu", shapes=shapes, seed=1)
    mixed_host, mixed_dev = params("cpu", shapes=shapes), params(CUDA, shapes=shapes, seed=1)
    ref = fo.torch.AdamW(host_ref + dev_ref, lr=1e-2, state_format="quant8")
    mixed = fo.torch.AdamW(mixed_host + mixed_dev, lr=1e-2, state_format="quant8")
    assert mixed.param_groups[0]["arithmetic"] == "fast"
    run(ref, host_ref + dev_ref, 4)
    run(mixed, mixed_host + mixed_dev, 4)
    assert_same_bits(host_ref + dev_ref, mixed_host + mixed_dev)
    assert_same_state(ref, mixed)
    mem = mixed.state_memory()
    assert mem["host_bytes"] > 0 and mem["device_bytes"] > 0, mem


@pytest.mark.parametrize("overlap", [False, "always"])
def test_a_non_default_current_stream_steps_with_the_same_bits(overlap):
    ref_ps, ps = params(CUDA), params(CUDA)
    ref = fo.torch.AdamW(ref_ps, lr=1e-2, state_format="quant8", max_grad_norm=1.0)
    opt = fo.torch.AdamW(ps, lr=1e-2, state_format="quant8", overlap=overlap, max_grad_norm=1.0)
    run(ref, ref_ps, 6)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run(opt, ps, 3)
        assert opt._stream[0] == side.cuda_stream  # fo stepped on the current stream
    torch.cuda.current_stream().wait_stream(side)
    run(opt, ps, 3, start=3)  # back on the default stream: fo orders it after the side one
    assert opt._stream[0] == 0
    assert_same_bits(ref_ps, ps)
    assert_same_state(ref, opt)


def test_overlap_with_cuda_and_host_parameters_has_the_bits_of_the_plain_step():
    torch.manual_seed(0)
    host_layer, dev_layer = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4).to(CUDA)
    ref_host, ref_dev = copy.deepcopy(host_layer), copy.deepcopy(dev_layer)

    def loop(h, d, opt):
        for s in range(4):
            opt.zero_grad()
            x = torch.randn(5, 8, generator=torch.Generator().manual_seed(s))
            d(h(x).tanh().to(CUDA)).pow(2).sum().backward()
            opt.step()
        torch.cuda.synchronize()
        return opt

    ref = loop(ref_host, ref_dev, fo.torch.AdamW([*ref_host.parameters(), *ref_dev.parameters()], lr=1e-2,
                                                 max_grad_norm=0.5))
    opt = loop(host_layer, dev_layer, fo.torch.AdamW([*host_layer.parameters(), *dev_layer.parameters()],
                                                     lr=1e-2, overlap="always", max_grad_norm=0.5))
    assert_same_bits([*ref_host.parameters(), *ref_dev.parameters()],
                     [*host_layer.parameters(), *dev_layer.parameters()])
    assert_same_state(ref, opt)
    assert opt.last_step_stats["handed_over"] == 4


def backward_loop(overlap, steps=5, dtype=torch.float32, edit=None, **kw):
    """A small model on the GPU trained with real backward passes by fo.torch.AdamW(**kw,
    overlap=overlap): (model, optimizer, each step's last_step_stats). `edit`: "clip_after"
    clips the gradients after backward (after hand-over), "scaler_skip" skips step 2's
    `step()` (as GradScaler does on inf: the next zero_grad rolls it back)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8)).to(CUDA, dtype)
    opt = fo.torch.AdamW(model.parameters(), lr=1e-2, overlap=overlap, **kw)
    stats = []
    for s in range(steps):
        opt.zero_grad()
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(s)).to(CUDA, dtype)
        model(x).float().pow(2).mean().backward()
        if edit == "clip_after":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-2)
        if edit == "scaler_skip" and s == 2:
            continue
        opt.step()
        stats.append(opt.last_step_stats)
    torch.cuda.synchronize()
    return model, opt, stats


@pytest.mark.parametrize("edit", [None, "clip_after", "scaler_skip"])
@pytest.mark.parametrize("max_grad_norm", [None, 1e-3, 1e3])
def test_cuda_parameters_step_early_in_backward_with_the_bits_of_the_plain_step(max_grad_norm, edit):
    """overlap=True on a model on the GPU: each gradient is handed over by its hook and
    stepped on fo's step lane during backward; clipping that scales, a gradient clipped
    by the loop after hand-over, and a skipped step (GradScaler found inf) roll back on the
    GPU, and every step has overlap=False's bits."""
    def loop(overlap):
        return backward_loop(overlap, dtype=torch.bfloat16, edit=edit, state_format="quant8",
                             master_weight_bits=24, max_grad_norm=max_grad_norm)

    ref_model, ref, _ = loop(False)
    model, opt, stats = loop("always")
    assert_same_bits(list(ref_model.parameters()), list(model.parameters()))
    assert_same_state(ref, opt)
    if edit is None:
        assert all(s["speculative"] > 0 and s["handed_over_in_backward"] == 4 for s in stats), stats
    if max_grad_norm == 1e-3:
        assert all(s["clipped"] for s in stats), stats


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copies_continue_identically_on_the_gpu(how):
    ps = params(CUDA, torch.bfloat16)
    opt = fo.torch.AdamW(ps, lr=1e-2, state_format="quant8", master_weight_bits=24)
    run(opt, ps, 2)
    twin = copy.deepcopy(opt) if how == "deepcopy" else pickle.loads(pickle.dumps(opt))
    twin_ps = [p for g in twin.param_groups for p in g["params"]]
    assert all(p.device == CUDA for p in twin_ps) and all(a is not b for a, b in zip(ps, twin_ps))
    run(opt, ps, 3, start=2)
    run(twin, twin_ps, 3, start=2)
    assert_same_bits(ps, twin_ps)
    assert_same_state(opt, twin)


def test_schedulers_and_groups_added_later_follow_the_host():
    def build(device):
        first, later = params(device), params(device, shapes=[(7, 5)], seed=3)
        opt = fo.torch.SGD(first, lr=0.1, momentum=0.9, state_format="param_dtype", arithmetic="exact")
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        return opt, sched, first, later

    runs = []
    for device in ("cpu", CUDA):
        opt, sched, first, later = build(device)
        for s in range(6):
            if s == 3:
                opt.add_param_group({"params": later, "lr": 0.05})
            ps = first + (later if s >= 3 else [])
            give_grads(ps, s)
            opt.step()
            sched.step()
        runs.append((opt, first + later))
    assert runs[1][0].param_groups[1]["arithmetic"] == "exact"
    assert_same_bits(runs[0][1], runs[1][1])
    assert_same_state(runs[0][0], runs[1][0])


def test_a_compiled_step_has_the_eager_bits():
    eager_ps, ps = params(CUDA), params(CUDA)
    eager = fo.torch.AdamW(eager_ps, lr=1e-2)
    opt = fo.torch.AdamW(ps, lr=1e-2)
    step = torch.compile(opt.step, fullgraph=True, backend="aot_eager")
    for s in range(3):
        give_grads(eager_ps, s)
        eager.step()
        give_grads(ps, s)
        step()
    torch.cuda.synchronize()
    assert_same_bits(eager_ps, ps)


def test_an_unknown_device_is_refused_naming_the_parameter():
    w = torch.nn.Parameter(torch.zeros(3, device="meta"))
    opt = fo.torch.AdamW([("enc.w", w)])
    w.grad = torch.zeros(3, device="meta")
    with pytest.raises(fo.FoError, match="parameter enc.w is on meta"):
        opt.step()


# -- DCP under FSDP2 (a CUDA mesh of one rank) -----------------------------------------------------
@pytest.fixture
def one_rank(tmp_path):
    dist = torch.distributed
    if not dist.is_available() or not dist.is_nccl_available():
        pytest.skip("needs torch.distributed with NCCL")
    torch.cuda.set_device(0)
    dist.init_process_group("cpu:gloo,cuda:nccl", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        yield init_device_mesh("cuda", (1,))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("save", ["save", "async_save"])
@pytest.mark.parametrize("fmt", ["fp32", "quant8"])
def test_dcp_resume_under_fsdp2_on_a_cuda_mesh_is_bit_equal(one_rank, tmp_path, fmt, save):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(12, 20), torch.nn.Linear(20, 5)).to(CUDA)
        for layer in model:
            fully_shard(layer, mesh=one_rank)
        fully_shard(model, mesh=one_rank)
        return model, fo.torch.AdamW(model.parameters(), lr=1e-2, state_format=fmt)

    def steps(model, opt, start, n):
        ps = list(model.parameters())
        for s in range(start, start + n):
            g = torch.Generator().manual_seed(s)
            for p in ps:
                full = torch.randn(p.shape, generator=g).to(CUDA)
                p.grad = distribute_tensor(full, p.device_mesh, p.placements)
            opt.step()
        torch.cuda.synchronize()

    straight, s_opt = build()
    steps(straight, s_opt, 0, 6)
    saved, opt = build()
    steps(saved, opt, 0, 3)
    msd, osd = get_state_dict(saved, opt)
    assert type(osd["state"]["0.weight"]["exp_avg"]).__name__ == "DTensor"
    assert osd["state"]["0.weight"]["exp_avg"].device.type == "cuda"
    if save == "save":
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=tmp_path / "ckpt")
    else:  # the state of the call, while training goes on
        fut = dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=tmp_path / "ckpt")
        steps(saved, opt, 100, 2)
        fut.result()
    resumed, r_opt = build()
    msd, osd = get_state_dict(resumed, r_opt)  # a fresh optimizer: DCP initializes its state
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=tmp_path / "ckpt")
    set_state_dict(resumed, r_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    steps(resumed, r_opt, 3, 3)
    assert_same_bits([p.to_local() for p in straight.parameters()], [p.to_local() for p in resumed.parameters()])
    if fmt == "fp32":  # decoded fp32 loads exactly; quant8 is requantized on load (the params above match)
        assert_same_state(s_opt, r_opt)


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf"), 3.0])
def test_clip_grad_norm_on_cuda_gradients_has_the_hosts_bits(norm_type):
    """fo.torch.clip_grad_norm_ sums CUDA gradients on the GPU and scales them there: the total
    and the scaled gradients are the host computation's bits; a mixed list too."""
    host, dev = params("cpu", torch.bfloat16), params(CUDA, torch.bfloat16)
    give_grads(host, 0)
    give_grads(dev, 0)
    total_h = fo.torch.clip_grad_norm_(host, 0.5, norm_type=norm_type)
    total_d = fo.torch.clip_grad_norm_(dev, 0.5, norm_type=norm_type)
    assert total_d.device == CUDA and torch.equal(total_h, total_d.cpu())
    assert_same_bits([p.grad for p in host], [p.grad for p in dev])
    mixed = params("cpu", torch.bfloat16)[:2] + params(CUDA, torch.bfloat16)[2:]
    give_grads(mixed, 0)
    assert torch.equal(fo.torch.clip_grad_norm_(mixed, 0.5, norm_type=norm_type).cpu(), total_h)
    assert_same_bits([p.grad for p in host], [p.grad for p in mixed])
