// The four entry points on 2 in-process ranks: shard a [5, 3] weight unevenly, hand each
// rank its rows from rank 0's full tensor, step AdamW (quant8 state), save a checkpoint.
#include <fo.h>

#include <cstdio>
#include <thread>
#include <vector>

#define CHECK(call) \
  if ((call) != FO_OK) { std::fprintf(stderr, "%s\n", fo_last_error_message()); return 1; }

int rank_main(fo_comm* comm, int64_t rank) {
  const int64_t shape[2] = {5, 3}, mesh[1] = {2}, coord[1] = {rank};
  const fo_placement shard0[1] = {{FO_PLACEMENT_SHARD, 0, 0}};
  fo_shard_info info;  // 1. fo_wrap_uneven: rank 0 holds rows 0..3, rank 1 rows 3..5
  CHECK(fo_wrap_uneven(2, shape, 1, mesh, coord, shard0, &info));

  std::vector<float> full(15), local(info.local_shape[0] * 3), grad(local.size(), 0.5f);
  for (int i = 0; i < 15; ++i) full[i] = 0.1f * i;
  fo_shard_spec spec{2, shape, 1, mesh, coord, shard0};
  fo_broadcast_source src{"fc.weight", {full.data(), FO_DTYPE_F32, 2, shape, nullptr, FO_DEVICE_HOST}};
  fo_broadcast_dest dst{"fc.weight", {local.data(), FO_DTYPE_F32, 2, info.local_shape, nullptr, FO_DEVICE_HOST}, &spec};
  fo_broadcast_stats stats;  // 2. fo_broadcast_state_dict: each rank receives only its rows
  CHECK(fo_broadcast_state_dict(comm, rank == 0 ? &src : nullptr, rank == 0, &dst, 1, nullptr, &stats));

  fo_optim_config cfg;  // 3. fo_optimizer_step: AdamW, FlashOptim's quant8 state
  fo_optim_config_default(FO_ALGORITHM_ADAMW, &cfg);
  cfg.state_format = FO_STATE_FORMAT_QUANT8;
  cfg.master_weight_bits = 0;  // f32 params are their own master
  fo_optimizer* opt = nullptr;
  int32_t index = 0;
  fo_tensor param{local.data(), FO_DTYPE_F32, 2, info.local_shape, nullptr, FO_DEVICE_HOST};
  fo_tensor g{grad.data(), FO_DTYPE_F32, 2, info.local_shape, nullptr, FO_DEVICE_HOST};
  CHECK(fo_optimizer_create(&cfg, &opt));
  CHECK(fo_optimizer_add_param(opt, "fc.weight", &param, &spec, &index));
  CHECK(fo_optimizer_step(opt, &g, 1));

  fo_pack_options po{(int32_t)rank, 2, FO_PACK_MODE_COMPRESSED, FO_PACK_PARAMS_NONE, FO_WRITE_UNSHARDED_RANK0, "step-1"};
  CHECK(fo_state_save(opt, "quickstart_ckpt", &po));  // 4. fo_state_pack + save
  std::printf("rank %lld: rows %lld..%lld, received %llu bytes, w[0] = %.4f\n", (long long)rank,
              (long long)info.global_offset[0], (long long)(info.global_offset[0] + info.local_shape[0]),
              (unsigned long long)stats.bytes_received, local[0]);
  fo_optimizer_destroy(opt);
  return 0;
}

int main() {
  fo_comm* comms[2];
  CHECK(fo_comm_create_local_group(2, 60.0, comms));
  int rc[2];
  std::thread t([&] { rc[1] = rank_main(comms[1], 1); });
  rc[0] = rank_main(comms[0], 0);
  t.join();
  for (fo_comm* c : comms) fo_comm_destroy(c);
  CHECK(fo_checkpoint_verify("quickstart_ckpt"));  // every element saved exactly once
  return rc[0] | rc[1];
}
