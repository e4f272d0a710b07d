// The offline checkpoint tools through the C ABI: fo_checkpoint_convert reshards torch's
// 4-rank checkpoint onto a 2x2 mesh and to 3 ranks (quant8), fo_checkpoint_diff_json finds
// the first equal to torch's full file and the second within tolerance only; a failed
// convert leaves nothing at DST, and errors name the option.
#include <nlohmann/json.hpp>
#include <filesystem>
#include <string>
#include <unistd.h>

#include "check.hpp"

namespace fs = std::filesystem;
using nlohmann::json;

static json diff(const std::string& a, const std::string& b, double rtol, double atol) {
  char* out = nullptr;
  CHECK_OK(fo_checkpoint_diff_json(a.c_str(), b.c_str(), rtol, atol, &out));
  CHECK(out != nullptr);
  json j = json::parse(out ? out : "null");
  fo_string_free(out);
  return j;
}

static size_t entries(const fs::path& d) {
  size_t n = 0;
  for (auto it = fs::directory_iterator(d); it != fs::directory_iterator(); ++it) ++n;
  return n;
}

int main() {
  char t[] = "/tmp/fo_cpp_tools_XXXXXX";
  fs::path root = mkdtemp(t);
  const std::string src = fo_test::oracle_path("ckpt_fsdp2_4ranks/sharded");
  const std::string full = fo_test::oracle_path("ckpt_fsdp2_4ranks/full.safetensors");

  // A 2x2 mesh, Shard(0) x Shard(1): the same values as torch's full file.
  int64_t mesh[2] = {2, 2};
  fo_placement pl[2] = {{FO_PLACEMENT_SHARD, 0, 0}, {FO_PLACEMENT_SHARD, 1, 0}};
  fo_convert_options o{FO_CONVERT_FORMAT_KEEP, 0, 2, mesh, 2, pl, 0};
  fs::path m = root / "mesh";
  CHECK_OK(fo_checkpoint_convert(src.c_str(), m.c_str(), &o));
  json r = diff(m, full, 0, 0);
  CHECK(r["equal"] == true);
  CHECK(r["keys_compared"] == 48);
  CHECK(entries(m) == 5);  // 4 rank files + the commit record
  CHECK(entries(root) == 1);  // no staging directory left beside it

  // 3 ranks, quant8 moments: not equal, within a loose tolerance.
  fo_convert_options q{FO_CONVERT_FORMAT_COMPRESSED, 3, 0, nullptr, 0, nullptr, 0};
  fs::path c = root / "q";
  CHECK_OK(fo_checkpoint_convert(src.c_str(), c.c_str(), &q));
  CHECK(diff(c, src, 0, 0)["equal"] == false);
  json loose = diff(c, src, 1.0, 1.0);
  CHECK(loose["equal"] == true);
  int compressed = 0;
  char buf[1 << 16];
  size_t need = 0;
  CHECK_OK(fo_checkpoint_info_json(c.c_str(), buf, sizeof buf, &need));
  json toc = json::parse(buf);
  for (auto& [k, v] : toc["keys"].items()) compressed += v["compressed"].get<bool>();
  CHECK(compressed > 0);

  // NULL options: SRC's world size, its format. Into the non-empty q: refused, q unchanged.
  CHECK_ERR(fo_checkpoint_convert(src.c_str(), c.c_str(), nullptr), FO_ERR_INVALID_ARGUMENT, "force");
  CHECK(entries(c) > 0);
  // Mesh of 4 ranks but ranks 3: refused before anything is created, naming the option.
  fo_convert_options bad{FO_CONVERT_FORMAT_KEEP, 3, 2, mesh, 0, nullptr, 0};
  CHECK_ERR(fo_checkpoint_convert(src.c_str(), (root / "x/y").c_str(), &bad), FO_ERR_INVALID_ARGUMENT,
            "options.mesh 2,2 holds 4 ranks, not options.ranks 3");
  CHECK(!fs::exists(root / "x"));
  // The diff of an unreadable checkpoint is an error, its out pointer NULL.
  char* out = reinterpret_cast<char*>(1);
  CHECK_ERR(fo_checkpoint_diff_json(src.c_str(), (root / "none").c_str(), 0, 0, &out), FO_ERR_NOT_FOUND, "none");
  CHECK(out == nullptr);

  fs::remove_all(root);
  return fo_test::summary("test_ckpt_tools");
}
