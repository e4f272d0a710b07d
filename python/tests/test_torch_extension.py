"""examples/torch_extension: a PyTorch C++ extension calling fo's C ABI on at::Tensor params
and grads, built with torch.utils.cpp_extension against the installed torch, then checked
against torch.optim.AdamW, fo's numpy path and fo's checkpoint reader.

The build (a minute or more on 2 cores) is cached in target/torch_ext/<torch version>/;
setuptools rebuilds only when the source is newer than the built module."""
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import ROOT

torch = pytest.importorskip("torch")
import fo  # noqa: E402  (after the skip: without torch nothing here runs)

HP = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


@pytest.fixture(scope="module")
def ext():
    cache = ROOT / "target" / "torch_ext" / f"torch-{torch.__version__}-py{sys.version_info[0]}{sys.version_info[1]}"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "python")] + [p for p in [env.get("PYTHONPATH")] if p])
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "torch_extension" / "setup.py"), "-q", "build_ext",
                          "--build-lib", str(cache / "lib"), "--build-temp", str(cache / "tmp")],
                         env=env, cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    print(f"\ntorch extension build (cached in {cache}): {time.monotonic() - t0:.1f} s")
    sys.path.insert(0, str(cache / "lib"))
    try:
        import fo_torch_ext
    finally:
        sys.path.remove(str(cache / "lib"))
    assert fo_torch_ext.abi_version() == fo.abi_version()
    return fo_torch_ext


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


def grads_for(m, step):
    """Deterministic grads; the weights' are transposed views (strides (1, rows)), so the
    extension must pass strides to fo rather than assume contiguity."""
    out = []
    for i, p in enumerate(m.parameters()):
        n = p.numel()
        g = torch.cos(0.3 * torch.arange(n, dtype=torch.float32) + step + i)
        out.append(g.reshape(p.shape[::-1]).t() if p.dim() == 2 else g.reshape(p.shape))
    return out


def test_fp32_state_follows_torch_adamw_with_strided_grads(ext):
    ours, ref = model(), model()
    opt = ext.Optimizer("adamw", state_format="fp32", master_weight_bits=0, **HP)
    for name, p in ours.named_parameters():
        opt.add_param(name, p)
    torch_opt = torch.optim.AdamW(ref.parameters(), **HP)
    for s in range(10):
        gs = grads_for(ours, s)
        assert not gs[0].is_contiguous()
        opt.step(gs)
        for p, g in zip(ref.parameters(), gs):
            p.grad = g.contiguous()
        torch_opt.step()
    for i, (p, q) in enumerate(zip(ours.parameters(), ref.parameters())):
        np.testing.assert_allclose(p.detach().numpy(), q.detach().numpy(), rtol=1e-5, atol=1e-7)
        st = torch_opt.state[q]
        np.testing.assert_allclose(opt.get_state(i, "exp_avg").numpy(), st["exp_avg"].numpy(), rtol=1e-5, atol=1e-9)
        np.testing.assert_allclose(opt.get_state(i, "exp_avg_sq").numpy(), st["exp_avg_sq"].numpy(), rtol=1e-5,
                                   atol=1e-12)
        assert opt.get_state(i, "step").item() == 10.0


def test_steps_from_param_grad_and_skips_params_without_one(ext):
    m = model()
    opt = ext.Optimizer("sgd", lr=0.5, momentum=0.9, weight_decay=0.0, state_format="fp32")
    for name, p in m.named_parameters():
        opt.add_param(name, p)
    before = [p.detach().clone() for p in m.parameters()]
    version = m[0].weight._version
    m[0].weight.grad = torch.ones_like(m[0].weight)
    opt.step()  # the other three have no .grad
    torch.testing.assert_close(m[0].weight.detach(), before[0] - 0.5, rtol=0, atol=1e-6)
    for p, b in list(zip(m.parameters(), before))[1:]:
        assert torch.equal(p.detach(), b)
    assert m[0].weight._version > version  # autograd sees the in-place update
    with pytest.raises(RuntimeError, match="state"):
        opt.get_state(1, "momentum_buffer")  # never stepped: fo's error names the missing state


def test_quant8_bf16_equals_fos_numpy_path_bit_for_bit(ext):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    w = torch.sin(0.1 * torch.arange(96, dtype=torch.float32)).reshape(8, 12).to(torch.bfloat16)
    p = torch.nn.Parameter(w.clone())
    opt = ext.Optimizer("adamw", state_format="quant8", master_weight_bits=24, **HP)
    opt.add_param("w", p)
    arr = w.float().numpy().astype(ml_dtypes.bfloat16)
    ref = fo.Optimizer("adamw", state_format="quant8", master_weight_bits=24, **HP)
    ref.add_param("w", arr)
    for s in range(5):
        g = torch.cos(0.2 * torch.arange(96, dtype=torch.float32) + s).reshape(8, 12).to(torch.bfloat16)
        opt.step([g])
        ref.step([g.float().numpy().astype(ml_dtypes.bfloat16)])
    np.testing.assert_array_equal(p.detach().view(torch.int16).numpy(), arr.view(np.int16))
    for key in ("exp_avg::quantized", "exp_avg::scales", "exp_avg_sq::quantized", "error_bits"):
        np.testing.assert_array_equal(opt.get_state(0, key).numpy(), ref.get_state(0, key), err_msg=key)


def test_pack_and_save_are_read_by_fo_and_by_torch(ext, tmp_path):
    m = model()
    opt = ext.Optimizer("adamw", state_format="quant8", master_weight_bits=0, **HP)
    for name, p in m.named_parameters():
        opt.add_param(name, p)
    for s in range(3):
        opt.step(grads_for(m, s))
    packed = opt.pack(mode="compressed")
    assert packed["state.0.weight.exp_avg::quantized"].dtype == torch.int8
    assert torch.equal(packed["state.0.weight.exp_avg::quantized"], opt.get_state(0, "exp_avg::quantized"))
    portable = opt.pack(mode="portable")
    assert torch.equal(portable["state.2.bias.exp_avg_sq"], opt.get_state(3, "exp_avg_sq"))
    opt.save(str(tmp_path), save_id="s3")
    # fo's numpy binding loads the extension's file...
    back = fo.Optimizer("adamw", state_format="quant8", master_weight_bits=0, **HP)
    arrays = {n: p.detach().numpy().copy() for n, p in m.named_parameters()}
    for n, a in arrays.items():
        back.add_param(n, a)
    fo.ckpt.load(back, tmp_path)
    for i in range(4):
        np.testing.assert_array_equal(back.get_state(i, "exp_avg"), opt.get_state(i, "exp_avg").numpy())
    # ...and torch's AdamW loads it through fo.ckpt.torch_state_dict.
    torch_opt = torch.optim.AdamW(m.parameters(), **HP)
    torch_opt.load_state_dict(fo.ckpt.torch_state_dict(tmp_path))
    for i, p in enumerate(m.parameters()):
        torch.testing.assert_close(torch_opt.state[p]["exp_avg"], opt.get_state(i, "exp_avg"), rtol=0, atol=0)


def test_refuses_what_fo_cannot_take_naming_the_parameter(ext):
    opt = ext.Optimizer("adamw", state_format="fp32")
    with pytest.raises(RuntimeError, match="parameter t is not contiguous"):
        opt.add_param("t", torch.ones(3, 4).t())
    with pytest.raises(RuntimeError, match="parameter i has dtype Long"):
        opt.add_param("i", torch.ones(3, dtype=torch.int64))
    with pytest.raises(RuntimeError, match="parameter m is on meta"):
        opt.add_param("m", torch.ones(3, device="meta"))
    with pytest.raises(RuntimeError, match="unknown state_format 'int4'"):
        ext.Optimizer("adamw", state_format="int4")
    w = torch.nn.Parameter(torch.ones(3))
    opt.add_param("w", w)
    with pytest.raises(RuntimeError, match=r"fo_optimizer_add_param\(w\): FO_ERR_"):
        opt.add_param("w", torch.nn.Parameter(torch.ones(2)))  # fo's own error, with its message
    with pytest.raises(RuntimeError, match="step got 2 grads for 1 parameters"):
        opt.step([torch.ones(3), torch.ones(3)])
    with pytest.raises(RuntimeError, match=r"grad of w has shape \[4\]"):
        opt.step([torch.ones(4)])
    with pytest.raises(RuntimeError, match="grad of w has dtype Double"):
        opt.step([torch.ones(3, dtype=torch.float64)])


def test_train_example_loss_falls_and_torch_loads_its_checkpoint(ext, tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(ext.__file__), str(ROOT / "python")]))
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "torch_extension" / "train.py"), str(tmp_path / "ck")],
                       env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "torch.optim.AdamW loaded it (step 60)" in r.stdout
    fo.ckpt.verify(tmp_path / "ck")
