// fo_optimizer_* through the C ABI: torch/lion trajectories (fp32 state, rtol 1e-5 /
// atol 1e-7 every step), a FlashOptim trajectory bit for bit (bf16 params, quant8 state,
// 24-bit masters), state read/write, groups, offload plan, and the error paths.
#include <nlohmann/json.hpp>
#include <cmath>
#include <cstdint>
#include <map>
#include <vector>

#include "check.hpp"

using nlohmann::json;

// A safetensors file: 8-byte little-endian header length, JSON header, raw data.
struct Safetensors {
  std::string bytes;
  json header;
  size_t base = 0;
  explicit Safetensors(const std::string& path) : bytes(fo_test::read_file(path)) {
    uint64_t n = 0;
    std::memcpy(&n, bytes.data(), 8);
    header = json::parse(bytes.substr(8, n));
    base = 8 + n;
  }
  std::vector<int64_t> shape(const std::string& k) const { return header.at(k).at("shape").get<std::vector<int64_t>>(); }
  std::string raw(const std::string& k) const {
    auto off = header.at(k).at("data_offsets");
    return bytes.substr(base + off[0].get<size_t>(), off[1].get<size_t>() - off[0].get<size_t>());
  }
  // Row t of a per-step tensor [T, ...].
  std::string row(const std::string& k, size_t t) const {
    std::string all = raw(k);
    size_t per = all.size() / (size_t)shape(k)[0];
    return all.substr(t * per, per);
  }
};

static std::vector<float> as_f32(const std::string& b) {
  std::vector<float> v(b.size() / 4);
  std::memcpy(v.data(), b.data(), b.size());
  return v;
}

static fo_tensor view(void* data, int32_t dtype, const std::vector<int64_t>& shape) {
  return fo_tensor{data, dtype, (int32_t)shape.size(), shape.data(), nullptr, FO_DEVICE_HOST};
}

// Registers p0..p{n-1} from `init` buffers; returns the optimizer.
static fo_optimizer* make(const fo_optim_config& cfg, std::vector<std::string>& bufs,
                          const std::vector<std::vector<int64_t>>& shapes, int32_t dtype) {
  fo_optimizer* opt = nullptr;
  CHECK_OK(fo_optimizer_create(&cfg, &opt));
  for (size_t i = 0; i < bufs.size(); ++i) {
    fo_tensor t = view(&bufs[i][0], dtype, shapes[i]);
    int32_t idx = -1;
    CHECK_OK(fo_optimizer_add_param(opt, ("p" + std::to_string(i)).c_str(), &t, nullptr, &idx));
    CHECK(idx == (int32_t)i);
  }
  return opt;
}

static void step(fo_optimizer* opt, const Safetensors& st, size_t n, size_t t, int32_t dtype,
                 const std::vector<std::vector<int64_t>>& shapes) {
  std::vector<std::string> g(n);
  std::vector<fo_tensor> grads(n);
  for (size_t i = 0; i < n; ++i) {
    g[i] = st.row("p" + std::to_string(i) + ".grads", t);
    grads[i] = view(&g[i][0], dtype, shapes[i]);
  }
  CHECK_OK(fo_optimizer_step(opt, grads.data(), n));
}

static void torch_case(const std::string& name, int32_t algorithm, double lr, double b1, double b2, double eps,
                       double wd, double momentum, double dampening, bool decoupled) {
  Safetensors st(fo_test::oracle_path("optim/torch_" + name + ".safetensors"));
  fo_optim_config cfg;
  fo_optim_config_default(algorithm, &cfg);
  cfg.lr = cfg.initial_lr = lr;
  cfg.beta1 = b1, cfg.beta2 = b2, cfg.eps = eps, cfg.weight_decay = wd, cfg.momentum = momentum,
  cfg.dampening = dampening, cfg.decouple_lr = decoupled;
  cfg.state_format = FO_STATE_FORMAT_FP32, cfg.master_weight_bits = 0;
  size_t n = 3;
  std::vector<std::string> bufs;
  std::vector<std::vector<int64_t>> shapes;
  for (size_t i = 0; i < n; ++i) {
    bufs.push_back(st.raw("p" + std::to_string(i) + ".init"));
    shapes.push_back(st.shape("p" + std::to_string(i) + ".init"));
  }
  fo_optimizer* opt = make(cfg, bufs, shapes, 0);
  int bad = 0;
  for (size_t t = 0; t < 25; ++t) {
    step(opt, st, n, t, 0, shapes);
    for (size_t i = 0; i < n; ++i) {
      std::vector<float> want = as_f32(st.row("p" + std::to_string(i) + ".params", t)), got = as_f32(bufs[i]);
      for (size_t j = 0; j < want.size(); ++j)
        if (!(std::fabs(got[j] - want[j]) <= 1e-7f + 1e-5f * std::fabs(want[j]))) ++bad;
    }
  }
  if (bad) fo_test::fail(__FILE__, __LINE__, name + ": " + std::to_string(bad) + " values outside rtol 1e-5 / atol 1e-7");
  CHECK(bad == 0);
  fo_optimizer_destroy(opt);
}

static void flash_adamw_mw24_is_bit_exact() {
  Safetensors st(fo_test::oracle_path("optim/flash_traj_flash_adamw_mw24.safetensors"));
  fo_optim_config cfg;
  fo_optim_config_default(FO_ALGORITHM_ADAMW, &cfg);  // AdamW, quant8, 24-bit masters
  cfg.lr = cfg.initial_lr = 1e-2;
  size_t n = 3;
  std::vector<std::string> bufs;
  std::vector<std::vector<int64_t>> shapes;
  for (size_t i = 0; i < n; ++i) {
    bufs.push_back(st.raw("p" + std::to_string(i) + ".init"));
    shapes.push_back(st.shape("p" + std::to_string(i) + ".init"));
  }
  fo_optimizer* opt = make(cfg, bufs, shapes, 2);
  int mismatches = 0;
  for (size_t t = 0; t < 10; ++t) {
    step(opt, st, n, t, 2, shapes);
    for (size_t i = 0; i < n; ++i) {
      std::string p = "p" + std::to_string(i);
      mismatches += bufs[i] != st.row(p + ".param", t);
      // Raw state read through the ABI: codes, fp16 scales, error bits, master.
      const std::map<std::string, int32_t> raw = {{"exp_avg::quantized", 4}, {"exp_avg::scales", 1},
                                                  {"exp_avg_sq::quantized", 5}, {"exp_avg_sq::scales", 1},
                                                  {"error_bits", 4}, {"master", 0}};
      for (const auto& kv : raw) {
        std::string key = kv.first, ok = kv.first == "master" ? p + ".master_fp32" : p + "." + key;
        if (key.find("::") != std::string::npos) ok = p + "." + key.substr(0, key.find("::")) + "." + key.substr(key.find("::") + 2);
        std::string want = st.row(ok, t), got(want.size(), '\0');
        std::vector<int64_t> full = st.shape(ok), shape(full.begin() + 1, full.end());
        fo_tensor out = view(&got[0], kv.second, shape);
        CHECK_OK(fo_optimizer_get_state(opt, (int32_t)i, key.c_str(), &out));
        mismatches += got != want;
      }
    }
  }
  CHECK(mismatches == 0);
  // Bytes: 1 + 1 + 1 + 4/32 per element.
  uint64_t bytes = 0;
  CHECK_OK(fo_optimizer_state_bytes(opt, -1, &bytes));
  CHECK(bytes == (1 + 33 + 1100) * 3 + 2 * 2 * (1 + 2 + 35));
  char keys[256];
  size_t len = 0;
  CHECK_OK(fo_optimizer_state_keys(opt, 1, keys, sizeof keys, &len));
  CHECK(std::string(keys) == "step\nexp_avg::quantized\nexp_avg::scales\nexp_avg_sq::quantized\nexp_avg_sq::scales\nerror_bits");
  fo_optimizer_destroy(opt);
}

static void errors_change_nothing_and_say_why() {
  fo_optim_config cfg;
  fo_optim_config_default(FO_ALGORITHM_ADAMW, &cfg);
  fo_optimizer* opt = nullptr;
  cfg.beta1 = 1.5;
  CHECK_ERR(fo_optimizer_create(&cfg, &opt), FO_ERR_INVALID_ARGUMENT, "beta1");
  CHECK(opt == nullptr);
  fo_optim_config_default(FO_ALGORITHM_ADAMW, &cfg);
  cfg.check_numerics = 1;
  CHECK_ERR(fo_optimizer_create(nullptr, &opt), FO_ERR_INVALID_ARGUMENT, "cfg");
  CHECK_OK(fo_optimizer_create(&cfg, &opt));
  std::vector<float> f32(4, 1.0f);
  std::vector<int64_t> shape = {4};
  fo_tensor pf = view(f32.data(), 0, shape);
  int32_t idx = -1;
  CHECK_ERR(fo_optimizer_add_param(opt, "w32", &pf, nullptr, &idx), FO_ERR_DTYPE, "master_weight_bits = 0");
  std::vector<uint16_t> p = {0x3f80, 0x4000, 0xbf80, 0x3f00}, before = p;  // bf16 1, 2, -1, 0.5
  fo_tensor pt = view(p.data(), 2, shape);
  CHECK_OK(fo_optimizer_add_param(opt, "w", &pt, nullptr, &idx));
  CHECK_ERR(fo_optimizer_add_param(opt, "w", &pt, nullptr, &idx), FO_ERR_INVALID_ARGUMENT, "already registered");
  std::vector<float> g = {0.5f, NAN, 1.0f, 2.0f};
  fo_tensor gt = view(g.data(), 0, shape);
  CHECK_ERR(fo_optimizer_step(opt, &gt, 1), FO_ERR_NUMERICS, "non-finite");
  CHECK(p == before);
  fo_tensor two[2] = {gt, fo_tensor{nullptr, FO_DTYPE_F32, 0, nullptr, nullptr, FO_DEVICE_HOST}};
  CHECK_ERR(fo_optimizer_step(opt, two, 2), FO_ERR_INVALID_ARGUMENT, "2 gradients given for 1 parameters");
  std::vector<int64_t> bad_shape = {3};
  fo_tensor gs = view(g.data(), 0, bad_shape);
  CHECK_ERR(fo_optimizer_step(opt, &gs, 1), FO_ERR_SHAPE, "gradient of w");
  float out[4];
  fo_tensor ot = view(out, 0, shape);
  CHECK_ERR(fo_optimizer_get_state(opt, 0, "exp_avg", &ot), FO_ERR_NOT_FOUND, "no optimizer state yet");
  g[1] = 0.25f;
  CHECK_OK(fo_optimizer_step(opt, &gt, 1));
  CHECK(p != before);
  CHECK_ERR(fo_optimizer_get_state(opt, 0, "nonsense", &ot), FO_ERR_NOT_FOUND, "nonsense");
  fo_tensor o3 = view(out, 0, bad_shape);
  CHECK_ERR(fo_optimizer_get_state(opt, 0, "exp_avg", &o3), FO_ERR_SHAPE, "exp_avg");
  CHECK_ERR(fo_optimizer_get_state(opt, 0, "error_bits", &ot), FO_ERR_DTYPE, "error_bits");
  CHECK_ERR(fo_optimizer_get_state(opt, 5, "exp_avg", &ot), FO_ERR_INVALID_ARGUMENT, "index");
  // set_state: a bad second entry leaves the first unapplied.
  float m[4] = {1, 2, 3, 4}, v_bad[3] = {1, 1, 1};
  fo_tensor vals[2] = {view(m, 0, shape), view(v_bad, 0, bad_shape)};
  const char* keys[2] = {"exp_avg", "exp_avg_sq"};
  float m_before[4];
  fo_tensor mb = view(m_before, 0, shape);
  CHECK_OK(fo_optimizer_get_state(opt, 0, "exp_avg", &mb));
  CHECK_ERR(fo_optimizer_set_state(opt, 0, keys, vals, 2), FO_ERR_SHAPE, "exp_avg_sq");
  CHECK_OK(fo_optimizer_get_state(opt, 0, "exp_avg", &ot));
  CHECK(std::memcmp(out, m_before, sizeof out) == 0);
  CHECK_OK(fo_optimizer_set_state(opt, 0, keys, vals, 1));
  CHECK_OK(fo_optimizer_get_state(opt, 0, "exp_avg", &ot));
  CHECK(std::fabs(out[3] - 4.0f) < 1e-6f && std::fabs(out[0] - 1.0f) < 0.02f);
  CHECK_ERR(fo_optimizer_step(nullptr, &gt, 1), FO_ERR_INVALID_ARGUMENT, "opt");
  fo_optimizer_destroy(opt);
  fo_optimizer_destroy(nullptr);
}

static void groups_offload_and_threads() {
  fo_optim_config cfg;
  fo_optim_config_default(FO_ALGORITHM_SGDW, &cfg);
  cfg.state_format = FO_STATE_FORMAT_FP32, cfg.master_weight_bits = 0, cfg.lr = 0.5;
  fo_optimizer* opt = nullptr;
  CHECK_OK(fo_optimizer_create(&cfg, &opt));
  int32_t g1 = -1, i0 = -1, i1 = -1;
  CHECK_OK(fo_optimizer_add_param_group(opt, &cfg, &g1));
  CHECK(g1 == 1);
  std::vector<float> a(3, 1.0f), b(3, 1.0f), g(3, 1.0f);
  std::vector<int64_t> shape = {3};
  fo_tensor ta = view(a.data(), 0, shape), tb = view(b.data(), 0, shape);
  CHECK_OK(fo_optimizer_add_param(opt, "a", &ta, nullptr, &i0));
  CHECK_OK(fo_optimizer_add_param_to_group(opt, "b", &tb, nullptr, g1, &i1));
  CHECK_OK(fo_optimizer_set_group_lr(opt, g1, 0.0));
  fo_tensor grads[2] = {view(g.data(), 0, shape), view(g.data(), 0, shape)};
  CHECK_OK(fo_optimizer_step(opt, grads, 2));
  CHECK(a[0] == 0.5f && b[0] == 1.0f);
  fo_optim_config got;
  CHECK_OK(fo_optimizer_get_group_config(opt, 1, &got));
  CHECK(got.lr == 0.0 && got.algorithm == FO_ALGORITHM_SGDW);
  got.state_format = FO_STATE_FORMAT_QUANT8;
  CHECK_ERR(fo_optimizer_set_group_config(opt, 1, &got), FO_ERR_INVALID_ARGUMENT, "state_format");
  char js[1024];
  size_t len = 0;
  CHECK_ERR(fo_optimizer_param_groups_json(opt, js, 4, &len), FO_ERR_INVALID_ARGUMENT, "capacity");
  CHECK_OK(fo_optimizer_param_groups_json(opt, js, sizeof js, &len));
  json groups = json::parse(js);
  CHECK(groups.size() == 2 && groups[1]["params"][0] == "b" && groups[0]["lr"] == 0.5);
  fo_optimizer_destroy(opt);

  const int64_t numels[4] = {10, 10, 10, 10};
  int32_t plan[4];
  CHECK_OK(fo_offload_plan(numels, 4, 0.3, plan));
  CHECK(plan[0] == 1 && plan[1] == 1 && plan[2] == 0 && plan[3] == 0);
  CHECK_ERR(fo_offload_plan(numels, 4, 1.5, plan), FO_ERR_INVALID_ARGUMENT, "fraction");
  int32_t threads = 0;
  CHECK_OK(fo_set_num_threads(1));
  CHECK_OK(fo_get_num_threads(&threads));
  CHECK(threads == 1);
  CHECK_ERR(fo_set_num_threads(-1), FO_ERR_INVALID_ARGUMENT, "n");
  CHECK_OK(fo_set_num_threads(0));
}

// arithmetic = 1 (fast): same case, from exact's state every step; masters within two
// 24-bit error-bits codes of exact's, quant8 codes within one; a bad code is refused by name.
static void fast_arithmetic_stays_within_the_bound() {
  Safetensors st(fo_test::oracle_path("optim/flash_traj_flash_adamw_mw24.safetensors"));
  fo_optim_config cfg;
  fo_optim_config_default(FO_ALGORITHM_ADAMW, &cfg);
  CHECK(cfg.arithmetic == FO_ARITHMETIC_EXACT);
  cfg.lr = cfg.initial_lr = 1e-2;
  size_t n = 3;
  std::vector<std::string> be, bf;
  std::vector<std::vector<int64_t>> shapes;
  for (size_t i = 0; i < n; ++i) {
    be.push_back(st.raw("p" + std::to_string(i) + ".init"));
    shapes.push_back(st.shape("p" + std::to_string(i) + ".init"));
  }
  bf = be;
  fo_optimizer* exact = make(cfg, be, shapes, 2);
  cfg.arithmetic = FO_ARITHMETIC_FAST;
  fo_optimizer* fast = make(cfg, bf, shapes, 2);
  fo_optim_config got;
  CHECK_OK(fo_optimizer_get_group_config(fast, 0, &got));
  CHECK(got.arithmetic == FO_ARITHMETIC_FAST);
  const char* keys[] = {"step", "exp_avg::quantized", "exp_avg::scales", "exp_avg_sq::quantized",
                        "exp_avg_sq::scales", "error_bits"};
  int bad = 0, differ = 0;
  for (size_t t = 0; t < 10; ++t) {
    for (size_t i = 0; i < n; ++i) {
      bf[i] = be[i];
      if (t == 0) continue;
      std::vector<std::vector<char>> bufs(6);
      std::vector<std::vector<int64_t>> shp(6);
      std::vector<fo_tensor> ts(6);
      for (int k = 0; k < 6; ++k) {
        int32_t dtype = 0, ndim = 0;
        int64_t dims[8];
        CHECK_OK(fo_optimizer_state_info(exact, (int32_t)i, keys[k], &dtype, &ndim, dims));
        shp[k].assign(dims, dims + ndim);
        size_t numel = 1;
        for (auto d : shp[k]) numel *= (size_t)d;
        bufs[k].resize(numel * 8 + 8);
        ts[k] = view(bufs[k].data(), dtype, shp[k]);
        CHECK_OK(fo_optimizer_get_state(exact, (int32_t)i, keys[k], &ts[k]));
      }
      CHECK_OK(fo_optimizer_set_state(fast, (int32_t)i, keys, ts.data(), 6));
    }
    step(exact, st, n, t, 2, shapes);
    step(fast, st, n, t, 2, shapes);
    for (size_t i = 0; i < n; ++i) {
      size_t numel = be[i].size() / 2;
      std::vector<float> me(numel), mf(numel);
      std::vector<int64_t> s1 = {(int64_t)numel};
      fo_tensor te = view(me.data(), 0, s1), tf = view(mf.data(), 0, s1);
      CHECK_OK(fo_optimizer_get_state(exact, (int32_t)i, "master", &te));
      CHECK_OK(fo_optimizer_get_state(fast, (int32_t)i, "master", &tf));
      for (size_t j = 0; j < numel; ++j) {
        int e2 = 0;
        std::frexp(std::fabs(me[j]) > 1e-30f ? me[j] : 1e-30f, &e2);
        double unit = std::ldexp(1.0, e2 - 1 - 8) / 127.0;
        if (std::fabs((double)me[j] - (double)mf[j]) > 2 * unit) ++bad;
        if (me[j] != mf[j]) ++differ;
      }
      for (const char* q : {"exp_avg::quantized", "exp_avg_sq::quantized"}) {
        std::vector<uint8_t> qe(numel), qf(numel);
        fo_tensor a = view(qe.data(), std::string(q).rfind("exp_avg_sq", 0) == 0 ? 5 : 4, s1);
        fo_tensor b = a;
        b.data = qf.data();
        CHECK_OK(fo_optimizer_get_state(exact, (int32_t)i, q, &a));
        CHECK_OK(fo_optimizer_get_state(fast, (int32_t)i, q, &b));
        bool sgn = a.dtype == FO_DTYPE_I8;
        for (size_t j = 0; j < numel; ++j) {
          int x = sgn ? (int)(int8_t)qe[j] : (int)qe[j], y = sgn ? (int)(int8_t)qf[j] : (int)qf[j];
          if (std::abs(x - y) > 1) ++bad;
        }
      }
    }
  }
  CHECK(bad == 0);
  CHECK(differ > 0);
  fo_optimizer_destroy(exact);
  fo_optimizer_destroy(fast);
  cfg.arithmetic = 2;
  fo_optimizer* none = nullptr;
  CHECK_ERR(fo_optimizer_create(&cfg, &none), FO_ERR_INVALID_ARGUMENT, "arithmetic");
  CHECK(none == nullptr);
}

// fo_optimizer_share_state: the pointer shows the live fp32 state after each step, a write
// through it is a write to the state, and it stays valid after the optimizer is destroyed.
static void shared_state_is_live_and_outlives_the_optimizer() {
  fo_optim_config cfg;
  fo_optim_config_default(FO_ALGORITHM_ADAMW, &cfg);
  cfg.state_format = FO_STATE_FORMAT_FP32;
  cfg.master_weight_bits = 0;
  std::vector<float> w(100), g(100), out(100);
  for (size_t i = 0; i < w.size(); ++i) w[i] = std::sin(0.3f * (float)i), g[i] = std::cos(0.7f * (float)i);
  std::vector<int64_t> shape{10, 10};
  fo_optimizer* opt = nullptr;
  CHECK_OK(fo_optimizer_create(&cfg, &opt));
  fo_tensor p = view(w.data(), FO_DTYPE_F32, shape), gr = view(g.data(), FO_DTYPE_F32, shape);
  fo_tensor o = view(out.data(), FO_DTYPE_F32, shape);
  int32_t idx = -1;
  CHECK_OK(fo_optimizer_add_param(opt, "w", &p, nullptr, &idx));
  CHECK_OK(fo_optimizer_step(opt, &gr, 1));
  fo_state_share* sh = nullptr;
  float* data = nullptr;
  int64_t n = 0;
  CHECK_OK(fo_optimizer_share_state(opt, 0, "exp_avg_sq", &sh, &data, &n));
  CHECK(sh != nullptr && data != nullptr && n == 100);
  for (int k = 0; k < 3; ++k) {
    CHECK_OK(fo_optimizer_step(opt, &gr, 1));
    CHECK_OK(fo_optimizer_get_state(opt, 0, "exp_avg_sq", &o));
    CHECK(std::memcmp(out.data(), data, 400) == 0);
  }
  for (int64_t i = 0; i < n; ++i) data[i] = 0.25f;
  CHECK_OK(fo_optimizer_get_state(opt, 0, "exp_avg_sq", &o));
  CHECK(out[0] == 0.25f && out[99] == 0.25f);
  fo_optimizer_destroy(opt);
  CHECK(data[42] == 0.25f);  // still allocated: the share holds it
  fo_state_share_destroy(sh);
  fo_state_share_destroy(nullptr);
}

int main() {
  torch_case("adamw_defaults", 0, 1e-3, 0.9, 0.999, 1e-8, 1e-2, 0, 0, false);
  torch_case("adam_l2_wd1e-2", 1, 1e-3, 0.9, 0.999, 1e-8, 1e-2, 0, 0, false);
  torch_case("sgd_momentum0.9_dampening0.1", 2, 0.05, 0, 0, 0, 0, 0.9, 0.1, false);
  torch_case("lion_decoupled_wd1e-2", 4, 1e-3, 0.9, 0.99, 0, 1e-2, 0, 0, true);
  flash_adamw_mw24_is_bit_exact();
  errors_change_nothing_and_say_why();
  groups_offload_and_threads();
  fast_arithmetic_stays_within_the_bound();
  shared_state_is_live_and_outlives_the_optimizer();
  return fo_test::summary("test_optim");
}
