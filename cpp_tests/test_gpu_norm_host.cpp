// The clip's GPU kernels (src/kernels/gpu/fo_norm.cuh) built for the host by the
// C++ compiler without contraction, against libfo's CPU fo_clip_grad_norm, bit for bit:
// the total norm (p = 2, 1, infinity) summed from the kernels' chunk partials as fo
// folds them, and the gradients the scale kernel writes, for f32/bf16/f16/f64
// gradients across chunk boundaries, several in one launch.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "check.hpp"
#include "fo_norm.cuh"

namespace {

enum { F32 = 0, F16 = 1, BF16 = 2, F64 = 3 };
size_t dsize(int32_t d) { return d == F64 ? 8 : d == F32 ? 4 : 2; }

std::vector<uint8_t> encode(int32_t dtype, const std::vector<double>& v) {
  std::vector<uint8_t> b(v.size() * dsize(dtype));
  for (size_t i = 0; i < v.size(); ++i) {
    if (dtype == F64) {
      std::memcpy(&b[8 * i], &v[i], 8);
    } else if (dtype == F32) {
      float f = (float)v[i];
      std::memcpy(&b[4 * i], &f, 4);
    } else {
      uint16_t h = dtype == F16 ? fo_f32_to_f16((float)v[i]) : fo_f32_to_bf16((float)v[i]);
      std::memcpy(&b[2 * i], &h, 2);
    }
  }
  return b;
}

// The kernels' result as fo folds it: each tensor's chunks in order, then the tensors.
struct Kernels {
  double sum = 0, max = 0;
};

Kernels run_norm(std::vector<std::vector<uint8_t>>& bufs, const std::vector<int32_t>& dtypes,
                 const std::vector<uint64_t>& sizes, int power) {
  std::vector<fo_norm_tensor> t;
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  uint64_t chunks = 0;
  for (size_t i = 0; i < bufs.size(); ++i) {
    uint64_t n = (sizes[i] + FO_NORM_CHUNK - 1) / FO_NORM_CHUNK;
    ranges.push_back({chunks, chunks + n});
    if (n) t.push_back({bufs[i].data(), sizes[i], chunks, dtypes[i], 0});
    chunks += n;
  }
  std::vector<double> ls(chunks * FO_NORM_LANES), lm(chunks * FO_NORM_LANES), out(2 * chunks);
  fo_host_launch(5, 7, [&] { fo_norm_lanes_kernel(t.data(), (int)t.size(), chunks, power, ls.data(), lm.data()); });
  fo_host_launch(2, 3, [&] { fo_norm_chunks_kernel(ls.data(), lm.data(), chunks, out.data()); });
  Kernels k;
  for (auto [lo, hi] : ranges) {
    double s = 0, m = 0;
    for (uint64_t c = lo; c < hi; ++c) s = s + out[2 * c], m = fo_nanmax(out[2 * c + 1], m);
    k.sum = k.sum + s;
    k.max = fo_nanmax(m, k.max);
  }
  return k;
}

void norms_and_scaling_match_libfo() {
  fo_comm* comm = nullptr;
  CHECK_OK(fo_comm_create_local_group(1, 30.0, &comm));
  const std::vector<uint64_t> sizes = {1, 8191, 8192, 8193, 0, 20000};
  std::mt19937_64 rng(11);
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  for (int32_t dtype : {F32, BF16, F16, F64}) {
    for (double p : {2.0, 1.0, (double)INFINITY}) {
      std::vector<std::vector<uint8_t>> ours, theirs;
      std::vector<int32_t> dtypes;
      for (size_t i = 0; i < sizes.size(); ++i) {
        std::vector<double> v(sizes[i]);
        for (size_t j = 0; j < v.size(); ++j) v[j] = j % 5 == 0 ? 0.0 : u(rng) * std::pow(10.0, (double)(j % 9) - 4);
        ours.push_back(encode(dtype, v));
        dtypes.push_back(dtype);
      }
      theirs = ours;
      Kernels k = run_norm(ours, dtypes, sizes, p == 2.0 ? 2 : 1);
      double want = std::isinf(p) ? k.max : p == 2.0 ? std::sqrt(k.sum + 0.0) : k.sum + 0.0;
      // fo: the same gradients on the host, all shards of rank 0 of 1.
      std::vector<int64_t> shapes(sizes.begin(), sizes.end());
      std::vector<fo_clip_grad> grads;
      for (size_t i = 0; i < sizes.size(); ++i)
        grads.push_back({{theirs[i].data(), dtype, 1, &shapes[i], nullptr, -1}, 1});
      double max_norm = want * 0.5, total = 0;
      CHECK_OK(fo_clip_grad_norm(comm, grads.data(), (int64_t)grads.size(), max_norm, p, 1, &total));
      if (std::memcmp(&total, &want, 8) != 0) {
        std::fprintf(stderr, "dtype %d p %g: kernels %.17g, libfo %.17g\n", dtype, p, want, total);
        CHECK(false);
      }
      double coef = max_norm / (total + 1e-6);
      std::vector<fo_norm_tensor> t;
      uint64_t chunks = 0;
      for (size_t i = 0; i < sizes.size(); ++i) {
        if (!sizes[i]) continue;
        t.push_back({ours[i].data(), sizes[i], chunks, dtype, 0});
        chunks += (sizes[i] + FO_NORM_CHUNK - 1) / FO_NORM_CHUNK;
      }
      fo_host_launch(4, 5, [&] { fo_scale_kernel(t.data(), (int)t.size(), chunks, (float)coef, coef); });
      CHECK(ours == theirs);
    }
  }
  fo_comm_destroy(comm);
}

}  // namespace

int main() {
  norms_and_scaling_match_libfo();
  return fo_test::summary("test_gpu_norm_host");
}
