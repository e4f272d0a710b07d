"""fo.torch's step under `torch.compile`: one opaque custom op, `fo::step`, as torch's own
fused optimizers are one aten op (`_fused_adamw_`) in the graph.

Dynamo cannot trace fo's step (ctypes calls, data pointer comparisons), and a graph break
there warns. While Dynamo traces, `step` calls only this op; the op runs the ordinary eager
step when the compiled graph executes, so hyper-parameters an lr scheduler writes into
`param_groups` take effect without recompiling, and `torch.compile(opt.step,
fullgraph=True)` compiles. The op mutates one tensor the compiler can see (a step counter
owned by the optimizer), which keeps it ordered and never dead-code eliminated; the
parameters it updates in place are the optimizer's own, as in eager mode, so a graph that
reads parameters after the step must not be reordered around it (the step is its own graph
in a training loop: backward graph-breaks before it).

Only `fo.torch` imports this module (it needs torch)."""
import itertools
import weakref

import torch

_LIVE = weakref.WeakValueDictionary()  # key -> optimizer, for the op to find its optimizer
_KEYS = itertools.count()


def is_compiling():
    return torch.compiler.is_compiling()


def register(opt):
    """A fresh key for `opt`; its step counter is created here, outside any trace."""
    key = next(_KEYS)
    _LIVE[key] = opt
    opt._compile_counter = torch.zeros((), dtype=torch.int64)
    return key


@torch.library.custom_op("fo::step", mutates_args=("counter",))
def _step_op(counter: torch.Tensor, key: int) -> None:
    opt = _LIVE.get(key)
    if opt is None:
        raise RuntimeError(f"fo::step: the fo.torch optimizer with key {key} no longer exists")
    with torch.no_grad():
        opt._step()
    counter.add_(1)


@_step_op.register_fake
def _(counter, key):
    return None


def step(opt, closure):
    """What `step` does while Dynamo traces it."""
    loss = None
    if closure is not None:
        with torch.enable_grad():
            loss = closure()
    _step_op(opt._compile_counter, opt._compile_key)
    return loss
