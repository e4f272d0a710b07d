// The element-wise update rules of src/optim/math/rule/ (torch.rs, flash.rs), one element
// at a time. Two arithmetic contracts, chosen by `kind`:
// - torch (fp32 state): torch.optim's CPU arithmetic; `add(alpha=)` and `lerp` are fused
//   multiply-adds (fo_fma), everything else separately rounded.
// - flash (every compressed format): FlashOptim 0.1.4's kernels, no fused operation.
// - fast (arithmetic = fast, compressed formats; src/optim/math/rule/fast.rs): Adam with the
//   bias corrections folded into two scalars and fused multiply-adds; SGD and Lion with
//   torch's operations. Its states are coded by fo_fast.cuh (fo_rule_fast says which).
// The scalars (decay, bias corrections, ...) are computed once per tensor and step on the
// host, in fo's Rust `Rule::new`, and arrive here rounded to f32.
#pragma once
#include "fo_shim.cuh"

enum fo_rule_kind {
  FO_RULE_TORCH_ADAM = 0,
  FO_RULE_FLASH_ADAM = 1,
  FO_RULE_TORCH_SGD = 2,
  FO_RULE_FLASH_SGD = 3,
  FO_RULE_TORCH_LION = 4,
  FO_RULE_FLASH_LION = 5,
  FO_RULE_FAST_ADAM = 6,
  FO_RULE_FAST_SGD = 7,   // torch sgd's arithmetic, fast-coded state
  FO_RULE_FAST_LION = 8,  // torch lion's arithmetic, fast-coded state
};

// Whether the rule belongs to the fast arithmetic (its compressed states are coded the fast
// way, fo_fast.cuh).
FO_HD bool fo_rule_fast(int32_t kind) { return kind >= FO_RULE_FAST_ADAM; }

// Field use per kind (unused fields are 0):
//   torch adam: l2 decay w1 b2 w2 bc2_sqrt eps lr(= -lr/bc1)
//   flash adam: l2 decay b1 w1 b2 w2 bc1 bc2 eps lr
//   torch sgd:  l2 decay momentum wdamp lr(= -lr)      flash sgd: the same with lr
//   torch lion: decay b1 w1 b2 w2 lr(= -lr)            flash lion: the same with lr
//   fast adam:  l2 decay b1 w1 b2 w2 bc2_sqrt(= 1/sqrt(bc2)) eps lr(= lr/bc1)
//   fast sgd, fast lion: as torch sgd, torch lion
struct fo_rule {
  int32_t kind;
  int32_t has_l2;
  int32_t has_momentum;
  int32_t nesterov;
  float l2, decay, b1, w1, b2, w2, bc1, bc2, bc2_sqrt, eps, lr, momentum, wdamp;
};

FO_HD float fo_sign(float x) { return x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : 0.0f); }

// ATen's vectorized CPU lerp.
FO_HD float fo_lerp(float start, float end, float w) {
  float d = end - start;
  return fo_abs(w) < 0.5f ? fo_fma(w, d, start) : fo_fma(w - 1.0f, d, end);
}

// Updates one element: parameter *p from gradient g, states *m and *v (ignored where the
// rule has none). `first`: the momentum buffer was just created (SGD copies g). `root`:
// fast Adam's *v holds sqrt(v) in and out (quant8 state, fo_fast.cuh).
FO_HD void fo_rule_apply(const fo_rule& r, float* p, float g, float* m, float* v, bool first, bool root) {
  switch (r.kind) {
    case FO_RULE_FAST_ADAM: {
      float gi = r.has_l2 ? fo_fma(*p, r.l2, g) : g;
      float mi = fo_fma(gi, r.w1, *m * r.b1);
      float prev = root ? *v * *v : *v;
      float vi = fo_fma(gi * gi, r.w2, prev * r.b2);
      float rt = fo_sqrt(vi);
      float denom = fo_fma(rt, r.bc2_sqrt, r.eps);
      *p = fo_fma(*p, r.decay, -fo_div(r.lr * mi, denom));
      *m = mi;
      *v = root ? rt : vi;
      break;
    }
    case FO_RULE_TORCH_ADAM: {
      float gi = r.has_l2 ? fo_fma(*p, r.l2, g) : g;
      float pi = *p * r.decay;
      float mi = fo_lerp(*m, gi, r.w1);
      float vi = *v * r.b2 + (r.w2 * gi) * gi;
      float denom = fo_div(fo_sqrt(vi), r.bc2_sqrt) + r.eps;
      *p = pi + fo_div(r.lr * mi, denom);
      *m = mi;
      *v = vi;
      break;
    }
    case FO_RULE_FLASH_ADAM: {
      float gi = r.has_l2 ? g + *p * r.l2 : g;
      float mi = *m * r.b1 + gi * r.w1;
      float vi = *v * r.b2 + (gi * gi) * r.w2;
      float pi = *p * r.decay;
      *p = pi - fo_div(r.lr * fo_div(mi, r.bc1), fo_sqrt(fo_div(vi, r.bc2)) + r.eps);
      *m = mi;
      *v = vi;
      break;
    }
    case FO_RULE_TORCH_SGD:
    case FO_RULE_FAST_SGD: {
      float gi = r.has_l2 ? fo_fma(*p, r.l2, g) : g;
      float d = gi;
      if (r.has_momentum) {
        float b = first ? gi : fo_fma(gi, r.wdamp, *m * r.momentum);
        *m = b;
        d = r.nesterov ? fo_fma(b, r.momentum, gi) : b;
      }
      *p = fo_fma(d, r.lr, *p * r.decay);
      break;
    }
    case FO_RULE_FLASH_SGD: {
      float gi = r.has_l2 ? g + *p * r.l2 : g;
      float pi = *p * r.decay;
      if (r.has_momentum) {
        float b = first ? gi : *m * r.momentum + gi * r.wdamp;
        *m = b;
        *p = r.nesterov ? pi - (gi + r.momentum * b) * r.lr : pi - b * r.lr;
      } else {
        *p = pi - gi * r.lr;
      }
      break;
    }
    case FO_RULE_TORCH_LION:
    case FO_RULE_FAST_LION: {
      float u = fo_sign(fo_fma(g, r.w1, *m * r.b1));
      *p = fo_fma(u, r.lr, *p * r.decay);
      *m = fo_fma(g, r.w2, *m * r.b2);
      break;
    }
    default: {  // FO_RULE_FLASH_LION
      float u = fo_sign(*m * r.b1 + g * r.w1);
      *m = *m * r.b2 + g * r.w2;
      *p = *p * r.decay - u * r.lr;
      break;
    }
  }
}
