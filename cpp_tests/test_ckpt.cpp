// Checkpoints through the C ABI: pack and iterate the packed view, save on 3 ranks, load
// on 2 (resharded) and compare with the saved state; consolidate torch's own checkpoint
// and compare every key with full.safetensors; error paths name the file or key.
#include <nlohmann/json.hpp>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <thread>
#include <vector>
#include <unistd.h>

#include "check.hpp"

namespace fs = std::filesystem;
using nlohmann::json;

static const int64_t ROWS = 10, COLS = 7;

// One rank: an fp32 AdamW optimizer over its Shard(0) rows of a (10, 7) parameter "w".
struct Rank {
  fo_optimizer* opt = nullptr;
  std::vector<float> param;
  int64_t rows = 0, row0 = 0;
  int64_t mesh, coord;
  fo_placement pl{FO_PLACEMENT_SHARD, 0, 0};
  int64_t gshape[2] = {ROWS, COLS};

  Rank(int world, int rank) : mesh(world), coord(rank) {
    fo_shard_info info;
    CHECK_OK(fo_wrap_uneven(2, gshape, 1, &mesh, &coord, &pl, &info));
    rows = info.local_shape[0];
    row0 = info.global_offset[0];
    for (int64_t i = 0; i < rows * COLS; ++i) param.push_back(std::sin(0.3f * float(row0 * COLS + i)));
    fo_optim_config cfg;
    fo_optim_config_default(FO_ALGORITHM_ADAMW, &cfg);
    cfg.state_format = FO_STATE_FORMAT_FP32;
    cfg.master_weight_bits = 0;
    cfg.lr = 1e-2;
    CHECK_OK(fo_optimizer_create(&cfg, &opt));
    int64_t shape[2] = {rows, COLS};
    fo_tensor t{param.data(), FO_DTYPE_F32, 2, shape, nullptr, FO_DEVICE_HOST};
    fo_shard_spec spec{2, gshape, 1, &mesh, &coord, &pl};
    int32_t idx = -1;
    CHECK_OK(fo_optimizer_add_param(opt, "w", &t, &spec, &idx));
  }
  ~Rank() { fo_optimizer_destroy(opt); }

  void step(int s) {
    std::vector<float> g(rows * COLS);
    for (int64_t i = 0; i < rows * COLS; ++i) g[i] = std::cos(0.7f * float(row0 * COLS + i) + float(s));
    int64_t shape[2] = {rows, COLS};
    fo_tensor t{g.data(), FO_DTYPE_F32, 2, shape, nullptr, FO_DEVICE_HOST};
    CHECK_OK(fo_optimizer_step(opt, &t, 1));
  }

  std::vector<float> state(const char* key) {
    std::vector<float> out(rows * COLS);
    int64_t shape[2] = {rows, COLS};
    fo_tensor t{out.data(), FO_DTYPE_F32, 2, shape, nullptr, FO_DEVICE_HOST};
    CHECK_OK(fo_optimizer_get_state(opt, 0, key, &t));
    return out;
  }
};

static void packed_view_lists_chunks_with_global_offsets() {
  Rank r(3, 2);  // rows 8..10
  r.step(0);
  fo_pack_options o{2, 3, FO_PACK_MODE_PORTABLE, FO_PACK_PARAMS_NONE, FO_WRITE_UNSHARDED_RANK0, "c++"};
  fo_packed* p = nullptr;
  CHECK_OK(fo_state_pack(r.opt, &o, &p));
  size_t n = 0;
  CHECK_OK(fo_packed_num_entries(p, &n));
  std::map<std::string, fo_packed_entry> by_key;
  for (size_t i = 0; i < n; ++i) {
    fo_packed_entry e;
    CHECK_OK(fo_packed_get_entry(p, i, &e));
    by_key[e.key] = e;
  }
  CHECK(by_key.count("state.w.exp_avg") == 1 && by_key.count("state.w.exp_avg_sq") == 1);
  CHECK(by_key.count("state.w.step") == 0);  // unsharded entries: rank 0 writes them
  fo_packed_entry e = by_key["state.w.exp_avg"];
  CHECK(e.dtype == FO_DTYPE_F32 && e.ndim == 2 && e.shape[0] == 2 && e.global_shape[0] == ROWS && e.global_offset[0] == 8);
  CHECK(e.nbytes == 2 * COLS * 4);
  std::vector<float> m = r.state("exp_avg");
  CHECK(std::memcmp(e.data, m.data(), e.nbytes) == 0);
  char buf[4096];
  size_t len = 0;
  CHECK_OK(fo_packed_metadata_json(p, buf, sizeof buf, &len));
  json meta = json::parse(buf);
  CHECK(meta["mode"] == "portable" && meta["param_groups"][0]["lr"] == 1e-2);
  CHECK_ERR(fo_packed_get_entry(p, n, &e), FO_ERR_INVALID_ARGUMENT, "out of range");
  fo_packed_destroy(p);
  fo_packed_destroy(nullptr);
}

static void save_on_three_ranks_load_on_two() {
  fs::path dir = fs::temp_directory_path() / ("fo-cpp-ckpt-" + std::to_string(::getpid()));
  fs::remove_all(dir);
  std::vector<float> m_global(ROWS * COLS), v_global(ROWS * COLS);
  for (int r = 0; r < 3; ++r) {
    Rank src(3, r);
    src.step(0);
    src.step(1);
    auto m = src.state("exp_avg"), v = src.state("exp_avg_sq");
    std::copy(m.begin(), m.end(), m_global.begin() + src.row0 * COLS);
    std::copy(v.begin(), v.end(), v_global.begin() + src.row0 * COLS);
    fo_pack_options o{r, 3, FO_PACK_MODE_COMPRESSED, FO_PACK_PARAMS_NONE, FO_WRITE_UNSHARDED_RANK0, "s"};
    CHECK_OK(fo_state_save(src.opt, dir.c_str(), &o));
  }
  CHECK_OK(fo_checkpoint_verify(dir.c_str()));
  // Its table of contents: asking with no room reports the size needed, then the JSON.
  size_t need = 0;
  CHECK_ERR(fo_checkpoint_info_json(dir.c_str(), nullptr, 0, &need), FO_ERR_INVALID_ARGUMENT, "capacity");
  std::vector<char> toc(need);
  CHECK_OK(fo_checkpoint_info_json(dir.c_str(), toc.data(), toc.size(), &need));
  json info = json::parse(toc.data());
  CHECK(info["mode"] == "compressed" && info["param_groups"][0]["params"][0] == "w");
  CHECK(info["keys"]["state.w.exp_avg"] == json({{"dtype", "F32"}, {"shape", {ROWS, COLS}}, {"compressed", false}}));
  CHECK(info["keys"]["state.w.step"]["shape"].empty());
  for (int r = 0; r < 2; ++r) {
    Rank dst(2, r);
    std::vector<char> js(4096);
    fo_load_report rep{0, 0, 0, 0, js.data(), js.size(), 0};
    CHECK_OK(fo_state_load(dst.opt, dir.c_str(), nullptr, &rep));
    CHECK(rep.loaded == 3 && rep.missing == 0 && rep.unexpected == 0);
    CHECK(json::parse(js.data())["loaded"].size() == 3);
    auto m = dst.state("exp_avg"), v = dst.state("exp_avg_sq");
    CHECK(std::memcmp(m.data(), m_global.data() + dst.row0 * COLS, m.size() * 4) == 0);
    CHECK(std::memcmp(v.data(), v_global.data() + dst.row0 * COLS, v.size() * 4) == 0);
  }
  // A flipped byte: the load fails naming the file, and the optimizer keeps no state.
  fs::path f = dir / "shard-00002-model-00001-of-00001.safetensors";
  std::string bytes = fo_test::read_file(f.string());
  bytes[bytes.size() - 3] ^= 0x10;
  std::ofstream(f, std::ios::binary) << bytes;
  Rank dst(1, 0);
  CHECK_ERR(fo_state_load(dst.opt, dir.c_str(), nullptr, nullptr), FO_ERR_CORRUPT, "shard-00002");
  CHECK_ERR(fo_checkpoint_verify(dir.c_str()), FO_ERR_CORRUPT, "checksum mismatch");
  CHECK_ERR(fo_state_load(dst.opt, (dir / "nope").c_str(), nullptr, nullptr), FO_ERR_NOT_FOUND, "nope");
  CHECK_ERR(fo_state_load(dst.opt, nullptr, nullptr, nullptr), FO_ERR_INVALID_ARGUMENT, "dir");
  fo_pack_options bad{3, 3, FO_PACK_MODE_COMPRESSED, FO_PACK_PARAMS_NONE, FO_WRITE_UNSHARDED_RANK0, nullptr};
  CHECK_ERR(fo_state_save(dst.opt, dir.c_str(), &bad), FO_ERR_INVALID_ARGUMENT, "options.rank");
  fs::remove_all(dir);
}

// Tensors of a safetensors file: name -> (header entry, bytes).
static std::map<std::string, std::pair<json, std::string>> tensors(const std::string& path) {
  std::string b = fo_test::read_file(path);
  uint64_t n = 0;
  std::memcpy(&n, b.data(), 8);
  json h = json::parse(b.substr(8, n));
  std::map<std::string, std::pair<json, std::string>> out;
  for (auto& [k, v] : h.items()) {
    if (k == "__metadata__") continue;
    size_t a = v["data_offsets"][0], e = v["data_offsets"][1];
    out[k] = {v, b.substr(8 + n + a, e - a)};
  }
  return out;
}

static void consolidates_torch_checkpoint_bit_for_bit() {
  for (const char* name : {"ckpt_fsdp2_4ranks", "ckpt_fsdp_tp_2x2"}) {
    fs::path out = fs::temp_directory_path() / ("fo-cpp-cons-" + std::to_string(::getpid()));
    CHECK_OK(fo_checkpoint_consolidate(fo_test::oracle_path(std::string(name) + "/sharded").c_str(), out.c_str()));
    auto got = tensors((out / "model-00001-of-00001.safetensors").string());
    auto want = tensors(fo_test::oracle_path(std::string(name) + "/full.safetensors"));
    CHECK(got.size() == want.size() && got.size() == 48);
    for (auto& [k, w] : want) {
      auto it = got.find(k);
      CHECK(it != got.end() && it->second.second == w.second && it->second.first["shape"] == w.first["shape"] &&
            it->second.first["dtype"] == w.first["dtype"]);
    }
    json index = json::parse(fo_test::read_file((out / "model.safetensors.index.json").string()));
    CHECK(index["weight_map"].size() == 48);
    fs::remove_all(out);
  }
}

// Independent ranks must name their save; through a communicator the ranks agree on a
// generated id and fo_state_save_comm returns once the checkpoint is committed.
void saves_need_an_id_or_a_communicator() {
  fs::path dir = fs::temp_directory_path() / ("fo-cpp-commit-" + std::to_string(getpid()));
  fs::remove_all(dir);
  Rank a(2, 0), b(2, 1);
  a.step(0);
  b.step(0);
  fo_pack_options o{0, 2, FO_PACK_MODE_PORTABLE, FO_PACK_PARAMS_NONE, FO_WRITE_UNSHARDED_RANK0, nullptr};
  CHECK_ERR(fo_state_save(a.opt, dir.c_str(), &o), FO_ERR_INVALID_ARGUMENT, "save_id");
  fo_comm* comms[2] = {nullptr, nullptr};
  CHECK_OK(fo_comm_create_local_group(2, 60.0, comms));
  fo_status st[2];
  std::thread t([&] {
    fo_pack_options o1{1, 2, FO_PACK_MODE_PORTABLE, FO_PACK_PARAMS_NONE, FO_WRITE_UNSHARDED_RANK0, nullptr};
    st[1] = fo_state_save_comm(b.opt, dir.c_str(), &o1, comms[1]);
  });
  st[0] = fo_state_save_comm(a.opt, dir.c_str(), &o, comms[0]);
  t.join();
  CHECK(st[0] == FO_OK && st[1] == FO_OK);
  CHECK(fs::exists(dir / "fo-commit.json"));
  CHECK_OK(fo_checkpoint_verify(dir.c_str()));
  fo_comm_destroy(comms[0]);
  fo_comm_destroy(comms[1]);
  fs::remove_all(dir);
}

int main() {
  saves_need_an_id_or_a_communicator();
  packed_view_lists_chunks_with_global_offsets();
  save_on_three_ranks_load_on_two();
  consolidates_torch_checkpoint_bit_for_bit();
  return fo_test::summary("test_ckpt");
}
