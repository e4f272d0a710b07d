"""GradScaler's part of fo.torch's `step()`, mixed into fo._torch_overlap's `Overlap`.

fo.torch's optimizers set `_step_supports_amp_scaling`, so `GradScaler.step(opt)` does not
unscale the gradients itself: it sets `opt.grad_scale` (None if `unscale_` already ran) and
`opt.found_inf` and calls `step()`. Unscaling here is the same op with the same factor as
`GradScaler.unscale_`, so the bits are those of torch's own flow; and fo knows the gradients
changed (that op leaves `_version` alone, so no edit check could see it)."""
import torch


class GradScaling:
    """Needs `_settle_open`, `_names` and `_unscaled` (fo._torch_overlap's `Overlap`)."""

    def _grad_scaler_step(self):
        """GradScaler's part of `step()`: False if the step is skipped (inf/NaN gradients,
        any open step rolled back), else True with the gradients unscaled."""
        found_inf = getattr(self, "found_inf", None)
        if found_inf is None:
            return True
        if float(found_inf) > 0:
            self._settle_open()
            return False
        scale = getattr(self, "grad_scale", None)
        if scale is not None:
            inv_scale = scale.double().reciprocal().float()
            groups = {}
            for _, p, _ in self._names():
                if p.grad is not None:
                    groups.setdefault((p.grad.device, p.grad.dtype), []).append(p.grad)
            dummy = torch.zeros((), dtype=torch.float32, device=inv_scale.device)
            for (device, _), grads in groups.items():
                torch._amp_foreach_non_finite_check_and_unscale_(grads, dummy.to(device), inv_scale.to(device))
        # with scale None, GradScaler.unscale_ already unscaled them in place
        self._unscaled = True
        return True
