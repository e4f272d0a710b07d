//! Several strided gradients in one step (gathered on fo's pool, `Optimizer::step`) step
//! every parameter as contiguous copies of the same values do, beside contiguous and
//! missing gradients, at 1 and 3 threads.
use fo::optim::{Algorithm, OptimConfig, Optimizer, StateFormat};
use fo::{DType, TensorView};

const ROWS: usize = 37;
const COLS: usize = 21;

fn values(n: usize, k: f32) -> Vec<f32> {
    (0..n)
        .map(|i| (i as f32 * 0.37 + k).sin() * (1.0 + (i % 7) as f32))
        .collect()
}

fn view(v: &mut [f32], shape: &[i64], strides: Option<&[i64]>) -> TensorView {
    unsafe { TensorView::host(v.as_mut_ptr() as *mut u8, DType::F32, shape, strides, "t").unwrap() }
}

/// Five (ROWS, COLS) parameters stepped 3 times; `strided`: their gradients as the
/// layouts below, else as row-major copies. Returns the parameters.
fn run(format: StateFormat, threads: usize, strided: bool) -> Vec<Vec<f32>> {
    fo::optim::set_num_threads(threads).unwrap();
    let mut cfg = OptimConfig::default_for(Algorithm::AdamW);
    (cfg.state_format, cfg.lr, cfg.master_weight_bits) = (format, 1e-2, 0);
    let mut opt = Optimizer::new(cfg).unwrap();
    let mut params: Vec<Vec<f32>> = (0..5).map(|k| values(ROWS * COLS, k as f32)).collect();
    for (k, p) in params.iter_mut().enumerate() {
        unsafe {
            opt.add_param(
                &format!("w{k}"),
                view(p, &[ROWS as i64, COLS as i64], None),
                None,
                0,
            )
        }
        .unwrap();
    }
    let n = ROWS * COLS;
    for step in 0..3 {
        let g: Vec<f32> = values(n, 10.0 + step as f32); // row-major values of every gradient
                                                         // column-major storage of g, and g on every other element of a twice-longer buffer
        let mut col: Vec<f32> = (0..n).map(|i| g[(i % ROWS) * COLS + i / ROWS]).collect();
        let mut col2 = col.clone();
        let mut skip: Vec<f32> = (0..2 * n)
            .map(|i| if i % 2 == 0 { g[i / 2] } else { f32::NAN })
            .collect();
        let mut rows: Vec<Vec<f32>> = (0..5).map(|_| g.clone()).collect();
        let shape = [ROWS as i64, COLS as i64];
        let grads: Vec<Option<TensorView>> = if strided {
            vec![
                Some(view(&mut rows[0], &shape, None)),
                Some(view(&mut col, &shape, Some(&[1, ROWS as i64]))),
                None,
                Some(view(&mut col2, &shape, Some(&[1, ROWS as i64]))),
                Some(view(&mut skip, &shape, Some(&[2 * COLS as i64, 2]))),
            ]
        } else {
            let mut it = rows.iter_mut();
            (0..5)
                .map(|k| {
                    let r = it.next().unwrap();
                    (k != 2).then(|| view(r, &shape, None))
                })
                .collect()
        };
        unsafe { opt.step(&grads) }.unwrap();
    }
    fo::optim::set_num_threads(0).unwrap();
    params
}

#[test]
fn several_strided_gradients_step_as_their_contiguous_copies() {
    for format in [StateFormat::Fp32, StateFormat::Quant8] {
        let want = run(format, 1, false);
        assert_ne!(want[0], values(ROWS * COLS, 0.0), "the parameters moved");
        assert_eq!(
            want[2],
            values(ROWS * COLS, 2.0),
            "no gradient: not stepped"
        );
        for threads in [1, 3] {
            assert_eq!(
                run(format, threads, true),
                want,
                "{format:?} at {threads} threads"
            );
        }
    }
}
