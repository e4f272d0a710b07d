"""What of fo.torch's CUDA support can be checked without a GPU (python/tests/test_torch_cuda.py
runs the rest on one): device codes and refusals naming the parameter, the stream choice and
when fo is told of a new stream (torch's streams stood in for), the arithmetic a group of
CUDA parameters defaults to (fast, as on the host), and what overlap=True and the state path do with a parameter
fo.torch takes for a CUDA one."""
import types

import pytest

torch = pytest.importorskip("torch")
import fo  # noqa: E402
import fo._torch_args as targs  # noqa: E402
import fo._torch_cuda as tcuda  # noqa: E402
import fo._torch_overlap as tov  # noqa: E402
import fo._torch_overlap_cuda as tovc  # noqa: E402
import fo.torch  # noqa: E402
from fo import _codes  # noqa: E402
from test_torch_overlap import assert_same_bits, backward, build, snapshot, train  # noqa: E402


def on(device):
    """A stand-in with only a `.device`: what device_code and is_cuda read."""
    return types.SimpleNamespace(device=torch.device(device))


def libfo_steps_devices():
    """Whether this libfo has the cuda feature and a driver (set_stream refuses otherwise)."""
    why = tcuda.device_support()
    assert why is None or why.status == _codes.FO_ERR_UNSUPPORTED, why
    return why is None


# -- device codes ------------------------------------------------------------------------
def test_device_codes_are_the_hosts_or_the_cuda_ordinal():
    assert targs.device_code(torch.zeros(2), "x") == _codes.FO_DEVICE_HOST == -1
    assert targs.device_code(on("cuda:3"), "x") == 3
    assert targs.device_code(on("cuda:0"), "x") == 0
    for dev in ("meta", "mps", "xpu:1"):
        with pytest.raises(fo.FoError, match=f"parameter fc.w is on {dev}; fo steps host") as e:
            targs.device_code(on(dev), "parameter fc.w")
        assert e.value.name == "FO_ERR_UNSUPPORTED"


def test_a_meta_gradient_is_refused_naming_it():
    # torch refuses a meta .grad on a host parameter, so the gradient array is asked directly
    grads = targs.GradArray(1)
    with pytest.raises(fo.FoError, match="gradient of parameter enc.w is on meta") as e:
        grads.set(0, torch.zeros(3, device="meta"), "gradient of parameter enc.w")
    assert e.value.name == "FO_ERR_UNSUPPORTED"
    grads.set(0, torch.zeros(3), "gradient of parameter enc.w")
    assert grads.array[0].device == _codes.FO_DEVICE_HOST


def test_a_cuda_parameter_that_this_libfo_cannot_step_is_refused_by_fo_naming_it(monkeypatch):
    """A CUDA parameter reaches fo with its ordinal; a libfo built without `cuda` (or without
    a driver) refuses it with its own message, which fo.torch completes with the parameter's
    name (fo names only the argument). Stood in for by a host tensor registered as device 0."""
    if libfo_steps_devices():
        pytest.skip("this libfo steps device tensors: the refusal under test is a host-only build's")
    w = torch.nn.Parameter(torch.zeros(4))
    real = targs.device_code
    monkeypatch.setattr(targs, "device_code", lambda t, what: 0 if t is w else real(t, what))
    opt = fo.torch.AdamW([("decoder.proj.weight", w)], lr=1e-3)
    w.grad = torch.ones(4)
    with pytest.raises(fo.FoError) as e:
        opt.step()
    assert e.value.name == "FO_ERR_UNSUPPORTED"
    msg = e.value.message
    assert msg.startswith("parameter decoder.proj.weight is on cuda:0: "), msg
    assert "device = 0" in msg, msg  # fo's own words follow: what is missing
    if "built without GPU support" in tcuda.device_support().message:
        assert "built without GPU support (rebuild with `--features cuda`)" in msg, msg
    assert torch.equal(w, torch.zeros(4))


# -- the stream --------------------------------------------------------------------------
def test_one_device_steps_on_its_current_stream_several_on_their_default_streams():
    assert tcuda.choose_stream({0: 0x5a}) == 0x5a
    assert tcuda.choose_stream({1: 0}) == 0
    assert tcuda.choose_stream({0: 0, 1: 0, 3: 0}) == 0  # NULL: each device's legacy stream
    with pytest.raises(fo.FoError) as e:
        tcuda.choose_stream({0: 0, 1: 0xbeef})
    assert e.value.name == "FO_ERR_UNSUPPORTED"
    assert "devices [0, 1]" in e.value.message and "cuda:1 on stream 0xbeef" in e.value.message
    assert "cuda:0 on" not in e.value.message  # device 0 is on its default stream
    assert "one fo.torch optimizer per device" in e.value.message


class FakeStream:
    """torch.cuda.Stream's part fo.torch uses: the handle, and wait_stream (recorded)."""

    waits = []

    def __init__(self, device, handle):
        self.device, self.cuda_stream = device, handle

    def wait_stream(self, other):
        FakeStream.waits.append((self.cuda_stream, other.cuda_stream))

    def __eq__(self, other):
        return (self.device, self.cuda_stream) == (other.device, other.cuda_stream)

    __hash__ = None


class FakeFo:
    def __init__(self):
        self.calls = []

    def set_stream(self, stream):
        self.calls.append(stream)


class Holder(tcuda.Streams):
    """fo.torch's optimizer as the Streams mixin sees it."""

    def __init__(self, devices):
        self._fo, self._stream = FakeFo(), None
        self._device = {f"p{i}": d for i, d in enumerate(devices)}


@pytest.fixture
def current(monkeypatch):
    """{device: handle} read as torch.cuda.current_stream(device); 0 is the default stream."""
    now = {}
    monkeypatch.setattr(torch.cuda, "current_stream", lambda d: FakeStream(d, now.get(d, 0)))
    monkeypatch.setattr(torch.cuda, "default_stream", lambda d: FakeStream(d, 0))
    FakeStream.waits = []
    return now


def test_fo_is_told_the_stream_only_when_it_changed(current):
    h = Holder([-1, 0, 0])
    h._use_current_stream()
    assert h._fo.calls == [None]  # torch's default stream is the legacy one: NULL, said once
    h._use_current_stream()
    assert h._fo.calls == [None]
    current[0] = 0x77
    h._use_current_stream()
    h._use_current_stream()
    assert h._fo.calls == [None, 0x77]
    current[0] = 0x99
    h._use_current_stream()
    current[0] = 0
    h._use_current_stream()
    assert h._fo.calls == [None, 0x77, 0x99, None]


def test_an_optimizer_without_cuda_parameters_never_sets_a_stream(current):
    h = Holder([-1, -1])
    current[0] = 0x77
    h._use_current_stream()
    assert h._fo.calls == [] and h._stream is None


def test_several_devices_step_on_null_and_refuse_a_side_stream(current):
    h = Holder([0, 1, -1])
    h._use_current_stream()
    assert h._fo.calls == [None]
    current[1] = 0x42
    with pytest.raises(fo.FoError, match="cuda:1 on stream 0x42"):
        h._use_current_stream()
    assert h._fo.calls == [None]  # nothing changed


def test_a_parameter_on_another_device_takes_fo_back_to_null_before_it_is_registered(current):
    h = Holder([0])
    current[0] = 0x77
    h._use_current_stream()
    h._before_cuda_register(0)  # the stream's own device: nothing to do
    assert h._fo.calls == [0x77]
    h._before_cuda_register(1)  # fo refuses a device parameter off its stream's device
    assert h._fo.calls == [0x77, None] and h._stream[0] == 0
    h._device["q"] = 1
    h._before_cuda_register(2)  # already NULL: every device's
    assert h._fo.calls == [0x77, None]


def test_a_step_opened_on_another_stream_is_ordered_after_the_callers_by_events(current):
    h = Holder([0])
    current[0] = 0x10  # the stream a backward hook opened the step on
    h._use_current_stream()
    current[0] = 0x20  # the caller's at step()
    behind = h._order_after_current()
    assert FakeStream.waits == [(0x10, 0x20)]  # fo's stream waits for the gradients' stream
    h._order_current(behind)
    assert FakeStream.waits == [(0x10, 0x20), (0x20, 0x10)]  # then the caller's waits for fo's
    FakeStream.waits = []
    current[0] = 0x10
    h._order_current(h._order_after_current())
    assert FakeStream.waits == []  # the same stream: nothing to order


# -- arithmetic ----------------------------------------------------------------------------
def test_every_group_defaults_to_fast_whether_its_parameters_are_on_cuda_or_not(monkeypatch):
    a, b, c, d = (torch.nn.Parameter(torch.zeros(2)) for _ in range(4))
    monkeypatch.setattr(tcuda, "is_cuda", lambda p: p is a or p is d)  # stand-ins for CUDA parameters
    opt = fo.torch.AdamW([{"params": [a, b]}, {"params": [c]}, {"params": [c.new_zeros(1)], "arithmetic": None}])
    assert [g["arithmetic"] for g in opt.param_groups] == ["fast", "fast", "fast"]
    opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(1)), d]})
    assert opt.param_groups[-1]["arithmetic"] == "fast"
    assert opt.defaults["arithmetic"] == "fast" == fo.torch.DEFAULT_ARITHMETIC
    # a choice made is kept, by name or fo's code (exact's is 0: not taken for "no choice")
    opt = fo.torch.AdamW([a, b], arithmetic="exact")
    assert opt.param_groups[0]["arithmetic"] == "exact"
    opt = fo.torch.AdamW([a, b], arithmetic=_codes.FO_ARITHMETIC_EXACT)
    assert opt.param_groups[0]["arithmetic"] == "exact"
    opt = fo.torch.SGD([{"params": [a], "arithmetic": "fast"}, {"params": [b]}], arithmetic="exact")
    assert [g["arithmetic"] for g in opt.param_groups] == ["fast", "exact"]


# -- overlap and state -----------------------------------------------------------------------
@pytest.mark.parametrize("on_step_stream", [True, False])
def test_a_cuda_gradient_is_handed_over_by_its_hook_on_the_steps_stream_else_at_step(monkeypatch, on_step_stream):
    """A CUDA parameter's hook hands its gradient over where it runs on the step's stream,
    and leaves it for step() (grads_at_end) on another one; the result has overlap=False's
    bits either way. fc1.weight stands in for a CUDA parameter."""
    monkeypatch.setattr(tov, "_host_cores", lambda: 64)  # backward's threads leave fo cores
    ref_model, ref = build("adamw", False, max_grad_norm=0.5)
    model, opt = build("adamw", "always", max_grad_norm=0.5)
    monkeypatch.setattr(tov, "is_cuda", lambda p: p is model.fc1.weight)
    monkeypatch.setattr(opt, "_on_step_stream", lambda p: on_step_stream)
    train(ref_model, ref)
    stats = train(model, opt)
    assert_same_bits(snapshot(ref_model, ref), snapshot(model, opt))
    in_backward = 6 if on_step_stream else 5
    assert all(s["handed_over"] == 6 and s["handed_over_in_backward"] == in_backward for s in stats), stats


@pytest.mark.parametrize("bucket", [1 << 30, 5600, 1], ids=["one-bucket", "two-buckets", "each-alone"])
def test_cuda_gradients_go_over_in_buckets_and_the_rest_when_backward_ends(monkeypatch, bucket):
    """Hooks of CUDA parameters on the step's stream queue their gradients: a bucket of
    BUCKET_BYTES goes over in one grads_ready call, the rest when backward ends, so every
    gradient is handed over in backward, in fewer calls, with overlap=False's bits; a step
    skipped (zero_grad after backward) drops the queue. Net's trained parameters (6, 7588
    bytes) stand in for CUDA ones."""
    monkeypatch.setattr(tov, "_host_cores", lambda: 64)
    monkeypatch.setattr(tovc, "BUCKET_BYTES", bucket)
    ref_model, ref = build("adamw", False, max_grad_norm=0.5)
    model, opt = build("adamw", "always", max_grad_norm=0.5)
    trained = {id(p) for n, p in model.named_parameters() if not n.startswith("unused")}
    monkeypatch.setattr(tov, "is_cuda", lambda p: id(p) in trained)
    monkeypatch.setattr(opt, "_on_step_stream", lambda p: True)
    calls, real = [], tov._optim._grads_ready
    monkeypatch.setattr(tov._optim, "_grads_ready", lambda h, idx, arr, n: calls.append(n) or real(h, idx, arr, n))
    train(ref_model, ref)
    stats = train(model, opt)
    assert all(s["handed_over"] == 6 and s["handed_over_in_backward"] == 6 for s in stats), stats
    per_step = {1 << 30: [6], 5600: None, 1: [1] * 6}[bucket]
    if per_step is None:  # head and fc2 (5820 bytes, whichever of fc2's comes first), then fc1 at the end
        assert len(calls) == 6 and all(a + b == 6 and a >= 3 for a, b in zip(calls[::2], calls[1::2])), calls
    else:
        assert calls == per_step * 3, calls
    for m, o in ((ref_model, ref), (model, opt)):
        backward(m, 7)
        o.zero_grad()  # a skipped step: what was handed over is put back, the queue dropped
    assert not opt._cuda_queue
    train(ref_model, ref)
    train(model, opt)
    assert_same_bits(snapshot(ref_model, ref), snapshot(model, opt))


def test_a_cuda_gradient_queued_outside_backward_is_handed_over_at_once(monkeypatch):
    """No backward to end (a hook called directly): no final callback can be queued, so the
    gradient goes over at once rather than wait for a callback that never runs."""
    model, opt = build("adamw", "always")
    monkeypatch.setattr(tov, "is_cuda", lambda p: True)
    monkeypatch.setattr(opt, "_on_step_stream", lambda p: True)
    backward(model, 0)  # hands all six over, the last when backward ends
    assert len(opt._handed) == 6 and not opt._cuda_queue
    opt.zero_grad()  # dropped: nothing handed over now
    assert not opt._handed
    backward(model, 1)
    opt._settle_open()
    p = model.fc2.weight
    opt._from_backward(p, None)
    assert p in opt._handed and not opt._cuda_queue and not opt._cuda_callback
    opt.step()
    assert opt.last_step_stats["handed_over"] == 6


def test_the_steps_stream_is_the_one_fo_took_for_the_parameters_device(current):
    """`_on_step_stream`: the hook's current stream on the parameter's device against the
    one fo took there (fo's stream and its per-device torch streams, `_stream`)."""
    h = types.SimpleNamespace(_stream=(0x10, {0: FakeStream(0, 0x10)}))
    step_stream = tov.Overlap._on_step_stream
    current[0] = 0x10
    assert step_stream(h, on("cuda:0"))
    current[0] = 0x20  # a hook on another stream of that device
    assert not step_stream(h, on("cuda:0"))
    assert not step_stream(h, on("cuda:1"))  # a device fo took no stream of
    assert not step_stream(types.SimpleNamespace(_stream=None), on("cuda:0"))  # no CUDA parameter yet


def test_a_cuda_parameters_fp32_state_is_decoded_never_lent():
    """fo lends host fp32 state only; a CUDA parameter's state is read through host memory
    and moved to its device. Stood in for by marking a host parameter's device code."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(5))
    opt = fo.torch.AdamW([w], lr=1e-2, state_format="fp32")
    w.grad = torch.randn(5)
    opt.step()
    lent = opt.state[w]["exp_avg"]
    assert opt.state.is_live(w, "exp_avg", lent)  # the host parameter's: fo's own buffer
    want = lent.clone()
    opt._device[w] = 0
    got = opt._get(opt._index[w], "exp_avg", w)
    assert not opt.state.is_live(w, "exp_avg", got) and got.data_ptr() != lent.data_ptr()
    assert torch.equal(got, want)
