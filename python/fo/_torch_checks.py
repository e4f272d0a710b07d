"""torch's own constructor checks for fo.torch's optimizers: the same conditions, in the
same order, with torch's exception types and wording (torch/optim/adam.py and sgd.py of
torch 2.15; `torch.testing._internal.common_optimizers`' error inputs are tested against
them). They run first in each constructor, as torch's do before `Optimizer.__init__`, so a
bad hyper-parameter fails where it is written, not as an FoError at the first step (fo
builds its handle lazily). Lion, which torch lacks, gets Adam's checks that apply to it.

fo's own arguments (`state_format`, `arithmetic`) are checked here too, and torch's message
for a sparse gradient is written here.

Only `fo.torch` imports this module (it needs torch)."""
from torch import Tensor

from .optim import ARITHMETIC, STATE_FORMATS


def _tensor_lr(lr, foreach, capturable):
    if isinstance(lr, Tensor):
        if foreach and not capturable:
            raise ValueError("lr as a Tensor is not supported for capturable=False and foreach=True")
        if lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")


def _betas_in_range(betas):
    # Written as torch writes it: a NaN fails `not 0.0 <= b < 1.0`.
    for i in (0, 1):
        if not 0.0 <= betas[i] < 1.0:
            raise ValueError(f"Invalid beta parameter at index {i}: {betas[i]}")


def adam(lr, betas, eps, weight_decay, foreach=None, capturable=False):
    """torch.optim.Adam's (and so AdamW's) checks."""
    _tensor_lr(lr, foreach, capturable)
    if not 0.0 <= lr:
        raise ValueError(f"Invalid learning rate: {lr}")
    if not 0.0 <= eps:
        raise ValueError(f"Invalid epsilon value: {eps}")
    _betas_in_range(betas)
    if not 0.0 <= weight_decay:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")
    if not ((isinstance(betas[0], float) and isinstance(betas[1], float))
            or (isinstance(betas[0], Tensor) and isinstance(betas[1], Tensor))):
        raise ValueError("betas must be either both floats or both Tensors")
    for i in (0, 1):
        if isinstance(betas[i], Tensor):
            if not capturable and foreach:
                raise ValueError(f"betas[{i}] as a Tensor is not supported for capturable=False and foreach=True")
            if betas[i].numel() != 1:
                raise ValueError(f"Tensor betas[{i}] must be 1-element")


def sgd(lr, momentum, dampening, weight_decay, nesterov):
    """torch.optim.SGD's checks (`lr < 0.0`, as torch writes it: unlike Adam's, a NaN passes
    here, and fo refuses it at the first step)."""
    if isinstance(lr, Tensor) and lr.numel() != 1:
        raise ValueError("Tensor lr must be 1-element")
    if lr < 0.0:
        raise ValueError(f"Invalid learning rate: {lr}")
    if momentum < 0.0:
        raise ValueError(f"Invalid momentum value: {momentum}")
    if weight_decay < 0.0:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError("Nesterov momentum requires a momentum and zero dampening")


def lion(lr, betas, weight_decay):
    """Adam's checks that mean something for Lion: a Tensor lr has one element, lr >= 0,
    0 <= betas < 1 (either may be 0: Lion interpolates with both), weight_decay >= 0."""
    if isinstance(lr, Tensor) and lr.numel() != 1:
        raise ValueError("Tensor lr must be 1-element")
    if not 0.0 <= lr:
        raise ValueError(f"Invalid learning rate: {lr}")
    _betas_in_range(betas)
    if not 0.0 <= weight_decay:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")


def unexpected(kind, names):
    """The TypeError Python gives `kind.__init__` for an unknown keyword, for keywords that
    fo.torch's constructors collect in **flags before knowing them."""
    if names:
        raise TypeError(f"{kind}.__init__() got an unexpected keyword argument {names[0]!r}")


def arithmetic_code(value):
    """fo's code for an arithmetic given by name ("exact"/"fast") or code."""
    code = ARITHMETIC.get(value, value) if isinstance(value, str) else int(value)
    if code not in ARITHMETIC.values():
        raise ValueError(f"arithmetic {value!r} is not one of {sorted(ARITHMETIC)}")
    return code


def arithmetic_name(value, default):
    """The name param_groups show ("exact"/"fast") for a name or fo code; None: `default`."""
    if value is None:
        return default
    code = arithmetic_code(value)
    return next(k for k, v in ARITHMETIC.items() if v == code)


def state_format(value):
    if not isinstance(value, str) or value not in STATE_FORMATS:
        raise ValueError(f"state_format {value!r} is not one of {sorted(STATE_FORMATS)}")


def sparse_message(opt, name):
    kind = type(opt).__name__
    if kind == "SGD":
        return (f"fo.torch.SGD does not support sparse gradients (parameter {name}); torch.optim.SGD "
                "does, or densify the gradient (grad.to_dense())")
    return (f"{kind} does not support sparse gradients (parameter {name}), please consider SparseAdam "
            "instead")
