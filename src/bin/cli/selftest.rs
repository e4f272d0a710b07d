//! `fo selftest`: on a machine with a GPU, steps every rule x state format on the GPU and
//! on the CPU from the same inputs and counts mismatching elements (parameters and every
//! state buffer, bit for bit: must be 0), then times the GPU step against a
//! device-to-device copy of the same bytes in the same run. Without a GPU (a build
//! without feature `cuda`, no libcuda, no device) it says why and exits 0: there is
//! nothing to compare.
use super::args::Count;

#[derive(Debug, clap::Args)]
#[command(after_help = "Examples:
  fo selftest                     GPU vs CPU bits for every rule x format, then GPU speed
  fo selftest --device 1 --size 16M")]
pub struct SelftestArgs {
    /// The CUDA device to test (>= 0).
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(i32).range(0..))]
    pub device: i32,
    /// Parameters per throughput case (K and M suffixes), in 64 equal tensors.
    #[arg(long, default_value = "64M")]
    pub size: Count,
    /// Timed steps per throughput case (the best one counts), 1..=100000.
    #[arg(long, default_value_t = 5,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=100_000))]
    pub iters: usize,
}

pub fn run(a: &SelftestArgs) -> Result<(), String> {
    if let Some(why) = no_gpu() {
        println!("fo selftest: no GPU to test: {why}. Nothing compared (exit 0).");
        return Ok(());
    }
    #[cfg(feature = "cuda")]
    return super::selftest_gpu::run(
        fo::device::Device::from_c(a.device, "--device").map_err(|e| e.to_string())?,
        a.size.0,
        a.iters,
    );
    #[cfg(not(feature = "cuda"))]
    unreachable!("no_gpu() is Some without the cuda feature: {a:?}")
}

/// Why this process has no GPU to test (the machine or the build, not a failure of fo).
fn no_gpu() -> Option<String> {
    #[cfg(not(feature = "cuda"))]
    return Some("this fo was built without GPU support (rebuild with `--features cuda`)".into());
    #[cfg(feature = "cuda")]
    super::selftest_gpu::no_gpu()
}
