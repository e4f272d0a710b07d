//! Reading state out (`get_state`, `get_state_as`, `get_state_into`, `state_info`): the
//! bits of every key in every format are pinned by digests taken before reads became
//! parallel and copy-free, and the read into caller memory (the one `fo_optimizer_get_state`
//! and so `state_dict()` use) must give exactly the allocating read's bytes, whatever the
//! thread count, the buffer's alignment or its strides, and must leave a buffer it refuses
//! untouched.
use fo::optim::{Algorithm, OptimConfig, Optimizer, StateFormat};
use fo::{DType, Error, TensorView};

/// Rows x cols of every parameter: more elements than three parallel chunks (so chunk
/// boundaries are crossed) and not a multiple of the quant8 group (a short last group).
const ROWS: usize = 3;
const COLS: usize = 65_549;
const N: usize = ROWS * COLS;

struct Case {
    name: &'static str,
    algorithm: Algorithm,
    format: StateFormat,
    param: DType,
    bits: u32,
    /// FNV-1a of every key's bytes, read in each float dtype it converts to.
    digest: u64,
}

fn cases() -> Vec<Case> {
    use Algorithm::*;
    use StateFormat::*;
    let c = |name, algorithm, format, param, bits, digest| Case {
        name,
        algorithm,
        format,
        param,
        bits,
        digest,
    };
    vec![
        c(
            "adamw fp32 f32",
            AdamW,
            Fp32,
            DType::F32,
            0,
            0xf0da2026f8f8c3d9,
        ),
        c(
            "adamw quant8 bf16 24",
            AdamW,
            Quant8,
            DType::BF16,
            24,
            0x9e66d10bbe4b11cd,
        ),
        c(
            "adamw quant8_wide bf16 32",
            AdamW,
            Quant8Wide,
            DType::BF16,
            32,
            0x2aa625c1f1b439f4,
        ),
        c(
            "adamw param_dtype bf16",
            AdamW,
            ParamDtype,
            DType::BF16,
            0,
            0x7e865f7ef41a81f8,
        ),
        c(
            "adamw param_dtype f16 24",
            AdamW,
            ParamDtype,
            DType::F16,
            24,
            0x5fedf20f7b22facc,
        ),
        c(
            "sgd quant8 f16 24",
            Sgd,
            Quant8,
            DType::F16,
            24,
            0xab83c50fe148a301,
        ),
        c(
            "lion quant8 f32",
            Lion,
            Quant8,
            DType::F32,
            0,
            0x1aacbd37fea32358,
        ),
    ]
}

fn wave(n: usize, k: f32) -> Vec<f32> {
    (0..n)
        .map(|i| (i as f32 * 0.37 + k).sin() * (1.0 + (i % 7) as f32) * 1e-2)
        .collect()
}

fn as_dtype(v: &[f32], d: DType) -> Vec<u8> {
    v.iter()
        .flat_map(|&x| match d {
            DType::F32 => x.to_le_bytes().to_vec(),
            DType::BF16 => half::bf16::from_f32(x).to_le_bytes().to_vec(),
            _ => half::f16::from_f32(x).to_le_bytes().to_vec(),
        })
        .collect()
}

/// An optimizer over one parameter stepped twice; the parameter and gradient memory it
/// borrows are returned with it.
fn stepped(c: &Case) -> (Optimizer, Vec<u8>, Vec<u8>) {
    let mut cfg = OptimConfig::default_for(c.algorithm);
    (cfg.state_format, cfg.master_weight_bits, cfg.lr) = (c.format, c.bits, 1e-2);
    if c.algorithm == Algorithm::Sgd {
        cfg.momentum = 0.9;
    }
    let mut param = as_dtype(&wave(N, 0.0), c.param);
    let mut grad = Vec::new();
    let mut opt = Optimizer::new(cfg).unwrap();
    let shape = [ROWS as i64, COLS as i64];
    unsafe {
        let p = TensorView::host(param.as_mut_ptr(), c.param, &shape, None, "p").unwrap();
        opt.add_param("w", p, None, 0).unwrap();
        for k in 1..=2 {
            grad = as_dtype(&wave(N, k as f32), c.param);
            let g = TensorView::host(grad.as_mut_ptr(), c.param, &shape, None, "g").unwrap();
            opt.step(&[Some(g)]).unwrap();
        }
    }
    (opt, param, grad)
}

/// Every key with every dtype it can be read as.
fn reads(opt: &Optimizer) -> Vec<(String, DType)> {
    let mut keys = opt.state_keys(0).unwrap();
    keys.push("master".into());
    let mut out = vec![];
    for k in keys {
        let natural = opt.get_state(0, &k).unwrap().dtype;
        if natural == DType::F32 {
            for d in [DType::F32, DType::F64, DType::BF16, DType::F16] {
                out.push((k.clone(), d));
            }
        } else {
            out.push((k, natural));
        }
    }
    out
}

fn fnv(h: &mut u64, bytes: &[u8]) {
    for &b in bytes {
        *h = (*h ^ b as u64).wrapping_mul(0x100_0000_01b3);
    }
}

#[test]
fn state_reads_keep_their_bits_in_every_format() {
    let mut wrong = vec![];
    for c in cases() {
        let (opt, _p, _g) = stepped(&c);
        let mut h = 0xcbf2_9ce4_8422_2325u64;
        for (k, d) in reads(&opt) {
            fnv(&mut h, k.as_bytes());
            fnv(&mut h, &opt.get_state_as(0, &k, d).unwrap().data);
        }
        if h != c.digest {
            wrong.push(format!("{}: {h:#x}", c.name));
        }
    }
    assert!(wrong.is_empty(), "digests changed: {wrong:#?}");
}

/// `get_state_into` through a view of `buf` with `shape` and `strides` (elements).
fn read_into(
    opt: &Optimizer,
    key: &str,
    d: DType,
    buf: &mut [u8],
    shape: &[i64],
    strides: Option<&[i64]>,
) -> fo::Result<()> {
    unsafe {
        let v = TensorView::host(buf.as_mut_ptr(), d, shape, strides, "out").unwrap();
        opt.get_state_into(0, key, &v)
    }
}

#[test]
fn reads_into_caller_memory_equal_the_allocating_read() {
    for threads in [1, 2] {
        fo::optim::set_num_threads(threads).unwrap();
        for c in cases() {
            let (opt, _p, _g) = stepped(&c);
            for (k, d) in reads(&opt) {
                let want = opt.get_state_as(0, &k, d).unwrap();
                let shape: Vec<i64> = want.shape.iter().map(|&s| s as i64).collect();
                let what = format!("{} {k} as {d}, {threads} threads", c.name);
                // (TensorView refuses misaligned memory; state::out's own tests cover a
                // byte buffer at any offset.)
                let mut buf = vec![0x5Au8; want.data.len()];
                read_into(&opt, &k, d, &mut buf, &shape, None).unwrap();
                assert!(buf == want.data, "{what}");
                if shape.len() == 2 {
                    // The transpose of a [COLS, ROWS] buffer: element (r, c) at c * ROWS + r.
                    let mut buf = vec![0u8; want.data.len()];
                    let strides = [1, ROWS as i64];
                    read_into(&opt, &k, d, &mut buf, &shape, Some(&strides)).unwrap();
                    let es = d.size();
                    for (r, c) in [(0, 0), (1, 7), (2, COLS - 1), (ROWS - 1, 65_536)] {
                        let (at, src) = ((c * ROWS + r) * es, (r * COLS + c) * es);
                        assert_eq!(
                            buf[at..at + es],
                            want.data[src..src + es],
                            "{what} ({r}, {c})"
                        );
                    }
                }
            }
        }
    }
    fo::optim::set_num_threads(0).unwrap();
}

#[test]
fn state_info_gives_the_dtype_and_shape_of_get_state() {
    let c = &cases()[1];
    let (opt, _p, _g) = stepped(c);
    let mut keys = opt.state_keys(0).unwrap();
    keys.push("master".into());
    for k in keys {
        let t = opt.get_state(0, &k).unwrap();
        assert_eq!(opt.state_info(0, &k).unwrap(), (t.dtype, t.shape), "{k}");
    }
    let e = opt.state_info(0, "momentum_buffer").unwrap_err();
    assert!(
        e.to_string().contains("no state key \"momentum_buffer\""),
        "{e}"
    );
}

#[test]
fn a_refused_read_into_caller_memory_writes_nothing() {
    let (opt, _p, _g) = stepped(&cases()[1]);
    let shape = [ROWS as i64, COLS as i64];
    let mut buf = vec![0x5Au8; N * 8];
    let refused = |key: &str, d: DType, shape: &[i64], buf: &mut [u8]| {
        read_into(&opt, key, d, buf, shape, None).unwrap_err()
    };
    let e = refused("exp_avg", DType::F32, &[COLS as i64, ROWS as i64], &mut buf);
    assert!(
        matches!(e, Error::Shape(_)) && e.to_string().contains("out has shape"),
        "{e}"
    );
    let e = refused("exp_avg", DType::I32, &shape, &mut buf);
    assert!(e.to_string().contains("cannot be read as"), "{e}");
    let e = refused("error_bits", DType::F32, &shape, &mut buf);
    assert!(e.to_string().contains("state key error_bits is I8"), "{e}");
    let e = refused("exp_avg::scales", DType::F16, &shape, &mut buf);
    assert!(matches!(e, Error::Shape(_)), "{e}");
    let e = refused("momentum_buffer", DType::F32, &shape, &mut buf);
    assert!(matches!(e, Error::NotFound(_)), "{e}");
    assert!(
        buf.iter().all(|&b| b == 0x5A),
        "a refused read wrote into the buffer"
    );
}
