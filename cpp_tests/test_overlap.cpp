// The overlapped step through the C ABI (fo_optimizer_step_begin / _grads_ready /
// _step_end): bit-identical to fo_optimizer_step with the same gradients, handed over in
// reverse order and in buckets; with clipping, to fo_clip_grad_norm then
// fo_optimizer_step (clipping that triggers and that does not); a bad gradient fails the
// step with nothing changed; misuse is an error; destroy with a step open restores;
// ranks of one communicator that disagree on clipping fail every rank, nothing stepped.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "check.hpp"

namespace {

const std::vector<std::vector<int64_t>> kShapes = {{300}, {7, 9}, {2048 + 77}, {5}};

uint16_t bf16(float x) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  return (uint16_t)((b + 0x7fff + ((b >> 16) & 1)) >> 16);
}

float bf16_to_float(uint16_t h) {
  uint32_t b = (uint32_t)h << 16;
  float x;
  std::memcpy(&x, &b, 4);
  return x;
}

int64_t numel(const std::vector<int64_t>& s) {
  int64_t n = 1;
  for (auto d : s) n *= d;
  return n;
}

// Deterministic values in [-scale, scale] as bf16 bits.
std::vector<uint16_t> values(int64_t n, uint32_t seed, float scale) {
  std::vector<uint16_t> v((size_t)n);
  uint32_t x = seed * 2654435761u + 1;
  for (auto& e : v) {
    x ^= x << 13, x ^= x >> 17, x ^= x << 5;
    e = bf16(((float)(x % 20001) / 10000.0f - 1.0f) * scale);
  }
  return v;
}

fo_tensor view(void* data, const std::vector<int64_t>& shape) {
  return fo_tensor{data, FO_DTYPE_BF16, (int32_t)shape.size(), shape.data(), nullptr, FO_DEVICE_HOST};
}

struct Model {
  fo_optimizer* opt = nullptr;
  std::vector<std::vector<uint16_t>> params;
  Model() {
    fo_optim_config cfg;
    fo_optim_config_default(FO_ALGORITHM_ADAMW, &cfg);  // quant8 state, 24-bit masters
    cfg.lr = cfg.initial_lr = 1e-2;
    CHECK_OK(fo_optimizer_create(&cfg, &opt));
    for (size_t i = 0; i < kShapes.size(); ++i) {
      params.push_back(values(numel(kShapes[i]), 7 + (uint32_t)i, 1.0f));
      fo_tensor t = view(params[i].data(), kShapes[i]);
      int32_t idx = -1;
      CHECK_OK(fo_optimizer_add_param(opt, ("p" + std::to_string(i)).c_str(), &t, nullptr, &idx));
    }
  }
  ~Model() { fo_optimizer_destroy(opt); }
  // Parameters and every state entry, raw.
  std::string bits() const {
    std::string out;
    for (auto& p : params) out.append((const char*)p.data(), p.size() * 2);
    for (int32_t i = 0; i < (int32_t)params.size(); ++i) {
      char keys[1024];
      size_t len = 0;
      CHECK_OK(fo_optimizer_state_keys(opt, i, keys, sizeof keys, &len));
      std::string all(keys), key;
      for (size_t at = 0; at <= all.size(); ++at) {
        if (at < all.size() && all[at] != '\n') {
          key += all[at];
          continue;
        }
        if (key.empty()) continue;
        int32_t dt = 0, nd = 0;
        int64_t shape[FO_MAX_DIMS];
        CHECK_OK(fo_optimizer_state_info(opt, i, key.c_str(), &dt, &nd, shape));
        int64_t n = 1;
        for (int d = 0; d < nd; ++d) n *= shape[d];
        size_t width = dt == FO_DTYPE_F32 || dt == FO_DTYPE_I32 ? 4 : dt == FO_DTYPE_I64 || dt == FO_DTYPE_F64 ? 8
                       : dt == FO_DTYPE_I8 || dt == FO_DTYPE_U8 ? 1 : 2;
        std::string buf((size_t)n * width + 1, '\0');
        std::vector<int64_t> sh(shape, shape + nd);
        fo_tensor t{&buf[0], dt, nd, sh.data(), nullptr, FO_DEVICE_HOST};
        CHECK_OK(fo_optimizer_get_state(opt, i, key.c_str(), &t));
        out += key + buf;
        key.clear();
      }
    }
    return out;
  }
};

struct Grads {
  std::vector<std::vector<uint16_t>> data;
  std::vector<fo_tensor> views;
  Grads(uint32_t seed, float scale) {
    for (size_t i = 0; i < kShapes.size(); ++i) data.push_back(values(numel(kShapes[i]), seed * 31 + (uint32_t)i, scale));
    for (size_t i = 0; i < kShapes.size(); ++i) views.push_back(view(data[i].data(), kShapes[i]));
  }
};

// Hands everything over in reverse order, two buckets, and ends the step.
fo_status overlapped(Model& m, Grads& g, const fo_overlap_options* o, fo_overlap_stats* st) {
  CHECK_OK(fo_optimizer_step_begin(m.opt, o));
  int32_t late[2] = {3, 2}, early[2] = {1, 0};
  fo_tensor a[2] = {g.views[3], g.views[2]}, b[2] = {g.views[1], g.views[0]};
  CHECK_OK(fo_optimizer_grads_ready(m.opt, late, a, 2));
  CHECK_OK(fo_optimizer_grads_ready(m.opt, early, b, 2));
  return fo_optimizer_step_end(m.opt, nullptr, st);
}

void same_bits_as_one_step() {
  Model a, b;
  for (uint32_t s = 0; s < 3; ++s) {
    Grads ga(s, 1.0f), gb(s, 1.0f);
    CHECK_OK(fo_optimizer_step(a.opt, ga.views.data(), ga.views.size()));
    fo_overlap_stats st;
    CHECK_OK(overlapped(b, gb, nullptr, &st));
    CHECK(st.handed_over == 4 && st.speculative == 4 && st.rolled_back == 0 && st.total_norm == -1.0);
    CHECK(st.undo_high_water_bytes > 0);
    CHECK(a.bits() == b.bits());
  }
}

void clipping_equals_clip_then_step() {
  fo_comm* comm = nullptr;
  CHECK_OK(fo_comm_create_local_group(1, 5.0, &comm));
  for (double max_norm : {0.5, 1e6}) {
    Model a, b;
    for (uint32_t s = 0; s < 2; ++s) {
      Grads ga(s + 10, 1.0f), gb(s + 10, 1.0f);
      std::vector<fo_clip_grad> cg;
      for (auto& v : ga.views) cg.push_back(fo_clip_grad{v, 0});
      double total = 0;
      CHECK_OK(fo_clip_grad_norm(comm, cg.data(), (int64_t)cg.size(), max_norm, 2.0, 0, &total));
      CHECK_OK(fo_optimizer_step(a.opt, ga.views.data(), ga.views.size()));
      fo_overlap_options o;
      fo_overlap_options_default(&o);
      o.max_norm = max_norm;
      fo_overlap_stats st;
      CHECK_OK(overlapped(b, gb, &o, &st));
      CHECK(std::memcmp(&st.total_norm, &total, sizeof total) == 0);
      bool clips = max_norm / (total + 1e-6) < 1.0;
      CHECK(st.clipped == (clips ? 1 : 0));
      // once the clip is certain to scale, later gradients wait for step_end (no early step)
      CHECK(st.speculative + st.deferred == 4);
      CHECK(st.rolled_back == (clips ? st.speculative : 0u));
      CHECK(ga.data == gb.data);  // scaled alike (or not at all)
      CHECK(a.bits() == b.bits());
    }
  }
  fo_comm_destroy(comm);
}

void a_bad_gradient_changes_nothing() {
  Model m;
  Grads g(3, 1.0f);
  CHECK_OK(fo_optimizer_step(m.opt, g.views.data(), g.views.size()));
  std::string before = m.bits();
  CHECK_OK(fo_optimizer_step_begin(m.opt, nullptr));
  int32_t ok[2] = {0, 1};
  CHECK_OK(fo_optimizer_grads_ready(m.opt, ok, g.views.data(), 2));
  int32_t bad = 2;
  fo_tensor wrong = g.views[3];  // p3's shape for p2
  CHECK_ERR(fo_optimizer_grads_ready(m.opt, &bad, &wrong, 1), FO_ERR_SHAPE, "gradient of p2");
  fo_overlap_stats st;
  CHECK_ERR(fo_optimizer_step_end(m.opt, nullptr, &st), FO_ERR_SHAPE, "gradient of p2");
  CHECK(st.rolled_back == 2 && st.rollback_ns > 0);
  CHECK(m.bits() == before);
}

void abort_puts_every_early_step_back() {
  Model m;
  Grads g(4, 1.0f);
  CHECK_OK(fo_optimizer_step(m.opt, g.views.data(), g.views.size()));
  std::string before = m.bits();
  CHECK_ERR(fo_optimizer_step_abort(m.opt, nullptr), FO_ERR_INVALID_ARGUMENT, "no overlapped step is open");
  CHECK_OK(fo_optimizer_step_begin(m.opt, nullptr));
  int32_t all[4] = {0, 1, 2, 3};
  CHECK_OK(fo_optimizer_grads_ready(m.opt, all, g.views.data(), 4));
  fo_overlap_stats st;
  CHECK_OK(fo_optimizer_step_abort(m.opt, &st));
  CHECK(st.handed_over == 4 && st.rolled_back == st.speculative);
  CHECK(m.bits() == before);
  // The step is closed: the handle takes a plain step again.
  CHECK_ERR(fo_optimizer_step_end(m.opt, nullptr, nullptr), FO_ERR_INVALID_ARGUMENT, "no overlapped step is open");
  CHECK_OK(fo_optimizer_step(m.opt, g.views.data(), g.views.size()));
}

// The undo records kept between overlapped steps are freed on request, with their size;
// a second request frees nothing; with a step open the call is refused; the next
// overlapped step makes them again.
void kept_undo_records_are_released() {
  Model m;
  Grads g(4, 1.0f);
  size_t freed = 7;
  CHECK_OK(fo_optimizer_release_undo(m.opt, &freed));
  CHECK(freed == 0);
  int32_t all[4] = {0, 1, 2, 3};
  for (int k = 0; k < 2; ++k) {
    CHECK_OK(fo_optimizer_step_begin(m.opt, nullptr));
    CHECK_OK(fo_optimizer_grads_ready(m.opt, all, g.views.data(), 4));
    if (k == 1) CHECK_ERR(fo_optimizer_release_undo(m.opt, &freed), FO_ERR_BUSY, "fo_optimizer_release_undo");
    fo_overlap_stats st;
    CHECK_OK(fo_optimizer_step_end(m.opt, nullptr, &st));
    CHECK(st.speculative == 4);
    CHECK_OK(fo_optimizer_release_undo(m.opt, &freed));
    CHECK(freed > 0 && freed <= st.undo_high_water_bytes);
    CHECK_OK(fo_optimizer_release_undo(m.opt, nullptr));
    CHECK_OK(fo_optimizer_release_undo(m.opt, &freed));
    CHECK(freed == 0);
  }
}

// A gradient edited after its early step is named by fo_optimizer_grads_changed: scaled
// (the sampled fingerprint), or one element changed (only the full one, once asked for);
// one multiplied by 1.0 is not named. Redone as fo.torch does it (abort, then the plain
// step), the result is the plain step's with the final gradients.
void edited_gradients_are_named_and_the_redone_step_is_exact() {
  Model m, plain;
  CHECK_OK(fo_optimizer_set_full_fingerprints(m.opt, 1));
  Grads g(9, 1.0f), final_g(9, 1.0f);
  int32_t all[4] = {0, 1, 2, 3}, out[4] = {-1, -1, -1, -1};
  size_t n = 99;
  CHECK_OK(fo_optimizer_step_begin(m.opt, nullptr));
  CHECK_OK(fo_optimizer_grads_ready(m.opt, all, g.views.data(), 4));
  CHECK_OK(fo_optimizer_grads_changed(m.opt, all, 4, out, 4, &n));
  CHECK(n == 0);
  for (auto& e : g.data[3]) e = bf16(0.5f * bf16_to_float(e));  // a loop's clip, say
  g.data[2][600] ^= 1;  // one element between the sampled bytes
  CHECK_OK(fo_optimizer_grads_changed(m.opt, nullptr, 0, out, 4, &n));
  CHECK(n == 1 && out[0] == 3);
  CHECK_OK(fo_optimizer_grads_changed(m.opt, all, 4, out, 1, &n));
  CHECK(n == 2 && out[0] == 2);  // two changed; room for one
  CHECK_OK(fo_optimizer_step_abort(m.opt, nullptr));
  CHECK_OK(fo_optimizer_step(m.opt, g.views.data(), g.views.size()));
  for (auto& e : final_g.data[3]) e = bf16(0.5f * bf16_to_float(e));
  final_g.data[2][600] ^= 1;
  CHECK_OK(fo_optimizer_step(plain.opt, final_g.views.data(), final_g.views.size()));
  CHECK(m.bits() == plain.bits());
}

void misuse_is_an_error() {
  Model m;
  Grads g(5, 1.0f);
  int32_t i0 = 0;
  CHECK_ERR(fo_optimizer_grads_ready(m.opt, &i0, g.views.data(), 1), FO_ERR_INVALID_ARGUMENT, "no overlapped step is open");
  CHECK_ERR(fo_optimizer_step_end(m.opt, nullptr, nullptr), FO_ERR_INVALID_ARGUMENT, "no overlapped step is open");
  CHECK_OK(fo_optimizer_step_begin(m.opt, nullptr));
  CHECK_ERR(fo_optimizer_step_begin(m.opt, nullptr), FO_ERR_INVALID_ARGUMENT, "already open");
  CHECK_OK(fo_optimizer_grads_ready(m.opt, &i0, g.views.data(), 1));
  CHECK_ERR(fo_optimizer_step(m.opt, g.views.data(), g.views.size()), FO_ERR_BUSY, "fo_optimizer_step: ");
  uint64_t bytes = 0;
  CHECK_ERR(fo_optimizer_state_bytes(m.opt, -1, &bytes), FO_ERR_BUSY, "overlapped step open");
  int32_t n = 0;
  CHECK_OK(fo_optimizer_num_params(m.opt, &n));
  CHECK_ERR(fo_optimizer_grads_ready(m.opt, &i0, g.views.data(), 1), FO_ERR_INVALID_ARGUMENT, "already handed over");
  CHECK(fo_optimizer_step_end(m.opt, nullptr, nullptr) == FO_ERR_INVALID_ARGUMENT);
  CHECK_OK(fo_optimizer_step(m.opt, g.views.data(), g.views.size()));
}

void destroy_with_a_step_open_restores() {
  auto* m = new Model();
  std::vector<std::vector<uint16_t>> before = m->params;
  Grads g(9, 1.0f);
  CHECK_OK(fo_optimizer_step_begin(m->opt, nullptr));
  int32_t all[4] = {0, 1, 2, 3};
  CHECK_OK(fo_optimizer_grads_ready(m->opt, all, g.views.data(), 4));
  fo_optimizer_destroy(m->opt);
  m->opt = nullptr;
  CHECK(m->params == before);
  delete m;
}

}  // namespace

// Issue 38: through a communicator, rank 0 clipping while rank 1 does not used to step
// rank 1 (FO_OK) while rank 0 timed out in the norm's all-reduce. Every rank now fails at
// once with FO_ERR_INVALID_ARGUMENT naming both choices, and nothing is stepped.
void ranks_disagreeing_on_clipping_fail_every_rank_with_nothing_stepped() {
  fo_comm* comms[2] = {nullptr, nullptr};
  CHECK_OK(fo_comm_create_local_group(2, 60.0, comms));
  std::vector<std::thread> ts;
  for (int rank = 0; rank < 2; ++rank) {
    ts.emplace_back([&, rank] {
      Model m;
      Grads g(5, 1.0f);
      std::string before = m.bits();
      fo_overlap_options o{rank == 0 ? 0.5 : 0.0, 2.0, 0, UINT64_MAX};
      CHECK_OK(fo_optimizer_step_begin(m.opt, &o));
      int32_t all[4] = {0, 1, 2, 3};
      CHECK_OK(fo_optimizer_grads_ready(m.opt, all, g.views.data(), 4));
      fo_overlap_stats st;
      CHECK(fo_optimizer_step_end(m.opt, comms[rank], &st) == FO_ERR_INVALID_ARGUMENT);
      std::string msg = fo_test::last_error();
      CHECK(msg.find("rank 1 does not clip while rank 0 clips") != std::string::npos);
      CHECK(m.bits() == before);
    });
  }
  for (auto& t : ts) t.join();
  for (auto* c : comms) fo_comm_destroy(c);
}

int main() {
  same_bits_as_one_step();
  clipping_equals_clip_then_step();
  a_bad_gradient_changes_nothing();
  misuse_is_an_error();
  edited_gradients_are_named_and_the_redone_step_is_exact();
  abort_puts_every_early_step_back();
  kept_undo_records_are_released();
  destroy_with_a_step_open_restores();
  ranks_disagreeing_on_clipping_fail_every_rank_with_nothing_stepped();
  return fo_test::summary("test_overlap");
}
