"""Trains a small regression model with the example extension (fo's AdamW, quant8 state, on
the model's own at::Tensor params), saves the state with fo_state_save, and hands the file to
torch.optim.AdamW through fo.ckpt.torch_state_dict. Exits non-zero if the loss does not fall
or the loaded state differs from the extension's.

    pip install . && pip install --no-build-isolation examples/torch_extension
    python examples/torch_extension/train.py [CKPT_DIR]
"""
import sys
import tempfile

import torch

import fo
import fo_torch_ext


def main(ckpt_dir):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))
    x = torch.randn(256, 16)
    y = (x[:, :4].sum(dim=1, keepdim=True) - x[:, 4:8].sum(dim=1, keepdim=True)).tanh()

    opt = fo_torch_ext.Optimizer("adamw", lr=1e-2, state_format="quant8", master_weight_bits=0)
    for name, p in model.named_parameters():
        opt.add_param(name, p)
    losses = []
    for step in range(60):
        for p in model.parameters():
            p.grad = None
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()  # each parameter's .grad, handed to fo as it is
        losses.append(loss.item())
        if step % 20 == 0:
            print(f"step {step:3d}  loss {losses[-1]:.4f}")
    print(f"step {len(losses) - 1:3d}  loss {losses[-1]:.4f}")
    if not losses[-1] < 0.5 * losses[0]:
        sys.exit(f"loss did not fall: {losses[0]:.4f} -> {losses[-1]:.4f}")

    opt.save(ckpt_dir, save_id=f"step{len(losses)}")
    torch_opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch_opt.load_state_dict(fo.ckpt.torch_state_dict(ckpt_dir))
    for i, p in enumerate(model.parameters()):
        if not torch.equal(torch_opt.state[p]["exp_avg"], opt.get_state(i, "exp_avg")):
            sys.exit(f"parameter {i}: torch's loaded exp_avg differs from the extension's")
    print(f"saved to {ckpt_dir}; torch.optim.AdamW loaded it (step {torch_opt.state[model[0].weight]['step'].item():.0f})")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="fo_ext_ckpt_"))
