"""fo.torch under Hugging Face's Trainer, as its users run it (issue 33): the default
max_grad_norm=1.0 clips the gradients between backward and step(), gradient accumulation runs
without no_handover(), and a run resumed from a checkpoint must continue the uninterrupted one.
With overlap="always" (and overlap=True, measured) every case must end with overlap=False's
bits. A tiny GPT-2 built from a config (no download), on the host."""
import warnings

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
import fo.torch  # noqa: E402


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n=64, length=16, vocab=64):
        g = torch.Generator().manual_seed(7)
        self.ids = torch.randint(0, vocab, (n, length), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def model():
    transformers.set_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(cfg)


def train(tmp_path, overlap, accumulation=1, max_steps=6, save_steps=None, resume=None, m=None, clip=None):
    """`clip`: the Trainer's max_grad_norm 0 and the optimizer's `clip` (None: the Trainer's
    default, 1.0)."""
    m = m or model()
    opt = fo.torch.AdamW(m.parameters(), lr=1e-3, weight_decay=0.0, state_format="fp32", overlap=overlap,
                         max_grad_norm=clip)
    extra = {} if clip is None else {"max_grad_norm": 0.0}
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=max_steps, per_device_train_batch_size=4,
        gradient_accumulation_steps=accumulation, learning_rate=1e-3, seed=0, data_seed=0,
        save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500, report_to=[],
        logging_strategy="no", use_cpu=True, dataloader_num_workers=0, disable_tqdm=True, **extra)
    trainer = transformers.Trainer(model=m, args=args, train_dataset=Tokens(), optimizers=(opt, None))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train(resume_from_checkpoint=resume)
    return [p.detach().clone() for p in m.parameters()], opt


def same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("overlap", ["always", True])
@pytest.mark.parametrize("accumulation", [1, 2])
def test_trainer_with_its_default_clipping_and_accumulation_matches_overlap_false(tmp_path, accumulation, overlap):
    ref, _ = train(tmp_path / "ref", False, accumulation)
    got, opt = train(tmp_path / "overlap", overlap, accumulation)
    assert same(ref, got)
    assert opt.last_step_stats is not None


def test_trainer_resumed_from_a_checkpoint_continues_the_uninterrupted_run(tmp_path):
    ref, _ = train(tmp_path / "ref", True, max_steps=6)
    train(tmp_path / "first", True, max_steps=6, save_steps=3)
    resumed, _ = train(tmp_path / "first", True, max_steps=6, resume=str(tmp_path / "first" / "checkpoint-3"))
    assert same(ref, resumed)


def test_trainer_clipping_through_the_optimizer_keeps_overlapping(tmp_path):
    # The advice fo's warning gives: the Trainer still "clips" by inf (multiplies every
    # gradient by 1.0 in place), which fo sees leaves the bits alone: the early steps stand.
    ref, _ = train(tmp_path / "ref", False, clip=1.0, max_steps=8)
    got, opt = train(tmp_path / "overlap", "always", clip=1.0, max_steps=8)
    assert same(ref, got)
    assert opt._deferred is None
    assert opt.last_step_stats["handed_over_in_backward"] > 0 and opt.last_step_stats["redone"] is None
