"""fo.torch as a torch user meets it (issue 25): defaults, copies, visible state, memory,
torch's flags, torch.compile, sparse gradients, names in param_groups, checkpoints."""
import copy
import pickle
import re
import warnings

import pytest

torch = pytest.importorskip("torch")
import fo  # noqa: E402
import fo.ckpt  # noqa: E402
import fo.torch  # noqa: E402


def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(7, 40), torch.nn.Tanh(), torch.nn.Linear(40, 3))


def batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(16, 7, generator=g), torch.randn(16, 3, generator=g)


def train(model, opt, steps, start=0):
    for s in range(start, start + steps):
        x, y = batch(s)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def params_equal(a, b):
    return all(torch.equal(pa, pb) for pa, pb in zip(a.parameters(), b.parameters()))


# -- 1. defaults -----------------------------------------------------------------------
def test_default_is_quant8_with_fast_arithmetic_and_exact_is_one_argument_away():
    ps = list(make_model().parameters())
    g = fo.torch.AdamW(ps).param_groups[0]
    assert (g["state_format"], g["arithmetic"]) == ("quant8", fo.torch.DEFAULT_ARITHMETIC) == ("quant8", "fast")
    for make in (lambda ps: fo.torch.Adam(ps, weight_decay=0.1), lambda ps: fo.torch.SGD(ps, lr=0.1, momentum=0.9),
                 lambda ps: fo.torch.Lion(ps, weight_decay=0.1)):
        model = make_model()
        opt = make(model.parameters())
        assert opt.param_groups[0]["arithmetic"] == fo.torch.DEFAULT_ARITHMETIC
        train(model, opt, 2)  # every algorithm steps under the default
        assert len(opt.state) == 4
    a, b = make_model(), make_model()
    oa, ob = fo.torch.AdamW(a.parameters(), lr=1e-2), fo.torch.AdamW(b.parameters(), lr=1e-2, arithmetic="exact")
    train(a, oa, 3)
    train(b, ob, 3)
    assert ob._fo.group_config(0).arithmetic == 0
    assert oa._fo.group_config(0).arithmetic == 1
    assert not params_equal(a, b)  # fast and exact are different arithmetic, close to each other
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=1e-3, atol=1e-5)


# -- 2. deepcopy and pickle ------------------------------------------------------------
@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
@pytest.mark.parametrize("fmt", ["fp32", "quant8"])
def test_deepcopy_and_pickle_give_an_optimizer_that_continues_identically(how, fmt):
    model = make_model()
    opt = fo.torch.AdamW(model.parameters(), lr=1e-2, state_format=fmt)
    train(model, opt, 4)
    both = {"model": model, "opt": opt}
    twin = copy.deepcopy(both) if how == "deepcopy" else pickle.loads(pickle.dumps(both))
    m2, o2 = twin["model"], twin["opt"]
    assert o2.param_groups[0]["params"][0] is next(m2.parameters())  # the copy's own params
    assert len(o2.state) == len(opt.state) == 4
    assert o2.state_dict()["state"][0]["step"].item() == 4
    train(model, opt, 3, start=4)
    train(m2, o2, 3, start=4)
    assert params_equal(model, m2)
    # independent: stepping the copy did not touch the original's state
    assert opt.state_dict()["state"][0]["step"].item() == 7 == o2.state_dict()["state"][0]["step"].item()


def test_deepcopy_of_an_optimizer_alone_and_of_a_never_stepped_one():
    model = make_model()
    fresh = copy.deepcopy(fo.torch.SGD(model.parameters(), lr=0.1, momentum=0.9))
    assert len(fresh.state) == 0 and fresh.param_groups[0]["momentum"] == 0.9
    opt = fo.torch.SGD(model.parameters(), lr=0.1, momentum=0.9, state_format="fp32")
    train(model, opt, 2)
    clone = copy.deepcopy(opt)  # params deep-copied with it, as torch's optimizers do
    p = clone.param_groups[0]["params"][0]
    assert p is not opt.param_groups[0]["params"][0]
    torch.testing.assert_close(clone.state[p]["momentum_buffer"],
                               opt.state[opt.param_groups[0]["params"][0]]["momentum_buffer"])


# -- 3. opt.state edits reach fo ---------------------------------------------------------
def test_zeroing_exp_avg_in_place_reaches_fo():
    a, b = make_model(), make_model()
    oa = fo.torch.AdamW(a.parameters(), lr=1e-2, state_format="fp32")
    ob = fo.torch.AdamW(b.parameters(), lr=1e-2, state_format="fp32")
    train(a, oa, 3)
    train(b, ob, 3)
    for p in oa.param_groups[0]["params"]:
        oa.state[p]["exp_avg"].zero_()
    sd = ob.state_dict()
    for st in sd["state"].values():
        st["exp_avg"].zero_()
    ob.load_state_dict(sd)  # the torch way of doing the same, through a state dict
    train(a, oa, 2, start=3)
    train(b, ob, 2, start=3)
    assert params_equal(a, b)
    # the edit reached fo: without it the trajectory differs
    c = make_model()
    oc = fo.torch.AdamW(c.parameters(), lr=1e-2, state_format="fp32")
    train(c, oc, 5)
    assert not params_equal(a, c)


def test_state_tensors_held_across_steps_follow_the_optimizer():
    model = make_model()
    opt = fo.torch.AdamW(model.parameters(), lr=1e-2, state_format="quant8")
    train(model, opt, 1)
    p = next(model.parameters())
    m, step = opt.state[p]["exp_avg"], opt.state[p]["step"]
    assert opt.state[p]["exp_avg"] is m  # the same tensor until the next step, like torch
    train(model, opt, 2, start=1)
    assert step.item() == 3  # refreshed in place after each step
    fresh = opt._export(p)["exp_avg"]
    assert torch.equal(m, fresh) and opt.state[p]["exp_avg"] is m
    opt.state[p]["step"] = torch.tensor(10.0)  # assignment into the dict reaches fo too
    m.zero_()  # an edit of a tensor held across steps reaches fo (quant8 stores zero exactly)
    assert opt.state_dict()["state"][0]["step"].item() == 10
    assert torch.count_nonzero(opt._export(p)["exp_avg"]) == 0


def test_quant8_edits_are_requantized():
    model = make_model()
    opt = fo.torch.AdamW(model.parameters(), lr=1e-2, state_format="quant8")
    train(model, opt, 2)
    p = next(model.parameters())
    v = opt.state[p]["exp_avg_sq"]
    v.mul_(4.0)
    stored = opt.state_dict()["state"][0]["exp_avg_sq"]
    assert not torch.equal(stored, v / 4) and torch.allclose(stored, v, rtol=0.05, atol=1e-12)


# -- 4. what fo stores -------------------------------------------------------------------
def test_state_memory_reports_bytes_per_param_per_group_and_format_and_repr_shows_it():
    torch.manual_seed(0)
    w32 = torch.nn.Parameter(torch.randn(64, 32))
    wbf = torch.nn.Parameter(torch.randn(64, 32).bfloat16())
    opt = fo.torch.AdamW([{"params": [w32], "state_format": "fp32"},
                          {"params": [wbf], "master_weight_bits": 24}], lr=1e-3)
    assert opt.state_memory()["bytes"] == 0 and "none yet" in repr(opt)
    w32.grad, wbf.grad = torch.ones_like(w32), torch.ones_like(wbf)
    opt.step()
    m = opt.state_memory()
    n = 64 * 32
    g32, g8 = m["groups"]
    assert (g32["state_format"], g32["params"], g32["bytes_per_param"]) == ("fp32", n, 8.0)
    # quant8: int8 + uint8 + fp16 scale per 32 for each of two buffers, plus int8 error bits
    assert (g8["state_format"], g8["master_weight_bits"], g8["params"]) == ("quant8", 24, n)
    assert g8["bytes_per_param"] == pytest.approx(2 + 4 / 32 + 1)
    assert m["formats"]["quant8"]["bytes"] == g8["bytes"] and m["bytes"] == g32["bytes"] + g8["bytes"]
    assert (m["host_bytes"], m["device_bytes"], m["params"]) == (m["bytes"], 0, 2 * n)
    assert m["bytes"] == opt._fo.state_bytes()
    r = repr(opt)
    assert r.startswith("AdamW (") and "fo state:" in r and "fp32 8.000 B/param" in r and "quant8 3.125 B/param" in r


def test_save_checkpoint_writes_the_compressed_form_in_one_call_and_loads_back(tmp_path):
    a = make_model()
    oa = fo.torch.AdamW(a.named_parameters(), lr=1e-2)  # named: checkpoint keys are FQNs
    train(a, oa, 3)
    oa.param_groups[0]["lr"] = 5e-3
    oa.save_checkpoint(tmp_path / "ck")
    fo.ckpt.verify(tmp_path / "ck")
    sd = fo.ckpt.torch_state_dict(tmp_path / "ck")
    assert sd["param_groups"][0]["lr"] == 5e-3
    from safetensors import safe_open
    (f,) = (tmp_path / "ck").glob("shard-*.safetensors")
    with safe_open(str(f), "np") as st:
        keys = set(st.keys())
        assert st.get_tensor("state.0.weight.exp_avg::quantized").dtype.name == "int8"
    assert "state.0.weight.exp_avg_sq::scales" in keys and "state.0.weight.exp_avg" not in keys
    b = make_model()
    b.load_state_dict(a.state_dict())
    ob = fo.torch.AdamW(b.named_parameters(), lr=1e-2)
    report = ob.load_checkpoint(tmp_path / "ck")
    assert not report["missing"] and ob.param_groups[0]["lr"] == 5e-3
    train(a, oa, 2, start=3)
    train(b, ob, 2, start=3)
    assert params_equal(a, b)  # the compressed state loads back bit for bit



def test_save_checkpoint_async_equals_a_sync_save_at_the_call_while_training_goes_on(tmp_path):
    a = make_model()
    oa = fo.torch.AdamW(a.named_parameters(), lr=1e-2)
    train(a, oa, 3)
    oa.save_checkpoint(tmp_path / "sync", save_id="s")
    pending = oa.save_checkpoint_async(tmp_path / "async", save_id="s", staging_budget=1 << 10)
    train(a, oa, 2, start=3)  # steps while the save is in flight
    pending.wait()
    assert pending.done()

    def files(d):
        return {f.name: f.read_bytes() for f in sorted(d.iterdir()) if not f.name.startswith(".")}

    assert files(tmp_path / "async") == files(tmp_path / "sync") and files(tmp_path / "sync")
    fo.ckpt.verify(tmp_path / "async")

# -- 5. fused / foreach / capturable -----------------------------------------------------
def test_fused_and_foreach_are_accepted_and_capturable_is_refused_saying_what_to_write():
    ps = list(make_model().parameters())
    for kw in ({"fused": True}, {"fused": False}, {"foreach": True}, {"foreach": False}):
        opt = fo.torch.AdamW(ps, **kw)
        assert opt.param_groups[0][next(iter(kw))] == next(iter(kw.values()))
    fo.torch.SGD(ps, fused=True, foreach=False)
    with pytest.raises(fo.FoError, match="drop capturable"):
        fo.torch.AdamW(ps, capturable=True)


# -- 6. torch.compile ---------------------------------------------------------------------
# aot_eager functionalizes the op's mutation (its counter), inductor compiles it (about 6 s)
@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_compiled_step_is_one_opaque_op_under_fullgraph(backend):
    torch._dynamo.reset()
    a, b = make_model(), make_model()
    oa = fo.torch.AdamW(a.parameters(), lr=1e-2, state_format="fp32")
    ob = fo.torch.AdamW(b.parameters(), lr=1e-2, state_format="fp32")
    compiled = torch.compile(ob.step, fullgraph=True, backend=backend)
    for s in range(3):
        for m, o, st in ((a, oa, oa.step), (b, ob, compiled)):
            x, y = batch(s)
            o.zero_grad()
            torch.nn.functional.mse_loss(m(x), y).backward()
            o.param_groups[0]["lr"] = 1e-2 / (1 + s)  # read at run time, not baked in
            st()
    assert params_equal(a, b)  # the compiled step is fo's step
    assert ob.state_dict()["state"][0]["step"].item() == 3


def compiled_loop(opt_of, compiled=True):
    """A compiled training step (forward, backward, step, schedule) run 3 times: the
    final parameters, the graph-break reasons and the warnings."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = make_model()
    opt = opt_of(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))

    def train_step(x, y):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        sched.step()
        return loss

    if compiled:
        train_step = torch.compile(train_step, backend="eager")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for s in range(3):
            train_step(*batch(s))
    # the optimizer's class name aside (`Adam.step`, `_FoOptimizer.step`)
    breaks = {re.sub(r"`\w+\.step`", "OPT.step", r.split("Developer debug context")[0])
              for r in torch._dynamo.utils.counters["graph_break"]}
    return model, breaks, [str(w.message) for w in seen]


def test_compiled_training_loop_breaks_only_where_torchs_own_adamw_does_and_warns_nothing():
    model, breaks, warned = compiled_loop(lambda ps: fo.torch.AdamW(ps, lr=1e-2, state_format="fp32"))
    _, ref_breaks, _ = compiled_loop(lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    assert warned == []
    assert breaks <= ref_breaks, breaks - ref_breaks  # no break of fo's own (ctypes, data pointers)
    eager, _, _ = compiled_loop(lambda ps: fo.torch.AdamW(ps, lr=1e-2, state_format="fp32"), compiled=False)
    assert params_equal(model, eager)


# -- 7. sparse gradients ------------------------------------------------------------------
def test_sparse_gradients_say_what_torch_says():
    emb = torch.nn.Embedding(10, 4, sparse=True)
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match="AdamW does not support sparse gradients.*SparseAdam"):
        fo.torch.AdamW(emb.parameters()).step()
    with pytest.raises(RuntimeError, match="SGD does not support sparse gradients.*torch.optim.SGD"):
        fo.torch.SGD(emb.parameters(), lr=0.1).step()


# -- 8. arithmetic by name --------------------------------------------------------------
def test_arithmetic_is_shown_by_name():
    ps = list(make_model().parameters())
    opt = fo.torch.AdamW(ps[:2], arithmetic=0)
    assert opt.param_groups[0]["arithmetic"] == "exact" and "arithmetic: exact" in repr(opt)
    opt.add_param_group({"params": ps[2:], "arithmetic": "exact"})
    assert opt.param_groups[1]["arithmetic"] == "exact"
    assert opt.state_dict()["param_groups"][0]["arithmetic"] == "exact"


# -- 9. step is 0-dim in fo.ckpt.torch_state_dict ----------------------------------------
def test_ckpt_torch_state_dict_step_is_0_dim_like_torch(tmp_path):
    model = make_model()
    m0 = make_model()
    ref = torch.optim.AdamW(m0.parameters())
    train(m0, ref, 1)
    opt = fo.torch.AdamW(model.parameters(), lr=1e-2)
    train(model, opt, 2)
    opt.save_checkpoint(tmp_path)
    for source in (tmp_path, opt._fo):
        sd = fo.ckpt.torch_state_dict(source)
        assert sd["state"][0]["step"].shape == ref.state_dict()["state"][0]["step"].shape == ()
        assert sd["state"][0]["step"].item() == 2


# -- 10. threads ------------------------------------------------------------------------
def test_fo_threads_are_its_own_pool_apart_from_torchs():
    before, torch_before = fo.get_num_threads(), torch.get_num_threads()
    try:
        fo.set_num_threads(1)
        assert fo.get_num_threads() == 1 and torch.get_num_threads() == torch_before
        torch.set_num_threads(1)
        fo.set_num_threads(2)
        assert (fo.get_num_threads(), torch.get_num_threads()) == (2, 1)
        model = make_model()
        train(model, fo.torch.AdamW(model.parameters()), 1)  # steps on fo's 2 threads
    finally:
        fo.set_num_threads(0)
        torch.set_num_threads(torch_before)
    assert fo.get_num_threads() == before



def _bits(t):
    return t.contiguous().view(torch.int32) if t.dtype == torch.float32 else t


def test_state_of_large_params_reads_the_same_bits_at_any_thread_count_and_tracks_torch():
    # More elements than fo decodes per parallel chunk (65536) times three, and not a
    # multiple of the quant8 group: state reads split across threads and a short last group.
    torch.manual_seed(0)
    shape = (3, 65_549)
    grads = [torch.randn(shape) * 1e-2 for _ in range(2)]
    for fmt in ("fp32", "quant8"):
        w = torch.nn.Parameter(torch.randn(shape))
        ref = torch.nn.Parameter(w.detach().clone())
        opt, topt = fo.torch.AdamW([w], lr=1e-2, state_format=fmt), torch.optim.AdamW([ref], lr=1e-2)
        for g in grads:
            w.grad, ref.grad = g.clone(), g.clone()
            opt.step()
            topt.step()
        reads = []
        try:
            for threads in (1, 2):
                fo.set_num_threads(threads)
                opt.state.handed.clear()  # read afresh from fo (what the first read after a step does)
                reads.append((opt.state_dict()["state"][0], dict(opt.state[w])))
        finally:
            fo.set_num_threads(0)
        for sd, st in reads:
            for k in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(_bits(sd[k]), _bits(reads[0][0][k])), f"{fmt} {k}"
                assert torch.equal(_bits(st[k]), _bits(reads[0][0][k])), f"{fmt} {k} via opt.state"
        if fmt == "fp32":
            for k in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(reads[0][0][k], topt.state[ref][k], rtol=1e-5, atol=1e-7)


# -- torch's companions ---------------------------------------------------------------------
def test_swa_utils_schedule_and_average_with_an_fo_optimizer():
    from torch.optim.swa_utils import SWALR, AveragedModel
    model = make_model()
    opt = fo.torch.SGD(model.parameters(), lr=0.1, momentum=0.9, state_format="fp32")
    swa, sched = AveragedModel(model), SWALR(opt, swa_lr=0.05, anneal_epochs=2)
    snapshots = []
    for s in range(5):
        train(model, opt, 1, start=s)
        if s >= 2:
            swa.update_parameters(model)
            snapshots.append([p.detach().clone() for p in model.parameters()])
            sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05) and swa.n_averaged.item() == 3
    for avg, ps in zip(swa.module.parameters(), zip(*snapshots)):
        torch.testing.assert_close(avg, sum(ps) / 3)


def test_grad_scaler_skips_the_overflowing_step_and_unscales_like_for_torch_optim():
    out = {}
    for kind in ("torch", "fo"):
        torch.manual_seed(0)
        m = torch.nn.Linear(8, 4)
        opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) if kind == "torch"
               else fo.torch.AdamW(m.parameters(), lr=1e-2, state_format="fp32"))
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        for s in range(4):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = m(torch.randn(4, 8)).float().pow(2).sum()
            scaler.scale(loss).backward()
            if s == 2:
                m.weight.grad[0, 0] = float("inf")
            scaler.step(opt)
            scaler.update()
        out[kind] = (m.weight.detach(), scaler.get_scale(), opt.state_dict()["state"][0]["step"].item())
    assert out["fo"][1:] == out["torch"][1:] == (512.0, 3)  # the inf step skipped, the scale halved
    torch.testing.assert_close(out["fo"][0], out["torch"][0], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("options", [{"full_state_dict": True, "cpu_offload": True},
                                     {"flatten_optimizer_state_dict": True}, {}], ids=["full_cpu", "flat", "plain"])
def test_distributed_state_dict_options_round_trip(options):
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                         set_optimizer_state_dict)
    o = StateDictOptions(**options)
    a = make_model()
    oa = fo.torch.AdamW(a.parameters(), lr=1e-2)
    train(a, oa, 2)
    sd = get_optimizer_state_dict(a, oa, options=o)
    b = make_model()
    b.load_state_dict(a.state_dict())
    ob = fo.torch.AdamW(b.parameters(), lr=1e-2)
    set_optimizer_state_dict(b, ob, sd, options=o)
    train(a, oa, 2, start=2)
    train(b, ob, 2, start=2)
    assert params_equal(a, b)


def test_zero_redundancy_optimizer_wraps_fo_and_loads_its_consolidated_state(tmp_path):
    dist = torch.distributed
    if not dist.is_available() or dist.is_initialized():
        pytest.skip("needs torch.distributed and no process group of another test")
    from torch.distributed.optim import ZeroRedundancyOptimizer
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        a, b = make_model(), make_model()
        za = ZeroRedundancyOptimizer(a.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-2)
        zb = ZeroRedundancyOptimizer(b.parameters(), optimizer_class=fo.torch.AdamW, lr=1e-2, state_format="fp32")
        train(a, za, 3)
        train(b, zb, 3)
        for p, q in zip(a.parameters(), b.parameters()):
            torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-7)
        zb.consolidate_state_dict(to=0)
        sd = zb.state_dict()
        assert sd["state"][0]["step"].item() == 3
        c = make_model()
        c.load_state_dict(b.state_dict())
        zc = ZeroRedundancyOptimizer(c.parameters(), optimizer_class=fo.torch.AdamW, lr=1e-2, state_format="fp32")
        # assigns zc.optim.state[p] = {...}; sd holds zb's live fp32 state, and torch (ZeRO
        # and torch.optim alike) adopts same-dtype tensors without a copy, so two optimizers
        # stepping side by side need a copy between them, as with torch's own AdamW
        zc.load_state_dict(copy.deepcopy(sd))
        train(b, zb, 2, start=3)
        train(c, zc, 2, start=3)
        assert params_equal(b, c)
    finally:
        dist.destroy_process_group()


def test_gradient_slots_kept_across_steps_follow_new_strides_and_none():
    torch.manual_seed(0)
    a, b = torch.nn.Parameter(torch.randn(3, 4)), torch.nn.Parameter(torch.randn(3, 4))
    c, d = torch.nn.Parameter(torch.randn(5)), torch.nn.Parameter(torch.randn(5))
    with torch.no_grad():
        b.copy_(a)
        d.copy_(c)
    ta, fb = torch.optim.AdamW([a, c], lr=1e-2), fo.torch.AdamW([b, d], lr=1e-2, state_format="fp32")
    for s in range(4):
        g = torch.randn(4, 3)
        a.grad, b.grad = g.t().contiguous(), (g.t() if s % 2 == 0 else g.t().contiguous())  # strides change
        gc = torch.randn(5)
        c.grad, d.grad = (None, None) if s == 2 else (gc, gc.clone())  # no gradient at step 2
        ta.step()
        fb.step()
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(d, c, rtol=1e-5, atol=1e-7)
    assert fb.state[d]["step"].item() == 3
