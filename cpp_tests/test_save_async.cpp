// Async saves through the C ABI: fo_state_save_async returns at once, steps run while
// the writer works, fo_save_wait returns the whole save's status, and the files equal a
// synchronous save of the state as of the call; poll and stats report progress and the
// staging pool's high-water mark within its budget; a write error surfaces at wait with
// FO_ERR_IO and the path; a communicator save commits at wait on every rank; a second
// save waits for the first's writer (and into one directory, for its commit, or is
// FO_ERR_BUSY while a communicator commit awaits its wait); ranks that disagree fail
// every rank at once; destroying the communicator before the wait fails the save
// (FO_ERR_COMM), never a use-after-free.
#include <cmath>
#include <condition_variable>
#include <mutex>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>
#include <unistd.h>

#include "check.hpp"

namespace fs = std::filesystem;

static const int64_t ROWS = 2003, COLS = 129;

// One rank: a quant8 AdamW optimizer over its Shard(0) rows of two (2003, 129) params.
struct Rank {
  fo_optimizer* opt = nullptr;
  std::vector<float> w[2];
  int64_t rows = 0, row0 = 0, mesh, coord;
  fo_placement pl{FO_PLACEMENT_SHARD, 0, 0};
  int64_t gshape[2] = {ROWS, COLS};

  Rank(int world, int rank) : mesh(world), coord(rank) {
    fo_shard_info info;
    CHECK_OK(fo_wrap_uneven(2, gshape, 1, &mesh, &coord, &pl, &info));
    rows = info.local_shape[0];
    row0 = info.global_offset[0];
    fo_optim_config cfg;
    fo_optim_config_default(0, &cfg);
    cfg.state_format = 1;  // quant8
    cfg.master_weight_bits = 0;
    cfg.lr = 1e-2;
    CHECK_OK(fo_optimizer_create(&cfg, &opt));
    int64_t shape[2] = {rows, COLS};
    fo_shard_spec spec{2, gshape, 1, &mesh, &coord, &pl};
    for (int k = 0; k < 2; ++k) {
      for (int64_t i = 0; i < rows * COLS; ++i) w[k].push_back(std::sin(0.3f * float(row0 * COLS + i) + float(k)));
      fo_tensor t{w[k].data(), 0, 2, shape, nullptr, -1};
      int32_t idx = -1;
      CHECK_OK(fo_optimizer_add_param(opt, k == 0 ? "a" : "b", &t, &spec, &idx));
    }
  }
  ~Rank() { fo_optimizer_destroy(opt); }

  void step(int s) {
    std::vector<float> g[2];
    int64_t shape[2] = {rows, COLS};
    fo_tensor t[2];
    for (int k = 0; k < 2; ++k) {
      g[k].resize(rows * COLS);
      for (int64_t i = 0; i < rows * COLS; ++i) g[k][i] = std::cos(0.7f * float(row0 * COLS + i) + float(s + k));
      t[k] = fo_tensor{g[k].data(), 0, 2, shape, nullptr, -1};
    }
    CHECK_OK(fo_optimizer_step(opt, t, 2));
  }
};

static std::string tmpdir(const char* name) {
  std::string d = (fs::temp_directory_path() / (std::string("fo_cpp_async_") + name + "_" + std::to_string(getpid()))).string();
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

static void same_files(const std::string& a, const std::string& b) {
  int n = 0;
  for (auto& e : fs::directory_iterator(a)) {
    std::string name = e.path().filename().string();
    if (name[0] == '.') continue;
    ++n;
    CHECK(fo_test::read_file(e.path().string()) == fo_test::read_file(b + "/" + name));
  }
  CHECK(n >= 2);  // a rank file and the commit record at least
}

static void async_save_equals_sync_save_while_steps_run() {
  Rank r(1, 0);
  r.step(0);
  std::string sync = tmpdir("sync"), asy = tmpdir("async");
  fo_pack_options po{0, 1, 0, 1, -1, "s1"};
  CHECK_OK(fo_state_save(r.opt, sync.c_str(), &po));
  fo_save_options so{po, 1 << 20};  // a 1 MiB pool: one param's state at a time
  fo_save* s = nullptr;
  CHECK_OK(fo_state_save_async(r.opt, asy.c_str(), &so, nullptr, &s));
  r.step(1);
  r.step(2);
  int32_t done = -1;
  uint64_t bytes = 0;
  CHECK_OK(fo_save_poll(s, &done, &bytes));
  CHECK(done == 0 || done == 1);
  CHECK_OK(fo_save_poll(s, nullptr, nullptr));
  CHECK_OK(fo_save_wait(s, -1.0));
  CHECK_OK(fo_save_wait(s, 0.0));  // the same outcome again
  fo_save_stats st;
  CHECK_OK(fo_save_stats_get(s, &st));
  CHECK(st.done == 1);
  CHECK(st.bytes_written == st.bytes_total && st.bytes_total > 0);
  CHECK(st.staging_budget == (1u << 20));
  CHECK(st.staging_high_water <= st.staging_budget);
  fo_save_destroy(s);
  same_files(asy, sync);
  CHECK_OK(fo_checkpoint_verify(asy.c_str()));
  fs::remove_all(sync);
  fs::remove_all(asy);
}

static void a_write_error_surfaces_at_wait_with_the_path() {
  Rank r(1, 0);
  r.step(0);
  std::string root = tmpdir("fault");
  std::string file = root + "/not-a-dir";
  { std::ofstream(file) << "x"; }
  std::string dir = file + "/ckpt";
  fo_save_options so{{0, 1, 0, 0, -1, nullptr}, 0};
  fo_save* s = nullptr;
  CHECK_OK(fo_state_save_async(r.opt, dir.c_str(), &so, nullptr, &s));
  r.step(1);
  fo_status st = fo_save_wait(s, 60.0);
  CHECK(st == FO_ERR_IO);
  CHECK(fo_test::last_error().find(file) != std::string::npos);
  CHECK(fo_save_wait(s, -1.0) == FO_ERR_IO);
  fo_save_destroy(s);
  CHECK(std::string(fo_status_name(FO_ERR_TIMEOUT)) == "FO_ERR_TIMEOUT");
  fs::remove_all(root);
}

static void destroying_the_optimizer_before_the_save_is_safe() {
  std::string sync = tmpdir("d-sync"), asy = tmpdir("d-async");
  fo_save* s = nullptr;
  {
    Rank r(1, 0);
    r.step(0);
    fo_pack_options po{0, 1, 0, 0, -1, "d"};
    CHECK_OK(fo_state_save(r.opt, sync.c_str(), &po));
    fo_save_options so{po, 0};
    CHECK_OK(fo_state_save_async(r.opt, asy.c_str(), &so, nullptr, &s));
  }  // fo_optimizer_destroy waits for the writer to let go of the state
  CHECK_OK(fo_save_wait(s, -1.0));
  fo_save_destroy(s);
  same_files(asy, sync);
  fs::remove_all(sync);
  fs::remove_all(asy);
}

static void two_ranks_commit_at_wait_through_a_communicator() {
  std::string sync = tmpdir("c-sync"), asy = tmpdir("c-async");
  fo_comm* comms[2] = {nullptr, nullptr};
  CHECK_OK(fo_comm_create_local_group(2, 60.0, comms));
  std::vector<std::thread> ts;
  for (int rank = 0; rank < 2; ++rank) {
    ts.emplace_back([&, rank] {
      Rank r(2, rank);
      r.step(0);
      fo_pack_options po{rank, 2, 0, 0, -1, "c"};
      CHECK_OK(fo_state_save_comm(r.opt, sync.c_str(), &po, comms[rank]));
      fo_save_options so{po, 0};
      fo_save* s = nullptr;
      CHECK_OK(fo_state_save_async(r.opt, asy.c_str(), &so, comms[rank], &s));
      r.step(1);
      CHECK_OK(fo_save_wait(s, -1.0));
      fo_save_destroy(s);
    });
  }
  for (auto& t : ts) t.join();
  for (auto* c : comms) fo_comm_destroy(c);
  same_files(asy, sync);
  fs::remove_all(sync);
  fs::remove_all(asy);
}

// Lifecycle: a second save while one is in flight waits for the first's writer (both
// files hold their call's state).
static void a_second_save_waits_for_the_first_and_both_hold_their_call_state() {
  Rank r(1, 0);
  r.step(0);
  std::string sa = tmpdir("2-sa"), sb = tmpdir("2-sb"), a = tmpdir("2-a"), b = tmpdir("2-b");
  fo_pack_options px{0, 1, 0, 1, -1, "x"}, py{0, 1, 0, 1, -1, "y"};
  fo_save *s1 = nullptr, *s2 = nullptr;
  CHECK_OK(fo_state_save(r.opt, sa.c_str(), &px));
  fo_save_options sx{px, 4096}, sy{py, 0};
  CHECK_OK(fo_state_save_async(r.opt, a.c_str(), &sx, nullptr, &s1));
  r.step(1);
  CHECK_OK(fo_state_save(r.opt, sb.c_str(), &py));
  CHECK_OK(fo_state_save_async(r.opt, b.c_str(), &sy, nullptr, &s2));
  r.step(2);
  CHECK_OK(fo_save_wait(s2, -1.0));
  CHECK_OK(fo_save_wait(s1, -1.0));
  fo_save_destroy(s2);
  fo_save_destroy(s1);
  same_files(a, sa);
  same_files(b, sb);
  for (auto& d : {sa, sb, a, b}) fs::remove_all(d);
}

// Lifecycle: the communicator destroyed before the save's wait. The destroy waits for
// the writer and detaches the save; the wait fails with FO_ERR_COMM (not committed:
// the previous checkpoint stays the visible one) and never touches the freed handle.
static void destroying_the_comm_before_wait_fails_the_save_and_keeps_the_previous() {
  std::string dir = tmpdir("cd"), ref = tmpdir("cd-ref");
  fo_comm* comm = nullptr;
  CHECK_OK(fo_comm_create_local_group(1, 60.0, &comm));
  Rank r(1, 0);
  r.step(0);
  fo_pack_options first{0, 1, 0, 0, -1, "first"};
  CHECK_OK(fo_state_save_comm(r.opt, dir.c_str(), &first, comm));
  CHECK_OK(fo_state_save(r.opt, ref.c_str(), &first));
  r.step(1);
  fo_save_options so{{0, 1, 0, 0, -1, "second"}, 0};
  fo_save* s = nullptr;
  CHECK_OK(fo_state_save_async(r.opt, dir.c_str(), &so, comm, &s));
  r.step(2);
  fo_comm_destroy(comm);
  int32_t done = 0;
  CHECK_OK(fo_save_poll(s, &done, nullptr));
  CHECK(done == 1);  // the destroy waited for the writer
  CHECK(fo_save_wait(s, -1.0) == FO_ERR_COMM);
  CHECK(fo_test::last_error().find("destroyed before fo_save_wait") != std::string::npos);
  CHECK(fo_save_wait(s, 0.0) == FO_ERR_COMM);  // the same outcome again
  fo_save_destroy(s);
  same_files(dir, ref);
  CHECK_OK(fo_checkpoint_verify(dir.c_str()));
  fs::remove_all(dir);
  fs::remove_all(ref);
}

// The ranks' threads meet here (C++17 has no std::barrier).
struct Barrier {
  std::mutex m;
  std::condition_variable cv;
  int n, waiting = 0, round = 0;
  explicit Barrier(int n) : n(n) {}
  void wait() {
    std::unique_lock<std::mutex> g(m);
    int r = round;
    if (++waiting == n) {
      waiting = 0;
      ++round;
      cv.notify_all();
    } else {
      cv.wait(g, [&] { return round != r; });
    }
  }
};

// A directory holds save `id` (whose synchronous twin is `ref`), byte for byte, and a
// fresh optimizer of the same rank loads it.
static void holds(const std::string& dir, const std::string& ref, int world, int rank) {
  same_files(dir, ref);
  CHECK_OK(fo_checkpoint_verify(dir.c_str()));
  Rank fresh(world, rank);
  fo_load_options lo{1, 0, 1};
  CHECK_OK(fo_state_load(fresh.opt, dir.c_str(), &lo, nullptr));
}

// Issue 38: a loop saving every N steps into `latest/` starts the next save before it
// waits for the previous one. Without a communicator the second save waits for the
// first's commit: both waits are OK and the directory holds the second save. Many runs,
// with and without a step between the calls.
static void a_second_save_into_one_dir_commits_after_the_first() {
  Rank r(1, 0);
  std::string dir = tmpdir("race"), ra = tmpdir("race-a"), rb = tmpdir("race-b");
  for (int run = 0; run < 20; ++run) {
    std::string a = "a" + std::to_string(run), b = "b" + std::to_string(run);
    fo_pack_options pa{0, 1, 0, 1, -1, a.c_str()}, pb{0, 1, 0, 1, -1, b.c_str()};
    r.step(2 * run);
    CHECK_OK(fo_state_save(r.opt, ra.c_str(), &pa));
    fo_save_options sa{pa, 0}, sb{pb, 0};
    fo_save *s1 = nullptr, *s2 = nullptr;
    CHECK_OK(fo_state_save_async(r.opt, dir.c_str(), &sa, nullptr, &s1));
    if (run % 2 == 0) r.step(2 * run + 1);
    CHECK_OK(fo_state_save(r.opt, rb.c_str(), &pb));
    CHECK_OK(fo_state_save_async(r.opt, dir.c_str(), &sb, nullptr, &s2));
    CHECK_OK(fo_save_wait(s1, INFINITY));
    CHECK_OK(fo_save_wait(s2, INFINITY));
    fo_save_destroy(s1);
    fo_save_destroy(s2);
    holds(dir, rb, 1, 0);
  }
  for (auto& d : {dir, ra, rb}) fs::remove_all(d);
}

// The same through a communicator (1 and 2 ranks): the first save commits at its wait,
// which the second cannot run for it, so the second is FO_ERR_BUSY on every rank,
// naming the first; the first's wait commits it; saved again after that wait, the
// second commits and replaces it.
static void a_second_save_through_a_comm_before_the_first_wait_is_busy() {
  for (int world : {1, 2}) {
    std::string dir = tmpdir("race-c"), ra = tmpdir("race-c-a"), rb = tmpdir("race-c-b");
    std::vector<fo_comm*> comms(world, nullptr);
    CHECK_OK(fo_comm_create_local_group(world, 60.0, comms.data()));
    Barrier sync(world);
    std::vector<std::thread> ts;
    for (int rank = 0; rank < world; ++rank) {
      ts.emplace_back([&, rank] {
        Rank r(world, rank);
        fo_comm* c = comms[rank];
        for (int run = 0; run < 8; ++run) {
          std::string a = "a" + std::to_string(run), b = "b" + std::to_string(run);
          fo_pack_options pa{rank, world, 0, 1, -1, a.c_str()}, pb{rank, world, 0, 1, -1, b.c_str()};
          r.step(3 * run);
          CHECK_OK(fo_state_save_comm(r.opt, ra.c_str(), &pa, c));
          fo_save_options sa{pa, 0}, sb{pb, 0};
          fo_save *s1 = nullptr, *s2 = nullptr;
          CHECK_OK(fo_state_save_async(r.opt, dir.c_str(), &sa, c, &s1));
          if (run % 2 == 0) r.step(3 * run + 1);
          CHECK(fo_state_save_async(r.opt, dir.c_str(), &sb, c, &s2) == FO_ERR_BUSY);
          CHECK(fo_test::last_error().find("\"" + a + "\"") != std::string::npos);
          CHECK(s2 == nullptr);
          CHECK_OK(fo_save_wait(s1, INFINITY));
          fo_save_destroy(s1);
          sync.wait();
          if (rank == 0) holds(dir, ra, world, rank);
          sync.wait();
          r.step(3 * run + 2);
          CHECK_OK(fo_state_save_comm(r.opt, rb.c_str(), &pb, c));
          CHECK_OK(fo_state_save_async(r.opt, dir.c_str(), &sb, c, &s2));
          CHECK_OK(fo_save_wait(s2, 1e300));
          fo_save_destroy(s2);
          sync.wait();
          if (rank == 0) holds(dir, rb, world, rank);
          sync.wait();
        }
      });
    }
    for (auto& t : ts) t.join();
    for (auto* c : comms) fo_comm_destroy(c);
    for (auto& d : {dir, ra, rb}) fs::remove_all(d);
  }
}

// Ranks that disagree fail every rank at once with FO_ERR_INVALID_ARGUMENT naming both
// values (the synchronous save's behaviour), never FO_ERR_INTERNAL or a timeout.
static void ranks_saving_into_different_dirs_fail_every_rank() {
  std::string d0 = tmpdir("dd0"), d1 = tmpdir("dd1");
  fo_comm* comms[2] = {nullptr, nullptr};
  CHECK_OK(fo_comm_create_local_group(2, 60.0, comms));
  std::vector<std::thread> ts;
  for (int rank = 0; rank < 2; ++rank) {
    ts.emplace_back([&, rank] {
      Rank r(2, rank);
      r.step(0);
      fo_save_options so{{rank, 2, 0, 0, -1, "s"}, 0};
      fo_save* s = nullptr;
      const std::string& dir = rank == 0 ? d0 : d1;
      CHECK(fo_state_save_async(r.opt, dir.c_str(), &so, comms[rank], &s) == FO_ERR_INVALID_ARGUMENT);
      std::string m = fo_test::last_error();
      CHECK(m.find(d0) != std::string::npos && m.find(d1) != std::string::npos);
      // One rank's bad option: every rank's error at once.
      fo_save_options bad{{rank == 1 ? 7 : 0, 2, 0, 0, -1, "s"}, 0};
      CHECK(fo_state_save_async(r.opt, d0.c_str(), &bad, comms[rank], &s) == FO_ERR_INVALID_ARGUMENT);
      CHECK(fo_test::last_error().find("options.rank") != std::string::npos);
      CHECK(s == nullptr);
      CHECK(fo_save_wait(nullptr, INFINITY) == FO_ERR_INVALID_ARGUMENT);  // NULL save
    });
  }
  for (auto& t : ts) t.join();
  for (auto* c : comms) fo_comm_destroy(c);
  fs::remove_all(d0);
  fs::remove_all(d1);
}

int main() {
  async_save_equals_sync_save_while_steps_run();
  a_write_error_surfaces_at_wait_with_the_path();
  destroying_the_optimizer_before_the_save_is_safe();
  two_ranks_commit_at_wait_through_a_communicator();
  a_second_save_waits_for_the_first_and_both_hold_their_call_state();
  destroying_the_comm_before_wait_fails_the_save_and_keeps_the_previous();
  a_second_save_into_one_dir_commits_after_the_first();
  a_second_save_through_a_comm_before_the_first_wait_is_busy();
  ranks_saving_into_different_dirs_fail_every_rank();
  return fo_test::summary("test_save_async");
}
