// The step kernel's vector accesses (src/kernels/gpu/fo_vec.cuh: a lane's 4 elements in one
// access of 4, 8 or 16 bytes), on the host build through the shim, whose vector load and
// store abort on an address not aligned to their size (a fault on a GPU) and count the rest:
// - the shim does abort on a misaligned vector load or store (a forked child);
// - a range moved in vectors and one moved element by element hold the same bytes;
// - the step kernel over tensors whose arrays start 1 or 2 elements past a 16-byte
//   boundary (2, 4 or 8 bytes; one array or all), with lengths that leave tails shorter
//   than a vector, takes no vector at all and gives the bytes of the all-aligned run,
//   which takes exactly one vector access per array of every whole range.
// test_gpu_kernels_host checks the aligned run against libfo's CPU step, bit for bit.
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "check.hpp"
#include "fo_step.cuh"

namespace {

// `n` bytes starting `off` bytes past a 16-byte boundary.
struct Buf {
  std::vector<uint8_t> mem;
  uint8_t* p = nullptr;
  size_t n = 0;
  Buf() = default;
  Buf(size_t bytes, size_t off) : mem(bytes + 32), n(bytes) {
    uintptr_t a = reinterpret_cast<uintptr_t>(mem.data());
    p = mem.data() + ((16 - a % 16) % 16) + off;
  }
  std::string bytes() const { return std::string((const char*)p, n); }
};

bool aborts(void (*f)()) {
  pid_t pid = fork();
  if (pid == 0) {
    f();
    _exit(0);
  }
  int st = 0;
  waitpid(pid, &st, 0);
  return WIFSIGNALED(st) && WTERMSIG(st) == SIGABRT;
}

alignas(16) uint8_t g_block[64];

uint32_t g_words[4] = {1, 2, 3, 4};

void the_shim_aborts_on_a_misaligned_vector_access() {
  CHECK(!aborts([] { fo_vload(g_block + 16, 16, g_words); }));
  CHECK(aborts([] { fo_vload(g_block + 4, 16, g_words); }));
  CHECK(aborts([] { fo_vload(g_block + 2, 16, g_words); }));
  CHECK(aborts([] { fo_vstore(g_block + 8, 16, g_words); }));
  CHECK(!aborts([] { fo_vstore(g_block + 32, 16, g_words); }));
  CHECK(!aborts([] { fo_vload(g_block + 8, 8, g_words); }));
  CHECK(aborts([] { fo_vload(g_block + 4, 8, g_words); }));
  CHECK(!aborts([] { fo_vstore(g_block + 4, 4, g_words); }));
  CHECK(aborts([] { fo_vstore(g_block + 2, 4, g_words); }));
}

// Gather then scatter a range of FO_VEC elements of each size in one access and element by
// element: the same words in, the same bytes out, and one access each way.
void vector_and_element_ranges_agree() {
  std::mt19937 rng(7);
  for (int size : {1, 2, 4}) {
    Buf src(64 * size, 0), a(64 * size, 0), b(64 * size, 0);
    for (size_t i = 0; i < src.n; ++i) src.p[i] = (uint8_t)rng();
    for (uint64_t e0 : {0u, 16u, 32u}) {
      uint32_t wv[FO_VEC], we[FO_VEC];
      uint64_t l0 = fo_vec_loads, s0 = fo_vec_stores;
      fo_gather(wv, src.p, size, e0, FO_VEC, true);
      fo_scatter(a.p, wv, size, e0, FO_VEC, true);
      CHECK(fo_vec_loads - l0 == 1 && fo_vec_stores - s0 == 1);
      fo_gather(we, src.p, size, e0, FO_VEC, false);
      fo_scatter(b.p, we, size, e0, FO_VEC, false);
      CHECK(fo_vec_loads - l0 == 1 && fo_vec_stores - s0 == 1);
      CHECK(std::memcmp(wv, we, sizeof wv) == 0);
      CHECK(std::memcmp(a.p + e0 * size, src.p + e0 * size, FO_VEC * size) == 0);
    }
    CHECK(a.bytes() == b.bytes());
  }
}

// One tensor's arrays; `shift[k]`: elements past a 16-byte boundary for param, grad,
// error bits, m, v.
struct Row {
  Buf param, grad, err, m, v, ms, vs;
};

struct Case {
  const char* name;
  int32_t pdtype, gdtype, ebits, mk, vk;
  fo_rule rule;
};

int msize(int32_t k) { return k == FO_MOMENT_NONE ? 0 : k == FO_MOMENT_F32 ? 4 : k <= FO_MOMENT_BF16 ? 2 : 1; }

fo_rule adam(int32_t kind) {
  fo_rule r{};
  r.kind = kind, r.decay = 0.999f, r.b1 = 0.9f, r.w1 = 0.1f, r.b2 = 0.999f, r.w2 = 0.001f;
  r.bc1 = 0.1f, r.bc2 = 0.001f, r.bc2_sqrt = 0.0316f, r.eps = 1e-8f, r.lr = kind == FO_RULE_TORCH_ADAM ? -0.1f : 1e-2f;
  return r;
}

fo_rule sgd() {
  fo_rule r{};
  r.kind = FO_RULE_FLASH_SGD, r.has_momentum = 1, r.momentum = 0.9f, r.wdamp = 1.0f, r.decay = 1.0f, r.lr = 1e-2f;
  r.has_l2 = 1, r.l2 = 1e-2f;
  return r;
}

fo_rule lion() {
  fo_rule r{};
  r.kind = FO_RULE_TORCH_LION, r.decay = 0.99f, r.b1 = 0.9f, r.w1 = 0.1f, r.b2 = 0.99f, r.w2 = 0.01f, r.lr = -1e-3f;
  return r;
}

const size_t kSizes[] = {1, 15, 16, 17, 31, 32, 33, 47, 100, 130};

// Runs two steps of `c` over every size with arrays shifted by `shift` elements; returns
// every array's bytes and counts the vector accesses in *loads and *stores.
std::string run(const Case& c, const int* shift, uint64_t* loads, uint64_t* stores) {
  int ps = c.pdtype == 0 ? 4 : 2, gs = c.gdtype == 0 ? 4 : 2, es = c.ebits / 8;
  int ms = msize(c.mk), vs = msize(c.vk);
  std::mt19937 rng(11);
  std::vector<Row> rows(std::size(kSizes));
  std::vector<fo_step_tensor> table;
  uint64_t groups = 0;
  auto fill = [&](Buf& b, size_t bytes, size_t off, bool finite16) {
    b = Buf(bytes, off);
    for (size_t i = 0; i < b.n; ++i) b.p[i] = (uint8_t)rng();
    // Halves and floats as moderate numbers (random bits are NaN or huge too often).
    for (size_t i = 0; finite16 && i + 1 < b.n; i += 2) b.p[i + 1] = (uint8_t)(0x30 + b.p[i + 1] % 16);
  };
  for (size_t r = 0; r < rows.size(); ++r) {
    size_t n = kSizes[r], g = (n + 31) / 32;
    Row& w = rows[r];
    fill(w.param, n * ps, shift[0] * ps, true);
    fill(w.grad, n * gs, shift[1] * gs, true);
    fill(w.err, n * es, shift[2] * es, false);
    fill(w.m, n * ms, shift[3] * ms, ms > 1);
    fill(w.v, n * vs, shift[4] * vs, vs > 1);
    fill(w.ms, 2 * g, 0, true);
    fill(w.vs, 2 * g, 0, true);
    fo_step_tensor t{};
    t.param = w.param.p, t.grad = w.grad.p, t.error_bits = es ? w.err.p : nullptr;
    t.m = ms ? w.m.p : nullptr, t.v = vs ? w.v.p : nullptr;
    t.m_scales = (uint16_t*)w.ms.p, t.v_scales = (uint16_t*)w.vs.p;
    t.numel = n, t.group_begin = groups, t.param_dtype = c.pdtype, t.grad_dtype = c.gdtype;
    t.error_bits_width = c.ebits, t.m_kind = c.mk, t.v_kind = c.vk;
    table.push_back(t);
    groups += g;
  }
  uint64_t l0 = fo_vec_loads, s0 = fo_vec_stores;
  // One block of one warp: the grid-stride loop runs many times, tensors straddle it.
  for (int step = 0; step < 2; ++step)
    fo_host_launch(1, 32, [&] { fo_step_kernel(table.data(), (int)table.size(), groups, c.rule, step == 0); });
  *loads = fo_vec_loads - l0, *stores = fo_vec_stores - s0;
  std::string out;
  for (Row& w : rows)
    out += w.param.bytes() + w.err.bytes() + w.m.bytes() + w.v.bytes() + w.ms.bytes() + w.vs.bytes();
  return out;
}

void misaligned_and_tail_ranges_step_element_by_element() {
  const Case cases[] = {
      {"f32 adam fp32 state", 0, 0, 0, FO_MOMENT_F32, FO_MOMENT_F32, adam(FO_RULE_TORCH_ADAM)},
      {"bf16+8 adamw quant8", 2, 2, 8, FO_MOMENT_Q8_SIGNED, FO_MOMENT_Q8_SQRT, adam(FO_RULE_FLASH_ADAM)},
      {"f16+16 adam quant8_wide f32 grad", 1, 0, 16, FO_MOMENT_Q8_SIGNED, FO_MOMENT_Q8_FOURTH,
       adam(FO_RULE_FLASH_ADAM)},
      {"bf16 sgd bf16 state f16 grad", 2, 1, 0, FO_MOMENT_BF16, FO_MOMENT_NONE, sgd()},
      {"f16+8 lion f16 state", 1, 1, 8, FO_MOMENT_F16, FO_MOMENT_NONE, lion()},
  };
  const int shifts[][5] = {{1, 1, 1, 1, 1}, {2, 2, 2, 2, 2}, {1, 0, 0, 0, 0}, {0, 1, 0, 0, 0},
                           {0, 0, 1, 0, 0}, {0, 0, 0, 1, 0}, {0, 0, 0, 0, 2}};
  const int aligned[5] = {0, 0, 0, 0, 0};
  int runs = 0;
  for (const Case& c : cases) {
    uint64_t loads = 0, stores = 0;
    std::string want = run(c, aligned, &loads, &stores);
    // Every whole range moves each array in one access: sum(n / FO_VEC) ranges per step,
    // the gradient loaded, the parameter, error bits and moments loaded and stored.
    uint64_t whole = 0;
    for (size_t n : kSizes) whole += n / FO_VEC;
    uint64_t out_arrays = 1 + (c.ebits != 0) + (c.mk != 0) + (c.vk != 0);
    CHECK(loads == 2 * whole * (out_arrays + 1));
    CHECK(stores == 2 * whole * out_arrays);
    for (const int* s : shifts) {
      const bool present[5] = {true, true, c.ebits != 0, c.mk != 0, c.vk != 0};
      bool shifted = false;
      for (int k = 0; k < 5; ++k) shifted = shifted || (present[k] && s[k] != 0);
      if (!shifted) continue;  // the one shifted array is not there
      std::string got = run(c, s, &loads, &stores);
      CHECK(loads == 0 && stores == 0);
      if (got != want) fo_test::fail(__FILE__, __LINE__, std::string(c.name) + ": a shifted run differs");
      ++runs;
    }
  }
  std::printf("vector step: %d shifted runs equal to the aligned ones\n", runs);
  CHECK(runs == 5 * 7 - 4);
}

}  // namespace

int main() {
  the_shim_aborts_on_a_misaligned_vector_access();
  vector_and_element_ranges_agree();
  misaligned_and_tail_ranges_step_element_by_element();
  return fo_test::summary("test_gpu_vec_host");
}
