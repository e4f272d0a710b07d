//! FlashOptim's quant8 codec and master-weight error bits, bit for bit against
//! `flash_quant.safetensors` and `flash_ecc.safetensors` (FlashOptim 0.1.4's own outputs).
mod optim_util;

use fo::optim::math::master_split::{encode_error_bits, reconstruct};
use fo::optim::math::quant8::*;
use fo::DType;
use half::f16;
use optim_util::*;

fn names(part: &str) -> Vec<String> {
    let m = manifest();
    m["flashoptim"][part]["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["name"].as_str().unwrap().to_string())
        .collect()
}

#[test]
fn quant8_codes_scales_and_decoded_values_equal_flashoptim_on_all_22_inputs() {
    let bytes = read("flash_quant.safetensors");
    let o = Oracle::new(&bytes);
    let cases = names("quantization");
    assert_eq!(cases.len(), 22);
    for name in &cases {
        let k = |s: &str| format!("quant.{name}.{s}");
        // Momentum: signed softsign.
        let x = o.f32(&k("input"));
        let mut q = vec![0i8; x.len()];
        let mut s = vec![f16::ZERO; num_groups(x.len())];
        quantize_signed(&x, &mut q, &mut s);
        assert_eq!(q, o.i8(&k("momentum.quantized")), "{name}: momentum codes");
        let s_bits: Vec<u16> = s.iter().map(|v| v.to_bits()).collect();
        assert_eq!(
            s_bits,
            o.u16(&k("momentum.scales")),
            "{name}: momentum scales"
        );
        let mut d = vec![0f32; x.len()];
        dequantize_signed(&o.i8(&k("momentum.quantized")), &s, &mut d);
        let want = o.f32(&k("momentum.decoded"));
        for (i, (a, b)) in d.iter().zip(&want).enumerate() {
            assert!(same_f32(*a, *b), "{name}: momentum decoded[{i}] {a} vs {b}");
        }
        // Variance: unsigned sqrt.
        let v = o.f32(&k("variance.input"));
        let mut q = vec![0u8; v.len()];
        quantize_unsigned_sqrt(&v, &mut q, &mut s);
        assert_eq!(q, o.u8(&k("variance.quantized")), "{name}: variance codes");
        let s_bits: Vec<u16> = s.iter().map(|v| v.to_bits()).collect();
        assert_eq!(
            s_bits,
            o.u16(&k("variance.scales")),
            "{name}: variance scales"
        );
        dequantize_unsigned_sqrt(&q, &s, &mut d);
        let want = o.f32(&k("variance.decoded"));
        for (i, (a, b)) in d.iter().zip(&want).enumerate() {
            assert!(same_f32(*a, *b), "{name}: variance decoded[{i}] {a} vs {b}");
        }
    }
}

fn check_recon<C: fo::optim::math::master_split::ErrorCode + PartialEq + std::fmt::Debug>(
    what: &str,
    bf16: &[u16],
    codes: &[C],
    want: &[f32],
) {
    let mut r = vec![0f32; bf16.len()];
    reconstruct(DType::BF16, bf16, codes, &mut r).unwrap();
    for (i, (a, b)) in r.iter().zip(want).enumerate() {
        assert!(
            same_f32(*a, *b),
            "{what}: recon[{i}] {a} vs {b} (code {:?})",
            codes[i]
        );
    }
}

#[test]
fn error_bits_and_reconstruction_equal_flashoptim_on_all_11_inputs() {
    let bytes = read("flash_ecc.safetensors");
    let o = Oracle::new(&bytes);
    let cases = names("error_bits");
    assert_eq!(cases.len(), 11);
    for name in &cases {
        let k = |s: &str| format!("ecc.{name}.{s}");
        let x = o.f32(&k("fp32"));
        let b = o.u16(&k("bf16"));
        // torch's f32 -> bf16 cast is ours too.
        let ours_b: Vec<u16> = x
            .iter()
            .map(|&v| fo::optim::math::master_split::bf16_bits_rne(v))
            .collect();
        assert_eq!(ours_b, b, "{name}: bf16 rounding");
        let mut e8 = vec![0i8; x.len()];
        encode_error_bits(DType::BF16, &x, &b, &mut e8).unwrap();
        assert_eq!(e8, o.i8(&k("ecc24")), "{name}: ecc24");
        check_recon(&format!("{name} 24"), &b, &e8, &o.f32(&k("recon24")));
        let mut e16 = vec![0i16; x.len()];
        encode_error_bits(DType::BF16, &x, &b, &mut e16).unwrap();
        assert_eq!(e16, o.i16(&k("ecc32")), "{name}: ecc32");
        check_recon(&format!("{name} 32"), &b, &e16, &o.f32(&k("recon32")));
    }
}

#[test]
fn reconstruction_of_every_int8_code_and_sampled_int16_codes_equals_flashoptim() {
    let bytes = read("flash_ecc.safetensors");
    let o = Oracle::new(&bytes);
    let b = o.u16("recon.all_int8_codes.bf16");
    assert_eq!(b.len(), 1792);
    check_recon(
        "all_int8_codes",
        &b,
        &o.i8("recon.all_int8_codes.ecc"),
        &o.f32("recon.all_int8_codes.recon"),
    );
    let b = o.u16("recon.int16_codes.bf16");
    check_recon(
        "int16_codes",
        &b,
        &o.i16("recon.int16_codes.ecc"),
        &o.f32("recon.int16_codes.recon"),
    );
}
