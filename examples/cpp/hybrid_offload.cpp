// A hybrid-offload optimizer through fo's C ABI, the way a C++ training extension uses it:
// the offload planner picks which parameters live in a host arena (standing in for the
// CPU-offloaded shards of Megatron's HybridDeviceOptimizer), every parameter is stepped
// with AdamW + quant8 state + 24-bit master weights, the state is packed and saved, then
// reloaded into a fresh optimizer whose next steps must match the original bit for bit.
// Its GPU half puts the resident parameters on GPU 0 (the shards Megatron keeps on the
// device) and steps them in the same fo_optimizer_step as the host arena's, on the
// caller's stream; the result must be the bits of an all-host run. It is skipped, saying
// why, where libcuda, a GPU or a `--features cuda` build of libfo is missing. Each half
// prints where its step time goes (std::chrono around the calls it makes): making the
// gradients, uploading the device ones, the fo_optimizer_step call, and waiting for the
// stream; the first step apart, since it allocates state (and on a GPU loads the kernels).
#include <dlfcn.h>
#include <fo.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

void check(fo_status s, const char* what) {
  if (s != FO_OK) {
    std::fprintf(stderr, "%s failed: %s: %s\n", what, fo_status_name(s), fo_last_error_message());
    std::exit(1);
  }
}

uint16_t to_bf16(float x) {  // round to nearest even (inputs here are finite)
  uint32_t u;
  std::memcpy(&u, &x, 4);
  u += 0x7FFF + ((u >> 16) & 1);
  return static_cast<uint16_t>(u >> 16);
}

struct Param {
  const char* fqn;
  std::vector<int64_t> shape;
  int64_t numel() const {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return n;
  }
};

const std::vector<Param> kParams = {
    {"embed.weight", {50, 16}}, {"layer.weight", {33, 16}}, {"layer.bias", {33}}, {"head.weight", {7, 33}}};

// Parameter memory: offloaded params are slices of one host arena, the others own buffers.
struct Model {
  std::vector<uint16_t> host_arena;
  std::vector<std::vector<uint16_t>> resident;
  std::vector<uint16_t*> data;

  explicit Model(const std::vector<int32_t>& offloaded) {
    int64_t arena = 0;
    for (size_t i = 0; i < kParams.size(); ++i)
      if (offloaded[i]) arena += kParams[i].numel();
    host_arena.assign(static_cast<size_t>(arena), 0);
    resident.resize(kParams.size());
    int64_t at = 0;
    for (size_t i = 0; i < kParams.size(); ++i) {
      if (offloaded[i]) {
        data.push_back(host_arena.data() + at);
        at += kParams[i].numel();
      } else {
        resident[i].assign(static_cast<size_t>(kParams[i].numel()), 0);
        data.push_back(resident[i].data());
      }
    }
  }
};

fo_tensor bf16_tensor(void* data, const Param& p, int32_t device = FO_DEVICE_HOST) {
  return fo_tensor{data, FO_DTYPE_BF16, static_cast<int32_t>(p.shape.size()), p.shape.data(), nullptr, device};
}

void init(Model& m) {
  for (size_t i = 0; i < kParams.size(); ++i)
    for (int64_t j = 0; j < kParams[i].numel(); ++j) m.data[i][j] = to_bf16(std::cos(0.11f * j + i) * 0.5f);
}

// Where the GPU half keeps the resident parameters and their gradients (device
// addresses; 0 for parameters in the host arena).
struct OnDevice {
  std::vector<unsigned long long> param, grad;
};

// Two groups: the planner's host-offloaded params (group 0) and the rest (group 1), whose
// memory is `dev->param[i]` on GPU 0 where `dev` is given. Returns NULL, with fo's
// message in `refused`, when fo refuses a parameter (a device one, by a build without GPU
// support).
fo_optimizer* make_optimizer(Model& m, const std::vector<int32_t>& offloaded, const OnDevice* dev = nullptr,
                             std::string* refused = nullptr) {
  fo_optim_config cfg;
  fo_optim_config_default(FO_ALGORITHM_ADAMW, &cfg);
  cfg.lr = 1e-2;
  cfg.state_format = FO_STATE_FORMAT_QUANT8;
  cfg.master_weight_bits = 24;
  fo_optimizer* opt = nullptr;
  check(fo_optimizer_create(&cfg, &opt), "fo_optimizer_create");
  cfg.lr = 5e-3;
  int32_t device_group = -1;
  check(fo_optimizer_add_param_group(opt, &cfg, &device_group), "fo_optimizer_add_param_group");
  for (size_t i = 0; i < kParams.size(); ++i) {
    bool gpu = dev && dev->param[i] != 0;
    fo_tensor t = gpu ? bf16_tensor(reinterpret_cast<void*>(dev->param[i]), kParams[i], 0)
                      : bf16_tensor(m.data[i], kParams[i]);
    int32_t index = -1;
    fo_status st =
        fo_optimizer_add_param_to_group(opt, kParams[i].fqn, &t, nullptr, offloaded[i] ? 0 : device_group, &index);
    if (st != FO_OK && gpu && refused) {
      *refused = fo_last_error_message();
      fo_optimizer_destroy(opt);
      return nullptr;
    }
    check(st, "fo_optimizer_add_param_to_group");
  }
  return opt;
}

// The few CUDA driver entry points the GPU half uses, loaded at run time so that the
// example builds and runs (skipping that half) where CUDA is absent.
struct Cuda {
  int (*Init)(unsigned) = nullptr;
  int (*DeviceGetCount)(int*) = nullptr;
  int (*PrimaryCtxRetain)(void**, int) = nullptr;
  int (*CtxPushCurrent)(void*) = nullptr;
  int (*MemAlloc)(unsigned long long*, size_t) = nullptr;
  int (*MemFree)(unsigned long long) = nullptr;
  int (*MemcpyHtoD)(unsigned long long, const void*, size_t) = nullptr;
  int (*MemcpyDtoH)(void*, unsigned long long, size_t) = nullptr;
  int (*StreamCreate)(void**, unsigned) = nullptr;
  int (*StreamSynchronize)(void*) = nullptr;

  // Empty when usable, else why not.
  std::string load() {
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) return "libcuda.so.1 could not be loaded (no NVIDIA driver)";
    bool ok = sym(lib, "cuInit", Init) && sym(lib, "cuDeviceGetCount", DeviceGetCount) &&
              sym(lib, "cuDevicePrimaryCtxRetain", PrimaryCtxRetain) &&
              sym(lib, "cuCtxPushCurrent_v2", CtxPushCurrent) &&
              sym(lib, "cuMemAlloc_v2", MemAlloc) && sym(lib, "cuMemFree_v2", MemFree) &&
              sym(lib, "cuMemcpyHtoD_v2", MemcpyHtoD) && sym(lib, "cuMemcpyDtoH_v2", MemcpyDtoH) &&
              sym(lib, "cuStreamCreate", StreamCreate) && sym(lib, "cuStreamSynchronize", StreamSynchronize);
    if (!ok) return "libcuda.so.1 lacks a driver API entry point this example uses";
    int count = 0;
    if (Init(0) != 0 || DeviceGetCount(&count) != 0 || count == 0) return "no CUDA device";
    void* ctx = nullptr;
    if (PrimaryCtxRetain(&ctx, 0) != 0 || CtxPushCurrent(ctx) != 0) return "GPU 0's primary context is unavailable";
    return "";
  }
  template <typename F>
  static bool sym(void* lib, const char* name, F& f) {
    f = reinterpret_cast<F>(dlsym(lib, name));
    return f != nullptr;
  }
};

void cu_check(int r, const char* what) {
  if (r != 0) {
    std::fprintf(stderr, "%s failed: CUresult %d\n", what, r);
    std::exit(1);
  }
}

// Where a step's time goes, summed over steps (ms): the fo_optimizer_step call is the
// optimizer's own time (on a GPU it returns once the device kernels are queued, after
// stepping the host arena on the CPU); the stream wait is the device work still running.
struct StepTimes {
  double make = 0, upload = 0, call = 0, wait = 0;
  int steps = 0;

  static double since(std::chrono::steady_clock::time_point& t) {
    auto now = std::chrono::steady_clock::now();
    double ms = std::chrono::duration<double, std::milli>(now - t).count();
    t = now;
    return ms;
  }
  // One line: `first` (the step that allocated state) and the mean of the rest.
  static void print(const char* what, const StepTimes& first, const StepTimes& rest, bool gpu) {
    auto part = [gpu](const StepTimes& t, int n) {
      char buf[160];
      if (gpu)
        std::snprintf(buf, sizeof buf, "grads made %.3f, uploaded %.3f, fo_optimizer_step %.3f, stream wait %.3f ms",
                      t.make / n, t.upload / n, t.call / n, t.wait / n);
      else
        std::snprintf(buf, sizeof buf, "grads made %.3f, fo_optimizer_step %.3f ms", t.make / n, t.call / n);
      return std::string(buf);
    };
    std::printf("%s step time: first step %s; next %d steps, mean %s\n", what, part(first, 1).c_str(), rest.steps,
                rest.steps ? part(rest, rest.steps).c_str() : "-");
  }
};

// Deterministic bf16 gradients for step `s`; the resident parameters' go to their device
// buffers where `dev` is given, and the step runs on `stream`, waited for before return.
// Adds the step's time split to `times` where given.
void step(fo_optimizer* opt, int s, const OnDevice* dev = nullptr, const Cuda* cu = nullptr, void* stream = nullptr,
          StepTimes* times = nullptr) {
  auto t = std::chrono::steady_clock::now();
  StepTimes local;
  StepTimes& acc = times ? *times : local;
  std::vector<std::vector<uint16_t>> grads;
  std::vector<fo_tensor> views;
  for (size_t i = 0; i < kParams.size(); ++i) {
    std::vector<uint16_t> g(static_cast<size_t>(kParams[i].numel()));
    for (size_t j = 0; j < g.size(); ++j) g[j] = to_bf16(std::sin(0.37f * (j + 1) + 1.3f * s + i) * 0.1f);
    grads.push_back(std::move(g));
  }
  acc.make += StepTimes::since(t);
  for (size_t i = 0; i < kParams.size(); ++i) {
    if (dev && dev->grad[i] != 0) {
      cu_check(cu->MemcpyHtoD(dev->grad[i], grads[i].data(), grads[i].size() * 2), "cuMemcpyHtoD (grad)");
      views.push_back(bf16_tensor(reinterpret_cast<void*>(dev->grad[i]), kParams[i], 0));
    } else {
      views.push_back(bf16_tensor(grads[i].data(), kParams[i]));
    }
  }
  acc.upload += StepTimes::since(t);
  check(fo_optimizer_step(opt, views.data(), views.size()), "fo_optimizer_step");
  acc.call += StepTimes::since(t);
  // The device gradients are reused by the next step: wait for this one's kernels.
  if (cu) cu_check(cu->StreamSynchronize(stream), "cuStreamSynchronize");
  acc.wait += StepTimes::since(t);
  ++acc.steps;
}

// The GPU half: returns the number of mismatching parameters (0 also when skipped).
int gpu_half(const std::vector<int32_t>& offloaded) {
  Cuda cu;
  std::string why = cu.load();
  if (!why.empty()) {
    std::printf("GPU half skipped: %s\n", why.c_str());
    return 0;
  }
  const int kSteps = 5;
  Model host(offloaded), hybrid(offloaded);
  init(host);
  init(hybrid);
  OnDevice dev;
  for (size_t i = 0; i < kParams.size(); ++i) {
    unsigned long long p = 0, g = 0;
    if (!offloaded[i]) {
      size_t bytes = static_cast<size_t>(kParams[i].numel()) * 2;
      cu_check(cu.MemAlloc(&p, bytes), "cuMemAlloc");
      cu_check(cu.MemAlloc(&g, bytes), "cuMemAlloc");
      cu_check(cu.MemcpyHtoD(p, hybrid.data[i], bytes), "cuMemcpyHtoD (param)");
    }
    dev.param.push_back(p);
    dev.grad.push_back(g);
  }
  std::string refused;
  fo_optimizer* opt = make_optimizer(hybrid, offloaded, &dev, &refused);
  if (!opt) {
    std::printf("GPU half skipped: %s\n", refused.c_str());
    return 0;
  }
  void* stream = nullptr;
  cu_check(cu.StreamCreate(&stream, 0), "cuStreamCreate");
  check(fo_optimizer_set_stream(opt, stream), "fo_optimizer_set_stream");
  fo_optimizer* ref = make_optimizer(host, offloaded);
  StepTimes first, rest;
  for (int s = 0; s < kSteps; ++s) {
    step(ref, s);
    step(opt, s, &dev, &cu, stream, s == 0 ? &first : &rest);
  }
  int failures = 0, on_gpu = 0;
  for (size_t i = 0; i < kParams.size(); ++i) {
    if (dev.param[i] != 0) {
      ++on_gpu;
      cu_check(cu.MemcpyDtoH(hybrid.data[i], dev.param[i], static_cast<size_t>(kParams[i].numel()) * 2),
               "cuMemcpyDtoH");
      cu.MemFree(dev.param[i]);
      cu.MemFree(dev.grad[i]);
    }
    if (std::memcmp(host.data[i], hybrid.data[i], static_cast<size_t>(kParams[i].numel()) * 2) != 0) {
      std::fprintf(stderr, "%s: GPU/host hybrid step differs from the all-host step\n", kParams[i].fqn);
      ++failures;
    }
  }
  fo_optimizer_destroy(opt);
  fo_optimizer_destroy(ref);
  std::printf("GPU half: %d params on GPU 0, %d in the host arena, %d steps: %s\n", on_gpu,
              static_cast<int>(kParams.size()) - on_gpu, kSteps,
              failures == 0 ? "bit-identical to the all-host step" : "MISMATCH");
  StepTimes::print("GPU half", first, rest, true);
  return failures;
}

std::vector<std::string> state_keys(const fo_optimizer* opt, int32_t i) {
  size_t n = 0;
  fo_optimizer_state_keys(opt, i, nullptr, 0, &n);
  std::string buf(n, '\0');
  check(fo_optimizer_state_keys(opt, i, buf.data(), buf.size(), &n), "fo_optimizer_state_keys");
  std::vector<std::string> keys;
  size_t start = 0;
  for (size_t j = 0; j <= buf.size(); ++j) {
    if (j == buf.size() || buf[j] == '\n' || buf[j] == '\0') {
      if (j > start) keys.push_back(buf.substr(start, j - start));
      start = j + 1;
      if (j < buf.size() && buf[j] == '\0') break;
    }
  }
  return keys;
}

std::vector<unsigned char> raw_state(const fo_optimizer* opt, int32_t i, const std::string& key) {
  int32_t dtype = 0, ndim = 0;
  int64_t shape[FO_MAX_DIMS];
  check(fo_optimizer_state_info(opt, i, key.c_str(), &dtype, &ndim, shape), "fo_optimizer_state_info");
  // Bytes per element, indexed by FO_DTYPE_* code (FO_DTYPE_F32 = 0 .. FO_DTYPE_F8_E5M2 = 11).
  static const size_t kSize[] = {4, 2, 2, 8, 1, 1, 2, 4, 8, 1, 1, 1};
  size_t n = kSize[dtype];
  for (int d = 0; d < ndim; ++d) n *= static_cast<size_t>(shape[d]);
  std::vector<unsigned char> out(n);
  fo_tensor t{out.data(), dtype, ndim, shape, nullptr, FO_DEVICE_HOST};
  check(fo_optimizer_get_state(opt, i, key.c_str(), &t), "fo_optimizer_get_state");
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string dir = argc > 1 ? argv[1] : "hybrid_offload_ckpt";
  std::vector<int64_t> numels;
  for (const Param& p : kParams) numels.push_back(p.numel());
  std::vector<int32_t> offloaded(kParams.size());
  check(fo_offload_plan(numels.data(), numels.size(), 0.5, offloaded.data()), "fo_offload_plan");
  for (size_t i = 0; i < kParams.size(); ++i)
    std::printf("%-13s %5lld elements -> %s\n", kParams[i].fqn, static_cast<long long>(numels[i]),
                offloaded[i] ? "host arena (offloaded)" : "resident");

  Model model(offloaded);
  init(model);
  fo_optimizer* opt = make_optimizer(model, offloaded);
  StepTimes first, rest;
  for (int s = 0; s < 5; ++s) step(opt, s, nullptr, nullptr, nullptr, s == 0 ? &first : &rest);
  StepTimes::print("host", first, rest, false);
  uint64_t state_bytes = 0;
  check(fo_optimizer_state_bytes(opt, -1, &state_bytes), "fo_optimizer_state_bytes");
  int64_t total = 0;
  for (int64_t n : numels) total += n;
  std::printf("optimizer state: %.3f bytes/param (fp32 AdamW: 8)\n",
              static_cast<double>(state_bytes) / static_cast<double>(total));

  // The packed view a host could hand to its own writer.
  fo_pack_options po{0, 1, FO_PACK_MODE_COMPRESSED, FO_PACK_PARAMS_STORED /* bf16 */, FO_WRITE_UNSHARDED_RANK0, "hybrid-offload-example"};
  fo_packed* packed = nullptr;
  check(fo_state_pack(opt, &po, &packed), "fo_state_pack");
  size_t entries = 0;
  check(fo_packed_num_entries(packed, &entries), "fo_packed_num_entries");
  for (size_t e = 0; e < entries; ++e) {
    fo_packed_entry pe;
    check(fo_packed_get_entry(packed, e, &pe), "fo_packed_get_entry");
    std::printf("  %-36s dtype %2d  %8llu bytes\n", pe.name, pe.dtype, static_cast<unsigned long long>(pe.nbytes));
  }
  check(fo_packed_save(packed, dir.c_str()), "fo_packed_save");
  fo_packed_destroy(packed);
  check(fo_checkpoint_verify(dir.c_str()), "fo_checkpoint_verify");

  // A fresh process would start here: new buffers, new optimizer, load.
  Model restored(offloaded);
  fo_optimizer* opt2 = make_optimizer(restored, offloaded);
  fo_load_options lo{1, 1 /* params */, 1};
  fo_load_report report{};
  check(fo_state_load(opt2, dir.c_str(), &lo, &report), "fo_state_load");
  std::printf("loaded %lld keys (%lld requantized)\n", static_cast<long long>(report.loaded),
              static_cast<long long>(report.requantized));

  int failures = 0;
  for (size_t i = 0; i < kParams.size(); ++i) {
    if (std::memcmp(model.data[i], restored.data[i], static_cast<size_t>(numels[i]) * 2) != 0) {
      std::fprintf(stderr, "%s: restored parameter differs\n", kParams[i].fqn);
      ++failures;
    }
    for (const std::string& key : state_keys(opt, static_cast<int32_t>(i)))
      if (raw_state(opt, static_cast<int32_t>(i), key) != raw_state(opt2, static_cast<int32_t>(i), key)) {
        std::fprintf(stderr, "%s: state %s differs after reload\n", kParams[i].fqn, key.c_str());
        ++failures;
      }
  }
  // The real proof: both keep training identically.
  for (int s = 5; s < 8; ++s) {
    step(opt, s);
    step(opt2, s);
  }
  for (size_t i = 0; i < kParams.size(); ++i)
    if (std::memcmp(model.data[i], restored.data[i], static_cast<size_t>(numels[i]) * 2) != 0) {
      std::fprintf(stderr, "%s: diverged after reload\n", kParams[i].fqn);
      ++failures;
    }
  fo_optimizer_destroy(opt);
  fo_optimizer_destroy(opt2);
  std::printf("hybrid_offload: %s\n", failures == 0 ? "reloaded state steps identically" : "MISMATCH");
  failures += gpu_half(offloaded);
  return failures == 0 ? 0 : 1;
}
