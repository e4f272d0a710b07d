//! Subcommand dispatch. Each subcommand lives in its own file.
mod bench_arith;
mod bench_broadcast;
mod bench_ckpt;
mod bench_step;
mod ckpt;
mod demo;
mod flags;
mod shard;

pub use flags::Flags;

const USAGE: &str = "usage: fo <command> [flags]

commands:
  shard     print every mesh coordinate's local shape, global offset and index ranges
            fo shard --shape 10,7 --mesh 2,3 --placements S0,SS0:3
            placements: R (Replicate), P (Partial), S<dim> (Shard), SS<dim>:<sf> (_StridedShard)
  ckpt      fo ckpt inspect DIR      keys, dtypes, global shapes, sharding, sizes, compressed or portable
            fo ckpt verify DIR       checksums, and every global element saved exactly once
            fo ckpt consolidate DIR OUT   one full safetensors file + model.safetensors.index.json
  bench     benchmarks:
            fo bench step [--sizes 1M,16M,64M] [--threads 1,2] [--tensors 200] [--only fp32|compressed|arith]
                          [--torch PYTHON] [--iters 10] [--algs adamw,adam,lion,sgd] [--arithmetic exact,fast]
            optimizer-step params/s and GB/s (fp32 AdamW, bf16+quant8+24-bit AdamW) vs a
            memory ceiling measured just before each case (best of the timed steps); then
            exact vs fast arithmetic (AdamW, Adam, Lion, SGD momentum) vs the compressed
            step's memory ceiling and torch's fused fp32 AdamW (--torch or FO_TORCH_PYTHON)
            fo bench broadcast [--ranks 4] [--size-mib 1024] [--tensors 16]
            rank 0's state dict to an in-process group: scatter vs full broadcast, bytes and time
            fo bench ckpt [--size-mib 2048] [--ranks 4] [--dir D] [--keep] [--save-only]
            save/load GB/s vs plain sequential write/read; compressed vs portable size
  demo      train a small bf16 MLP on in-process ranks through the whole library, with
            checkpoint restarts (same and other rank counts) and a broadcast restore
            fo demo [--ranks 4] [--steps 200] [--seed 0] [--out DIR] [--keep]
  help      this text";

pub fn run(args: &[String]) -> Result<(), String> {
    let Some((cmd, rest)) = args.split_first() else {
        return Err(format!("no command given\n\n{USAGE}"));
    };
    match cmd.as_str() {
        "shard" => shard::run(&Flags::parse(rest)?),
        "demo" => demo::run(&Flags::parse(rest)?),
        "ckpt" => ckpt::run(rest),
        "bench" => match rest.split_first() {
            Some((what, flags)) if what == "step" => bench_step::run(&Flags::parse(flags)?),
            Some((what, flags)) if what == "broadcast" => bench_broadcast::run(&Flags::parse(flags)?),
            Some((what, more)) if what == "ckpt" => bench_ckpt::run(more),
            _ => Err(format!("usage: fo bench <step|broadcast|ckpt> [flags]\n\n{USAGE}")),
        },
        "help" | "--help" | "-h" => {
            println!("{USAGE}");
            Ok(())
        }
        other => Err(format!("unknown command {other:?}\n\n{USAGE}")),
    }
}
