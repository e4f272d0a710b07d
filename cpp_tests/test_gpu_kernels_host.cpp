// The GPU kernels' host build (src/kernels/gpu, compiled here by the C++ compiler
// with -ffp-contract=off through the shim header) against libfo's CPU step, bit for bit:
// every rule x state format x param dtype x master bits x grad dtype, from the same
// inputs (random values over 1e-30..1e5 with zeros and subnormals; the oracle
// trajectories' inits and gradients), several steps, comparing parameters, states
// (f32, 16-bit, int8 codes and fp16 scales) and error bits after every step.
#include <nlohmann/json.hpp>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "check.hpp"
#include "fo_step.cuh"

namespace {

enum { F32 = 0, F16 = 1, BF16 = 2, I8 = 4, U8 = 5, I16 = 6 };
size_t dsize(int32_t d) { return d == F32 ? 4 : (d == I8 || d == U8) ? 1 : 2; }

// fo's Rule::new (src/optim/math/rule/mod.rs) in C++: the scalars a launch passes per tensor.
fo_rule make_rule(const fo_optim_config& c, uint64_t step) {
  fo_rule r{};
  bool torch = c.state_format == 0;
  bool decoupled = c.algorithm == 0 || c.algorithm == 3 || c.algorithm == 4;
  r.has_l2 = !decoupled && c.weight_decay != 0.0;
  r.l2 = (float)c.weight_decay;
  double da = decoupled ? (c.decouple_lr ? c.weight_decay * (c.lr / c.initial_lr) : c.weight_decay * c.lr) : 0.0;
  double s = (double)step;
  float b1f = (float)c.beta1, b2f = (float)c.beta2;
  if (torch) {
    r.decay = (float)(1.0 - da);
  } else {
    r.decay = 1.0f - (float)da;
  }
  switch (c.algorithm) {
    case 0:
    case 1:
      if (torch) {
        double bc1 = 1.0 - std::pow(c.beta1, s), bc2 = 1.0 - std::pow(c.beta2, s);
        r.kind = FO_RULE_TORCH_ADAM;
        r.w1 = (float)(1.0 - c.beta1), r.b2 = b2f, r.w2 = (float)(1.0 - c.beta2);
        r.bc2_sqrt = (float)std::sqrt(bc2), r.eps = (float)c.eps, r.lr = (float)(-(c.lr / bc1));
      } else {
        r.kind = FO_RULE_FLASH_ADAM;
        r.b1 = b1f, r.w1 = 1.0f - b1f, r.b2 = b2f, r.w2 = 1.0f - b2f;
        r.bc1 = 1.0f - (float)std::pow((double)b1f, s), r.bc2 = 1.0f - (float)std::pow((double)b2f, s);
        r.lr = (float)c.lr, r.eps = (float)c.eps;
      }
      break;
    case 2:
    case 3:
      r.kind = torch ? FO_RULE_TORCH_SGD : FO_RULE_FLASH_SGD;
      r.has_momentum = c.momentum != 0.0;
      r.momentum = (float)c.momentum, r.wdamp = (float)(1.0 - c.dampening), r.nesterov = c.nesterov;
      r.lr = torch ? (float)(-c.lr) : (float)c.lr;
      break;
    default:
      r.kind = torch ? FO_RULE_TORCH_LION : FO_RULE_FLASH_LION;
      r.b1 = b1f, r.b2 = b2f;
      r.w1 = torch ? (float)(1.0 - c.beta1) : 1.0f - b1f;
      r.w2 = torch ? (float)(1.0 - c.beta2) : 1.0f - b2f;
      r.lr = torch ? (float)(-c.lr) : (float)c.lr;
  }
  return r;
}

// One parameter's buffers on the kernel side (the "device" copy) and on libfo's side.
struct Param {
  std::vector<int64_t> shape;
  size_t numel = 0;
  std::string fo_bytes, k_bytes;           // parameter as libfo and as the kernel hold it
  std::string m, v, m_scales, v_scales, err;  // kernel-side state
  int32_t m_kind = FO_MOMENT_NONE, v_kind = FO_MOMENT_NONE;
  uint64_t step = 0;
};

struct Combo {
  fo_optim_config cfg;
  int32_t pdtype, gdtype;
  std::string name;
};


std::string encode(int32_t d, const std::vector<float>& x) {
  std::string out(x.size() * dsize(d), '\0');
  for (size_t i = 0; i < x.size(); ++i) {
    if (d == F32) {
      std::memcpy(&out[4 * i], &x[i], 4);
    } else {
      uint16_t b = fo_f32_to_half(d, x[i]);
      std::memcpy(&out[2 * i], &b, 2);
    }
  }
  return out;
}

// Values spanning the dtype's range: zeros, subnormals, 1e-30..1e5 (narrower for f16).
std::vector<float> random_values(std::mt19937_64& rng, size_t n, int32_t d) {
  std::uniform_real_distribution<double> u(0.0, 1.0);
  double lo = d == F16 ? -7.0 : -30.0, hi = d == F16 ? 3.0 : 5.0;
  float sub = d == F32 ? 3e-41f : d == BF16 ? 5e-39f : 3e-6f;
  std::vector<float> x(n);
  for (size_t i = 0; i < n; ++i) {
    double k = u(rng), sign = u(rng) < 0.5 ? -1.0 : 1.0;
    if (k < 0.08)
      x[i] = 0.0f;
    else if (k < 0.14)
      x[i] = (float)(sign * sub * (1.0 + 3.0 * u(rng)));
    else if (k < 0.6)
      x[i] = (float)(sign * std::pow(10.0, -3.0 + 3.0 * u(rng)));  // the usual scale
    else
      x[i] = (float)(sign * std::pow(10.0, lo + (hi - lo) * u(rng)));
  }
  return x;
}

// Runs `steps` steps of one combination on libfo and on the host-built kernel and
// compares every buffer bit for bit after each step. Returns the mismatch count.
struct Runner {
  Combo c;
  std::vector<Param> ps;
  fo_optimizer* opt = nullptr;

  Runner(const Combo& combo, const std::vector<std::vector<int64_t>>& shapes, const std::vector<std::vector<float>>& init)
      : c(combo) {
    CHECK_OK(fo_optimizer_create(&c.cfg, &opt));
    ps.resize(shapes.size());
    for (size_t i = 0; i < shapes.size(); ++i) {
      Param& p = ps[i];
      p.shape = shapes[i];
      p.numel = init[i].size();
      p.fo_bytes = p.k_bytes = encode(c.pdtype, init[i]);
      fo_tensor t{p.fo_bytes.empty() ? nullptr : &p.fo_bytes[0], c.pdtype, (int32_t)p.shape.size(), p.shape.data(),
                  nullptr, -1};
      int32_t idx = -1;
      CHECK_OK(fo_optimizer_add_param(opt, ("p" + std::to_string(i)).c_str(), &t, nullptr, &idx));
      alloc_state(p);
    }
  }
  ~Runner() { fo_optimizer_destroy(opt); }

  bool has_m() const { return c.cfg.algorithm != 2 && c.cfg.algorithm != 3 ? true : c.cfg.momentum != 0.0; }
  bool has_v() const { return c.cfg.algorithm <= 1; }

  void alloc_state(Param& p) {
    size_t n = p.numel, groups = (n + 31) / 32;
    int32_t fmt = c.cfg.state_format;
    int32_t plain = (fmt == 1 && c.pdtype == F16) ? FO_MOMENT_F16 : (fmt == 1 && c.pdtype == BF16) ? FO_MOMENT_BF16
                                                                                                 : FO_MOMENT_F32;
    auto bytes = [&](int32_t k) { return k == FO_MOMENT_F32 ? 4 * n : k <= FO_MOMENT_BF16 ? 2 * n : n; };
    if (has_m()) p.m_kind = fmt >= 2 ? FO_MOMENT_Q8_SIGNED : plain;
    if (has_v()) p.v_kind = fmt == 2 ? FO_MOMENT_Q8_SQRT : fmt == 3 ? FO_MOMENT_Q8_FOURTH : plain;
    if (p.m_kind) p.m.assign(bytes(p.m_kind), '\0');
    if (p.v_kind) p.v.assign(bytes(p.v_kind), '\0');
    if (fmt >= 2) p.m_scales.assign(2 * groups, '\0');
    if (fmt >= 2 && has_v()) p.v_scales.assign(2 * groups, '\0');
    p.err.assign(n * (c.cfg.master_weight_bits / 8 - 2 * (c.cfg.master_weight_bits != 0)), '\0');
  }

  static void* ptr(std::string& s) { return s.empty() ? nullptr : &s[0]; }

  // One step from `grads` (f32 values, encoded to the grad dtype; empty = no gradient).
  int step(const std::vector<std::vector<float>>& grads) {
    std::vector<std::string> g(ps.size());
    std::vector<fo_tensor> gt(ps.size());
    // One launch per step count (the rule's scalars and SGD's `first` go with the launch).
    std::map<uint64_t, std::pair<std::vector<fo_step_tensor>, uint64_t>> launches;
    for (size_t i = 0; i < ps.size(); ++i) {
      Param& p = ps[i];
      gt[i] = fo_tensor{nullptr, c.gdtype, (int32_t)p.shape.size(), p.shape.data(), nullptr, -1};
      if (grads[i].empty() && p.numel > 0) continue;
      g[i] = encode(c.gdtype, grads[i]);
      gt[i].data = g[i].empty() ? (void*)&gt[i] : &g[i][0];  // non-null: a (possibly empty) gradient
      p.step += 1;
      if (p.numel == 0) continue;
      fo_step_tensor t{};
      t.param = ptr(p.k_bytes), t.grad = ptr(g[i]), t.error_bits = ptr(p.err);
      t.m = ptr(p.m), t.m_scales = (uint16_t*)ptr(p.m_scales), t.v = ptr(p.v), t.v_scales = (uint16_t*)ptr(p.v_scales);
      auto& [table, groups] = launches[p.step];
      t.numel = p.numel, t.group_begin = groups, t.param_dtype = c.pdtype, t.grad_dtype = c.gdtype;
      t.error_bits_width = c.cfg.master_weight_bits == 24 ? 8 : c.cfg.master_weight_bits == 32 ? 16 : 0;
      t.m_kind = p.m_kind, t.v_kind = p.v_kind;
      table.push_back(t);
      groups += (p.numel + 31) / 32;
    }
    CHECK_OK(fo_optimizer_step(opt, gt.data(), gt.size()));
    // A small grid of whole warps (6), so the grid-stride loop and the table search both
    // get exercised.
    for (auto& [step, launch] : launches) {
      auto& [table, groups] = launch;
      fo_rule rule = make_rule(c.cfg, step);
      int32_t first = step == 1;
      fo_host_launch(3, 64, [&] { fo_step_kernel(table.data(), (int)table.size(), groups, rule, first); });
    }
    return compare();
  }

  int compare_key(size_t i, const char* key, int32_t dtype, const std::string& want) {
    if (want.empty()) return 0;
    std::string got(want.size(), '\0');
    std::vector<int64_t> shape = {(int64_t)(want.size() / dsize(dtype))};
    if (std::string(key).find("scales") == std::string::npos) shape = ps[i].shape;
    fo_tensor out{&got[0], dtype, (int32_t)shape.size(), shape.data(), nullptr, -1};
    CHECK_OK(fo_optimizer_get_state(opt, (int32_t)i, key, &out));
    int bad = 0;
    size_t w = dsize(dtype);
    for (size_t j = 0; j < want.size(); j += w) bad += std::memcmp(&got[j], &want[j], w) != 0;
    if (bad) fo_test::fail(__FILE__, __LINE__, c.name + " p" + std::to_string(i) + " " + key + ": " + std::to_string(bad) + " elements differ");
    return bad;
  }

  int compare() {
    int bad = 0;
    for (size_t i = 0; i < ps.size(); ++i) {
      Param& p = ps[i];
      size_t w = dsize(c.pdtype);
      int pb = 0;
      for (size_t j = 0; j < p.fo_bytes.size(); j += w) pb += std::memcmp(&p.fo_bytes[j], &p.k_bytes[j], w) != 0;
      if (pb) fo_test::fail(__FILE__, __LINE__, c.name + " p" + std::to_string(i) + " param: " + std::to_string(pb) + " elements differ");
      bad += pb;
      if (p.step == 0 || p.numel == 0) continue;
      const char* mname = c.cfg.algorithm == 2 || c.cfg.algorithm == 3 ? "momentum_buffer" : "exp_avg";
      auto moment = [&](const char* name, int32_t kind, const std::string& data, const std::string& scales) {
        std::string n(name);
        if (kind == FO_MOMENT_Q8_SIGNED || kind >= FO_MOMENT_Q8_SQRT) {
          bad += compare_key(i, (n + "::quantized").c_str(), kind == FO_MOMENT_Q8_SIGNED ? I8 : U8, data);
          bad += compare_key(i, (n + "::scales").c_str(), F16, scales);
        } else if (kind) {
          bad += compare_key(i, name, kind == FO_MOMENT_F32 ? F32 : kind == FO_MOMENT_F16 ? F16 : BF16, data);
        }
      };
      moment(mname, p.m_kind, p.m, p.m_scales);
      moment("exp_avg_sq", p.v_kind, p.v, p.v_scales);
      if (!p.err.empty()) bad += compare_key(i, "error_bits", c.cfg.master_weight_bits == 24 ? I8 : I16, p.err);
    }
    return bad;
  }
};

struct Hyper {
  const char* name;
  int32_t algorithm;
  double lr, b1, b2, eps, wd, momentum, dampening;
  int32_t nesterov, decouple_lr;
};

const Hyper kHypers[] = {
    {"adamw", 0, 1e-2, 0.9, 0.999, 1e-8, 0.1, 0, 0, 0, 0},
    {"adamw_decouple_lr", 0, 3e-2, 0.8, 0.95, 1e-6, 0.05, 0, 0, 0, 1},
    {"adam_l2", 1, 1e-2, 0.5, 0.9, 1e-8, 0.5, 0, 0, 0, 0},
    {"adam", 1, 1e-3, 0.9, 0.99, 1e-3, 0, 0, 0, 0, 0},
    {"sgd", 2, 1e-2, 0, 0, 0, 0, 0, 0, 0, 0},
    {"sgd_l2", 2, 1e-2, 0, 0, 0, 1e-2, 0, 0, 0, 0},
    {"sgd_momentum_dampening", 2, 1e-2, 0, 0, 0, 0, 0.9, 0.1, 0, 0},
    {"sgd_nesterov_l2", 2, 1e-2, 0, 0, 0, 5e-3, 0.8, 0, 1, 0},
    {"sgdw_momentum", 3, 1e-2, 0, 0, 0, 0.1, 0.9, 0, 0, 0},
    {"sgdw", 3, 1e-2, 0, 0, 0, 0.1, 0, 0, 0, 0},
    {"lion", 4, 1e-3, 0.9, 0.99, 0, 0.1, 0, 0, 0, 0},
    {"lion_b0.95_0.98", 4, 3e-4, 0.95, 0.98, 0, 1e-2, 0, 0, 0, 1},
};

fo_optim_config config_of(const Hyper& h, int32_t fmt, int32_t mw) {
  fo_optim_config c;
  fo_optim_config_default(h.algorithm, &c);
  c.lr = h.lr, c.initial_lr = h.decouple_lr ? 2.0 * h.lr : h.lr;
  if (h.algorithm <= 1 || h.algorithm == 4) c.beta1 = h.b1, c.beta2 = h.b2;
  if (h.algorithm <= 1) c.eps = h.eps;
  c.weight_decay = h.wd, c.momentum = h.momentum, c.dampening = h.dampening, c.nesterov = h.nesterov;
  c.decouple_lr = h.decouple_lr, c.state_format = fmt, c.master_weight_bits = mw, c.check_numerics = 0;
  return c;
}

const char* dname(int32_t d) { return d == F32 ? "f32" : d == F16 ? "f16" : "bf16"; }

// Every rule x format x param dtype x master bits x grad dtype on random inputs.
void random_matrix() {
  const std::vector<std::vector<int64_t>> shapes = {{100}, {3, 32}, {7}, {0}, {1, 45}};
  int combos = 0, mismatches = 0;
  uint64_t vectors = fo_vec_loads;  // heap buffers are 16-byte aligned: the vector path runs
  for (const Hyper& h : kHypers)
    for (int32_t fmt = 0; fmt < 4; ++fmt)
      for (int32_t pd : {F32, BF16, F16})
        for (int32_t mw : {0, 24, 32}) {
          if (pd == F32 && mw != 0) continue;  // f32 parameters are their own master
          for (int32_t gd : {F32, BF16, F16}) {
            Combo c{config_of(h, fmt, mw), pd, gd, ""};
            c.name = std::string(h.name) + "/fmt" + std::to_string(fmt) + "/" + dname(pd) + "/mw" + std::to_string(mw) +
                     "/grad_" + dname(gd);
            std::mt19937_64 rng(0x5eed + combos);
            std::vector<std::vector<float>> init;
            for (auto& s : shapes) {
              size_t n = 1;
              for (int64_t d : s) n *= (size_t)d;
              init.push_back(random_values(rng, n, pd));
            }
            Runner r(c, shapes, init);
            for (int t = 0; t < 4; ++t) {
              std::vector<std::vector<float>> g;
              for (size_t i = 0; i < shapes.size(); ++i) {
                // Step 2 skips parameter 2 (no gradient), step 3 gives p0 an all-zero gradient.
                if (t == 2 && i == 2) {
                  g.emplace_back();
                  continue;
                }
                std::vector<float> x = random_values(rng, init[i].size(), gd);
                if (t == 3 && i == 0) x.assign(x.size(), 0.0f);
                g.push_back(x);
              }
              mismatches += r.step(g);
            }
            ++combos;
          }
        }
  std::printf("random matrix: %d combinations x 4 steps, %d mismatching elements\n", combos, mismatches);
  CHECK(combos == 12 * 4 * 7 * 3);
  CHECK(fo_vec_loads > vectors);
  CHECK(mismatches == 0);
}


// A safetensors file: 8-byte little-endian header length, JSON header, raw data.
struct Safetensors {
  std::string bytes;
  nlohmann::json header;
  size_t base = 0;
  explicit Safetensors(const std::string& path) : bytes(fo_test::read_file(path)) {
    uint64_t n = 0;
    std::memcpy(&n, bytes.data(), 8);
    header = nlohmann::json::parse(bytes.substr(8, n));
    base = 8 + n;
  }
  bool has(const std::string& k) const { return header.contains(k); }
  std::vector<int64_t> shape(const std::string& k) const { return header.at(k).at("shape").get<std::vector<int64_t>>(); }
  int32_t dtype(const std::string& k) const {
    std::string d = header.at(k).at("dtype");
    return d == "F32" ? F32 : d == "BF16" ? BF16 : F16;
  }
  // Row t (all rows: t < 0) of tensor k as f32 values.
  std::vector<float> values(const std::string& k, int64_t t = -1) const {
    auto off = header.at(k).at("data_offsets");
    size_t lo = off[0].get<size_t>(), hi = off[1].get<size_t>();
    size_t w = dsize(dtype(k)), n = (hi - lo) / w;
    if (t >= 0) n /= (size_t)shape(k)[0], lo += (size_t)t * n * w;
    std::vector<float> x(n);
    for (size_t i = 0; i < n; ++i) x[i] = fo_load_any(bytes.data() + base + lo, dtype(k), i);
    return x;
  }
};

// A number from the manifest's kwargs (absent or null: the default).
double num(const nlohmann::json& k, const char* key, double def) {
  return k.contains(key) && k[key].is_number() ? k[key].get<double>() : def;
}

int32_t dtype_named(const std::string& s) { return s == "float32" ? F32 : s == "bfloat16" ? BF16 : F16; }

// The oracle trajectories' inits and gradients (zero-gradient steps included) under each
// case's own hyper-parameters, in every state format and master width; for FlashOptim's
// cases the kernel's parameters must also equal the oracle's, step by step.
void oracle_cases() {
  nlohmann::json man = nlohmann::json::parse(fo_test::read_file(fo_test::oracle_path("optim/manifest.json")));
  std::vector<nlohmann::json> cases;
  for (auto& c : man["torch_reference"]["cases"]) cases.push_back(c);
  for (auto& c : man["flashoptim"]["trajectories"]) cases.push_back(c);
  int runs = 0, mismatches = 0, oracle_bad = 0, oracle_checked = 0;
  for (auto& c : cases) {
    std::string opt = c["optimizer"];
    int32_t algo = opt.find("AdamW") != std::string::npos ? 0 : opt.find("Adam") != std::string::npos ? 1
                   : opt.find("SGD") != std::string::npos ? 2 : 4;
    const nlohmann::json& k = c["constructor_kwargs"];
    Hyper h{"", algo, num(k, "lr", 1e-3), 0.9, 0.999, num(k, "eps", 1e-8), num(k, "weight_decay", 0.0),
            num(k, "momentum", 0.0), num(k, "dampening", 0.0), k.contains("nesterov") && k["nesterov"] == true, 0};
    if (algo == 4) h.b2 = 0.99;
    if (k.contains("betas")) h.b1 = k["betas"][0], h.b2 = k["betas"][1];
    int32_t pd = dtype_named(c["param_dtype"]), gd = dtype_named(c.value("grad_dtype", c["param_dtype"].get<std::string>()));
    bool flash = c["part"] == "flash_trajectory";
    int32_t own_mw = flash ? (int32_t)num(k, "master_weight_bits", 24) : 0;
    Safetensors st(fo_test::oracle_path("optim/" + c["file"].get<std::string>()));
    size_t np = 0, steps = c["num_steps"];
    while (st.has("p" + std::to_string(np) + ".init")) ++np;
    std::vector<std::vector<int64_t>> shapes;
    std::vector<std::vector<float>> init;
    for (size_t i = 0; i < np; ++i) {
      std::string key = "p" + std::to_string(i) + ".init";
      shapes.push_back(st.shape(key));
      init.push_back(st.values(key));
    }
    for (int32_t fmt = 0; fmt < 4; ++fmt)
      for (int32_t mw : {0, 24, 32}) {
        if (pd == F32 && mw != 0) continue;
        Combo combo{config_of(h, fmt, mw), pd, gd, c["name"].get<std::string>() + "/fmt" + std::to_string(fmt) + "/mw" + std::to_string(mw)};
        Runner r(combo, shapes, init);
        bool own = flash && fmt == 2 && mw == own_mw;
        for (size_t t = 0; t < steps; ++t) {
          std::vector<std::vector<float>> g;
          for (size_t i = 0; i < np; ++i) g.push_back(st.values("p" + std::to_string(i) + ".grads", (int64_t)t));
          mismatches += r.step(g);
          for (size_t i = 0; own && i < np; ++i) {
            std::vector<float> want = st.values("p" + std::to_string(i) + ".param", (int64_t)t);
            std::string w = encode(pd, want);
            oracle_bad += w != r.ps[i].k_bytes;
            ++oracle_checked;
          }
        }
        ++runs;
      }
  }
  std::printf("oracle cases: %zu cases, %d runs, %d mismatching elements vs libfo; %d/%d FlashOptim param rows differ\n",
              cases.size(), runs, mismatches, oracle_bad, oracle_checked);
  CHECK(cases.size() == 24);  // 17 torch + 7 FlashOptim trajectories
  CHECK(mismatches == 0);
  CHECK(oracle_checked > 0);
  CHECK(oracle_bad == 0);
}

// A device tensor is refused with FO_ERR_UNSUPPORTED naming what is missing, never an
// abort, and nothing changes.
void device_tensors_are_refused_clearly() {
  fo_optim_config c = config_of(kHypers[0], 2, 24);
  fo_optimizer* opt = nullptr;
  CHECK_OK(fo_optimizer_create(&c, &opt));
  std::vector<int64_t> shape = {4};
  uint16_t p[4] = {0x3f80, 0x3f80, 0x3f80, 0x3f80}, g[4] = {0x3f80, 0, 0, 0};
  fo_tensor dev{p, BF16, 1, shape.data(), nullptr, 0};
  int32_t idx = -1;
  fo_status added = fo_optimizer_add_param(opt, "w", &dev, nullptr, &idx);
  if (added == FO_OK) {  // a GPU build on a GPU machine: `p` is not device memory, stop here
    std::printf("device 0 steps tensors here: refusal checks skipped\n");
    fo_optimizer_destroy(opt);
    return;
  }
  CHECK(added == FO_ERR_UNSUPPORTED);
  std::string m = fo_test::last_error();
  CHECK(m.find("param.device = 0") != std::string::npos);
  CHECK(m.find("--features cuda") != std::string::npos || m.find("libcuda") != std::string::npos ||
        m.find("NVRTC") != std::string::npos || m.find("CUDA device") != std::string::npos);
  fo_tensor host{p, BF16, 1, shape.data(), nullptr, -1};
  CHECK_OK(fo_optimizer_add_param(opt, "w", &host, nullptr, &idx));
  fo_tensor gdev{g, BF16, 1, shape.data(), nullptr, 1};
  CHECK(fo_optimizer_step(opt, &gdev, 1) == FO_ERR_UNSUPPORTED);
  CHECK(fo_test::last_error().find("device = 1") != std::string::npos);
  CHECK(p[0] == 0x3f80);
  // No GPU half here: the stream setter says why (a GPU build with libcuda takes it).
  fo_status s = fo_optimizer_set_stream(opt, nullptr);
  CHECK(s == FO_OK || (s == FO_ERR_UNSUPPORTED && fo_test::last_error().find("fo_optimizer_set_stream") != std::string::npos));
  fo_optimizer_destroy(opt);
}

// The launch table's layout as the kernel reads it. src/kernels/step_table_tests.rs asserts
// the same numbers for its Rust mirror (FoStepTensor, FoRule), which fo uploads as bytes.
static_assert(sizeof(fo_rule) == 68 && alignof(fo_rule) == 4, "fo_rule layout");
static_assert(offsetof(fo_rule, nesterov) == 12 && offsetof(fo_rule, l2) == 16, "fo_rule layout");
static_assert(offsetof(fo_rule, bc2_sqrt) == 48 && offsetof(fo_rule, wdamp) == 64, "fo_rule layout");
static_assert(sizeof(fo_step_tensor) == 96 && alignof(fo_step_tensor) == 8, "fo_step_tensor layout");
void table_layout() {
  const size_t want[] = {0, 8, 16, 24, 32, 40, 48, 56, 64, 72, 76, 80, 84, 88};
  const size_t got[] = {offsetof(fo_step_tensor, param),       offsetof(fo_step_tensor, grad),
                        offsetof(fo_step_tensor, error_bits),  offsetof(fo_step_tensor, m),
                        offsetof(fo_step_tensor, m_scales),    offsetof(fo_step_tensor, v),
                        offsetof(fo_step_tensor, v_scales),    offsetof(fo_step_tensor, numel),
                        offsetof(fo_step_tensor, group_begin), offsetof(fo_step_tensor, param_dtype),
                        offsetof(fo_step_tensor, grad_dtype),  offsetof(fo_step_tensor, error_bits_width),
                        offsetof(fo_step_tensor, m_kind),      offsetof(fo_step_tensor, v_kind)};
  for (size_t i = 0; i < sizeof(want) / sizeof(want[0]); ++i) CHECK(got[i] == want[i]);
  std::printf("table layout: fo_step_tensor %zu bytes, fo_rule %zu bytes (as step_table_tests.rs)\n",
              sizeof(fo_step_tensor), sizeof(fo_rule));
}

// The step kernel decodes codes through tables (fo_code_tables): every byte, in the
// layout the kernel indexes, gives the bits of the decode it replaces, for codes the
// encoder never writes too (-128, from a loaded checkpoint), and the fill splits over a
// block's threads without leaving an entry out (any thread count).
void code_tables_decode_every_byte_as_the_division_does() {
  const float scales[] = {1.0f, 0.37f, 1e-12f, 3.0e5f, 6.1e-5f, 65504.0f};
  size_t bad = 0;
  for (unsigned threads : {1u, 3u, 7u, 128u, 300u}) {
    fo_code_tables tb;
    std::memset(&tb, 0xff, sizeof(tb));  // NaN bits, so an entry left out shows
    for (unsigned i0 = 0; i0 < threads; ++i0) fo_code_tables_fill(&tb, i0, threads);
    for (unsigned c = 0; c < 256; ++c) {
      for (float s : scales) {
        auto same = [](float a, float b) { return fo_bits(a) == fo_bits(b); };
        bad += !same(fo_signed_decode_t(tb, (int8_t)c, s), fo_signed_decode((int8_t)c, s));
        bad += !same(fo_unsigned_decode_t(tb, (uint8_t)c, s, false), fo_unsigned_decode((uint8_t)c, s, false));
        bad += !same(fo_unsigned_decode_t(tb, (uint8_t)c, s, true), fo_unsigned_decode((uint8_t)c, s, true));
      }
      for (uint16_t bits : {(uint16_t)0x3f80, (uint16_t)0x0001, (uint16_t)0xc2f7, (uint16_t)0x7f7f}) {
        float want = fo_error_reconstruct(2, bits, (int8_t)c, 127.0f);
        bad += fo_bits(fo_error_reconstruct_unit(2, bits, tb.q127[c])) != fo_bits(want);
      }
    }
  }
  CHECK(bad == 0);
  const fo_code_tables& host = fo_host_code_tables();
  CHECK(host.q127[0x80] < -1.0f);  // -128 / 127: past -1, as the CPU decodes it
  CHECK(host.q255[255] == 1.0f && host.softsign[127] == 1.0f && host.softsign[0x81] == -1.0f);
  std::printf("code tables: 256 bytes x 3 tables match the divisions (%zu mismatches)\n", bad);
}

}  // namespace

int main() {
  table_layout();
  code_tables_decode_every_byte_as_the_division_does();
  device_tensors_are_refused_clearly();
  random_matrix();
  oracle_cases();
  return fo_test::summary("test_gpu_kernels_host");
}
