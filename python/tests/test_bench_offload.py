"""scripts/bench_offload.py without a GPU: its command line (help, refusals naming the
argument), the one-line exit 2 where there is nothing to measure, and, where torch is
installed, its torch loop and copies baseline on CPU tensors through a stand-in for
torch.cuda (they must compute what torch's own AdamW computes, or the baseline measures
something else), and the table's ratios (their direction is the targets' meaning)."""
import contextlib
import types

import pytest

from conftest import ROOT, load_script, run_script

SCRIPT = ROOT / "scripts" / "bench_offload.py"


def run(*args):
    return run_script(SCRIPT, *args)


def load():
    return load_script(SCRIPT)


def test_help_names_every_flag_and_the_targets():
    r = run("--help")
    assert r.returncode == 0, r.stderr
    for flag in ("--params", "--tensors", "--formats", "--threads", "--rounds", "--steps", "--warmup", "--device"):
        assert flag in r.stdout
    assert "torch loop" in r.stdout and "copies alone" in r.stdout and "1.25x" in r.stdout


@pytest.mark.parametrize("args,named", [
    (["--params", "12Q"], "--params"),
    (["--params", "0"], "--params"),
    (["--tensors", "32", "--params", "16"], "--tensors"),
    (["--formats", "fp16"], "--formats"),
    (["--formats", ","], "--formats"),
    (["--threads", "0"], "--threads"),
    (["--threads", "many"], "--threads"),
    (["--warmup", "-1"], "--warmup"),
    (["--device", "-1"], "--device"),
    (["--rounds", "x"], "--rounds"),
])
def test_bad_arguments_are_refused_naming_the_argument(args, named):
    r = run(*args)
    assert r.returncode == 2
    assert named in r.stderr.splitlines()[-1], r.stderr
    assert "Traceback" not in r.stderr


def test_without_a_gpu_it_exits_2_with_one_line_saying_why():
    r = run("--params", "1M", "--rounds", "1")
    assert r.returncode == 2, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    # Without torch: "needs torch"; with a CPU-only torch (or the GPU hidden): "no CUDA GPU".
    assert lines[0].startswith("bench_offload: ") and ("needs torch" in lines[0] or "no CUDA GPU" in lines[0])
    assert r.stdout == ""


def test_a_libfo_that_cannot_step_cuda_memory_is_named_with_the_fix():
    reason = load().fo_cuda_missing()
    if reason is None:
        pytest.skip("this libfo steps CUDA memory (a cuda build with a GPU)")
    import fo
    assert str(fo.library_path) in reason and "--features cuda" in reason, reason


def fake_cuda_torch():
    """Real torch, but "pinned" memory is plain memory and torch.cuda's streams, events and
    synchronize are no-ops: CPU copies complete at once, which is what they wait for."""
    torch = pytest.importorskip("torch")
    noop = types.SimpleNamespace(record=lambda *a: None, synchronize=lambda: None, wait_stream=lambda s: None,
                                 cuda_stream=0)
    cuda = types.SimpleNamespace(Event=lambda *a, **k: noop, Stream=lambda *a, **k: noop,
                                 current_stream=lambda: noop, synchronize=lambda: None,
                                 stream=lambda s: contextlib.nullcontext())

    def empty(*a, pin_memory=False, **k):
        return torch.empty(*a, **k)

    fake = types.SimpleNamespace(**{k: getattr(torch, k) for k in dir(torch) if not k.startswith("__")})
    fake.empty, fake.cuda = empty, cuda
    return torch, fake


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_torch_loop_steps_as_torch_adamw_on_fp32_masters(dtype):
    torch, fake = fake_cuda_torch()
    bench = load()
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    g = torch.Generator().manual_seed(0)
    init = [(torch.randn(n, generator=g) * 0.02).to(dt) for n in (1000, 37)]
    grads = [[(torch.randn(n, generator=g) * 1e-3).to(dt) for n in (1000, 37)] for _ in range(3)]
    loop = bench.TorchLoop(fake, init, grads[0])
    ref = [torch.nn.Parameter(p.float()) for p in init]
    opt = torch.optim.AdamW(ref, **bench.HP, **{loop.kind: True})
    for step_grads in grads:
        for buf, gr in zip(loop.grads, step_grads):
            buf.copy_(gr)  # the "CUDA" grads, rewritten in place as a backward would
        loop.step()
        for p, gr in zip(ref, step_grads):
            p.grad = gr.float()
        opt.step()
    for p, r in zip(loop.params, ref):
        assert p.dtype == dt
        assert torch.equal(p, r.detach().to(dt)), "the torch loop's params are not torch AdamW's"
    assert loop.kind in ("fused", "foreach")
    assert not any(p.requires_grad for p in loop.params)


def test_the_copies_move_each_grad_down_and_each_param_up():
    torch, fake = fake_cuda_torch()
    bench = load()
    init = [torch.arange(10, dtype=torch.bfloat16), torch.ones(3, dtype=torch.bfloat16)]
    grads = [torch.full((10,), 2.0, dtype=torch.bfloat16), torch.zeros(3, dtype=torch.bfloat16)]
    c = bench.Copies(fake, init, grads)
    for p in c.params:
        p.zero_()
    c.step()
    assert all(torch.equal(a, b) for a, b in zip(c.gpin, grads))
    assert all(torch.equal(a, b) for a, b in zip(c.params, init))
    assert c.bytes == (10 + 3) * 2 * 2  # grads down + params up, bf16


def test_the_table_gives_speedup_over_the_torch_loop_and_time_over_the_copies(capsys):
    bench = load()
    runners = {"torch loop bf16 (fused AdamW)": object(),
               "copies bf16": types.SimpleNamespace(bytes=4e9),
               "fo bf16+quant8+24b fast": types.SimpleNamespace(call_s=[0.004])}
    # seconds per step over 3 rounds: fo is 2x the torch loop and 1.25x the copies in each
    per = {"torch loop bf16 (fused AdamW)": [0.010, 0.012, 0.020],
           "copies bf16": [0.004, 0.0048, 0.008],
           "fo bf16+quant8+24b fast": [0.005, 0.006, 0.010]}
    bench.report(per, runners, {"fo bf16+quant8+24b fast": "bf16"}, 2)
    out = capsys.readouterr().out
    fo_line = next(ln for ln in out.splitlines() if ln.strip().startswith("fo bf16"))
    assert "6.0 [    5.0-   10.0]" in fo_line and "2.00x" in fo_line and "1.25x" in fo_line and "4.0" in fo_line
    copies = next(ln for ln in out.splitlines() if ln.strip().startswith("copies bf16"))
    assert copies.split()[-1] == "833.3"  # 4e9 B / 4.8 ms
    assert "2 thread(s)" in out
