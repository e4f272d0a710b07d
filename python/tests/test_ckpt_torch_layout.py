"""fo.ckpt.torch_state_dict: fo state in torch's nested optimizer layout (by index, by FQN,
flattened), from an optimizer or a checkpoint saved on any number of ranks. The numpy tests
run everywhere; the torch tests load the result with real torch and compare values."""
import numpy as np
import pytest

import fo

# torch 2.15's AdamW param group keys (besides "params"), and SGD's.
ADAMW_KEYS = {"lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "foreach", "capturable",
              "differentiable", "fused", "decoupled_weight_decay"}
SGD_KEYS = {"lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize", "foreach", "differentiable",
            "fused"}
SHAPES = {"0.weight": (5, 7), "0.bias": (5,), "2.weight": (3, 5), "2.bias": (3,)}
HP = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


def grad(fqn, step):
    n = int(np.prod(SHAPES[fqn]))
    return np.cos(0.37 * np.arange(n, dtype=np.float32) + step + len(fqn)).reshape(SHAPES[fqn]).astype(np.float32)


def two_group_adamw(state_format="fp32", steps=2, params=None):
    """Weights in group 0, biases in group 1 (lr 3e-2), registered interleaved, so fo's
    indices (registration order) differ from torch's (group by group)."""
    opt = fo.Optimizer("adamw", state_format=state_format, master_weight_bits=0, **HP)
    g1 = opt.add_param_group("adamw", state_format=state_format, master_weight_bits=0, **{**HP, "lr": 3e-2})
    params = params or {f: np.sin(np.arange(np.prod(s), dtype=np.float32)).reshape(s).astype(np.float32)
                        for f, s in SHAPES.items()}
    for fqn, w in params.items():
        opt.add_param(fqn, w, group=g1 if fqn.endswith("bias") else 0)
    for s in range(steps):
        opt.step([grad(f, s) for f in params])
    return opt, params


def test_optimizer_export_is_torchs_nested_layout_keyed_by_index():
    opt, _ = two_group_adamw()
    sd = fo.ckpt.torch_state_dict(opt, framework="numpy")
    assert [g["params"] for g in sd["param_groups"]] == [[0, 1], [2, 3]]  # torch numbers group by group
    assert set(sd["param_groups"][0]) == ADAMW_KEYS | {"initial_lr", "params"}
    assert sd["param_groups"][1]["lr"] == 3e-2 and sd["param_groups"][0]["betas"] == (0.9, 0.999)
    assert sd["param_groups"][0]["decoupled_weight_decay"] is True
    # torch index 1 is "2.weight" (fo index 2), torch index 2 is "0.bias" (fo index 1).
    for t, f in [(0, 0), (1, 2), (2, 1), (3, 3)]:
        assert list(sd["state"][t]) == ["step", "exp_avg", "exp_avg_sq"]
        np.testing.assert_array_equal(sd["state"][t]["exp_avg_sq"], opt.get_state(f, "exp_avg_sq"))
        assert sd["state"][t]["step"].shape == () and sd["state"][t]["step"] == 2.0


def test_never_stepped_optimizer_exports_empty_state_and_its_groups():
    opt, _ = two_group_adamw(steps=0)
    sd = fo.ckpt.torch_state_dict(opt, key_by="fqn", framework="numpy")
    assert sd["state"] == {}
    assert [g["params"] for g in sd["param_groups"]] == [["0.weight", "2.weight"], ["0.bias", "2.bias"]]


def test_quant8_state_is_exported_decoded_to_float32_without_error_bits():
    import ml_dtypes
    w = np.linspace(-1, 1, 70, dtype=np.float32).reshape(10, 7).astype(ml_dtypes.bfloat16)
    m = np.ones(9, np.float32)
    opt = fo.Optimizer("adamw", state_format="quant8", master_weight_bits=24, **HP)
    opt.add_param("w", w)
    g = opt.add_param_group("sgd", lr=0.1, momentum=0.9, state_format="quant8", master_weight_bits=0)
    opt.add_param("m", m, group=g)
    opt.step([np.cos(np.arange(70, dtype=np.float32)).reshape(10, 7).astype(ml_dtypes.bfloat16),
              np.sin(np.arange(9, dtype=np.float32))])
    sd = fo.ckpt.torch_state_dict(opt, key_by="fqn", framework="numpy")
    assert set(sd["state"]["w"]) == {"step", "exp_avg", "exp_avg_sq"}  # error_bits left out
    assert sd["state"]["w"]["exp_avg"].dtype == np.float32
    np.testing.assert_array_equal(sd["state"]["w"]["exp_avg"], opt.get_state(0, "exp_avg"))
    assert list(sd["state"]["m"]) == ["momentum_buffer"]
    np.testing.assert_array_equal(sd["state"]["m"]["momentum_buffer"], opt.get_state(1, "momentum_buffer"))
    assert set(sd["param_groups"][1]) == SGD_KEYS | {"initial_lr", "params"}
    assert sd["param_groups"][1]["momentum"] == 0.9 and sd["param_groups"][1]["nesterov"] is False


def make_rank(world, rank, steps=2):
    """A [10, 7] param sharded by rows over `world` ranks (uneven for 3), quant8 state."""
    spec = fo.ShardSpec((10, 7), (world,), (rank,), ["S0"])
    info = spec.info()
    r0, n = info.global_offset[0], info.local_shape[0]
    full = np.sin(0.3 * np.arange(70, dtype=np.float32)).reshape(10, 7)
    w = np.ascontiguousarray(full[r0:r0 + n])
    opt = fo.Optimizer("adamw", state_format="quant8", master_weight_bits=0, **HP)
    opt.add_param("w", w, shard=spec)
    for s in range(steps):
        opt.step([np.ascontiguousarray(np.cos(0.7 * full[r0:r0 + n] + s))])
    return opt, r0, n


def test_checkpoint_saved_on_three_ranks_exports_full_tensors_decoded_with_their_own_groups(tmp_path):
    want = {"exp_avg": np.zeros((10, 7), np.float32), "exp_avg_sq": np.zeros((10, 7), np.float32)}
    for r in range(3):
        opt, r0, n = make_rank(3, r)
        for k in want:
            want[k][r0:r0 + n] = opt.get_state(0, k)  # each rank's decode of its own groups
        fo.ckpt.save(opt, tmp_path, rank=r, world_size=3, mode="compressed", save_id="s")
    sd = fo.ckpt.torch_state_dict(tmp_path, framework="numpy")
    assert list(sd["state"]) == [0] and sd["param_groups"][0]["params"] == [0]
    for k, v in want.items():
        np.testing.assert_array_equal(sd["state"][0][k], v)  # bit for bit: no requantization
    assert sd["state"][0]["step"] == 2.0


def test_checkpoint_of_sgd_lion_adam_groups_in_any_state_format_exports_like_the_optimizer(tmp_path):
    """A first group that is not AdamW (once refused: group 0's algorithm was changed after
    creation), bf16 `param_dtype` state, and `quant8_wide` (saved dequantized)."""
    import ml_dtypes
    opt = fo.Optimizer("sgd", lr=0.1, momentum=0.9, state_format="param_dtype", master_weight_bits=0)
    opt.add_param("a", np.linspace(-1, 1, 40).astype(ml_dtypes.bfloat16).reshape(5, 8))
    g = opt.add_param_group("lion", lr=1e-3, state_format="quant8_wide", master_weight_bits=0)
    opt.add_param("b", np.ones(33, np.float32), group=g)
    g = opt.add_param_group("adam", lr=1e-3, state_format="quant8_wide", master_weight_bits=0)
    opt.add_param("c", np.ones(7, np.float32), group=g)
    for s in range(2):
        opt.step([np.cos(np.arange(40) + s).astype(ml_dtypes.bfloat16).reshape(5, 8),
                  np.sin(np.arange(33) + s).astype(np.float32), np.sin(np.arange(7) + s).astype(np.float32)])
    fo.ckpt.save(opt, tmp_path)
    want = fo.ckpt.torch_state_dict(opt, key_by="fqn", framework="numpy")
    got = fo.ckpt.torch_state_dict(tmp_path, key_by="fqn", framework="numpy")
    assert got["param_groups"] == want["param_groups"]
    assert [list(s) for s in got["state"].values()] == [["momentum_buffer"], ["exp_avg"], ["step", "exp_avg", "exp_avg_sq"]]
    for fqn, st in want["state"].items():
        for k, v in st.items():
            assert v.dtype == np.float32
            np.testing.assert_array_equal(got["state"][fqn][k], v, err_msg=f"{fqn}.{k}")


def test_flattened_form_has_torchs_flat_keys(tmp_path):
    opt, _ = two_group_adamw()
    flat = fo.ckpt.torch_state_dict(opt, flatten=True, framework="numpy")
    assert "state.2.weight.exp_avg" in flat and flat["state.0.bias.step"] == 2.0
    assert flat["param_groups.0.bias.lr"] == 3e-2 and flat["param_groups.2.weight.fused"] is None
    assert {k.rsplit(".", 1)[1] for k in flat if k.startswith("param_groups.0.weight.")} == ADAMW_KEYS | {"initial_lr"}


def test_bad_arguments_and_foreign_directories_raise(tmp_path):
    opt, _ = two_group_adamw(steps=0)
    with pytest.raises(ValueError, match="key_by"):
        fo.ckpt.torch_state_dict(opt, key_by="name")
    with pytest.raises(FileNotFoundError, match="no fo checkpoint files"):
        fo.ckpt.torch_state_dict(tmp_path)


# ---- with real torch -------------------------------------------------------------------

def torch_model(torch):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))


def torch_groups(model):
    named = dict(model.named_parameters())
    return [{"params": [named["0.weight"], named["2.weight"]]}, {"params": [named["0.bias"], named["2.bias"]], "lr": 3e-2}]


def stepped_pair(torch, steps=3):
    """fo (numpy, fp32 state) and torch.optim.AdamW stepped on the same params and grads."""
    model = torch_model(torch)
    ref = torch.optim.AdamW(torch_groups(model), **HP)
    params = {f: p.detach().numpy().copy() for f, p in model.named_parameters()}
    opt, _ = two_group_adamw(steps=0, params=params)
    for s in range(steps):
        for f, p in model.named_parameters():
            p.grad = torch.from_numpy(grad(f, s))
        ref.step()
        opt.step([grad(f, s) for f in params])
    return model, ref, opt, params


def test_torch_adamw_loads_the_export_keyed_by_param_and_continues_like_torch():
    torch = pytest.importorskip("torch")
    model, ref, opt, params = stepped_pair(torch)
    fresh_model = torch_model(torch)
    fresh = torch.optim.AdamW(torch_groups(fresh_model), **HP)
    # The bug this fixes: fo's flat checkpoint keys load into nothing, silently.
    flat = {f"state.{f}.{k}": torch.from_numpy(opt.get_state(i, k)) for i, f in enumerate(opt.fqns)
            for k in ("step", "exp_avg", "exp_avg_sq")}
    fresh.load_state_dict({"state": flat, "param_groups": fresh.state_dict()["param_groups"]})
    assert len(fresh.state) == 12 and not any(p in fresh.state for p in fresh_model.parameters())
    fresh = torch.optim.AdamW(torch_groups(fresh_model), **HP)
    fresh.load_state_dict(fo.ckpt.torch_state_dict(opt))
    named = dict(fresh_model.named_parameters())
    ref_named = dict(model.named_parameters())
    assert len(fresh.state) == 4
    for i, fqn in enumerate(opt.fqns):
        st = fresh.state[named[fqn]]
        for k in ("exp_avg", "exp_avg_sq"):
            np.testing.assert_array_equal(st[k].numpy(), opt.get_state(i, k))
            np.testing.assert_allclose(st[k].numpy(), ref.state[ref_named[fqn]][k].numpy(), rtol=1e-5, atol=1e-12)
        assert st["step"].item() == 3.0 and st["step"].dtype == torch.float32
    assert fresh.param_groups[1]["lr"] == 3e-2 and fresh.param_groups[0]["decoupled_weight_decay"] is True
    # One more step from the loaded state lands where torch's own run lands.
    with torch.no_grad():
        for f, p in fresh_model.named_parameters():
            p.copy_(torch.from_numpy(params[f]))
    for m in (model, fresh_model):
        for f, p in m.named_parameters():
            p.grad = torch.from_numpy(grad(f, 3))
    ref.step()
    fresh.step()
    for f, p in fresh_model.named_parameters():
        np.testing.assert_allclose(p.detach().numpy(), ref_named[f].detach().numpy(), rtol=1e-5, atol=1e-7)


def test_torch_sgd_loads_momentum_buffers():
    torch = pytest.importorskip("torch")
    model = torch_model(torch)
    params = {f: p.detach().numpy().copy() for f, p in model.named_parameters()}
    opt = fo.Optimizer("sgd", lr=0.1, momentum=0.9, state_format="fp32", master_weight_bits=0)
    for f, w in params.items():
        opt.add_param(f, w)
    opt.step([grad(f, 0) for f in params])
    sgd = torch.optim.SGD(model.parameters(), lr=0.5)
    sgd.load_state_dict(fo.ckpt.torch_state_dict(opt))
    assert sgd.param_groups[0]["lr"] == 0.1 and sgd.param_groups[0]["momentum"] == 0.9
    for i, p in enumerate(model.parameters()):
        np.testing.assert_array_equal(sgd.state[p]["momentum_buffer"].numpy(), opt.get_state(i, "momentum_buffer"))


@pytest.mark.parametrize("flatten", [False, True])
def test_set_optimizer_state_dict_takes_a_quant8_checkpoint_nested_and_flattened(tmp_path, flatten):
    torch = pytest.importorskip("torch")
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
    model, _, _, _ = stepped_pair(torch, steps=0)
    params = {f: p.detach().numpy().copy() for f, p in model.named_parameters()}
    opt, _ = two_group_adamw(state_format="quant8", steps=2, params=params)
    fo.ckpt.save(opt, tmp_path)
    sd = fo.ckpt.torch_state_dict(tmp_path, key_by="fqn", flatten=flatten)
    torch_opt = torch.optim.AdamW(torch_groups(model), **HP)
    set_optimizer_state_dict(model, torch_opt, sd, options=StateDictOptions(flatten_optimizer_state_dict=flatten))
    named = dict(model.named_parameters())
    for i, fqn in enumerate(opt.fqns):
        st = torch_opt.state[named[fqn]]
        np.testing.assert_array_equal(st["exp_avg"].numpy(), opt.get_state(i, "exp_avg"))
        np.testing.assert_array_equal(st["exp_avg_sq"].numpy(), opt.get_state(i, "exp_avg_sq"))
        assert st["step"].item() == 2.0
    assert torch_opt.param_groups[1]["lr"] == 3e-2
