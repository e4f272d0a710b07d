// fo_comm through the C ABI: a 4-rank in-process broadcast of a state dict (uneven,
// strided and whole entries, one with a cast), the agreed error when a key is missing
// on rank 0, and a global gradient clip.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "check.hpp"

static std::mutex mu;  // guards CHECK bookkeeping across rank threads

// Runs fn(rank, comm) on one thread per rank of a fresh in-process group.
static void run_group(int world, const std::function<void(int, fo_comm*)>& fn) {
  std::vector<fo_comm*> comms(world, nullptr);
  CHECK_OK(fo_comm_create_local_group(world, 10.0, comms.data()));
  std::vector<std::thread> ts;
  for (int r = 0; r < world; ++r) ts.emplace_back([&, r] { fn(r, comms[r]); });
  for (auto& t : ts) t.join();
  for (auto* c : comms) fo_comm_destroy(c);
}

static uint16_t bf16_bits(float f) {  // round to nearest even, as fo does
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7FFF + ((u >> 16) & 1);
  return (uint16_t)(u >> 16);
}

struct Spec {  // owns the arrays an fo_shard_spec points at
  std::vector<int64_t> shape, mesh, coord;
  std::vector<fo_placement> pl;
  fo_shard_spec view() const {
    return {(int32_t)shape.size(), shape.data(), (int32_t)mesh.size(), mesh.data(), coord.data(), pl.data()};
  }
};

static std::vector<int64_t> indices(const Spec& s, int dim) {
  std::vector<int64_t> out(64);
  int64_t n = 0;
  fo_shard_indices((int32_t)s.shape.size(), s.shape.data(), (int32_t)s.mesh.size(), s.mesh.data(), s.coord.data(),
                   s.pl.data(), dim, out.data(), 64, &n);
  out.resize((size_t)n);
  return out;
}

static void four_ranks_receive_their_shards() {
  const int world = 4;
  // Rank 0's full tensors: w f32 [10, 3] (Shard(0): rows 3,3,3,1), s f32 [7, 2]
  // (_StridedShard(0, 2), received as bf16), b i64 [5] (a whole buffer).
  std::vector<float> w(30), s(14);
  for (int i = 0; i < 30; ++i) w[i] = 0.5f * i;
  for (int i = 0; i < 14; ++i) s[i] = 1.0f / (i + 1);
  std::vector<int64_t> b = {5, 4, 3, 2, 1};
  run_group(world, [&](int rank, fo_comm* comm) {
    const int64_t w_shape[2] = {10, 3}, s_shape[2] = {7, 2}, b_shape[1] = {5};
    fo_broadcast_source full[3] = {
        {"model.b", {b.data(), FO_DTYPE_I64, 1, b_shape, nullptr, FO_DEVICE_HOST}},
        {"model.w", {w.data(), FO_DTYPE_F32, 2, w_shape, nullptr, FO_DEVICE_HOST}},
        {"model.s", {s.data(), FO_DTYPE_F32, 2, s_shape, nullptr, FO_DEVICE_HOST}},
    };
    Spec ws{{10, 3}, {4}, {rank}, {{FO_PLACEMENT_SHARD, 0, 0}}};
    Spec ss{{7, 2}, {4}, {rank}, {{FO_PLACEMENT_STRIDED_SHARD, 0, 2}}};
    std::vector<int64_t> wrows = indices(ws, 0), srows = indices(ss, 0);
    const int64_t wl[2] = {(int64_t)wrows.size(), 3}, sl[2] = {(int64_t)srows.size(), 2};
    std::vector<float> wd(wrows.size() * 3, -1.f);
    std::vector<uint16_t> sd(srows.size() * 2, 0);
    std::vector<int64_t> bd(5, 0);
    fo_shard_spec wv = ws.view(), sv = ss.view();
    // Destinations in another order than rank 0's: pairing is by name.
    fo_broadcast_dest dests[3] = {
        {"model.w", {wd.data(), FO_DTYPE_F32, 2, wl, nullptr, FO_DEVICE_HOST}, &wv},
        {"model.s", {sd.data(), FO_DTYPE_BF16, 2, sl, nullptr, FO_DEVICE_HOST}, &sv},
        {"model.b", {bd.data(), FO_DTYPE_I64, 1, b_shape, nullptr, FO_DEVICE_HOST}, nullptr},
    };
    fo_broadcast_stats st{};
    fo_status rc = fo_broadcast_state_dict(comm, rank == 0 ? full : nullptr, rank == 0 ? 3 : 0, dests, 3, nullptr, &st);
    std::string msg = fo_last_error_message();
    std::lock_guard<std::mutex> g(mu);
    CHECK(rc == FO_OK);
    if (rc != FO_OK) std::fprintf(stderr, "rank %d: %s\n", rank, msg.c_str());
    bool ok = true;
    for (size_t i = 0; i < wrows.size(); ++i)
      for (int j = 0; j < 3; ++j) ok = ok && wd[i * 3 + j] == w[wrows[i] * 3 + j];
    for (size_t i = 0; i < srows.size(); ++i)
      for (int j = 0; j < 2; ++j) ok = ok && sd[i * 2 + j] == bf16_bits(s[srows[i] * 2 + j]);
    CHECK(ok);
    CHECK(bd == b);
    // Only the shard travels: w rows * 12 bytes + s rows * 8 bytes + the 40-byte buffer.
    CHECK(st.bytes_received == wrows.size() * 12 + srows.size() * 8 + 40);
    CHECK(st.tensors == 3 && st.table_bytes > 0);
    if (rank == 3) CHECK(wrows.size() == 1);
  });
}

static void a_key_missing_on_rank_0_fails_every_rank() {
  std::vector<std::string> msgs(4);
  std::vector<fo_status> codes(4);
  std::vector<float> src(4, 1.f);
  run_group(4, [&](int rank, fo_comm* comm) {
    const int64_t shape[1] = {4};
    std::vector<float> dst(4, 7.f);
    fo_broadcast_source full[1] = {{"a", {src.data(), FO_DTYPE_F32, 1, shape, nullptr, FO_DEVICE_HOST}}};
    fo_broadcast_dest dests[2] = {{"a", {dst.data(), FO_DTYPE_F32, 1, shape, nullptr, FO_DEVICE_HOST}, nullptr},
                                  {"missing.weight", {dst.data(), FO_DTYPE_F32, 1, shape, nullptr, FO_DEVICE_HOST}, nullptr}};
    codes[rank] = fo_broadcast_state_dict(comm, full, 1, dests, 2, nullptr, nullptr);
    msgs[rank] = fo_last_error_message();
    std::lock_guard<std::mutex> g(mu);
    CHECK(dst == std::vector<float>(4, 7.f));  // untouched
  });
  for (int r = 0; r < 4; ++r) {
    CHECK(codes[r] == FO_ERR_NOT_FOUND);
    CHECK(msgs[r] == msgs[0]);
  }
  CHECK(msgs[0].find("missing.weight") != std::string::npos);
}

static void an_unknown_dtype_on_one_rank_fails_every_rank_alike() {
  std::vector<std::string> msgs(4);
  std::vector<fo_status> codes(4);
  std::vector<float> src(4, 1.f);
  run_group(4, [&](int rank, fo_comm* comm) {
    const int64_t shape[1] = {4};
    std::vector<float> dst(4, 7.f);
    fo_broadcast_source full[1] = {{"a", {src.data(), FO_DTYPE_F32, 1, shape, nullptr, FO_DEVICE_HOST}}};
    fo_broadcast_dest dests[1] = {{"a", {dst.data(), rank == 2 ? 42 : FO_DTYPE_F32, 1, shape, nullptr, FO_DEVICE_HOST}, nullptr}};
    codes[rank] = fo_broadcast_state_dict(comm, full, 1, dests, 1, nullptr, nullptr);
    msgs[rank] = fo_last_error_message();
  });
  for (int r = 0; r < 4; ++r) {
    CHECK(codes[r] == FO_ERR_INVALID_ARGUMENT);
    CHECK(msgs[r] == msgs[0]);
  }
  CHECK(msgs[0].find("dests[0].tensor.dtype") != std::string::npos && msgs[0].find("on rank 2") != std::string::npos);
}

static void clip_scales_every_rank_by_the_global_norm() {
  // Rank r holds the shard {r+1, r+1}; plus a replicated {1} on every rank.
  // total^2 = 2 * (1 + 4 + 9 + 16) + 1 = 61.
  std::vector<double> totals(4);
  run_group(4, [&](int rank, fo_comm* comm) {
    std::vector<float> shard(2, (float)(rank + 1)), rep(1, 1.f);
    const int64_t s2[1] = {2}, s1[1] = {1};
    fo_clip_grad grads[2] = {{{shard.data(), FO_DTYPE_F32, 1, s2, nullptr, FO_DEVICE_HOST}, 1}, {{rep.data(), FO_DTYPE_F32, 1, s1, nullptr, FO_DEVICE_HOST}, 0}};
    double total = 0;
    fo_status rc = fo_clip_grad_norm(comm, grads, 2, 1.0, 2.0, 1, &total);
    std::lock_guard<std::mutex> g(mu);
    CHECK(rc == FO_OK);
    totals[rank] = total;
    float coef = (float)(1.0 / (std::sqrt(61.0) + 1e-6));
    CHECK(shard[0] == (float)(rank + 1) * coef && rep[0] == coef);
  });
  for (double t : totals) CHECK(std::fabs(t - std::sqrt(61.0)) < 1e-12);
  // A rank with no gradients still takes part.
  run_group(2, [&](int rank, fo_comm* comm) {
    std::vector<float> g1(1, 3.f);
    const int64_t s1[1] = {1};
    fo_clip_grad grads[1] = {{{g1.data(), FO_DTYPE_F32, 1, s1, nullptr, FO_DEVICE_HOST}, 1}};
    double total = 0;
    fo_status rc = fo_clip_grad_norm(comm, rank == 0 ? grads : nullptr, rank == 0 ? 1 : 0, 10.0, INFINITY, 0, &total);
    std::lock_guard<std::mutex> g(mu);
    CHECK(rc == FO_OK && total == 3.0);
  });
}

// A host-side transport for fo_comm_callbacks: threads meet in an all-gather rendezvous.
// `broken` releases every waiter (a rank that failed left); waits are bounded.
struct Hub {
  std::mutex m;
  std::condition_variable cv;
  int n;
  uint64_t round = 0;
  int arrived = 0;
  bool broken = false;
  std::vector<std::vector<uint8_t>> slots, result;
  explicit Hub(int n_) : n(n_), slots(n_) {}
  bool exchange(int rank, std::vector<uint8_t> mine, std::vector<std::vector<uint8_t>>& out) {
    std::unique_lock<std::mutex> lk(m);
    if (broken) return false;
    uint64_t my = round;
    slots[rank] = std::move(mine);
    if (++arrived == n) {
      result = slots;
      arrived = 0;
      ++round;
      cv.notify_all();
    } else if (!cv.wait_for(lk, std::chrono::seconds(10), [&] { return round != my || broken; }) || round == my) {
      return false;
    }
    out = result;
    return true;
  }
  void leave() {
    std::lock_guard<std::mutex> lk(m);
    broken = true;
    cv.notify_all();
  }
};

struct RankCtx {
  Hub* hub;
  int rank;
  int fail_broadcast_at;  // -1: never
  int broadcasts = 0;
};

extern "C" int32_t hub_broadcast(void* user, void* buf, uintptr_t n, int32_t root) {
  auto* c = static_cast<RankCtx*>(user);
  if (c->broadcasts++ == c->fail_broadcast_at) return 5;
  std::vector<uint8_t> mine;
  if (c->rank == root) mine.assign((uint8_t*)buf, (uint8_t*)buf + n);
  std::vector<std::vector<uint8_t>> all;
  if (!c->hub->exchange(c->rank, mine, all) || all[root].size() != n) return 1;
  if (n) std::memcpy(buf, all[root].data(), n);
  return 0;
}

extern "C" int32_t hub_all_reduce(void* user, double* vals, uintptr_t n, int32_t op) {
  auto* c = static_cast<RankCtx*>(user);
  std::vector<uint8_t> mine((uint8_t*)vals, (uint8_t*)(vals + n));
  std::vector<std::vector<uint8_t>> all;
  if (!c->hub->exchange(c->rank, mine, all)) return 1;
  for (size_t i = 0; i < n; ++i) {
    double acc = 0;
    for (int r = 0; r < c->hub->n; ++r) {
      double v;
      std::memcpy(&v, all[r].data() + i * 8, 8);
      acc = r == 0 ? v : (op == FO_REDUCE_SUM ? acc + v : (std::isnan(acc) || std::isnan(v) ? NAN : std::max(acc, v)));
    }
    vals[i] = acc;
  }
  return 0;
}

extern "C" int32_t hub_barrier(void* user) {
  auto* c = static_cast<RankCtx*>(user);
  std::vector<std::vector<uint8_t>> all;
  return c->hub->exchange(c->rank, {}, all) ? 0 : 1;
}

// Runs a 4-rank broadcast through fo_comm_create_callbacks; rank `failing` fails its
// broadcast number `at` (-1: nobody fails). Returns each rank's status and message.
static void callback_group(int failing, int at, std::vector<fo_status>& codes, std::vector<std::string>& msgs,
                           std::vector<std::vector<float>>& got) {
  const int world = 4;
  Hub hub(world);
  std::vector<float> w(10);
  for (int i = 0; i < 10; ++i) w[i] = 1.5f * i;
  std::vector<std::thread> ts;
  for (int rank = 0; rank < world; ++rank) {
    ts.emplace_back([&, rank] {
      RankCtx ctx{&hub, rank, rank == failing ? at : -1};
      fo_comm_callbacks cb{&ctx, hub_broadcast, hub_all_reduce, hub_barrier, nullptr};
      fo_comm* comm = nullptr;
      fo_comm_create_callbacks(rank, world, &cb, &comm);
      const int64_t shape[1] = {10};
      fo_broadcast_source full[1] = {{"w", {w.data(), FO_DTYPE_F32, 1, shape, nullptr, FO_DEVICE_HOST}}};
      Spec ws{{10}, {4}, {rank}, {{FO_PLACEMENT_SHARD, 0, 0}}};
      std::vector<int64_t> rows = indices(ws, 0);
      const int64_t local[1] = {(int64_t)rows.size()};
      got[rank].assign(rows.size(), -1.f);
      fo_shard_spec wv = ws.view();
      fo_broadcast_dest dests[1] = {{"w", {got[rank].data(), FO_DTYPE_F32, 1, local, nullptr, FO_DEVICE_HOST}, &wv}};
      codes[rank] = fo_broadcast_state_dict(comm, full, 1, dests, 1, nullptr, nullptr);
      msgs[rank] = fo_last_error_message();
      if (codes[rank] != FO_OK) hub.leave();  // a failed rank leaves; the others stop waiting
      fo_comm_destroy(comm);
    });
  }
  for (auto& t : ts) t.join();
}

static void host_callbacks_drive_the_broadcast_and_report_failures() {
  std::vector<fo_status> codes(4);
  std::vector<std::string> msgs(4);
  std::vector<std::vector<float>> got(4);
  callback_group(-1, -1, codes, msgs, got);
  for (int r = 0; r < 4; ++r) CHECK(codes[r] == FO_OK);
  CHECK((got[0] == std::vector<float>{0.f, 1.5f, 3.f}) && (got[3] == std::vector<float>{13.5f}));
  auto t0 = std::chrono::steady_clock::now();
  callback_group(1, 2, codes, msgs, got);  // broadcasts 0, 1: the table; 2: the data (no scatter callback)
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(5));
  for (int r = 0; r < 4; ++r) {
    CHECK(codes[r] == FO_ERR_COMM);
    CHECK(got[r] == std::vector<float>(got[r].size(), -1.f));  // untouched
  }
  CHECK(msgs[1].find("broadcast callback returned 5 on rank 1") != std::string::npos);
}

static void nccl_and_bad_arguments_report_clearly() {
  fo_comm* c = nullptr;
  int dummy = 0;
  CHECK_ERR(fo_comm_create_nccl(&dummy, nullptr, 0, 1, &c), FO_ERR_UNSUPPORTED, "cuda");
  CHECK_ERR(fo_comm_create_local_group(0, 1.0, &c), FO_ERR_INVALID_ARGUMENT, "world_size");
  fo_comm_callbacks cb{};
  CHECK_ERR(fo_comm_create_callbacks(0, 2, &cb, &c), FO_ERR_INVALID_ARGUMENT, "callbacks.broadcast");
  CHECK_ERR(fo_broadcast_state_dict(nullptr, nullptr, 0, nullptr, 0, nullptr, nullptr), FO_ERR_INVALID_ARGUMENT, "comm");
  fo_comm_destroy(nullptr);
  fo_comm* one[1];
  CHECK_OK(fo_comm_create_local_group(1, 1.0, one));
  int32_t rank = -1, world = -1;
  CHECK_OK(fo_comm_info(one[0], &rank, &world));
  CHECK(rank == 0 && world == 1);
  fo_comm_destroy(one[0]);
}

int main() {
  four_ranks_receive_their_shards();
  a_key_missing_on_rank_0_fails_every_rank();
  an_unknown_dtype_on_one_rank_fails_every_rank_alike();
  clip_scales_every_rank_by_the_global_norm();
  host_callbacks_drive_the_broadcast_and_report_failures();
  nccl_and_bad_arguments_report_clearly();
  return fo_test::summary("test_comm");
}
