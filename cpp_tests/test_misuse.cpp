// The misuse table (issue 11): every function exported by include/fo.h called the way a
// hostile or careless caller would — NULL in each pointer, negative and huge sizes, unknown
// enums, flags outside their documented values. Each case runs in a forked child under an
// alarm, so a crash, an abort or a hang fails that case by name instead of the whole run.
// A case passes when the call returns a non-OK status with a non-empty message and writes
// nothing to stderr (a caught panic prints there); cases marked RETURNS (NULL-safe destroys,
// functions without a status) pass when the call returns at all.
// The header is parsed for every `fo_...(` declaration: a function without a case fails.
#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <regex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "check.hpp"

namespace {

constexpr unsigned kAlarmSeconds = 20;
constexpr int64_t kI64Max = std::numeric_limits<int64_t>::max();
constexpr int32_t kI32Max = std::numeric_limits<int32_t>::max();
const double kNaN = std::nan("");
const double kInf = std::numeric_limits<double>::infinity();

enum class Expect { Error, Returns };

struct Case {
  std::string fn;    // the exported function under test
  std::string what;  // the misuse, for the failure message
  Expect expect;
  std::function<fo_status()> call;
};

// Everything a case may need, valid, built in the child (fork keeps only the calling
// thread, so nothing that owns threads is built before forking).
struct Fx {
  float w[4] = {1, 2, 3, 4};
  float g[4] = {0.1f, -0.2f, 0.3f, -0.4f};
  float scratch[64] = {};
  int64_t shape4[1] = {4};
  int64_t neg_shape[1] = {-4};
  int64_t huge_shape[2] = {kI64Max, kI64Max};
  int64_t neg_stride[1] = {-1};
  fo_optim_config cfg{};
  fo_optimizer* opt = nullptr;
  fo_comm* comm = nullptr;
  fo_packed* packed = nullptr;
  std::string dir;       // a valid one-rank checkpoint
  std::string empty;     // an empty directory
  std::string outdir;    // where consolidate may write
  fo_pack_options pack{0, 1, FO_PACK_MODE_COMPRESSED, FO_PACK_PARAMS_NONE, FO_WRITE_UNSHARDED_RANK0, nullptr};
  fo_load_options load{1, 0, 1};
  fo_tensor param() { return fo_tensor{w, FO_DTYPE_F32, 1, shape4, nullptr, FO_DEVICE_HOST}; }
  fo_tensor grad() { return fo_tensor{g, FO_DTYPE_F32, 1, shape4, nullptr, FO_DEVICE_HOST}; }
  fo_tensor out4() { return fo_tensor{scratch, FO_DTYPE_F32, 1, shape4, nullptr, FO_DEVICE_HOST}; }
  fo_optimizer* fresh() {
    fo_optimizer* o = nullptr;
    must(fo_optimizer_create(&cfg, &o), "create");
    return o;
  }
  // A fixture call that fails makes every case meaningless: the child exits 4.
  static void must(fo_status s, const char* what) {
    if (s != FO_OK) {
      std::fprintf(stderr, "fixture: %s failed: %s\n", what, fo_last_error_message());
      _exit(4);
    }
  }
  Fx() {
    fo_optim_config_default(FO_ALGORITHM_ADAMW, &cfg);
    cfg.master_weight_bits = 0;  // f32 params hold their own master
    must(fo_optimizer_create(&cfg, &opt), "create");
    int32_t idx = -1;
    fo_tensor p = param();
    must(fo_optimizer_add_param(opt, "w", &p, nullptr, &idx), "add_param");
    fo_tensor gr = grad();
    must(fo_optimizer_step(opt, &gr, 1), "step");
    must(fo_comm_create_local_group(1, 5.0, &comm), "local group");
    must(fo_state_pack(opt, &pack, &packed), "pack");
    char t[] = "/tmp/fo_misuse_XXXXXX";
    std::string root = mkdtemp(t);
    dir = root + "/ckpt";
    empty = root + "/empty";
    outdir = root + "/out";
    mkdir(dir.c_str(), 0700);
    mkdir(empty.c_str(), 0700);
    must(fo_state_save(opt, dir.c_str(), &pack), "save");
    must(fo_checkpoint_verify(dir.c_str()), "verify");
  }
};

Fx& fx() {
  static Fx f;
  return f;
}

std::string read_all(int fd) {
  std::string s;
  char buf[4096];
  ssize_t n;
  while ((n = read(fd, buf, sizeof buf)) > 0) s.append(buf, static_cast<size_t>(n));
  return s;
}

// Runs one case in a child; returns "" when it passed, else why it failed.
std::string run_case(const Case& c) {
  int out_pipe[2], err_pipe[2];
  if (pipe(out_pipe) != 0 || pipe(err_pipe) != 0) return "pipe failed";
  std::fflush(nullptr);
  pid_t pid = fork();
  if (pid < 0) return "fork failed";
  if (pid == 0) {
    close(out_pipe[0]);
    close(err_pipe[0]);
    dup2(err_pipe[1], 2);
    fx();  // the fixture's own calls are not the case under test
    alarm(kAlarmSeconds);
    fo_status s = c.call();
    std::string msg = fo_last_error_message();
    std::string line = std::to_string(s) + "\n" + msg;
    if (write(out_pipe[1], line.data(), line.size()) < 0) _exit(3);
    _exit(0);
  }
  close(out_pipe[1]);
  close(err_pipe[1]);
  std::string result = read_all(out_pipe[0]);
  std::string err = read_all(err_pipe[0]);
  close(out_pipe[0]);
  close(err_pipe[0]);
  int st = 0;
  waitpid(pid, &st, 0);
  if (WIFSIGNALED(st)) {
    int sig = WTERMSIG(st);
    return sig == SIGALRM ? "hung (no return within " + std::to_string(kAlarmSeconds) + " s)"
                          : std::string("killed by signal ") + strsignal(sig) + "; stderr: " + err;
  }
  if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) return "child exited abnormally; stderr: " + err;
  if (c.expect == Expect::Returns) return "";
  size_t nl = result.find('\n');
  if (nl == std::string::npos) return "no status reported";
  int status = std::stoi(result.substr(0, nl));
  std::string msg = result.substr(nl + 1);
  if (status == FO_OK) return "returned FO_OK";
  if (msg.empty()) return std::string("returned ") + fo_status_name(status) + " with an empty message";
  if (status == FO_ERR_INTERNAL) return "returned FO_ERR_INTERNAL (a caught panic): " + msg;
  if (!err.empty()) return "wrote to stderr: " + err;
  return "";
}

// The functions the header exports, parsed from its declarations.
std::set<std::string> exported_functions() {
  std::string h = fo_test::read_file(std::string(FO_SOURCE_DIR) + "/include/fo.h");
  std::regex decl(R"((?:^|\n)(?:fo_status |void |const char \*|uint32_t )(fo_[a-z0-9_]+)\()");
  std::set<std::string> names;
  for (auto it = std::sregex_iterator(h.begin(), h.end(), decl); it != std::sregex_iterator(); ++it)
    names.insert((*it)[1]);
  return names;
}

std::vector<Case> cases() {
  std::vector<Case> v;
  auto E = [&](const char* fn, const char* what, std::function<fo_status(Fx&)> f) {
    v.push_back({fn, what, Expect::Error, [f] { return f(fx()); }});
  };
  auto R = [&](const char* fn, const char* what, std::function<void(Fx&)> f) {
    v.push_back({fn, what, Expect::Returns, [f] {
                   f(fx());
                   return FO_OK;
                 }});
  };

  // ---- status and version: no status to return; they must simply return.
  R("fo_last_error_message", "before any failure", [](Fx&) { (void)fo_last_error_message(); });
  R("fo_status_name", "unknown code 12345", [](Fx&) { (void)fo_status_name(12345); });
  R("fo_status_name", "negative code", [](Fx&) { (void)fo_status_name(-1); });
  R("fo_version", "plain call", [](Fx&) { (void)fo_version(); });
  R("fo_abi_version", "plain call", [](Fx&) { (void)fo_abi_version(); });

  // ---- checkpoint
  using PO = fo_pack_options;
  auto pack_with = [](std::function<void(PO&)> edit) {
    return [edit](Fx& f) {
      PO o = f.pack;
      edit(o);
      fo_packed* p = nullptr;
      return fo_state_pack(f.opt, &o, &p);
    };
  };
  E("fo_state_pack", "opt NULL", [](Fx& f) { fo_packed* p; return fo_state_pack(nullptr, &f.pack, &p); });
  E("fo_state_pack", "options NULL", [](Fx& f) { fo_packed* p; return fo_state_pack(f.opt, nullptr, &p); });
  E("fo_state_pack", "out NULL", [](Fx& f) { return fo_state_pack(f.opt, &f.pack, nullptr); });
  E("fo_state_pack", "mode 7", pack_with([](PO& o) { o.mode = 7; }));
  E("fo_state_pack", "mode -1", pack_with([](PO& o) { o.mode = -1; }));
  E("fo_state_pack", "params 9", pack_with([](PO& o) { o.params = 9; }));
  E("fo_state_pack", "write_unsharded 5", pack_with([](PO& o) { o.write_unsharded = 5; }));
  E("fo_state_pack", "write_unsharded INT32_MIN", pack_with([](PO& o) { o.write_unsharded = INT32_MIN; }));
  E("fo_state_pack", "rank -1", pack_with([](PO& o) { o.rank = -1; }));
  E("fo_state_pack", "world_size -1", pack_with([](PO& o) { o.world_size = -1; }));
  E("fo_state_pack", "world_size 0", pack_with([](PO& o) { o.world_size = 0; }));
  E("fo_state_pack", "rank == world_size", pack_with([](PO& o) { o.rank = 1; }));
  E("fo_state_pack", "save_id not UTF-8", pack_with([](PO& o) { o.save_id = "\xff\xfe"; }));

  E("fo_packed_num_entries", "packed NULL", [](Fx&) { size_t n; return fo_packed_num_entries(nullptr, &n); });
  E("fo_packed_num_entries", "out NULL", [](Fx& f) { return fo_packed_num_entries(f.packed, nullptr); });
  E("fo_packed_get_entry", "packed NULL", [](Fx&) { fo_packed_entry e; return fo_packed_get_entry(nullptr, 0, &e); });
  E("fo_packed_get_entry", "index SIZE_MAX", [](Fx& f) { fo_packed_entry e; return fo_packed_get_entry(f.packed, SIZE_MAX, &e); });
  E("fo_packed_get_entry", "out NULL", [](Fx& f) { return fo_packed_get_entry(f.packed, 0, nullptr); });
  E("fo_packed_metadata_json", "packed NULL", [](Fx&) { size_t n; return fo_packed_metadata_json(nullptr, nullptr, 0, &n); });
  E("fo_packed_metadata_json", "out_len NULL", [](Fx& f) { char b[8]; return fo_packed_metadata_json(f.packed, b, 8, nullptr); });
  E("fo_packed_metadata_json", "capacity 1", [](Fx& f) { char b[1]; size_t n; return fo_packed_metadata_json(f.packed, b, 1, &n); });
  E("fo_packed_metadata_json", "buf NULL, capacity 1<<20", [](Fx& f) { size_t n; return fo_packed_metadata_json(f.packed, nullptr, 1 << 20, &n); });
  E("fo_packed_save", "packed NULL", [](Fx& f) { return fo_packed_save(nullptr, f.empty.c_str()); });
  E("fo_packed_save", "dir NULL", [](Fx& f) { return fo_packed_save(f.packed, nullptr); });
  E("fo_packed_save", "dir not UTF-8", [](Fx& f) { return fo_packed_save(f.packed, "/tmp/\xff"); });
  E("fo_packed_save", "dir under /proc", [](Fx& f) { return fo_packed_save(f.packed, "/proc/fo-no/such"); });
  E("fo_packed_save", "dir empty string", [](Fx& f) { return fo_packed_save(f.packed, ""); });
  R("fo_packed_destroy", "NULL", [](Fx&) { fo_packed_destroy(nullptr); });

  E("fo_state_save", "opt NULL", [](Fx& f) { return fo_state_save(nullptr, f.empty.c_str(), &f.pack); });
  E("fo_state_save", "dir NULL", [](Fx& f) { return fo_state_save(f.opt, nullptr, &f.pack); });
  E("fo_state_save", "options NULL", [](Fx& f) { return fo_state_save(f.opt, f.empty.c_str(), nullptr); });
  E("fo_state_save", "mode 3", [](Fx& f) { PO o = f.pack; o.mode = 3; return fo_state_save(f.opt, f.empty.c_str(), &o); });
  E("fo_state_save", "write_unsharded 5", [](Fx& f) { PO o = f.pack; o.write_unsharded = 5; return fo_state_save(f.opt, f.empty.c_str(), &o); });
  E("fo_state_save", "rank 3 of 2", [](Fx& f) { PO o = f.pack; o.rank = 3; o.world_size = 2; return fo_state_save(f.opt, f.empty.c_str(), &o); });
  E("fo_state_save", "dir under /proc", [](Fx& f) { return fo_state_save(f.opt, "/proc/fo-no/such", &f.pack); });
  E("fo_state_save", "dir empty string", [](Fx& f) { return fo_state_save(f.opt, "", &f.pack); });
  E("fo_state_save", "world_size INT32_MAX-1", [](Fx& f) { PO o = f.pack; o.world_size = kI32Max - 1; return fo_state_save(f.opt, f.empty.c_str(), &o); });
  E("fo_state_save", "world_size 1e8", [](Fx& f) { PO o = f.pack; o.world_size = 100000000; o.save_id = "big"; return fo_state_save(f.opt, f.empty.c_str(), &o); });
  E("fo_state_save_comm", "opt NULL", [](Fx& f) { return fo_state_save_comm(nullptr, f.empty.c_str(), &f.pack, f.comm); });
  E("fo_state_save_comm", "dir NULL", [](Fx& f) { return fo_state_save_comm(f.opt, nullptr, &f.pack, f.comm); });
  E("fo_state_save_comm", "options NULL", [](Fx& f) { return fo_state_save_comm(f.opt, f.empty.c_str(), nullptr, f.comm); });
  E("fo_state_save_comm", "comm NULL", [](Fx& f) { return fo_state_save_comm(f.opt, f.empty.c_str(), &f.pack, nullptr); });
  E("fo_state_save_comm", "mode 3", [](Fx& f) { PO o = f.pack; o.mode = 3; return fo_state_save_comm(f.opt, f.empty.c_str(), &o, f.comm); });
  E("fo_state_save_comm", "write_unsharded 5", [](Fx& f) { PO o = f.pack; o.write_unsharded = 5; return fo_state_save_comm(f.opt, f.empty.c_str(), &o, f.comm); });
  E("fo_state_save_comm", "world_size 2 on a 1-rank comm", [](Fx& f) { PO o = f.pack; o.world_size = 2; return fo_state_save_comm(f.opt, f.empty.c_str(), &o, f.comm); });
  // Async saves: every pointer checked; a bad option fails at the call, nothing starts.
  using SO = fo_save_options;
  E("fo_state_save_async", "opt NULL", [](Fx& f) { fo_save* s = nullptr; SO o{f.pack, 0}; return fo_state_save_async(nullptr, f.empty.c_str(), &o, nullptr, &s); });
  E("fo_state_save_async", "dir NULL", [](Fx& f) { fo_save* s = nullptr; SO o{f.pack, 0}; return fo_state_save_async(f.opt, nullptr, &o, nullptr, &s); });
  E("fo_state_save_async", "options NULL", [](Fx& f) { fo_save* s = nullptr; return fo_state_save_async(f.opt, f.empty.c_str(), nullptr, nullptr, &s); });
  E("fo_state_save_async", "out NULL", [](Fx& f) { SO o{f.pack, 0}; return fo_state_save_async(f.opt, f.empty.c_str(), &o, nullptr, nullptr); });
  E("fo_state_save_async", "mode 3", [](Fx& f) { fo_save* s = nullptr; SO o{f.pack, 0}; o.pack.mode = 3; return fo_state_save_async(f.opt, f.empty.c_str(), &o, nullptr, &s); });
  E("fo_state_save_async", "world_size 2 on a 1-rank comm", [](Fx& f) { fo_save* s = nullptr; SO o{f.pack, 0}; o.pack.world_size = 2; o.pack.save_id = "x"; return fo_state_save_async(f.opt, f.empty.c_str(), &o, f.comm, &s); });
  E("fo_state_save_async", "dir under /proc (fails at wait)", [](Fx& f) {
    fo_save* s = nullptr; SO o{f.pack, 0};
    fo_status st = fo_state_save_async(f.opt, "/proc/fo-no/such", &o, nullptr, &s);
    if (st != FO_OK) return st;
    st = fo_save_wait(s, -1.0);
    fo_save_destroy(s);
    return st;
  });
  E("fo_save_wait", "save NULL", [](Fx&) { return fo_save_wait(nullptr, -1.0); });
  E("fo_save_wait", "timeout NaN", [](Fx& f) {
    fo_save* s = nullptr; SO o{f.pack, 0};
    Fx::must(fo_state_save_async(f.opt, f.empty.c_str(), &o, nullptr, &s), "save_async");
    fo_status st = fo_save_wait(s, kNaN);
    fo_save_destroy(s);
    return st;
  });
  // INFINITY (or any timeout past a week) means "no limit", as a negative one does
  // (issue 38): tests/ffi_save_lifecycle.rs and test_save_async.cpp wait with it.
  E("fo_save_poll", "save NULL", [](Fx&) { int32_t d = 0; uint64_t b = 0; return fo_save_poll(nullptr, &d, &b); });
  E("fo_save_stats_get", "save NULL", [](Fx&) { fo_save_stats st; return fo_save_stats_get(nullptr, &st); });
  E("fo_save_stats_get", "out NULL", [](Fx& f) {
    fo_save* s = nullptr; SO o{f.pack, 0};
    Fx::must(fo_state_save_async(f.opt, f.empty.c_str(), &o, nullptr, &s), "save_async");
    fo_status st = fo_save_stats_get(s, nullptr);
    fo_save_destroy(s);
    return st;
  });
  R("fo_save_destroy", "NULL", [](Fx&) { fo_save_destroy(nullptr); });
  E("fo_state_save_comm", "dir under /proc", [](Fx& f) { return fo_state_save_comm(f.opt, "/proc/fo-no/such", &f.pack, f.comm); });
  E("fo_state_save_comm", "dir empty string", [](Fx& f) { return fo_state_save_comm(f.opt, "", &f.pack, f.comm); });

  using LO = fo_load_options;
  auto load_with = [](LO o) { return [o](Fx& f) { return fo_state_load(f.opt, f.dir.c_str(), &o, nullptr); }; };
  E("fo_state_load", "opt NULL", [](Fx& f) { return fo_state_load(nullptr, f.dir.c_str(), nullptr, nullptr); });
  E("fo_state_load", "dir NULL", [](Fx& f) { return fo_state_load(f.opt, nullptr, nullptr, nullptr); });
  E("fo_state_load", "dir missing", [](Fx& f) { return fo_state_load(f.opt, "/tmp/fo-no-such-dir-x", nullptr, nullptr); });
  E("fo_state_load", "dir empty", [](Fx& f) { return fo_state_load(f.opt, f.empty.c_str(), nullptr, nullptr); });
  E("fo_state_load", "dir is a file", [](Fx& f) { return fo_state_load(f.opt, "/etc/hostname", nullptr, nullptr); });
  E("fo_state_load", "dir empty string", [](Fx& f) { return fo_state_load(f.opt, "", nullptr, nullptr); });
  E("fo_state_load", "strict 7", load_with(LO{7, 0, 1}));
  E("fo_state_load", "strict -1", load_with(LO{-1, 0, 1}));
  E("fo_state_load", "params 5", load_with(LO{1, 5, 1}));
  E("fo_state_load", "param_groups 2", load_with(LO{1, 0, 2}));
  E("fo_state_load", "into an optimizer of another shape", [](Fx& f) {
    fo_optimizer* o = f.fresh();
    float w2[3] = {1, 2, 3};
    int64_t s3[1] = {3};
    fo_tensor p{w2, FO_DTYPE_F32, 1, s3, nullptr, FO_DEVICE_HOST};
    int32_t i;
    Fx::must(fo_optimizer_add_param(o, "w", &p, nullptr, &i), "add_param [3]");
    return fo_state_load(o, f.dir.c_str(), nullptr, nullptr);
  });

  E("fo_checkpoint_consolidate", "dir NULL", [](Fx& f) { return fo_checkpoint_consolidate(nullptr, f.outdir.c_str()); });
  E("fo_checkpoint_consolidate", "out_dir NULL", [](Fx& f) { return fo_checkpoint_consolidate(f.dir.c_str(), nullptr); });
  E("fo_checkpoint_consolidate", "dir missing", [](Fx& f) { return fo_checkpoint_consolidate("/tmp/fo-no-such-dir-x", f.outdir.c_str()); });
  E("fo_checkpoint_consolidate", "dir empty", [](Fx& f) { return fo_checkpoint_consolidate(f.empty.c_str(), f.outdir.c_str()); });
  E("fo_checkpoint_consolidate", "out_dir under /proc", [](Fx& f) { return fo_checkpoint_consolidate(f.dir.c_str(), "/proc/fo-no/such"); });
  E("fo_checkpoint_consolidate", "dir empty string", [](Fx& f) { return fo_checkpoint_consolidate("", f.outdir.c_str()); });
  E("fo_checkpoint_consolidate", "out_dir empty string", [](Fx& f) { return fo_checkpoint_consolidate(f.dir.c_str(), ""); });
  // Offline tools: NULL paths and out pointers, unknown codes and counts fail at the call,
  // and nothing is written at the destination.
  E("fo_checkpoint_convert", "src NULL", [](Fx& f) { return fo_checkpoint_convert(nullptr, f.outdir.c_str(), nullptr); });
  E("fo_checkpoint_convert", "dst NULL", [](Fx& f) { return fo_checkpoint_convert(f.dir.c_str(), nullptr, nullptr); });
  E("fo_checkpoint_convert", "src missing", [](Fx& f) { return fo_checkpoint_convert("/tmp/fo-no-such-dir-x", f.outdir.c_str(), nullptr); });
  E("fo_checkpoint_convert", "dst = src", [](Fx& f) { return fo_checkpoint_convert(f.dir.c_str(), f.dir.c_str(), nullptr); });
  E("fo_checkpoint_convert", "to 9", [](Fx& f) {
    fo_convert_options o{9, 0, 0, nullptr, 0, nullptr, 0};
    return fo_checkpoint_convert(f.dir.c_str(), f.outdir.c_str(), &o);
  });
  E("fo_checkpoint_convert", "mesh NULL for 2 dims", [](Fx& f) {
    fo_convert_options o{FO_CONVERT_FORMAT_KEEP, 0, 2, nullptr, 0, nullptr, 0};
    return fo_checkpoint_convert(f.dir.c_str(), f.outdir.c_str(), &o);
  });
  E("fo_checkpoint_convert", "num_placements -1", [](Fx& f) {
    fo_placement pl{FO_PLACEMENT_SHARD, 0, 0};
    fo_convert_options o{FO_CONVERT_FORMAT_KEEP, 0, 0, nullptr, -1, &pl, 0};
    return fo_checkpoint_convert(f.dir.c_str(), f.outdir.c_str(), &o);
  });
  E("fo_checkpoint_convert", "ranks 5000", [](Fx& f) {
    fo_convert_options o{FO_CONVERT_FORMAT_KEEP, 5000, 0, nullptr, 0, nullptr, 0};
    return fo_checkpoint_convert(f.dir.c_str(), f.outdir.c_str(), &o);
  });
  E("fo_checkpoint_convert", "force 2", [](Fx& f) {
    fo_convert_options o{FO_CONVERT_FORMAT_KEEP, 0, 0, nullptr, 0, nullptr, 2};
    return fo_checkpoint_convert(f.dir.c_str(), f.outdir.c_str(), &o);
  });
  E("fo_checkpoint_diff_json", "a NULL", [](Fx& f) { char* s; return fo_checkpoint_diff_json(nullptr, f.dir.c_str(), 0, 0, &s); });
  E("fo_checkpoint_diff_json", "out_json NULL", [](Fx& f) { return fo_checkpoint_diff_json(f.dir.c_str(), f.dir.c_str(), 0, 0, nullptr); });
  E("fo_checkpoint_diff_json", "b missing", [](Fx& f) { char* s; return fo_checkpoint_diff_json(f.dir.c_str(), "/tmp/fo-no-such-dir-x", 0, 0, &s); });
  E("fo_checkpoint_diff_json", "rtol NaN", [](Fx& f) { char* s; return fo_checkpoint_diff_json(f.dir.c_str(), f.dir.c_str(), NAN, 0, &s); });
  E("fo_checkpoint_diff_json", "atol -1", [](Fx& f) { char* s; return fo_checkpoint_diff_json(f.dir.c_str(), f.dir.c_str(), 0, -1, &s); });
  R("fo_string_free", "NULL", [](Fx&) { fo_string_free(nullptr); });
  E("fo_checkpoint_verify", "dir NULL", [](Fx&) { return fo_checkpoint_verify(nullptr); });
  E("fo_checkpoint_verify", "dir missing", [](Fx&) { return fo_checkpoint_verify("/tmp/fo-no-such-dir-x"); });
  E("fo_checkpoint_info_json", "dir NULL", [](Fx&) { char b[64]; size_t n; return fo_checkpoint_info_json(nullptr, b, 64, &n); });
  E("fo_checkpoint_info_json", "dir missing", [](Fx&) { char b[64]; size_t n; return fo_checkpoint_info_json("/tmp/fo-no-such-dir-x", b, 64, &n); });
  E("fo_checkpoint_info_json", "dir empty", [](Fx& f) { char b[64]; size_t n; return fo_checkpoint_info_json(f.empty.c_str(), b, 64, &n); });
  E("fo_checkpoint_info_json", "out_len NULL", [](Fx& f) { char b[64]; return fo_checkpoint_info_json(f.dir.c_str(), b, 64, nullptr); });
  E("fo_checkpoint_info_json", "capacity 1", [](Fx& f) { char b[1]; size_t n; return fo_checkpoint_info_json(f.dir.c_str(), b, 1, &n); });
  E("fo_checkpoint_info_json", "buf NULL, capacity 1<<20", [](Fx& f) { size_t n; return fo_checkpoint_info_json(f.dir.c_str(), nullptr, 1 << 20, &n); });
  E("fo_checkpoint_verify", "dir empty", [](Fx& f) { return fo_checkpoint_verify(f.empty.c_str()); });
  E("fo_checkpoint_verify", "dir not UTF-8", [](Fx&) { return fo_checkpoint_verify("/tmp/\xff"); });
  E("fo_checkpoint_verify", "dir empty string (cwd holds a checkpoint)", [](Fx& f) {
    if (chdir(f.dir.c_str()) != 0) return FO_OK;
    return fo_checkpoint_verify("");
  });

  // ---- communicators
  static fo_comm_callbacks no_callbacks{};
  E("fo_comm_create_callbacks", "callbacks NULL", [](Fx&) { fo_comm* c; return fo_comm_create_callbacks(0, 2, nullptr, &c); });
  E("fo_comm_create_callbacks", "out NULL", [](Fx&) { return fo_comm_create_callbacks(0, 2, &no_callbacks, nullptr); });
  E("fo_comm_create_callbacks", "NULL function pointers", [](Fx&) { fo_comm* c; return fo_comm_create_callbacks(0, 2, &no_callbacks, &c); });
  E("fo_comm_create_callbacks", "rank -1", [](Fx&) { fo_comm* c; return fo_comm_create_callbacks(-1, 2, &no_callbacks, &c); });
  E("fo_comm_create_callbacks", "world_size 0", [](Fx&) { fo_comm* c; return fo_comm_create_callbacks(0, 0, &no_callbacks, &c); });
  E("fo_comm_create_callbacks", "rank == world_size", [](Fx&) { fo_comm* c; return fo_comm_create_callbacks(2, 2, &no_callbacks, &c); });
  auto local = [](int32_t n, double t) {
    return [n, t](Fx&) {
      static fo_comm* out[4];
      return fo_comm_create_local_group(n, t, out);
    };
  };
  E("fo_comm_create_local_group", "world_size INT32_MAX", local(kI32Max, 1.0));
  E("fo_comm_create_local_group", "world_size 1025", local(1025, 1.0));
  E("fo_comm_create_local_group", "world_size 0", local(0, 1.0));
  E("fo_comm_create_local_group", "world_size -1", local(-1, 1.0));
  E("fo_comm_create_local_group", "timeout NaN", local(2, kNaN));
  E("fo_comm_create_local_group", "timeout +inf", local(2, kInf));
  E("fo_comm_create_local_group", "timeout -inf", local(2, -kInf));
  E("fo_comm_create_local_group", "timeout 0", local(2, 0.0));
  E("fo_comm_create_local_group", "timeout -1", local(2, -1.0));
  E("fo_comm_create_local_group", "timeout 1e300", local(2, 1e300));
  E("fo_comm_create_local_group", "out NULL", [](Fx&) { return fo_comm_create_local_group(2, 1.0, nullptr); });
  E("fo_comm_create_nccl", "comm and stream NULL", [](Fx&) { fo_comm* c; return fo_comm_create_nccl(nullptr, nullptr, 0, 1, &c); });
  E("fo_comm_create_nccl", "rank -1", [](Fx&) { fo_comm* c; int x; return fo_comm_create_nccl(&x, &x, -1, 1, &c); });
  E("fo_comm_create_nccl", "world_size 0", [](Fx&) { fo_comm* c; int x; return fo_comm_create_nccl(&x, &x, 0, 0, &c); });
  E("fo_comm_create_nccl", "out NULL", [](Fx&) { int x; return fo_comm_create_nccl(&x, &x, 0, 1, nullptr); });
  R("fo_comm_destroy", "NULL", [](Fx&) { fo_comm_destroy(nullptr); });
  E("fo_comm_info", "comm NULL", [](Fx&) { int32_t r, w; return fo_comm_info(nullptr, &r, &w); });
  E("fo_comm_info", "rank NULL", [](Fx& f) { int32_t w; return fo_comm_info(f.comm, nullptr, &w); });
  E("fo_comm_info", "world_size NULL", [](Fx& f) { int32_t r; return fo_comm_info(f.comm, &r, nullptr); });
  E("fo_comm_set_stream", "comm NULL", [](Fx&) { return fo_comm_set_stream(nullptr, nullptr); });

  // broadcast: one rank; a valid source "w" and destination "w" unless edited.
  using Src = fo_broadcast_source;
  using Dst = fo_broadcast_dest;
  auto bcast = [](std::function<void(Src&, Dst&, fo_broadcast_options&, int64_t&, int64_t&)> edit) {
    return [edit](Fx& f) {
      Src s{"w", f.param()};
      Dst d{"w", f.out4(), nullptr};
      fo_broadcast_options o{0, FO_BROADCAST_STRATEGY_SCATTER};
      int64_t ns = 1, nd = 1;
      edit(s, d, o, ns, nd);
      return fo_broadcast_state_dict(f.comm, &s, ns, &d, nd, &o, nullptr);
    };
  };
  E("fo_broadcast_state_dict", "comm NULL", [](Fx& f) {
    Src s{"w", f.param()};
    return fo_broadcast_state_dict(nullptr, &s, 1, nullptr, 0, nullptr, nullptr);
  });
  E("fo_broadcast_state_dict", "full NULL on rank 0", [](Fx& f) { return fo_broadcast_state_dict(f.comm, nullptr, 1, nullptr, 0, nullptr, nullptr); });
  E("fo_broadcast_state_dict", "dests NULL, n_dests 1", [](Fx& f) {
    Src s{"w", f.param()};
    return fo_broadcast_state_dict(f.comm, &s, 1, nullptr, 1, nullptr, nullptr);
  });
  E("fo_broadcast_state_dict", "n_full -1", bcast([](Src&, Dst&, fo_broadcast_options&, int64_t& ns, int64_t&) { ns = -1; }));
  E("fo_broadcast_state_dict", "n_full INT64_MAX", bcast([](Src&, Dst&, fo_broadcast_options&, int64_t& ns, int64_t&) { ns = kI64Max; }));
  E("fo_broadcast_state_dict", "n_dests -1", bcast([](Src&, Dst&, fo_broadcast_options&, int64_t&, int64_t& nd) { nd = -1; }));
  E("fo_broadcast_state_dict", "n_dests INT64_MAX", bcast([](Src&, Dst&, fo_broadcast_options&, int64_t&, int64_t& nd) { nd = kI64Max; }));
  E("fo_broadcast_state_dict", "strategy 9", bcast([](Src&, Dst&, fo_broadcast_options& o, int64_t&, int64_t&) { o.strategy = 9; }));
  E("fo_broadcast_state_dict", "allow_int_float_cast 4", bcast([](Src&, Dst&, fo_broadcast_options& o, int64_t&, int64_t&) { o.allow_int_float_cast = 4; }));
  E("fo_broadcast_state_dict", "full key NULL", bcast([](Src& s, Dst&, fo_broadcast_options&, int64_t&, int64_t&) { s.key = nullptr; }));
  E("fo_broadcast_state_dict", "dest key NULL", bcast([](Src&, Dst& d, fo_broadcast_options&, int64_t&, int64_t&) { d.key = nullptr; }));
  E("fo_broadcast_state_dict", "dest key absent on rank 0", bcast([](Src&, Dst& d, fo_broadcast_options&, int64_t&, int64_t&) { d.key = "nope"; }));
  E("fo_broadcast_state_dict", "full dtype 99", bcast([](Src& s, Dst&, fo_broadcast_options&, int64_t&, int64_t&) { s.tensor.dtype = 99; }));
  E("fo_broadcast_state_dict", "full ndim 9", bcast([](Src& s, Dst&, fo_broadcast_options&, int64_t&, int64_t&) { s.tensor.ndim = 9; }));
  E("fo_broadcast_state_dict", "full ndim -1", bcast([](Src& s, Dst&, fo_broadcast_options&, int64_t&, int64_t&) { s.tensor.ndim = -1; }));
  E("fo_broadcast_state_dict", "full shape NULL", bcast([](Src& s, Dst&, fo_broadcast_options&, int64_t&, int64_t&) { s.tensor.shape = nullptr; }));
  E("fo_broadcast_state_dict", "full data NULL", bcast([](Src& s, Dst&, fo_broadcast_options&, int64_t&, int64_t&) { s.tensor.data = nullptr; }));
  E("fo_broadcast_state_dict", "full device 0", bcast([](Src& s, Dst&, fo_broadcast_options&, int64_t&, int64_t&) { s.tensor.device = 0; }));
  E("fo_broadcast_state_dict", "dest negative shape", bcast([](Src&, Dst& d, fo_broadcast_options&, int64_t&, int64_t&) { d.tensor.shape = fx().neg_shape; }));
  E("fo_broadcast_state_dict", "dest huge shape", bcast([](Src&, Dst& d, fo_broadcast_options&, int64_t&, int64_t&) {
    d.tensor.ndim = 2;
    d.tensor.shape = fx().huge_shape;
  }));
  E("fo_broadcast_state_dict", "dest negative stride", bcast([](Src&, Dst& d, fo_broadcast_options&, int64_t&, int64_t&) { d.tensor.strides = fx().neg_stride; }));

  auto clip = [](std::function<void(fo_clip_grad&, double&, double&, int32_t&, int64_t&)> edit) {
    return [edit](Fx& f) {
      fo_clip_grad g{f.grad(), 0};
      double max_norm = 1.0, norm_type = 2.0, total = 0;
      int32_t e = 0;
      int64_t n = 1;
      edit(g, max_norm, norm_type, e, n);
      return fo_clip_grad_norm(f.comm, &g, n, max_norm, norm_type, e, &total);
    };
  };
  using CG = fo_clip_grad;
  E("fo_clip_grad_norm", "comm NULL", [](Fx& f) {
    fo_clip_grad g{f.grad(), 0};
    double t;
    return fo_clip_grad_norm(nullptr, &g, 1, 1.0, 2.0, 0, &t);
  });
  E("fo_clip_grad_norm", "total_norm NULL", [](Fx& f) {
    fo_clip_grad g{f.grad(), 0};
    return fo_clip_grad_norm(f.comm, &g, 1, 1.0, 2.0, 0, nullptr);
  });
  E("fo_clip_grad_norm", "grads NULL, n 1", [](Fx& f) { double t; return fo_clip_grad_norm(f.comm, nullptr, 1, 1.0, 2.0, 0, &t); });
  E("fo_clip_grad_norm", "n_grads -1", clip([](CG&, double&, double&, int32_t&, int64_t& n) { n = -1; }));
  E("fo_clip_grad_norm", "n_grads INT64_MAX", clip([](CG&, double&, double&, int32_t&, int64_t& n) { n = kI64Max; }));
  E("fo_clip_grad_norm", "norm_type 0", clip([](CG&, double&, double& p, int32_t&, int64_t&) { p = 0; }));
  E("fo_clip_grad_norm", "norm_type -2", clip([](CG&, double&, double& p, int32_t&, int64_t&) { p = -2; }));
  E("fo_clip_grad_norm", "norm_type NaN", clip([](CG&, double&, double& p, int32_t&, int64_t&) { p = kNaN; }));
  E("fo_clip_grad_norm", "max_norm NaN", clip([](CG&, double& m, double&, int32_t&, int64_t&) { m = kNaN; }));
  E("fo_clip_grad_norm", "max_norm -1", clip([](CG&, double& m, double&, int32_t&, int64_t&) { m = -1; }));
  E("fo_clip_grad_norm", "error_if_nonfinite 2", clip([](CG&, double&, double&, int32_t& e, int64_t&) { e = 2; }));
  E("fo_clip_grad_norm", "is_shard 3", clip([](CG& g, double&, double&, int32_t&, int64_t&) { g.is_shard = 3; }));
  E("fo_clip_grad_norm", "grad dtype I32", clip([](CG& g, double&, double&, int32_t&, int64_t&) { g.tensor.dtype = FO_DTYPE_I32; }));
  E("fo_clip_grad_norm", "grad dtype -1", clip([](CG& g, double&, double&, int32_t&, int64_t&) { g.tensor.dtype = -1; }));
  E("fo_clip_grad_norm", "grad data NULL", clip([](CG& g, double&, double&, int32_t&, int64_t&) { g.tensor.data = nullptr; }));
  E("fo_clip_grad_norm", "grad huge shape", clip([](CG& g, double&, double&, int32_t&, int64_t&) {
    g.tensor.ndim = 2;
    g.tensor.shape = fx().huge_shape;
  }));

  // ---- optimizer
  R("fo_optim_config_default", "unknown algorithm 99", [](Fx&) { fo_optim_config c; fo_optim_config_default(99, &c); });
  R("fo_optim_config_default", "out NULL", [](Fx&) { fo_optim_config_default(FO_ALGORITHM_ADAMW, nullptr); });
  using OC = fo_optim_config;
  auto create = [](std::function<void(OC&)> edit) {
    return [edit](Fx& f) {
      OC c = f.cfg;
      edit(c);
      fo_optimizer* o = nullptr;
      return fo_optimizer_create(&c, &o);
    };
  };
  E("fo_optimizer_create", "cfg NULL", [](Fx&) { fo_optimizer* o; return fo_optimizer_create(nullptr, &o); });
  E("fo_optimizer_create", "out NULL", [](Fx& f) { return fo_optimizer_create(&f.cfg, nullptr); });
  E("fo_optimizer_create", "algorithm 99", create([](OC& c) { c.algorithm = 99; }));
  E("fo_optimizer_create", "algorithm -1", create([](OC& c) { c.algorithm = -1; }));
  E("fo_optimizer_create", "state_format 9", create([](OC& c) { c.state_format = 9; }));
  E("fo_optimizer_create", "master_weight_bits 7", create([](OC& c) { c.master_weight_bits = 7; }));
  E("fo_optimizer_create", "master_weight_bits -24", create([](OC& c) { c.master_weight_bits = -24; }));
  E("fo_optimizer_create", "lr NaN", create([](OC& c) { c.lr = kNaN; }));
  E("fo_optimizer_create", "lr -1", create([](OC& c) { c.lr = -1; }));
  E("fo_optimizer_create", "lr inf", create([](OC& c) { c.lr = kInf; }));
  E("fo_optimizer_create", "beta1 1.5", create([](OC& c) { c.beta1 = 1.5; }));
  E("fo_optimizer_create", "beta2 NaN", create([](OC& c) { c.beta2 = kNaN; }));
  E("fo_optimizer_create", "beta2 1.0 (torch: [0, 1))", create([](OC& c) { c.beta2 = 1.0; }));
  E("fo_optimizer_create", "beta1 1.0 (torch: [0, 1))", create([](OC& c) { c.beta1 = 1.0; }));
  E("fo_optimizer_create", "Lion beta2 1.0", create([](OC& c) { c.algorithm = 4; c.beta2 = 1.0; }));
  E("fo_optimizer_create", "SGD momentum -0.9", create([](OC& c) { c.algorithm = 2; c.momentum = -0.9; }));
  E("fo_optimizer_create", "SGD nesterov with dampening", create([](OC& c) { c.algorithm = 2; c.momentum = 0.9; c.dampening = 0.1; c.nesterov = 1; }));
  E("fo_optimizer_create", "eps -1", create([](OC& c) { c.eps = -1; }));
  E("fo_optimizer_create", "weight_decay NaN", create([](OC& c) { c.weight_decay = kNaN; }));
  E("fo_optimizer_create", "nesterov 2", create([](OC& c) { c.nesterov = 2; }));
  E("fo_optimizer_create", "decouple_lr -1", create([](OC& c) { c.decouple_lr = -1; }));
  E("fo_optimizer_create", "check_numerics 100", create([](OC& c) { c.check_numerics = 100; }));
  R("fo_optimizer_destroy", "NULL", [](Fx&) { fo_optimizer_destroy(nullptr); });

  using T = fo_tensor;
  auto add = [](std::function<void(T&)> edit) {
    return [edit](Fx& f) {
      fo_optimizer* o = f.fresh();
      T p = f.param();
      edit(p);
      int32_t i;
      return fo_optimizer_add_param(o, "x", &p, nullptr, &i);
    };
  };
  E("fo_optimizer_add_param", "opt NULL", [](Fx& f) { T p = f.param(); int32_t i; return fo_optimizer_add_param(nullptr, "x", &p, nullptr, &i); });
  E("fo_optimizer_add_param", "fqn NULL", [](Fx& f) { T p = f.param(); int32_t i; return fo_optimizer_add_param(f.fresh(), nullptr, &p, nullptr, &i); });
  E("fo_optimizer_add_param", "fqn not UTF-8", [](Fx& f) { T p = f.param(); int32_t i; return fo_optimizer_add_param(f.fresh(), "\xff", &p, nullptr, &i); });
  E("fo_optimizer_add_param", "param NULL", [](Fx& f) { int32_t i; return fo_optimizer_add_param(f.fresh(), "x", nullptr, nullptr, &i); });
  E("fo_optimizer_add_param", "out_index NULL", [](Fx& f) { T p = f.param(); return fo_optimizer_add_param(f.fresh(), "x", &p, nullptr, nullptr); });
  E("fo_optimizer_add_param", "duplicate fqn", [](Fx& f) { float w2[4]; T p{w2, FO_DTYPE_F32, 1, f.shape4, nullptr, FO_DEVICE_HOST}; int32_t i; return fo_optimizer_add_param(f.opt, "w", &p, nullptr, &i); });
  E("fo_optimizer_add_param", "dtype 99", add([](T& p) { p.dtype = 99; }));
  E("fo_optimizer_add_param", "dtype I32", add([](T& p) { p.dtype = FO_DTYPE_I32; }));
  E("fo_optimizer_add_param", "ndim -1", add([](T& p) { p.ndim = -1; }));
  E("fo_optimizer_add_param", "ndim 9", add([](T& p) { p.ndim = 9; }));
  E("fo_optimizer_add_param", "shape NULL", add([](T& p) { p.shape = nullptr; }));
  E("fo_optimizer_add_param", "negative shape", add([](T& p) { p.shape = fx().neg_shape; }));
  E("fo_optimizer_add_param", "huge shape", add([](T& p) {
    p.ndim = 2;
    p.shape = fx().huge_shape;
  }));
  E("fo_optimizer_add_param", "data NULL", add([](T& p) { p.data = nullptr; }));
  E("fo_optimizer_add_param", "data misaligned", add([](T& p) { p.data = static_cast<char*>(p.data) + 1; }));
  E("fo_optimizer_add_param", "device 0", add([](T& p) { p.device = 0; }));
  E("fo_optimizer_add_param", "device -7", add([](T& p) { p.device = -7; }));
  E("fo_optimizer_add_param", "negative stride", add([](T& p) { p.strides = fx().neg_stride; }));

  // shard specs for add_param: (8,) over a mesh of 2, coord 0 holds 4 rows.
  using SP = fo_shard_spec;
  auto add_sharded = [](std::function<void(SP&, fo_placement&)> edit) {
    return [edit](Fx& f) {
      static int64_t gshape[1] = {8}, mesh[1] = {2}, coord[1] = {0};
      fo_placement pl{FO_PLACEMENT_SHARD, 0, 0};
      SP s{1, gshape, 1, mesh, coord, &pl};
      edit(s, pl);
      T p = f.param();
      int32_t i;
      return fo_optimizer_add_param(f.fresh(), "x", &p, &s, &i);
    };
  };
  static int64_t bad_coord[1] = {2}, zero_mesh[1] = {0}, gshape_wrong[1] = {20}, huge_dim[1] = {int64_t(1) << 40};
  E("fo_optimizer_add_param", "shard ndim 9", add_sharded([](SP& s, fo_placement&) { s.ndim = 9; }));
  E("fo_optimizer_add_param", "shard mesh_ndim 0", add_sharded([](SP& s, fo_placement&) { s.mesh_ndim = 0; }));
  E("fo_optimizer_add_param", "shard global_shape NULL", add_sharded([](SP& s, fo_placement&) { s.global_shape = nullptr; }));
  E("fo_optimizer_add_param", "shard mesh_shape NULL", add_sharded([](SP& s, fo_placement&) { s.mesh_shape = nullptr; }));
  E("fo_optimizer_add_param", "shard coord NULL", add_sharded([](SP& s, fo_placement&) { s.coord = nullptr; }));
  E("fo_optimizer_add_param", "shard placements NULL", add_sharded([](SP& s, fo_placement&) { s.placements = nullptr; }));
  E("fo_optimizer_add_param", "shard coord outside mesh", add_sharded([](SP& s, fo_placement&) { s.coord = bad_coord; }));
  E("fo_optimizer_add_param", "shard mesh dim 0", add_sharded([](SP& s, fo_placement&) { s.mesh_shape = zero_mesh; }));
  E("fo_optimizer_add_param", "shard local shape differs", add_sharded([](SP& s, fo_placement&) { s.global_shape = gshape_wrong; }));
  E("fo_optimizer_add_param", "placement kind 9", add_sharded([](SP&, fo_placement& p) { p.kind = 9; }));
  E("fo_optimizer_add_param", "placement dim 3", add_sharded([](SP&, fo_placement& p) { p.dim = 3; }));
  E("fo_optimizer_add_param", "placement dim -1", add_sharded([](SP&, fo_placement& p) { p.dim = -1; }));
  E("fo_optimizer_add_param", "split_factor 0", add_sharded([](SP&, fo_placement& p) { p = {FO_PLACEMENT_STRIDED_SHARD, 0, 0}; }));
  E("fo_optimizer_add_param", "split_factor INT32_MAX on 2^40 rows", add_sharded([](SP& s, fo_placement& p) {
    p = {2, 0, kI32Max};
    s.global_shape = huge_dim;
  }));

  E("fo_optimizer_add_param_to_group", "opt NULL", [](Fx& f) { T p = f.param(); int32_t i; return fo_optimizer_add_param_to_group(nullptr, "x", &p, nullptr, 0, &i); });
  E("fo_optimizer_add_param_to_group", "group 5", [](Fx& f) { T p = f.param(); int32_t i; return fo_optimizer_add_param_to_group(f.fresh(), "x", &p, nullptr, 5, &i); });
  E("fo_optimizer_add_param_to_group", "group -1", [](Fx& f) { T p = f.param(); int32_t i; return fo_optimizer_add_param_to_group(f.fresh(), "x", &p, nullptr, -1, &i); });
  E("fo_optimizer_add_param_to_group", "param NULL", [](Fx& f) { int32_t i; return fo_optimizer_add_param_to_group(f.fresh(), "x", nullptr, nullptr, 0, &i); });

  auto step = [](std::function<void(T&, size_t&)> edit) {
    return [edit](Fx& f) {
      T g = f.grad();
      size_t n = 1;
      edit(g, n);
      return fo_optimizer_step(f.opt, &g, n);
    };
  };
  static int64_t shape5[1] = {5};
  E("fo_optimizer_step", "opt NULL", [](Fx& f) { T g = f.grad(); return fo_optimizer_step(nullptr, &g, 1); });
  E("fo_optimizer_step", "grads NULL, n 1", [](Fx& f) { return fo_optimizer_step(f.opt, nullptr, 1); });
  E("fo_optimizer_step", "n 0 for 1 param", step([](T&, size_t& n) { n = 0; }));
  E("fo_optimizer_step", "n SIZE_MAX", step([](T&, size_t& n) { n = SIZE_MAX; }));
  E("fo_optimizer_step", "n 2 for 1 param", [](Fx& f) { T g[2] = {f.grad(), f.grad()}; return fo_optimizer_step(f.opt, g, 2); });
  E("fo_optimizer_step", "grad dtype I8", step([](T& g, size_t&) { g.dtype = FO_DTYPE_I8; }));
  E("fo_optimizer_step", "grad dtype 1000", step([](T& g, size_t&) { g.dtype = 1000; }));
  E("fo_optimizer_step", "grad shape differs", step([](T& g, size_t&) { g.shape = shape5; }));
  E("fo_optimizer_step", "grad negative stride", step([](T& g, size_t&) { g.strides = fx().neg_stride; }));
  E("fo_optimizer_step", "grad ndim 9", step([](T& g, size_t&) { g.ndim = 9; }));
  E("fo_optimizer_step", "grad device 1", step([](T& g, size_t&) { g.device = 1; }));

  // The overlapped step: each case opens its own step where it needs one.
  auto opened = [](Fx& f) {
    Fx::must(fo_optimizer_step_begin(f.opt, nullptr), "step_begin");
    return f.opt;
  };
  // One hand-over of parameter 0's gradient through `fn` (grads_ready or grads_at_end),
  // edited first, in a step opened for it.
  using HandOver = fo_status (*)(fo_optimizer*, const int32_t*, const fo_tensor*, size_t);
  auto hand = [opened](HandOver fn, std::function<void(int32_t&, T&, size_t&)> edit) {
    return [opened, fn, edit](Fx& f) {
      int32_t i = 0;
      T g = f.grad();
      size_t n = 1;
      edit(i, g, n);
      return fn(opened(f), &i, &g, n);
    };
  };
  auto ready = [hand](std::function<void(int32_t&, T&, size_t&)> edit) { return hand(fo_optimizer_grads_ready, edit); };
  auto begin_with = [](std::function<void(fo_overlap_options&)> edit) {
    return [edit](Fx& f) {
      fo_overlap_options o;
      fo_overlap_options_default(&o);
      edit(o);
      return fo_optimizer_step_begin(f.opt, &o);
    };
  };
  R("fo_overlap_options_default", "out NULL", [](Fx&) { fo_overlap_options_default(nullptr); });
  E("fo_optimizer_step_begin", "opt NULL", [](Fx&) { return fo_optimizer_step_begin(nullptr, nullptr); });
  E("fo_optimizer_step_begin", "a step already open", [opened](Fx& f) { return fo_optimizer_step_begin(opened(f), nullptr); });
  E("fo_optimizer_step_begin", "max_norm NaN", begin_with([](fo_overlap_options& o) { o.max_norm = kNaN; }));
  E("fo_optimizer_step_begin", "norm_type -1", begin_with([](fo_overlap_options& o) { o.max_norm = 1, o.norm_type = -1; }));
  E("fo_optimizer_step_begin", "norm_type NaN", begin_with([](fo_overlap_options& o) { o.max_norm = 1, o.norm_type = kNaN; }));
  E("fo_optimizer_step_begin", "error_if_nonfinite 7", begin_with([](fo_overlap_options& o) { o.error_if_nonfinite = 7; }));
  E("fo_optimizer_grads_ready", "opt NULL", [](Fx& f) { int32_t i = 0; T g = f.grad(); return fo_optimizer_grads_ready(nullptr, &i, &g, 1); });
  E("fo_optimizer_grads_ready", "no step open", [](Fx& f) { int32_t i = 0; T g = f.grad(); return fo_optimizer_grads_ready(f.opt, &i, &g, 1); });
  E("fo_optimizer_grads_ready", "indices NULL, n 1", [opened](Fx& f) { T g = f.grad(); return fo_optimizer_grads_ready(opened(f), nullptr, &g, 1); });
  E("fo_optimizer_grads_ready", "grads NULL, n 1", [opened](Fx& f) { int32_t i = 0; return fo_optimizer_grads_ready(opened(f), &i, nullptr, 1); });
  E("fo_optimizer_grads_ready", "n SIZE_MAX", ready([](int32_t&, T&, size_t& n) { n = SIZE_MAX; }));
  E("fo_optimizer_grads_ready", "index -1", ready([](int32_t& i, T&, size_t&) { i = -1; }));
  E("fo_optimizer_grads_ready", "index INT32_MAX", ready([](int32_t& i, T&, size_t&) { i = kI32Max; }));
  E("fo_optimizer_grads_ready", "grad dtype I8", ready([](int32_t&, T& g, size_t&) { g.dtype = FO_DTYPE_I8; }));
  E("fo_optimizer_grads_ready", "grad shape differs", ready([](int32_t&, T& g, size_t&) { g.shape = shape5; }));
  E("fo_optimizer_grads_ready", "grad device 1", ready([](int32_t&, T& g, size_t&) { g.device = 1; }));
  E("fo_optimizer_grads_ready", "handed over twice", [opened](Fx& f) {
    int32_t i = 0;
    T g = f.grad();
    Fx::must(fo_optimizer_grads_ready(opened(f), &i, &g, 1), "grads_ready");
    return fo_optimizer_grads_ready(f.opt, &i, &g, 1);
  });
  auto at_end = [hand](std::function<void(int32_t&, T&, size_t&)> edit) { return hand(fo_optimizer_grads_at_end, edit); };
  E("fo_optimizer_grads_at_end", "opt NULL", [](Fx& f) { int32_t i = 0; T g = f.grad(); return fo_optimizer_grads_at_end(nullptr, &i, &g, 1); });
  E("fo_optimizer_grads_at_end", "no step open", [](Fx& f) { int32_t i = 0; T g = f.grad(); return fo_optimizer_grads_at_end(f.opt, &i, &g, 1); });
  E("fo_optimizer_grads_at_end", "indices NULL, n 1", [opened](Fx& f) { T g = f.grad(); return fo_optimizer_grads_at_end(opened(f), nullptr, &g, 1); });
  E("fo_optimizer_grads_at_end", "n SIZE_MAX", at_end([](int32_t&, T&, size_t& n) { n = SIZE_MAX; }));
  E("fo_optimizer_grads_at_end", "index -1", at_end([](int32_t& i, T&, size_t&) { i = -1; }));
  E("fo_optimizer_grads_at_end", "grad dtype I8", at_end([](int32_t&, T& g, size_t&) { g.dtype = FO_DTYPE_I8; }));
  E("fo_optimizer_grads_at_end", "handed over by grads_ready", [opened](Fx& f) {
    int32_t i = 0;
    T g = f.grad();
    Fx::must(fo_optimizer_grads_ready(opened(f), &i, &g, 1), "grads_ready");
    return fo_optimizer_grads_at_end(f.opt, &i, &g, 1);
  });
  E("fo_optimizer_step_end", "opt NULL", [](Fx&) { return fo_optimizer_step_end(nullptr, nullptr, nullptr); });
  E("fo_optimizer_step_end", "no step open", [](Fx& f) { return fo_optimizer_step_end(f.opt, nullptr, nullptr); });
  E("fo_optimizer_step_end", "after a bad gradient", [opened](Fx& f) {
    int32_t i = 0;
    T g = f.grad();
    g.dtype = FO_DTYPE_I8;
    fo_optimizer_grads_ready(opened(f), &i, &g, 1);
    fo_overlap_stats st;
    return fo_optimizer_step_end(f.opt, nullptr, &st);
  });
  E("fo_optimizer_step_abort", "opt NULL", [](Fx&) { return fo_optimizer_step_abort(nullptr, nullptr); });
  E("fo_optimizer_step_abort", "no step open", [](Fx& f) { return fo_optimizer_step_abort(f.opt, nullptr); });
  E("fo_optimizer_release_undo", "opt NULL", [](Fx&) { return fo_optimizer_release_undo(nullptr, nullptr); });
  E("fo_optimizer_set_full_fingerprints", "opt NULL", [](Fx&) { return fo_optimizer_set_full_fingerprints(nullptr, 1); });
  E("fo_optimizer_set_full_fingerprints", "full not 0/1", [](Fx& f) { return fo_optimizer_set_full_fingerprints(f.opt, 2); });
  E("fo_optimizer_set_full_fingerprints", "a step open", [opened](Fx& f) { return fo_optimizer_set_full_fingerprints(opened(f), 1); });
  E("fo_optimizer_grads_changed", "opt NULL", [](Fx&) {
    size_t n = 0;
    return fo_optimizer_grads_changed(nullptr, nullptr, 0, nullptr, 0, &n);
  });
  E("fo_optimizer_grads_changed", "no step open", [](Fx& f) {
    size_t n = 0;
    return fo_optimizer_grads_changed(f.opt, nullptr, 0, nullptr, 0, &n);
  });
  E("fo_optimizer_grads_changed", "out_n NULL", [opened](Fx& f) { return fo_optimizer_grads_changed(opened(f), nullptr, 0, nullptr, 0, nullptr); });
  E("fo_optimizer_grads_changed", "full NULL", [opened](Fx& f) {
    size_t n = 0;
    return fo_optimizer_grads_changed(opened(f), nullptr, 1, nullptr, 0, &n);
  });
  E("fo_optimizer_grads_changed", "out NULL", [opened](Fx& f) {
    size_t n = 0;
    return fo_optimizer_grads_changed(opened(f), nullptr, 0, nullptr, 2, &n);
  });
  E("fo_optimizer_grads_changed", "full index out of range", [opened](Fx& f) {
    size_t n = 0;
    int32_t i = 99;
    return fo_optimizer_grads_changed(opened(f), &i, 1, nullptr, 0, &n);
  });
  E("fo_optimizer_grads_changed", "full index negative", [opened](Fx& f) {
    size_t n = 0;
    int32_t i = -1;
    return fo_optimizer_grads_changed(opened(f), &i, 1, nullptr, 0, &n);
  });
  E("fo_optimizer_step", "a step open", [opened](Fx& f) { T g = f.grad(); return fo_optimizer_step(opened(f), &g, 1); });

  auto get = [](std::function<void(int32_t&, const char*&, T&)> edit) {
    return [edit](Fx& f) {
      int32_t i = 0;
      const char* k = "exp_avg";
      T o = f.out4();
      edit(i, k, o);
      return fo_optimizer_get_state(f.opt, i, k, &o);
    };
  };
  E("fo_optimizer_get_state", "opt NULL", [](Fx& f) { T o = f.out4(); return fo_optimizer_get_state(nullptr, 0, "exp_avg", &o); });
  E("fo_optimizer_get_state", "out NULL", [](Fx& f) { return fo_optimizer_get_state(f.opt, 0, "exp_avg", nullptr); });
  E("fo_optimizer_get_state", "index -1", get([](int32_t& i, const char*&, T&) { i = -1; }));
  E("fo_optimizer_get_state", "index INT32_MAX", get([](int32_t& i, const char*&, T&) { i = kI32Max; }));
  E("fo_optimizer_get_state", "key NULL", get([](int32_t&, const char*& k, T&) { k = nullptr; }));
  E("fo_optimizer_get_state", "key unknown", get([](int32_t&, const char*& k, T&) { k = "nope"; }));
  E("fo_optimizer_get_state", "key not UTF-8", get([](int32_t&, const char*& k, T&) { k = "\xff"; }));
  E("fo_optimizer_get_state", "out shape differs", get([](int32_t&, const char*&, T& o) { o.shape = shape5; }));
  E("fo_optimizer_get_state", "out dtype 77", get([](int32_t&, const char*&, T& o) { o.dtype = 77; }));
  E("fo_optimizer_get_state", "out data NULL", get([](int32_t&, const char*&, T& o) { o.data = nullptr; }));

  auto share = [](std::function<void(int32_t&, const char*&)> edit) {
    return [edit](Fx& f) {
      int32_t i = 0;
      const char* k = "exp_avg";
      edit(i, k);
      fo_state_share* sh = nullptr;
      float* data = nullptr;
      int64_t n = 0;
      return fo_optimizer_share_state(f.opt, i, k, &sh, &data, &n);
    };
  };
  E("fo_optimizer_share_state", "opt NULL", [](Fx&) { fo_state_share* sh; float* d; int64_t n; return fo_optimizer_share_state(nullptr, 0, "exp_avg", &sh, &d, &n); });
  E("fo_optimizer_share_state", "out NULL", [](Fx& f) { float* d; int64_t n; return fo_optimizer_share_state(f.opt, 0, "exp_avg", nullptr, &d, &n); });
  E("fo_optimizer_share_state", "out_data NULL", [](Fx& f) { fo_state_share* sh; int64_t n; return fo_optimizer_share_state(f.opt, 0, "exp_avg", &sh, nullptr, &n); });
  E("fo_optimizer_share_state", "out_numel NULL", [](Fx& f) { fo_state_share* sh; float* d; return fo_optimizer_share_state(f.opt, 0, "exp_avg", &sh, &d, nullptr); });
  E("fo_optimizer_share_state", "index -1", share([](int32_t& i, const char*&) { i = -1; }));
  E("fo_optimizer_share_state", "index INT32_MAX", share([](int32_t& i, const char*&) { i = kI32Max; }));
  E("fo_optimizer_share_state", "key NULL", share([](int32_t&, const char*& k) { k = nullptr; }));
  E("fo_optimizer_share_state", "key unknown", share([](int32_t&, const char*& k) { k = "nope"; }));
  E("fo_optimizer_share_state", "key step (not a buffer)", share([](int32_t&, const char*& k) { k = "step"; }));
  E("fo_optimizer_share_state", "key not UTF-8", share([](int32_t&, const char*& k) { k = "\xff"; }));
  E("fo_optimizer_share_state", "compressed (quant8) state", share([](int32_t&, const char*&) {}));
  E("fo_optimizer_share_state", "no state yet", [](Fx& f) {
    fo_optimizer* o = f.fresh();
    int32_t idx = -1;
    fo_tensor p = f.param();
    Fx::must(fo_optimizer_add_param(o, "w", &p, nullptr, &idx), "add_param");
    fo_state_share* sh;
    float* d;
    int64_t n;
    return fo_optimizer_share_state(o, 0, "exp_avg", &sh, &d, &n);
  });
  R("fo_state_share_destroy", "NULL", [](Fx&) { fo_state_share_destroy(nullptr); });

  E("fo_optimizer_state_info", "opt NULL", [](Fx&) { int32_t d, n; int64_t s[8]; return fo_optimizer_state_info(nullptr, 0, "exp_avg", &d, &n, s); });
  E("fo_optimizer_state_info", "out_dtype NULL", [](Fx& f) { int32_t n; int64_t s[8]; return fo_optimizer_state_info(f.opt, 0, "exp_avg", nullptr, &n, s); });
  E("fo_optimizer_state_info", "out_ndim NULL", [](Fx& f) { int32_t d; int64_t s[8]; return fo_optimizer_state_info(f.opt, 0, "exp_avg", &d, nullptr, s); });
  E("fo_optimizer_state_info", "out_shape NULL", [](Fx& f) { int32_t d, n; return fo_optimizer_state_info(f.opt, 0, "exp_avg", &d, &n, nullptr); });
  E("fo_optimizer_state_info", "index -1", [](Fx& f) { int32_t d, n; int64_t s[8]; return fo_optimizer_state_info(f.opt, -1, "exp_avg", &d, &n, s); });
  E("fo_optimizer_state_info", "key NULL", [](Fx& f) { int32_t d, n; int64_t s[8]; return fo_optimizer_state_info(f.opt, 0, nullptr, &d, &n, s); });
  E("fo_optimizer_state_info", "key unknown", [](Fx& f) { int32_t d, n; int64_t s[8]; return fo_optimizer_state_info(f.opt, 0, "nope", &d, &n, s); });

  auto set = [](std::function<void(int32_t&, const char**&, T*&, size_t&)> edit) {
    return [edit](Fx& f) {
      static const char* keys[1] = {"exp_avg"};
      static T vals[1];
      vals[0] = f.out4();
      int32_t i = 0;
      const char** k = keys;
      T* v = vals;
      size_t n = 1;
      edit(i, k, v, n);
      return fo_optimizer_set_state(f.opt, i, k, v, n);
    };
  };
  static const char* null_key[1] = {nullptr};
  static const char* unknown_key[1] = {"nope"};
  E("fo_optimizer_set_state", "opt NULL", [](Fx& f) { const char* k[1] = {"exp_avg"}; T v = f.out4(); return fo_optimizer_set_state(nullptr, 0, k, &v, 1); });
  E("fo_optimizer_set_state", "keys NULL", set([](int32_t&, const char**& k, T*&, size_t&) { k = nullptr; }));
  E("fo_optimizer_set_state", "values NULL", set([](int32_t&, const char**&, T*& v, size_t&) { v = nullptr; }));
  E("fo_optimizer_set_state", "keys[0] NULL", set([](int32_t&, const char**& k, T*&, size_t&) { k = null_key; }));
  E("fo_optimizer_set_state", "key unknown", set([](int32_t&, const char**& k, T*&, size_t&) { k = unknown_key; }));
  E("fo_optimizer_set_state", "index 9", set([](int32_t& i, const char**&, T*&, size_t&) { i = 9; }));
  E("fo_optimizer_set_state", "index -1", set([](int32_t& i, const char**&, T*&, size_t&) { i = -1; }));
  E("fo_optimizer_set_state", "n SIZE_MAX", set([](int32_t&, const char**&, T*&, size_t& n) { n = SIZE_MAX; }));
  E("fo_optimizer_set_state", "value shape differs", set([](int32_t&, const char**&, T*& v, size_t&) { v[0].shape = shape5; }));
  E("fo_optimizer_set_state", "value dtype 55", set([](int32_t&, const char**&, T*& v, size_t&) { v[0].dtype = 55; }));

  E("fo_optimizer_add_param_group", "opt NULL", [](Fx& f) { int32_t g; return fo_optimizer_add_param_group(nullptr, &f.cfg, &g); });
  E("fo_optimizer_add_param_group", "cfg NULL", [](Fx& f) { int32_t g; return fo_optimizer_add_param_group(f.opt, nullptr, &g); });
  E("fo_optimizer_add_param_group", "out_group NULL", [](Fx& f) { return fo_optimizer_add_param_group(f.opt, &f.cfg, nullptr); });
  E("fo_optimizer_add_param_group", "cfg lr NaN", [](Fx& f) { OC c = f.cfg; c.lr = kNaN; int32_t g; return fo_optimizer_add_param_group(f.opt, &c, &g); });
  E("fo_optimizer_add_param_group", "cfg nesterov 3", [](Fx& f) { OC c = f.cfg; c.nesterov = 3; int32_t g; return fo_optimizer_add_param_group(f.opt, &c, &g); });

  E("fo_optimizer_set_group_lr", "opt NULL", [](Fx&) { return fo_optimizer_set_group_lr(nullptr, 0, 1e-3); });
  E("fo_optimizer_set_group_lr", "group -1", [](Fx& f) { return fo_optimizer_set_group_lr(f.opt, -1, 1e-3); });
  E("fo_optimizer_set_group_lr", "group 7", [](Fx& f) { return fo_optimizer_set_group_lr(f.opt, 7, 1e-3); });
  E("fo_optimizer_set_group_lr", "lr NaN", [](Fx& f) { return fo_optimizer_set_group_lr(f.opt, 0, kNaN); });
  E("fo_optimizer_set_group_lr", "lr inf", [](Fx& f) { return fo_optimizer_set_group_lr(f.opt, 0, kInf); });
  E("fo_optimizer_set_group_lr", "lr -1", [](Fx& f) { return fo_optimizer_set_group_lr(f.opt, 0, -1.0); });

  E("fo_optimizer_set_group_config", "opt NULL", [](Fx& f) { return fo_optimizer_set_group_config(nullptr, 0, &f.cfg); });
  E("fo_optimizer_set_group_config", "cfg NULL", [](Fx& f) { return fo_optimizer_set_group_config(f.opt, 0, nullptr); });
  E("fo_optimizer_set_group_config", "group 5", [](Fx& f) { return fo_optimizer_set_group_config(f.opt, 5, &f.cfg); });
  E("fo_optimizer_set_group_config", "algorithm changed", [](Fx& f) { OC c = f.cfg; c.algorithm = FO_ALGORITHM_LION; return fo_optimizer_set_group_config(f.opt, 0, &c); });
  E("fo_optimizer_set_group_config", "check_numerics 9", [](Fx& f) { OC c = f.cfg; c.check_numerics = 9; return fo_optimizer_set_group_config(f.opt, 0, &c); });
  E("fo_optimizer_set_group_config", "beta1 1.0", [](Fx& f) { OC c = f.cfg; c.beta1 = 1.0; return fo_optimizer_set_group_config(f.opt, 0, &c); });
  E("fo_optimizer_set_group_config", "eps -inf", [](Fx& f) { OC c = f.cfg; c.eps = -kInf; return fo_optimizer_set_group_config(f.opt, 0, &c); });
  E("fo_optimizer_get_group_config", "opt NULL", [](Fx&) { OC c; return fo_optimizer_get_group_config(nullptr, 0, &c); });
  E("fo_optimizer_get_group_config", "group -1", [](Fx& f) { OC c; return fo_optimizer_get_group_config(f.opt, -1, &c); });
  E("fo_optimizer_get_group_config", "out NULL", [](Fx& f) { return fo_optimizer_get_group_config(f.opt, 0, nullptr); });
  E("fo_optimizer_num_params", "opt NULL", [](Fx&) { int32_t n; return fo_optimizer_num_params(nullptr, &n); });
  E("fo_optimizer_num_params", "out NULL", [](Fx& f) { return fo_optimizer_num_params(f.opt, nullptr); });
  E("fo_optimizer_state_bytes", "opt NULL", [](Fx&) { uint64_t n; return fo_optimizer_state_bytes(nullptr, 0, &n); });
  E("fo_optimizer_state_bytes", "index -2", [](Fx& f) { uint64_t n; return fo_optimizer_state_bytes(f.opt, -2, &n); });
  E("fo_optimizer_state_bytes", "index 99", [](Fx& f) { uint64_t n; return fo_optimizer_state_bytes(f.opt, 99, &n); });
  E("fo_optimizer_state_bytes", "out NULL", [](Fx& f) { return fo_optimizer_state_bytes(f.opt, 0, nullptr); });
  E("fo_optimizer_set_stream", "opt NULL", [](Fx&) { return fo_optimizer_set_stream(nullptr, nullptr); });
  E("fo_optimizer_set_mirror", "opt NULL", [](Fx&) { return fo_optimizer_set_mirror(nullptr, 0, nullptr); });
  E("fo_optimizer_set_mirror", "index 99", [](Fx& f) { return fo_optimizer_set_mirror(f.opt, 99, nullptr); });
  E("fo_optimizer_state_keys", "opt NULL", [](Fx&) { char b[64]; size_t n; return fo_optimizer_state_keys(nullptr, 0, b, 64, &n); });
  E("fo_optimizer_state_keys", "index 99", [](Fx& f) { char b[64]; size_t n; return fo_optimizer_state_keys(f.opt, 99, b, 64, &n); });
  E("fo_optimizer_state_keys", "out_len NULL", [](Fx& f) { char b[64]; return fo_optimizer_state_keys(f.opt, 0, b, 64, nullptr); });
  E("fo_optimizer_state_keys", "capacity 1", [](Fx& f) { char b[1]; size_t n; return fo_optimizer_state_keys(f.opt, 0, b, 1, &n); });
  E("fo_optimizer_state_keys", "buf NULL, capacity 1<<20", [](Fx& f) { size_t n; return fo_optimizer_state_keys(f.opt, 0, nullptr, 1 << 20, &n); });
  E("fo_optimizer_param_groups_json", "opt NULL", [](Fx&) { char b[64]; size_t n; return fo_optimizer_param_groups_json(nullptr, b, 64, &n); });
  E("fo_optimizer_param_groups_json", "out_len NULL", [](Fx& f) { char b[64]; return fo_optimizer_param_groups_json(f.opt, b, 64, nullptr); });
  E("fo_optimizer_param_groups_json", "capacity 1", [](Fx& f) { char b[1]; size_t n; return fo_optimizer_param_groups_json(f.opt, b, 1, &n); });
  E("fo_optimizer_param_groups_json", "buf NULL, capacity 1<<20", [](Fx& f) { size_t n; return fo_optimizer_param_groups_json(f.opt, nullptr, 1 << 20, &n); });

  static int64_t numels[2] = {10, 20}, neg_numels[2] = {10, -20};
  E("fo_offload_plan", "numels NULL", [](Fx&) { int32_t o[2]; return fo_offload_plan(nullptr, 2, 0.5, o); });
  E("fo_offload_plan", "out NULL", [](Fx&) { return fo_offload_plan(numels, 2, 0.5, nullptr); });
  E("fo_offload_plan", "n SIZE_MAX", [](Fx&) { int32_t o[2]; return fo_offload_plan(numels, SIZE_MAX, 0.5, o); });
  E("fo_offload_plan", "negative numel", [](Fx&) { int32_t o[2]; return fo_offload_plan(neg_numels, 2, 0.5, o); });
  E("fo_offload_plan", "fraction NaN", [](Fx&) { int32_t o[2]; return fo_offload_plan(numels, 2, kNaN, o); });
  E("fo_offload_plan", "fraction -1", [](Fx&) { int32_t o[2]; return fo_offload_plan(numels, 2, -1.0, o); });
  E("fo_offload_plan", "fraction 2", [](Fx&) { int32_t o[2]; return fo_offload_plan(numels, 2, 2.0, o); });

  E("fo_set_num_threads", "100000", [](Fx&) { return fo_set_num_threads(100000); });
  E("fo_set_num_threads", "INT32_MAX", [](Fx&) { return fo_set_num_threads(kI32Max); });
  E("fo_set_num_threads", "-1", [](Fx&) { return fo_set_num_threads(-1); });
  E("fo_get_num_threads", "out NULL", [](Fx&) { return fo_get_num_threads(nullptr); });

  // ---- shard math: a valid (10, 6) tensor on a 2-rank mesh, edited per case.
  struct Shard {
    int32_t ndim = 2, mesh_ndim = 1;
    int64_t shape[2] = {10, 6}, mesh[1] = {2}, coord[1] = {0};
    fo_placement pl[1] = {{FO_PLACEMENT_SHARD, 0, 0}};
    const int64_t *shape_p = shape, *mesh_p = mesh, *coord_p = coord;
    const fo_placement* pl_p = pl;
  };
  auto wrap = [](std::function<void(Shard&)> edit) {
    return [edit](Fx&) {
      Shard s;
      edit(s);
      fo_shard_info info;
      return fo_wrap_uneven(s.ndim, s.shape_p, s.mesh_ndim, s.mesh_p, s.coord_p, s.pl_p, &info);
    };
  };
  struct ShardEdit {
    const char* what;
    std::function<void(Shard&)> edit;
  };
  std::vector<ShardEdit> shard_edits = {
      {"ndim -1", [](Shard& s) { s.ndim = -1; }},
      {"ndim 9", [](Shard& s) { s.ndim = 9; }},
      {"global_shape NULL", [](Shard& s) { s.shape_p = nullptr; }},
      {"mesh_ndim 0", [](Shard& s) { s.mesh_ndim = 0; }},
      {"mesh_ndim 9", [](Shard& s) { s.mesh_ndim = 9; }},
      {"mesh_shape NULL", [](Shard& s) { s.mesh_p = nullptr; }},
      {"coord NULL", [](Shard& s) { s.coord_p = nullptr; }},
      {"placements NULL", [](Shard& s) { s.pl_p = nullptr; }},
      {"negative global_shape", [](Shard& s) { s.shape[0] = -10; }},
      {"mesh dim 0", [](Shard& s) { s.mesh[0] = 0; }},
      {"coord outside mesh", [](Shard& s) { s.coord[0] = 2; }},
      {"coord -1", [](Shard& s) { s.coord[0] = -1; }},
      {"placement kind 9", [](Shard& s) { s.pl[0].kind = 9; }},
      {"placement dim 2", [](Shard& s) { s.pl[0].dim = 2; }},
      {"placement dim INT32_MAX", [](Shard& s) { s.pl[0].dim = kI32Max; }},
      {"split_factor 0", [](Shard& s) { s.pl[0] = {2, 0, 0}; }},
      {"split_factor -5", [](Shard& s) { s.pl[0] = {2, 0, -5}; }},
      {"split_factor INT32_MAX on 2^40 rows", [](Shard& s) {
         s.pl[0] = {2, 0, kI32Max};
         s.shape[0] = int64_t(1) << 40;
       }},
      {"[INT64_MAX, 2] elements overflow", [](Shard& s) {
         s.shape[0] = kI64Max;
         s.shape[1] = 2;
       }},
  };
  for (auto& e : shard_edits) E("fo_wrap_uneven", e.what, wrap(e.edit));
  E("fo_wrap_uneven", "out NULL", [](Fx&) {
    Shard s;
    return fo_wrap_uneven(s.ndim, s.shape, 1, s.mesh, s.coord, s.pl, nullptr);
  });
  auto indices = [](std::function<void(Shard&)> edit, int32_t dim, int64_t cap, bool null_out, bool null_len) {
    return [=](Fx&) {
      Shard s;
      edit(s);
      static int64_t buf[16];
      int64_t len;
      return fo_shard_indices(s.ndim, s.shape_p, s.mesh_ndim, s.mesh_p, s.coord_p, s.pl_p, dim,
                              null_out ? nullptr : buf, cap, null_len ? nullptr : &len);
    };
  };
  auto keep = [](Shard&) {};
  for (auto& e : shard_edits) E("fo_shard_indices", e.what, indices(e.edit, 0, 16, false, false));
  E("fo_shard_indices", "dim -1", indices(keep, -1, 16, false, false));
  E("fo_shard_indices", "dim 2", indices(keep, 2, 16, false, false));
  E("fo_shard_indices", "capacity -1", indices(keep, 0, -1, false, false));
  E("fo_shard_indices", "capacity 2 for 5", indices(keep, 0, 2, false, false));
  E("fo_shard_indices", "out NULL, capacity 16", indices(keep, 0, 16, true, false));
  E("fo_shard_indices", "out_len NULL", indices(keep, 0, 16, false, true));
  E("fo_shard_indices", "[INT64_MAX, 1] rows listed", indices([](Shard& s) { s.shape[0] = kI64Max; s.shape[1] = 1; }, 0, 16, false, false));

  E("fo_padded_shard_size", "len -1", [](Fx&) { int64_t o; return fo_padded_shard_size(-1, 2, &o); });
  E("fo_padded_shard_size", "world 0", [](Fx&) { int64_t o; return fo_padded_shard_size(10, 0, &o); });
  E("fo_padded_shard_size", "world -1", [](Fx&) { int64_t o; return fo_padded_shard_size(10, -1, &o); });
  E("fo_padded_shard_size", "out NULL", [](Fx&) { return fo_padded_shard_size(10, 2, nullptr); });

  auto grouped = [](int32_t n, fo_placement p, bool null_in, bool null_out) {
    return [=](Fx&) {
      static fo_placement in[9], out[9];
      for (auto& x : in) x = p;
      return fo_grouped_placements(n, null_in ? nullptr : in, null_out ? nullptr : out);
    };
  };
  E("fo_grouped_placements", "mesh_ndim 0", grouped(0, {1, 0, 0}, false, false));
  E("fo_grouped_placements", "mesh_ndim 9", grouped(9, {1, 0, 0}, false, false));
  E("fo_grouped_placements", "mesh_ndim -1", grouped(-1, {1, 0, 0}, false, false));
  E("fo_grouped_placements", "placements NULL", grouped(1, {1, 0, 0}, true, false));
  E("fo_grouped_placements", "out NULL", grouped(1, {1, 0, 0}, false, true));
  E("fo_grouped_placements", "dim INT32_MAX", grouped(1, {1, kI32Max, 0}, false, false));
  E("fo_grouped_placements", "dim 7 (stacked dim 8)", grouped(1, {2, 7, 2}, false, false));
  E("fo_grouped_placements", "dim -1", grouped(1, {1, -1, 0}, false, false));
  E("fo_grouped_placements", "kind 4", grouped(1, {4, 0, 0}, false, false));
  E("fo_grouped_placements", "split_factor -1", grouped(1, {FO_PLACEMENT_STRIDED_SHARD, 0, -1}, false, false));
  return v;
}

// ---- The multi-threaded section (issue 23): two threads hammering one handle. Every
// call must return FO_OK or FO_ERR_BUSY (the handle taken by the other thread; its
// message names the call in progress), and the handle must end consistent: as many
// steps and params as calls that returned OK. Each scenario runs in its own child.
struct Hammer {
  std::string name;
  // Runs the scenario; returns "" when every call and the final state are as expected.
  std::function<std::string()> run;
};

constexpr int kRounds = 300;

// One thread's verdict on a status: OK and BUSY are the only answers allowed.
std::string judge(const char* call, fo_status s, int* ok) {
  if (s == FO_OK) {
    ++*ok;
    return "";
  }
  std::string msg = fo_last_error_message();
  if (s != FO_ERR_BUSY) return std::string(call) + " returned " + fo_status_name(s) + ": " + msg;
  if (msg.find(call) == std::string::npos || msg.find("is busy in fo_") == std::string::npos)
    return std::string(call) + ": FO_ERR_BUSY's message does not name both calls: " + msg;
  return "";
}

// A steady stepper: one f32 param "w" of 64 elements, steps until told to stop.
struct Stepper {
  std::vector<float> w = std::vector<float>(64, 0.5f), g = std::vector<float>(64, 0.01f);
  int64_t shape[1] = {64};
  fo_optimizer* opt = nullptr;
  Stepper() {
    fo_optim_config cfg;
    fo_optim_config_default(0, &cfg);
    cfg.master_weight_bits = 0;
    Fx::must(fo_optimizer_create(&cfg, &opt), "create");
    fo_tensor p{w.data(), 0, 1, shape, nullptr, -1};
    int32_t idx = -1;
    Fx::must(fo_optimizer_add_param(opt, "w", &p, nullptr, &idx), "add_param");
  }
  // Steps kRounds times with one gradient per param; the count comes from num_params.
  std::string run(int* ok, int* stale) {
    for (int r = 0; r < kRounds; ++r) {
      std::this_thread::yield();
      int32_t n = 0;
      fo_status s = fo_optimizer_num_params(opt, &n);
      if (s == FO_ERR_BUSY) continue;
      if (s != FO_OK) return std::string("num_params: ") + fo_last_error_message();
      std::vector<fo_tensor> grads(static_cast<size_t>(n), fo_tensor{nullptr, 0, 1, shape, nullptr, -1});
      grads[0].data = g.data();
      s = fo_optimizer_step(opt, grads.data(), grads.size());
      // The other thread may add a param between num_params and step: the step then
      // refuses the stale count, changing nothing (not a race: a caller's stale view).
      if (s == FO_ERR_INVALID_ARGUMENT && std::string(fo_last_error_message()).find("gradients given for") != std::string::npos) {
        ++*stale;
        continue;
      }
      std::string why = judge("fo_optimizer_step", s, ok);
      if (!why.empty()) return why;
    }
    return "";
  }
  float step_count() {
    float v = -1;
    int64_t none[1] = {0};
    fo_tensor out{&v, 0, 0, none, nullptr, -1};
    Fx::must(fo_optimizer_get_state(opt, 0, "step", &out), "get_state step");
    return v;
  }
  bool finite() {
    for (float x : w)
      if (!std::isfinite(x)) return false;
    return true;
  }
};

std::vector<Hammer> hammers() {
  std::vector<Hammer> v;
  v.push_back({"step + add_param", [] {
                 Stepper st;
                 int steps = 0, stale = 0, adds = 0;
                 std::vector<std::vector<float>> extra(kRounds, std::vector<float>(8, 1.0f));
                 int64_t shape8[1] = {8};
                 std::string other;
                 std::thread t([&] {
                   for (int r = 0; r < kRounds && other.empty(); ++r) {
                     std::this_thread::yield();
                     fo_tensor p{extra[r].data(), 0, 1, shape8, nullptr, -1};
                     int32_t idx = -1;
                     std::string fqn = "extra." + std::to_string(r);
                     other = judge("fo_optimizer_add_param", fo_optimizer_add_param(st.opt, fqn.c_str(), &p, nullptr, &idx), &adds);
                   }
                 });
                 std::string why = st.run(&steps, &stale);
                 t.join();
                 if (!why.empty() || !other.empty()) return why + other;
                 int32_t n = 0;
                 Fx::must(fo_optimizer_num_params(st.opt, &n), "num_params");
                 if (n != 1 + adds) return "num_params " + std::to_string(n) + " after " + std::to_string(adds) + " successful adds";
                 if (st.step_count() != 1.0f * steps) return "step " + std::to_string(st.step_count()) + " after " + std::to_string(steps) + " successful steps";
                 if (!st.finite()) return std::string("a non-finite parameter");
                 fo_optimizer_destroy(st.opt);
                 return std::string();
               }});
  v.push_back({"step + set_state", [] {
                 Stepper st;
                 int steps = 0, stale = 0, sets = 0;
                 std::vector<float> m(64, 0.25f);
                 int64_t shape[1] = {64};
                 std::string other;
                 std::thread t([&] {
                   // Retries until it has kRounds / 10 successes: the stepper re-takes
                   // the handle at once, so a caller giving up on BUSY may never get in.
                   while (sets < kRounds / 10 && other.empty()) {
                     std::this_thread::yield();
                     const char* keys[1] = {"exp_avg"};
                     fo_tensor val{m.data(), 0, 1, shape, nullptr, -1};
                     other = judge("fo_optimizer_set_state", fo_optimizer_set_state(st.opt, 0, keys, &val, 1), &sets);
                   }
                 });
                 std::string why = st.run(&steps, &stale);
                 t.join();
                 if (!why.empty() || !other.empty()) return why + other;
                 if (stale != 0) return std::string("a stale count without any add_param");
                 if (sets == 0 || steps == 0) return std::string("no call of one thread ever got the handle");
                 float expected = static_cast<float>(steps);
                 // set_state before the first step created the state at step 0.
                 if (st.step_count() != expected) return "step " + std::to_string(st.step_count()) + " after " + std::to_string(steps) + " successful steps";
                 if (!st.finite()) return std::string("a non-finite parameter");
                 fo_optimizer_destroy(st.opt);
                 return std::string();
               }});
  v.push_back({"step + load", [] {
                 Stepper st;
                 int steps = 0, stale = 0, loads = 0;
                 fo_tensor g{st.g.data(), 0, 1, st.shape, nullptr, -1};
                 Fx::must(fo_optimizer_step(st.opt, &g, 1), "step");
                 char t_[] = "/tmp/fo_hammer_XXXXXX";
                 std::string dir = mkdtemp(t_);
                 fo_pack_options po{0, 1, 0, 0, -1, nullptr};
                 Fx::must(fo_state_save(st.opt, dir.c_str(), &po), "save");
                 std::string other;
                 std::thread t([&] {
                   for (int r = 0; r < kRounds / 10 && other.empty(); ++r)
                     other = judge("fo_state_load", fo_state_load(st.opt, dir.c_str(), nullptr, nullptr), &loads);
                 });
                 std::string why = st.run(&steps, &stale);
                 t.join();
                 if (!why.empty() || !other.empty()) return why + other;
                 if (st.step_count() < 1.0f || st.step_count() > 1.0f + steps) return "step " + std::to_string(st.step_count()) + " out of range";
                 if (!st.finite()) return std::string("a non-finite parameter");
                 fo_optimizer_destroy(st.opt);
                 return std::string();
               }});
  v.push_back({"destroy while stepping", [] {
                 // A step long enough (16M elements) for destroy to arrive in its middle:
                 // destroy must wait for it, never free the state under it.
                 std::vector<float> w(1 << 24, 0.5f), g(1 << 24, 0.01f);
                 int64_t shape[1] = {1 << 24};
                 fo_optim_config cfg;
                 fo_optim_config_default(0, &cfg);
                 cfg.master_weight_bits = 0;
                 fo_optimizer* opt = nullptr;
                 Fx::must(fo_optimizer_create(&cfg, &opt), "create");
                 fo_tensor p{w.data(), 0, 1, shape, nullptr, -1};
                 int32_t idx = -1;
                 Fx::must(fo_optimizer_add_param(opt, "w", &p, nullptr, &idx), "add_param");
                 fo_tensor gr{g.data(), 0, 1, shape, nullptr, -1};
                 fo_status step = FO_ERR_INTERNAL;
                 std::thread t([&] { step = fo_optimizer_step(opt, &gr, 1); });
                 std::this_thread::sleep_for(std::chrono::milliseconds(2));
                 fo_optimizer_destroy(opt);
                 t.join();
                 if (step != FO_OK) return std::string("the step returned ") + fo_status_name(step);
                 for (size_t i = 0; i < w.size(); i += 4099)
                   if (!(w[i] < 0.5f)) return std::string("the step did not finish before destroy");
                 return std::string();
               }});
  return v;
}

// Runs one scenario in a child, like run_case.
std::string run_hammer(const Hammer& h) {
  int out_pipe[2];
  if (pipe(out_pipe) != 0) return "pipe failed";
  std::fflush(nullptr);
  pid_t pid = fork();
  if (pid < 0) return "fork failed";
  if (pid == 0) {
    close(out_pipe[0]);
    alarm(kAlarmSeconds * 3);
    std::string why = h.run();
    if (write(out_pipe[1], why.data(), why.size()) < 0) _exit(3);
    _exit(0);
  }
  close(out_pipe[1]);
  std::string why = read_all(out_pipe[0]);
  close(out_pipe[0]);
  int st = 0;
  waitpid(pid, &st, 0);
  if (WIFSIGNALED(st)) return std::string("killed by signal ") + strsignal(WTERMSIG(st));
  if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) return "child exited abnormally";
  return why;
}

}  // namespace

int main() {
  std::vector<Case> all = cases();
  std::map<std::string, int> per_fn;
  for (auto& c : all) ++per_fn[c.fn];

  // Coverage: every exported function has a case; every case names an exported function.
  std::set<std::string> exported = exported_functions();
  CHECK(exported.size() >= 40);
  for (auto& fn : exported) {
    ++fo_test::checks();
    if (!per_fn.count(fn)) fo_test::fail(__FILE__, __LINE__, fn + " is exported by fo.h but has no misuse case");
  }
  for (auto& [fn, n] : per_fn) {
    ++fo_test::checks();
    if (!exported.count(fn)) fo_test::fail(__FILE__, __LINE__, "case for " + fn + ", which fo.h does not export");
  }

  for (auto& c : all) {
    ++fo_test::checks();
    std::string why = run_case(c);
    if (!why.empty()) fo_test::fail(__FILE__, __LINE__, c.fn + " [" + c.what + "]: " + why);
  }
  std::vector<Hammer> hs = hammers();
  for (auto& h : hs) {
    ++fo_test::checks();
    std::string why = run_hammer(h);
    if (!why.empty()) fo_test::fail(__FILE__, __LINE__, "threads [" + h.name + "]: " + why);
  }
  std::printf("misuse table: %zu cases over %zu exported functions, %zu threaded scenarios\n", all.size(),
              exported.size(), hs.size());
  return fo_test::summary("test_misuse");
}
