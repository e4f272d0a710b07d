// The overlapped step: fo steps each layer as "backward" makes its gradient final, and the
// result has the bits of clip-then-step. 16 equal layers, AdamW with quant8 state; one
// optimizer steps sequentially (fo_clip_grad_norm, then fo_optimizer_step), the other opens
// a step, hands each layer's gradient over in backward's order (last layer first) and
// closes it with clipping in fo_optimizer_step_end. Prints the exposed step time both ways.
#include <fo.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <vector>

#define CHECK(call) \
  if ((call) != FO_OK) { std::fprintf(stderr, "%s\n", fo_last_error_message()); return 1; }

constexpr int kLayers = 16;
constexpr int64_t kNumel = 1 << 16;
using Clock = std::chrono::steady_clock;

static double ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

// Stands in for one layer's backward: fills its gradient (a little work per element).
static void backward_layer(std::vector<float>& g, int layer, int step) {
  for (int64_t i = 0; i < kNumel; ++i) g[i] = std::sin(0.001f * i + layer + 0.37f * step);
}

int main() {
  fo_optim_config cfg;
  fo_optim_config_default(FO_ALGORITHM_ADAMW, &cfg);
  cfg.state_format = FO_STATE_FORMAT_QUANT8;
  cfg.master_weight_bits = 0;
  fo_optimizer *seq = nullptr, *ovl = nullptr;
  CHECK(fo_optimizer_create(&cfg, &seq));
  CHECK(fo_optimizer_create(&cfg, &ovl));
  const int64_t shape[1] = {kNumel};
  std::vector<std::vector<float>> w_seq(kLayers, std::vector<float>(kNumel, 0.5f)), w_ovl = w_seq;
  std::vector<std::vector<float>> grads(kLayers, std::vector<float>(kNumel));
  std::vector<fo_tensor> g(kLayers);
  for (int l = 0; l < kLayers; ++l) {
    char name[32];
    std::snprintf(name, sizeof name, "layers.%d.weight", l);
    fo_tensor a{w_seq[l].data(), FO_DTYPE_F32, 1, shape, nullptr, FO_DEVICE_HOST};
    fo_tensor b{w_ovl[l].data(), FO_DTYPE_F32, 1, shape, nullptr, FO_DEVICE_HOST};
    int32_t i = 0;
    CHECK(fo_optimizer_add_param(seq, name, &a, nullptr, &i));
    CHECK(fo_optimizer_add_param(ovl, name, &b, nullptr, &i));
    g[l] = fo_tensor{grads[l].data(), FO_DTYPE_F32, 1, shape, nullptr, FO_DEVICE_HOST};
  }
  fo_comm* comm = nullptr;  // one rank: the clip norm's "all-reduce" is local
  CHECK(fo_comm_create_local_group(1, 60.0, &comm));
  fo_overlap_options opts;
  fo_overlap_options_default(&opts);
  const double max_norms[3] = {0.0, 1e6, 50.0};  // no clipping, clipping idle, clipping that triggers
  for (int step = 0; step < 3; ++step) {
    opts.max_norm = max_norms[step];
    // Sequential: the whole backward, then clip, then step (all of it after the last gradient).
    for (int l = kLayers - 1; l >= 0; --l) backward_layer(grads[l], l, step);
    auto t0 = Clock::now();
    double total = -1;
    if (opts.max_norm > 0) {
      std::vector<fo_clip_grad> cg(kLayers);
      for (int l = 0; l < kLayers; ++l) cg[l] = fo_clip_grad{g[l], 0};
      CHECK(fo_clip_grad_norm(comm, cg.data(), kLayers, opts.max_norm, 2.0, 0, &total));
    }
    CHECK(fo_optimizer_step(seq, g.data(), kLayers));
    double sequential = ms(Clock::now() - t0);

    // Overlapped: each layer handed over as soon as its gradient is final. fo reads it (and
    // may scale it in place when clipping) until step_end, so each layer has its own buffer.
    std::vector<std::vector<float>> own(kLayers, std::vector<float>(kNumel));
    std::vector<fo_tensor> og(kLayers);
    CHECK(fo_optimizer_step_begin(ovl, &opts));
    for (int32_t l = kLayers - 1; l >= 0; --l) {
      backward_layer(own[l], l, step);
      og[l] = fo_tensor{own[l].data(), FO_DTYPE_F32, 1, shape, nullptr, FO_DEVICE_HOST};
      CHECK(fo_optimizer_grads_ready(ovl, &l, &og[l], 1));
    }
    auto t1 = Clock::now();
    fo_overlap_stats st;
    CHECK(fo_optimizer_step_end(ovl, comm, &st));
    double exposed = ms(Clock::now() - t1);

    bool same = true;
    for (int l = 0; l < kLayers; ++l)
      same = same && std::memcmp(w_seq[l].data(), w_ovl[l].data(), kNumel * sizeof(float)) == 0;
    std::printf("step %d (max_norm %g): total norm %.4f (sequential %.4f), clipped %d, rolled back %llu, "
                "undo high water %llu B; exposed step: sequential %.2f ms, overlapped %.2f ms; %s\n",
                step, opts.max_norm, st.total_norm, total, st.clipped, (unsigned long long)st.rolled_back,
                (unsigned long long)st.undo_high_water_bytes, sequential, exposed,
                same ? "same bits" : "DIFFERENT");
    if (!same) return 1;
  }
  fo_comm_destroy(comm);
  fo_optimizer_destroy(seq);
  fo_optimizer_destroy(ovl);
  return 0;
}
