"""CUDA parameters in fo.torch's overlapped step (fo._torch_overlap): they step early on
their GPU. The step's stream is the one current where the first hook ran (FSDP2 calls the
hooks on its post-reduce stream; a plain backward on the stream of the op that made the
gradient). A hook on another stream leaves its gradient for `step()`. Gradients handed over
on the step's stream get their steps queued by fo on a stream of its own that waits for the
work queued on the step's stream so far (their producers) and for nothing after, so the
steps run beside the rest of backward; their undo records (parameter and state bytes) are
device memory until `step()`, counted in `undo_budget_bytes`. An offloaded CUDA parameter
(`offload=`) is handed over the same way and steps on fo's pool instead, its gradient
brought down on the device's down lane.

They are handed over in buckets. Each hand-over is one call into fo, which queues an undo
record per parameter, an event the lane waits on, the step table's upload and a kernel
launch. On an H200 (fo.torch, 24 bf16 Linear(2048) layers, 100.7M parameters, batch 32,
2026-11-28) handing the 48 gradients over one at a time took 3.5-4.1 ms of host time in
`grads_ready` and 5.3-6.4 ms in the hooks per iteration; in a backward that is bound by how
fast the host queues its kernels, that delays the GPU (iteration 10.6-12.2 ms). So a hook
on the step's stream queues its gradient, and the queue is handed over in one call once it
holds `BUCKET_BYTES` of parameters (as DDP buckets its all-reduces) and, for the rest, when
backward ends (an autograd final callback, as FSDP2 queues its own): every gradient is
still handed over in backward, behind the work that made it, and the step has the same
bits. There, 32 MiB buckets (6 calls) took 2.2-2.9 ms in `grads_ready` and one bucket at the
end 1.8-2.2 ms (iteration 8.0-10.6 and 7.4-8.7 ms; without overlap 4.9-5.4), before a
record became two copies instead of six (src/optim/overlap/device_early.rs). A gradient
handed over and changed again (a second backward) goes through the single hand-over, which
puts the early steps back and raises (fo._torch_overlap._hand_over_many)."""
import weakref

import torch

# The parameter bytes a bucket collects before it is handed over: DDP's default bucket is 25 MiB.
BUCKET_BYTES = 32 << 20


def _at_backward_end(ref):
    @torch.compiler.disable  # run by autograd at the end of backward, eagerly: never traced
    def flush():
        opt = ref()
        if opt is not None:
            opt._cuda_callback = False
            opt._flush_cuda()
    return flush


class CudaBuckets:
    """Mixed into fo._torch_overlap's `Overlap` (which provides `_handed`, `_hand_over`,
    `_hand_over_many`, `_in_backward` and `_stream`)."""

    def _cuda_init(self):
        self._cuda_queue = {}  # CUDA parameter -> None, in hook order: not handed over yet
        self._cuda_bytes = 0
        self._cuda_callback = False  # a flush is queued for the end of this backward

    def _on_step_stream(self, p):
        """Whether the stream current on CUDA parameter p's device is the step's: the one
        fo orders p's early step after (its gradient's producer). FSDP2 calls the hooks on
        its post-reduce stream, a plain backward on the stream of the op that made the
        gradient; a hook on any other stream leaves the gradient for `step()`, which
        orders fo's stream after the caller's."""
        step = (self._stream[1] if self._stream is not None else {}).get(p.device.index)
        return step is not None and step == torch.cuda.current_stream(p.device.index)

    def _queue_cuda(self, p):
        """A hook on the step's stream: queues p's gradient (a bucket full is handed over)."""
        if p in self._handed:  # a second backward: the single hand-over sees what changed
            self._flush_cuda()
            if self._hand_over(p):
                self._in_backward += 1
            return
        if p in self._cuda_queue:
            return  # still queued: its gradient accumulates in place
        self._cuda_queue[p] = None
        self._cuda_bytes += p.numel() * p.element_size()
        if not self._cuda_callback:
            try:
                torch.autograd.Variable._execution_engine.queue_callback(_at_backward_end(weakref.ref(self)))
                self._cuda_callback = True
            except RuntimeError:  # not inside a backward (the hook called directly): no bucket
                self._flush_cuda()
                return
        if self._cuda_bytes >= BUCKET_BYTES:
            self._flush_cuda()

    def _flush_cuda(self):
        """Hands the queued gradients over in one call (they step early on the GPU)."""
        ps = list(self._cuda_queue)
        self._drop_cuda_queue()
        if ps:
            self._in_backward += self._hand_over_many(ps)

    def _drop_cuda_queue(self):
        """Forgets the queue (`step()` hands every gradient over itself; a failed or dropped
        step hands nothing)."""
        self._cuda_queue, self._cuda_bytes = {}, 0
