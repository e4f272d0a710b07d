// A PyTorch C++ extension that steps at::Tensor params through fo's C ABI, the way a
// Megatron or TransformerEngine extension would: the tensors' own memory goes to fo
// (data_ptr, sizes, strides; no copies), every tensor is checked at this boundary
// (device, dtype, layout, count) with an error naming the parameter, and every fo failure
// becomes a Python RuntimeError carrying fo_last_error_message().
#include <torch/extension.h>

#include <fo.h>

#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace {

// Raises (RuntimeError in Python) unless `status` is FO_OK.
void check(fo_status status, const std::string& what) {
  TORCH_CHECK(status == FO_OK, what, ": ", fo_status_name(status), ": ", fo_last_error_message());
}

// fo's dtype code (fo.h, fo_tensor) for a torch scalar type.
int32_t fo_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return FO_DTYPE_F32;
    case at::kHalf: return FO_DTYPE_F16;
    case at::kBFloat16: return FO_DTYPE_BF16;
    case at::kDouble: return FO_DTYPE_F64;
    case at::kChar: return FO_DTYPE_I8;
    case at::kByte: return FO_DTYPE_U8;
    case at::kShort: return FO_DTYPE_I16;
    case at::kInt: return FO_DTYPE_I32;
    case at::kLong: return FO_DTYPE_I64;
    case at::kBool: return FO_DTYPE_BOOL;
    case at::kFloat8_e4m3fn: return FO_DTYPE_F8_E4M3;
    case at::kFloat8_e5m2: return FO_DTYPE_F8_E5M2;
    default: TORCH_CHECK(false, "fo has no dtype for ", t);
  }
  return -1;
}

at::ScalarType torch_dtype(int32_t code) {
  switch (code) {
    case FO_DTYPE_F32: return at::kFloat;
    case FO_DTYPE_F16: return at::kHalf;
    case FO_DTYPE_BF16: return at::kBFloat16;
    case FO_DTYPE_F64: return at::kDouble;
    case FO_DTYPE_I8: return at::kChar;
    case FO_DTYPE_U8: return at::kByte;
    case FO_DTYPE_I16: return at::kShort;
    case FO_DTYPE_I32: return at::kInt;
    case FO_DTYPE_I64: return at::kLong;
    case FO_DTYPE_BOOL: return at::kBool;
    case FO_DTYPE_F8_E4M3: return at::kFloat8_e4m3fn;
    case FO_DTYPE_F8_E5M2: return at::kFloat8_e5m2;
    default: TORCH_CHECK(false, "fo returned unknown dtype code ", code);
  }
  return at::kFloat;
}

int32_t lookup(const std::map<std::string, int32_t>& names, const std::string& name, const char* what) {
  auto it = names.find(name);
  TORCH_CHECK(it != names.end(), "unknown ", what, " '", name, "'");
  return it->second;
}

// The tensor kinds fo steps: host memory, a float dtype fo updates in place.
// `what` names the tensor in errors: "parameter fc1.weight", "grad of fc1.weight".
void check_steppable(const at::Tensor& t, const std::string& what) {
  TORCH_CHECK(t.defined(), what, " is undefined");
  TORCH_CHECK(t.layout() == at::kStrided, what, " is ", t.layout(), "; fo takes strided tensors");
  TORCH_CHECK(t.device().is_cpu(), what, " is on ", t.device(),
              "; this extension hands fo host tensors (e.g. FSDP2's CPU-offloaded shards)");
  auto s = t.scalar_type();
  TORCH_CHECK(s == at::kFloat || s == at::kBFloat16 || s == at::kHalf, what, " has dtype ", s,
              "; fo steps float32, bfloat16 and float16");
}

// An fo_tensor over a tensor's memory; owns the shape and stride arrays it points to.
struct View {
  std::vector<int64_t> shape, strides;
  fo_tensor t{};
  explicit View(const at::Tensor& x) : shape(x.sizes().vec()), strides(x.strides().vec()) {
    t = fo_tensor{x.data_ptr(), fo_dtype(x.scalar_type()), static_cast<int32_t>(x.dim()), shape.data(),
                  strides.data(), FO_DEVICE_HOST};
  }
  View(const View&) = delete;
  View& operator=(const View&) = delete;
};

class Optimizer {
 public:
  Optimizer(const std::string& algorithm, double lr, std::tuple<double, double> betas, double eps,
            double weight_decay, double momentum, const std::string& state_format, int64_t master_weight_bits) {
    static const std::map<std::string, int32_t> algorithms{{"adamw", FO_ALGORITHM_ADAMW},
                                                           {"adam", FO_ALGORITHM_ADAM},
                                                           {"sgd", FO_ALGORITHM_SGD},
                                                           {"sgdw", FO_ALGORITHM_SGDW},
                                                           {"lion", FO_ALGORITHM_LION}};
    static const std::map<std::string, int32_t> formats{{"fp32", FO_STATE_FORMAT_FP32},
                                                        {"param_dtype", FO_STATE_FORMAT_PARAM_DTYPE},
                                                        {"quant8", FO_STATE_FORMAT_QUANT8},
                                                        {"quant8_wide", FO_STATE_FORMAT_QUANT8_WIDE}};
    fo_optim_config cfg;
    fo_optim_config_default(lookup(algorithms, algorithm, "algorithm"), &cfg);
    cfg.lr = cfg.initial_lr = lr;
    cfg.beta1 = std::get<0>(betas);
    cfg.beta2 = std::get<1>(betas);
    cfg.eps = eps;
    cfg.weight_decay = weight_decay;
    cfg.momentum = momentum;
    cfg.state_format = lookup(formats, state_format, "state_format");
    cfg.master_weight_bits = static_cast<int32_t>(master_weight_bits);
    check(fo_optimizer_create(&cfg, &opt_), "fo_optimizer_create");
  }
  ~Optimizer() { fo_optimizer_destroy(opt_); }
  Optimizer(const Optimizer&) = delete;
  Optimizer& operator=(const Optimizer&) = delete;

  // Registers `param` (a leaf tensor, e.g. an nn.Parameter); fo updates its memory in place.
  int64_t add_param(const std::string& fqn, const at::Tensor& param) {
    check_steppable(param, "parameter " + fqn);
    TORCH_CHECK(param.is_contiguous(), "parameter ", fqn, " is not contiguous (strides ", param.strides(),
                "); fo updates params in place and needs them dense");
    View v(param);
    int32_t index = -1;
    check(fo_optimizer_add_param(opt_, fqn.c_str(), &v.t, nullptr, &index), "fo_optimizer_add_param(" + fqn + ")");
    params_.push_back(param);
    fqns_.push_back(fqn);
    return index;
  }

  // One step; grads[i] is parameter i's gradient (None: no gradient), any strides.
  void step(const std::vector<c10::optional<at::Tensor>>& grads) {
    TORCH_CHECK(grads.size() == params_.size(), "step got ", grads.size(), " grads for ", params_.size(),
                " parameters");
    std::vector<std::unique_ptr<View>> views;
    std::vector<fo_tensor> ts(grads.size(), fo_tensor{nullptr, FO_DTYPE_F32, 0, nullptr, nullptr, FO_DEVICE_HOST});
    for (size_t i = 0; i < grads.size(); ++i) {
      if (!grads[i].has_value() || !grads[i]->defined()) continue;
      const at::Tensor& g = *grads[i];
      check_steppable(g, "grad of " + fqns_[i]);
      TORCH_CHECK(g.sizes() == params_[i].sizes(), "grad of ", fqns_[i], " has shape ", g.sizes(), ", parameter has ",
                  params_[i].sizes());
      views.push_back(std::make_unique<View>(g));
      ts[i] = views.back()->t;
    }
    {
      pybind11::gil_scoped_release nogil;  // fo runs its own threads; let Python run meanwhile
      check(fo_optimizer_step(opt_, ts.data(), ts.size()), "fo_optimizer_step");
    }
    // The memory changed behind autograd's back: bump versions as an in-place op would.
    for (auto& p : params_) p.unsafeGetTensorImpl()->bump_version();
  }

  // One step with each registered parameter's `.grad`.
  void step_grads() {
    std::vector<c10::optional<at::Tensor>> grads;
    for (auto& p : params_) grads.emplace_back(p.grad().defined() ? c10::optional<at::Tensor>(p.grad()) : c10::nullopt);
    step(grads);
  }

  // State `key` of parameter `index`: decoded float32 for exp_avg, exp_avg_sq, momentum_buffer,
  // step and master; raw keys (`<name>::quantized`, `<name>::scales`, error_bits) as stored.
  at::Tensor get_state(int64_t index, const std::string& key) const {
    int32_t dtype = 0, ndim = 0;
    int64_t shape[FO_MAX_DIMS] = {0};
    auto i = static_cast<int32_t>(index);
    check(fo_optimizer_state_info(opt_, i, key.c_str(), &dtype, &ndim, shape), "fo_optimizer_state_info(" + key + ")");
    bool raw = key.find("::") != std::string::npos || key == "error_bits";
    at::Tensor out = at::empty(at::IntArrayRef(shape, ndim), at::TensorOptions().dtype(raw ? torch_dtype(dtype) : at::kFloat));
    View v(out);
    check(fo_optimizer_get_state(opt_, i, key.c_str(), &v.t), "fo_optimizer_get_state(" + key + ")");
    return out;
  }

  // fo_state_pack: this rank's state as {name: tensor} (copies of fo's chunks).
  std::map<std::string, at::Tensor> pack(int64_t rank, int64_t world_size, const std::string& mode) const {
    fo_pack_options o{static_cast<int32_t>(rank), static_cast<int32_t>(world_size), mode_code(mode),
                      FO_PACK_PARAMS_NONE, FO_WRITE_UNSHARDED_RANK0, nullptr};
    fo_packed* packed = nullptr;
    check(fo_state_pack(opt_, &o, &packed), "fo_state_pack");
    std::unique_ptr<fo_packed, void (*)(fo_packed*)> guard(packed, fo_packed_destroy);
    size_t n = 0;
    check(fo_packed_num_entries(packed, &n), "fo_packed_num_entries");
    std::map<std::string, at::Tensor> out;
    for (size_t i = 0; i < n; ++i) {
      fo_packed_entry e;
      check(fo_packed_get_entry(packed, i, &e), "fo_packed_get_entry");
      auto opts = at::TensorOptions().dtype(torch_dtype(e.dtype));
      at::Tensor t = at::empty(at::IntArrayRef(e.shape, e.ndim), opts);
      TORCH_CHECK(static_cast<uint64_t>(t.nbytes()) == e.nbytes, "entry ", e.name, ": ", e.nbytes, " bytes for shape ",
                  t.sizes());
      if (e.nbytes) std::memcpy(t.data_ptr(), e.data, e.nbytes);
      out.emplace(e.name, t);
    }
    return out;
  }

  // fo_state_save: this rank's safetensors file in `dir` (loadable by fo.ckpt.load on any sharding).
  void save(const std::string& dir, int64_t rank, int64_t world_size, const std::string& mode,
            const std::string& save_id) const {
    fo_pack_options o{static_cast<int32_t>(rank), static_cast<int32_t>(world_size), mode_code(mode),
                      FO_PACK_PARAMS_NONE, FO_WRITE_UNSHARDED_RANK0, save_id.empty() ? nullptr : save_id.c_str()};
    check(fo_state_save(opt_, dir.c_str(), &o), "fo_state_save(" + dir + ")");
  }

  void set_lr(int64_t group, double lr) { check(fo_optimizer_set_group_lr(opt_, static_cast<int32_t>(group), lr), "fo_optimizer_set_group_lr"); }

 private:
  static int32_t mode_code(const std::string& mode) {
    static const std::map<std::string, int32_t> modes{{"compressed", FO_PACK_MODE_COMPRESSED},
                                                      {"portable", FO_PACK_MODE_PORTABLE}};
    return lookup(modes, mode, "mode");
  }

  fo_optimizer* opt_ = nullptr;
  std::vector<at::Tensor> params_;  // keeps the memory fo borrows alive
  std::vector<std::string> fqns_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "fo's optimizer step and checkpoint packing over at::Tensor (an example extension)";
  m.def("abi_version", &fo_abi_version);
  pybind11::class_<Optimizer>(m, "Optimizer")
      .def(pybind11::init<const std::string&, double, std::tuple<double, double>, double, double, double,
                          const std::string&, int64_t>(),
           pybind11::arg("algorithm") = "adamw", pybind11::arg("lr") = 1e-3,
           pybind11::arg("betas") = std::make_tuple(0.9, 0.999), pybind11::arg("eps") = 1e-8,
           pybind11::arg("weight_decay") = 0.01, pybind11::arg("momentum") = 0.0,
           pybind11::arg("state_format") = "quant8", pybind11::arg("master_weight_bits") = 0)
      .def("add_param", &Optimizer::add_param, pybind11::arg("fqn"), pybind11::arg("param"))
      .def("step", &Optimizer::step, pybind11::arg("grads"))
      .def("step", &Optimizer::step_grads)
      .def("get_state", &Optimizer::get_state, pybind11::arg("index"), pybind11::arg("key"))
      .def("pack", &Optimizer::pack, pybind11::arg("rank") = 0, pybind11::arg("world_size") = 1,
           pybind11::arg("mode") = "compressed")
      .def("save", &Optimizer::save, pybind11::arg("dir"), pybind11::arg("rank") = 0, pybind11::arg("world_size") = 1,
           pybind11::arg("mode") = "compressed", pybind11::arg("save_id") = "")
      .def("set_lr", &Optimizer::set_lr, pybind11::arg("group"), pybind11::arg("lr"));
}
