"""fo.torch's CUDA parameters: device codes, the stream fo steps on, and the arithmetic a
group of CUDA parameters defaults to.

fo's C ABI steps device tensors where they lie (`fo_tensor.device` = the CUDA ordinal): a
CUDA parameter's state lives on its device, its kernels are queued on the optimizer's
stream (`fo_optimizer_set_stream`), and state reads and writes stage through host memory
after waiting for that stream. fo takes one stream per optimizer, of one device (or NULL:
each device's legacy default stream). So:
- at every `step()`, a CUDA parameter steps on `torch.cuda.current_stream(device)` of its
  device, as torch's own optimizers queue their kernels; fo is told only when that
  stream changed (the C layer orders the new stream after the old with an event);
- parameters on several CUDA devices in one optimizer step on NULL, which is every
  device's legacy default stream, and that is only right when each device's current
  stream is its default stream (torch's, `cuda_stream == 0`); otherwise the step is
  refused, naming the devices and streams: use one optimizer per device, or step on the
  default streams. Host parameters take no stream: an optimizer without CUDA parameters
  never calls `fo_optimizer_set_stream`.

Both arithmetics step CUDA parameters with the host's bits (fo_fast.cuh holds the fast
one's coding; `fo selftest` on an H200, 2026-11-28), and every param group defaults to
fo.torch's `"fast"`, wherever its parameters step.

Only `fo.torch` imports this module (it needs torch)."""
import torch

from . import optim as _optim
from ._codes import FO_DEVICE_HOST
from ._ffi import FoError
from ._torch_args import UNSUPPORTED, error, local



_SUPPORT = []  # [None, or the FoError of a libfo that cannot step CUDA tensors], probed once


def device_support():
    """None where the loaded libfo steps CUDA tensors (a `cuda` build with a driver), else the
    FoError it refuses a stream with, which says what is missing (asked of a scratch
    optimizer, once per process)."""
    if not _SUPPORT:
        opt = _optim.Optimizer("adamw")
        try:
            opt.set_stream(None)
            _SUPPORT.append(None)
        except FoError as e:
            _SUPPORT.append(e)
        finally:
            opt.close()
    return _SUPPORT[0]


def is_cuda(p):
    """Whether p's memory (a DTensor's local shard) is on a CUDA device."""
    return local(p).device.type == "cuda"


def choose_stream(current):
    """The stream handle fo steps on (0: NULL, each device's legacy default stream) given
    `current` = {device ordinal: the cuda_stream handle of torch's current stream there},
    for the devices that hold this optimizer's CUDA parameters (at least one). One device:
    its current stream. Several: NULL, and only when every current stream is the default
    one (handle 0), since fo queues on one stream per optimizer."""
    if len(current) == 1:
        return next(iter(current.values()))
    if all(h == 0 for h in current.values()):
        return 0
    busy = ", ".join(f"cuda:{d} on stream {h:#x}" for d, h in sorted(current.items()) if h)
    raise error(UNSUPPORTED, f"this optimizer holds CUDA parameters on devices {sorted(current)}, and fo steps "
                             f"them on one stream, which for several devices is each one's default stream; "
                             f"the current stream is not the default on {busy}. Step on the default streams, "
                             f"or use one fo.torch optimizer per device")


class Streams:
    """Mixed into fo.torch's optimizers (which provide `_fo`, `_device`, `_stream`): keeps
    fo's stream the current one of the CUDA parameters' device at each step."""

    def _cuda_devices(self):
        return sorted({d for d in self._device.values() if d != FO_DEVICE_HOST})

    def _before_cuda_register(self, device):
        """A CUDA parameter on `device` is about to be registered: fo refuses a device
        parameter off the stream's device, so a stream of another device goes back to
        NULL first (the next step picks the stream again)."""
        if self._stream is not None and self._stream[0] and device not in self._stream[1]:
            self._set_fo_stream(0, {d: torch.cuda.default_stream(d) for d in self._cuda_devices() + [device]})

    def _set_fo_stream(self, handle, streams):
        self._fo.set_stream(handle or None)
        # fo orders the next stream after this one with an event recorded on it, so it must
        # stay valid: holding torch's Stream objects keeps an external stream alive.
        self._stream = (handle, streams)

    def _current_streams(self):
        """{device: torch's current stream there} for the CUDA parameters' devices."""
        return {d: torch.cuda.current_stream(d) for d in self._cuda_devices()}

    def _use_current_stream(self):
        """Before a step: fo's stream becomes the current one (changed only when it
        changed). Nothing for an optimizer without CUDA parameters."""
        current = self._current_streams()
        if not current:
            return
        handle = choose_stream({d: s.cuda_stream for d, s in current.items()})
        if self._stream is None or self._stream[0] != handle:
            self._set_fo_stream(handle, current)

    def _order_after_current(self):
        """An overlapped step opened in a backward hook took the stream current there; if
        the caller's current stream at `step()` is another, fo's stream waits for it (the
        gradients are ordered on it) and, after the step, it waits for fo's (events, no
        host synchronize). Returns the streams to order after fo's, for `_order_current`."""
        current = self._current_streams()
        if not current or self._stream is None:
            return {}
        fo_streams = self._stream[1]
        behind = {d: s for d, s in current.items() if fo_streams.get(d) is not None and fo_streams[d] != s}
        for d, s in behind.items():
            fo_streams[d].wait_stream(s)
        return behind

    def _order_current(self, behind):
        for d, s in behind.items():
            s.wait_stream(self._stream[1][d])
