//! Writers -> readers -> backends round trips, as property tests over random
//! shapes (including 1 x n and n x 1), ranks, bit widths, uniform and graded
//! blocks, width-0 lines, and random (unaligned) byte ranges.

mod common;

use std::path::Path;

use proptest::prelude::*;
use proptest::test_runner::TestCaseError;

use rknot::backend::{self, Backend, Role};
use rknot::format::knot::{KnotTensorOut, write_knot};
use rknot::format::meta::{MetaValue, Metadata};
use rknot::format::rknot::{
    ArchMeta, Axis, Coding, LayerOut, Manifest, TensorSpec, TileGrid, pack_block, write_rknot,
    write_rknot_v2,
};
use rknot::format::sk32::{Sketch, dequant_sigma, dequant_uv, write_sk32};
use rknot::quant::{self, GgmlType};

fn write_file(dir: &Path, name: &str, bytes: &[u8]) -> std::path::PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    p
}

/// Check reads of the whole tensor and of random byte ranges against
/// `expected` (exact bits).
fn check_reads(
    b: &dyn Backend,
    index: usize,
    expected: &[f32],
    ranges: &[(u64, u64)],
) -> Result<(), TestCaseError> {
    let mut all = vec![0f32; expected.len()];
    b.read_f32(index, 0, &mut all)
        .map_err(|e| TestCaseError::fail(e.to_string()))?;
    for (i, (a, e)) in all.iter().zip(expected).enumerate() {
        prop_assert_eq!(
            a.to_bits(),
            e.to_bits(),
            "element {} got {} want {}",
            i,
            a,
            e
        );
    }
    let bytes: Vec<u8> = expected.iter().flat_map(|v| v.to_le_bytes()).collect();
    for &(off, len) in ranges {
        let off = off % (bytes.len() as u64 + 8);
        let mut buf = vec![0u8; len as usize];
        let n = b
            .read_bytes(index, off, &mut buf)
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        let want: &[u8] = if off as usize >= bytes.len() {
            &[]
        } else {
            &bytes[off as usize..(off as usize + len as usize).min(bytes.len())]
        };
        prop_assert_eq!(&buf[..n], want, "bytes at {} len {}", off, len);
    }
    Ok(())
}

fn shape_strategy() -> impl Strategy<Value = (u64, u64)> {
    prop_oneof![
        (1u64..=1, 1u64..300),
        (1u64..300, 1u64..=1),
        (1u64..40, 1u64..40),
        (30u64..130, 30u64..130),
    ]
}

// ------------------------------------------------------------------ SK32

fn sketch_strategy() -> impl Strategy<Value = Sketch> {
    shape_strategy().prop_flat_map(|(d_out, d_in)| {
        let rmax = d_out.min(d_in);
        (1..=rmax).prop_flat_map(move |rank| {
            (
                proptest::collection::vec(any::<u8>(), (d_out * rank) as usize),
                proptest::collection::vec(any::<u8>(), rank as usize),
                proptest::collection::vec(any::<u8>(), (rank * d_in) as usize),
                0.0f32..4.0,
                0.0f32..50.0,
                0.0f32..4.0,
            )
                .prop_map(move |(u, s, v, um, sm, vm)| Sketch {
                    name: "blk.0.attn_o.weight".into(),
                    d_out,
                    d_in,
                    rank,
                    u_max: um,
                    sigma_max: sm,
                    v_max: vm,
                    u_q8: u,
                    sigma_q8: s,
                    v_q8: v,
                })
        })
    })
}

/// f64 reference of W = U diag(σ) Vᵀ with the seed's dequantization.
fn sketch_reference(s: &Sketch) -> (Vec<f64>, Vec<f64>) {
    let (r, n) = (s.rank as usize, s.d_in as usize);
    let mut w = vec![0f64; (s.d_out * s.d_in) as usize];
    let mut bound = vec![0f64; w.len()];
    for i in 0..s.d_out as usize {
        for k in 0..r {
            let u = f64::from(dequant_uv(s.u_q8[i * r + k], s.u_max));
            let sg = f64::from(dequant_sigma(s.sigma_q8[k], s.sigma_max));
            for j in 0..n {
                let v = f64::from(dequant_uv(s.v_q8[k * n + j], s.v_max));
                w[i * n + j] += u * sg * v;
                bound[i * n + j] += (u * sg * v).abs();
            }
        }
    }
    (w, bound)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, .. ProptestConfig::default() })]

    #[test]
    fn sk32_round_trip(s in sketch_strategy(), ranges in proptest::collection::vec((0u64..200_000, 0u64..3000), 6)) {
        let dir = tempfile::tempdir().unwrap();
        let mut bytes = Vec::new();
        write_sk32(&mut bytes, "rank-k-exclusion-sketch", std::slice::from_ref(&s)).unwrap();
        let p = write_file(dir.path(), "m.sk32", &bytes);
        let b = backend::open(&p, None).unwrap();
        // Stored as attn_o, served as attn_output in both spellings.
        let idx = b.find("blk_0_attn_output_weight").unwrap();
        prop_assert_eq!(b.find("blk.0.attn_o.weight").unwrap(), idx);
        let info = &b.tensors().entries()[idx];
        prop_assert_eq!(&info.shape, &vec![s.d_out, s.d_in]);
        let mut got = vec![0f32; (s.d_out * s.d_in) as usize];
        b.read_f32(idx, 0, &mut got).unwrap();
        let (want, bound) = sketch_reference(&s);
        for i in 0..got.len() {
            // f32 accumulation over `rank` terms: relative to the sum of
            // magnitudes, error <= rank * 2^-22 comfortably.
            let tol = bound[i] * 1e-5 * (s.rank as f64).max(1.0) + 1e-30;
            prop_assert!((f64::from(got[i]) - want[i]).abs() <= tol,
                "elem {}: got {} want {} tol {}", i, got[i], want[i], tol);
        }
        // Sub-range reads are bit-identical to the whole-tensor read.
        check_reads(b.as_ref(), idx, &got, &ranges)?;
    }
}

// ------------------------------------------------------------- dense .knot

fn random_blocks(ty: GgmlType, n_elems: u64, seed: u64) -> Vec<u8> {
    let nbytes = ty.bytes_for(n_elems).unwrap() as usize;
    let mut x = seed | 1;
    let mut out: Vec<u8> = (0..nbytes)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect();
    // Keep f32 tensors finite-looking; quant blocks keep whatever bits they
    // got (the kernels must handle any bytes; we compare bit patterns).
    if ty == GgmlType::F32 {
        for c in out.chunks_exact_mut(4) {
            c[3] &= 0x3f;
        }
    }
    out
}

fn knot_types() -> impl Strategy<Value = GgmlType> {
    proptest::sample::select(quant::DECODABLE.to_vec())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, .. ProptestConfig::default() })]

    #[test]
    fn dense_knot_round_trip(
        specs in proptest::collection::vec((knot_types(), 1u64..4, 1u64..3, 1u64..3, any::<u64>()), 1..5),
        ranges in proptest::collection::vec((0u64..100_000, 0u64..5000), 5),
    ) {
        let dir = tempfile::tempdir().unwrap();
        let mut md = Metadata::default();
        md.push("general.architecture", MetaValue::String("llama".into()));
        md.push("llama.block_count", MetaValue::U32(specs.len() as u32));
        let mut owned = Vec::new();
        for (i, (ty, blocks, rows, outer, seed)) in specs.iter().enumerate() {
            let inner = ty.block_elems() * blocks;
            let shape: Vec<u64> = match i % 3 {
                0 => vec![inner],
                1 => vec![*rows, inner],
                _ => vec![*outer, *rows, inner],
            };
            let n: u64 = shape.iter().product();
            owned.push((format!("blk.{i}.ffn_up.weight"), *ty, shape, random_blocks(*ty, n, *seed)));
        }
        let outs: Vec<KnotTensorOut> = owned
            .iter()
            .map(|(n, ty, s, d)| KnotTensorOut { name: n, ty: *ty, shape: s, data: d })
            .collect();
        let mut bytes = Vec::new();
        write_knot(&mut bytes, &md, &outs).unwrap();
        let p = write_file(dir.path(), "m.knot", &bytes);
        let b = backend::open(&p, None).unwrap();
        prop_assert_eq!(b.summary().metadata.arch_u64("block_count"), Some(specs.len() as u64));
        for (name, ty, shape, data) in &owned {
            let idx = b.find(&name.replace('.', "_")).unwrap();
            prop_assert_eq!(&b.tensors().entries()[idx].shape, shape);
            let n: u64 = shape.iter().product();
            let mut want = vec![0f32; n as usize];
            quant::dequantize(*ty, data, &mut want).unwrap();
            check_reads(b.as_ref(), idx, &want, &ranges)?;
        }
    }
}

// ------------------------------------------------------------------ .rknot

#[derive(Debug, Clone)]
struct RknotCase {
    manifest: Manifest,
    spec: TensorSpec,
    /// Per block: scale and codes.
    blocks: Vec<(f32, Vec<u32>)>,
}

fn manifest_strategy() -> impl Strategy<Value = Manifest> {
    (1u64..80).prop_flat_map(|d| {
        proptest::sample::subsequence((0..d).collect::<Vec<_>>(), 1..=d as usize).prop_map(
            move |idx| {
                let k = idx.len();
                Manifest {
                    d,
                    amplitudes: (0..k).map(|i| 1.0 / (i + 1) as f32).collect(),
                    phase_alignment: (0..k).map(|i| (i % 5) as f32 / 4.0).collect(),
                    standing_indices: idx,
                }
            },
        )
    })
}

fn rknot_case() -> impl Strategy<Value = RknotCase> {
    (
        manifest_strategy(),
        any::<bool>(),
        any::<bool>(),
        1u64..70,
        any::<bool>(),
    )
        .prop_flat_map(|(m, rr, rc, other, flip)| {
            // Restricted axes have length d; the others a random length,
            // sometimes 1 (1 x n and n x 1 shapes).
            let other = if flip { 1 } else { other };
            let d_out = if rr { m.d } else { other };
            let d_in = if rc { m.d } else { (other * 7) % 90 + 1 };
            let cr = if rr { m.k() } else { d_out };
            let cc = if rc { m.k() } else { d_in };
            let coding = prop_oneof![
                (1u8..=16).prop_map(|bits| Coding::Uniform { bits }),
                (1u8..=16).prop_map(|bits| Coding::Affine { bits }),
                (1u8..=16, any::<bool>()).prop_flat_map(move |(max_bits, rows)| {
                    let lines = if rows { cr } else { cc };
                    proptest::collection::vec(0u8..=max_bits, lines as usize).prop_map(
                        move |line_bits| Coding::Graded {
                            max_bits,
                            line_axis: if rows { Axis::Rows } else { Axis::Cols },
                            line_bits,
                        },
                    )
                }),
            ];
            (
                Just(m),
                Just((rr, rc, d_out, d_in)),
                coding,
                1..=cr,
                // One-column tiles (the faithful profile's column segments,
                // read by their own path) half the time.
                prop_oneof![Just(1u64), 1..=cc],
                any::<u64>(),
            )
        })
        .prop_map(|(m, (rr, rc, d_out, d_in), coding, br, bc, seed)| {
            let spec = TensorSpec {
                name: "blk.3.ffn_down.weight".into(),
                d_out,
                d_in,
                restrict_rows: rr,
                restrict_cols: rc,
                coding,
                block_rows: br,
                block_cols: bc,
            };
            let grid = spec.grid(&m);
            let mut x = seed | 1;
            let mut rnd = move || {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x
            };
            let blocks = (0..grid.n_blocks())
                .map(|b| {
                    let t = grid.tile(b);
                    let scale = ((rnd() % 2000) as f32 - 1000.0) / 997.0;
                    let codes = (0..t.rows * t.cols)
                        .map(|_| rnd() as u32 & 0xffff)
                        .collect();
                    (scale, codes)
                })
                .collect();
            RknotCase {
                manifest: m,
                spec,
                blocks,
            }
        })
}

/// Width of compact entry (r, c) under a coding.
fn width(coding: &Coding, r: u64, c: u64) -> u8 {
    match coding {
        Coding::Uniform { bits } | Coding::Affine { bits } => *bits,
        // Not generated here (tests/lossless.rs and the codec's own tests
        // cover lossless blocks): the coded symbol's width.
        Coding::Lossless { .. } => coding.bits(),
        Coding::Graded {
            line_axis: Axis::Rows,
            line_bits,
            ..
        } => line_bits[r as usize],
        Coding::Graded {
            line_axis: Axis::Cols,
            line_bits,
            ..
        } => line_bits[c as usize],
    }
}

/// The case's blocks packed, each code masked to its line's width.
fn rknot_payloads(case: &RknotCase, grid: &TileGrid) -> Vec<Vec<u8>> {
    case.blocks
        .iter()
        .enumerate()
        .map(|(b, (scale, codes))| {
            let t = grid.tile(b as u64);
            let masked: Vec<u32> = codes
                .iter()
                .enumerate()
                .map(|(i, &c)| {
                    let (r, cc) = (t.row0 + i as u64 / t.cols, t.col0 + i as u64 % t.cols);
                    c & ((1u32 << width(&case.spec.coding, r, cc)) - 1)
                })
                .collect();
            match case.spec.coding {
                Coding::Affine { bits } => {
                    let (s, o) = affine_params(*scale);
                    rknot::format::rknot::pack_affine_block(bits, s, o, &masked)
                }
                _ => pack_block(&case.spec.coding, &t, *scale, &masked),
            }
        })
        .collect()
}

/// An affine block's f16 scale and offset, made from the case's scale.
fn affine_params(scale: f32) -> (half::f16, half::f16) {
    (
        half::f16::from_f32(scale),
        half::f16::from_f32(-2.75 * scale),
    )
}

/// Expected served tensor, computed from codes without the crate's decoder.
fn rknot_expected(case: &RknotCase, grid: &TileGrid) -> Vec<f32> {
    let s = &case.spec;
    let m = &case.manifest;
    let rows: Vec<u64> = if s.restrict_rows {
        m.standing_indices.clone()
    } else {
        (0..s.d_out).collect()
    };
    let cols: Vec<u64> = if s.restrict_cols {
        m.standing_indices.clone()
    } else {
        (0..s.d_in).collect()
    };
    let mut w = vec![0f32; (s.d_out * s.d_in) as usize];
    for (b, (scale, codes)) in case.blocks.iter().enumerate() {
        let t = grid.tile(b as u64);
        for i in 0..t.rows {
            for jj in 0..t.cols {
                let (r, c) = (t.row0 + i, t.col0 + jj);
                let wd = width(&s.coding, r, c);
                let code = codes[(i * t.cols + jj) as usize] & ((1u32 << wd) - 1);
                let v = if let Coding::Affine { .. } = s.coding {
                    // Section 6.3: code × scale, then + offset, in f32.
                    let (sc, of) = affine_params(*scale);
                    code as f32 * sc.to_f32() + of.to_f32()
                } else if wd == 0 {
                    0.0
                } else {
                    (code as i32 - (1i32 << (wd - 1))) as f32 * scale
                };
                w[(rows[r as usize] * s.d_in + cols[c as usize]) as usize] = v;
            }
        }
    }
    w
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, .. ProptestConfig::default() })]

    #[test]
    fn rknot_round_trip(case in rknot_case(), ranges in proptest::collection::vec((0u64..40_000, 0u64..3000), 6)) {
        let dir = tempfile::tempdir().unwrap();
        let grid = case.spec.grid(&case.manifest);
        let payloads = rknot_payloads(&case, &grid);
        let arch = ArchMeta { arch: "llama".into(), hidden_dim: case.manifest.d, num_layers: 4, metadata: Metadata::default() };
        let layer = LayerOut { index: 3, manifest: case.manifest.clone(), tensors: vec![(case.spec.clone(), payloads)] };
        let want = rknot_expected(&case, &grid);
        // Version 3 (packed block index) and the version-2 layout (blocks
        // listed in the header) of the same blocks serve the same values.
        let mut v3 = Vec::new();
        write_rknot(&mut v3, &arch, std::slice::from_ref(&layer)).unwrap();
        let mut v2 = Vec::new();
        write_rknot_v2(&mut v2, &arch, &[layer]).unwrap();
        for (name, bytes) in [("m3.rknot", &v3), ("m2.rknot", &v2)] {
            let p = write_file(dir.path(), name, bytes);
            let b = backend::open_single(&p, Role::Primary).unwrap();
            let idx = b.find("blk_3_ffn_down_weight").unwrap();
            check_reads(b.as_ref(), idx, &want, &ranges)?;
        }
    }
}

#[test]
fn rknot_quantizer_encodes_within_half_a_step() {
    let m = Manifest {
        d: 8,
        standing_indices: vec![1, 4, 6],
        amplitudes: vec![1.0, 0.5, 0.25],
        phase_alignment: vec![1.0, 0.5, 0.0],
    };
    let dense: Vec<f32> = (0..5 * 8)
        .map(|i| ((i * 37 % 23) as f32 - 11.0) / 7.0)
        .collect();
    for coding in [
        Coding::Uniform { bits: 8 },
        Coding::Graded {
            max_bits: 8,
            line_axis: Axis::Cols,
            line_bits: vec![8, 0, 8],
        },
        Coding::Affine { bits: 8 },
    ] {
        let spec = TensorSpec {
            name: "blk.0.attn_q.weight".into(),
            d_out: 5,
            d_in: 8,
            restrict_rows: false,
            restrict_cols: true,
            coding: coding.clone(),
            block_rows: 2,
            block_cols: 3,
        };
        let bytes = common::one_tensor_rknot(&m, spec, &dense);
        let dir = tempfile::tempdir().unwrap();
        let p = write_file(dir.path(), "q.rknot", &bytes);
        let b = backend::open_single(&p, Role::Primary).unwrap();
        let mut got = vec![0f32; 40];
        b.read_f32(0, 0, &mut got).unwrap();
        let maxabs = dense.iter().fold(0f32, |a, v| a.max(v.abs()));
        for r in 0..5 {
            for c in 0..8 {
                let g = got[r * 8 + c];
                let standing = m.standing_indices.contains(&(c as u64));
                let dropped = matches!(&coding, Coding::Graded { .. }) && c == 4;
                if !standing || dropped {
                    assert_eq!(g.to_bits(), 0f32.to_bits(), "({r},{c}) must be exactly 0.0");
                } else {
                    assert!(
                        (g - dense[r * 8 + c]).abs() <= maxabs / 127.0 * 0.5 + 1e-6,
                        "({r},{c}) {g}"
                    );
                }
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, .. ProptestConfig::default() })]

    /// A version-3 .rknot holding a compressed tensor and tensors stored as
    /// ggml blocks (dense_tensors) of random types and shapes: each reads
    /// back exactly, the dense ones as the ggml kernels decode their bytes.
    #[test]
    fn self_contained_rknot_round_trip(
        case in rknot_case(),
        specs in proptest::collection::vec((knot_types(), 1u64..4, 1u64..3, any::<u64>()), 1..4),
        ranges in proptest::collection::vec((0u64..40_000, 0u64..3000), 4),
    ) {
        use rknot::format::rknot::RknotWriter;
        let dir = tempfile::tempdir().unwrap();
        let grid = case.spec.grid(&case.manifest);
        let payloads = rknot_payloads(&case, &grid);
        let arch = ArchMeta { arch: "llama".into(), hidden_dim: case.manifest.d, num_layers: 4, metadata: Metadata::default() };
        let mut bytes = Vec::new();
        let mut w = RknotWriter::new(&mut bytes).unwrap();
        w.begin_layer(3, case.manifest.clone());
        w.tensor(&case.spec, &payloads).unwrap();
        let mut dense = Vec::new();
        for (i, (ty, blocks, rows, seed)) in specs.iter().enumerate() {
            let inner = ty.block_elems() * blocks;
            let shape = if i % 2 == 0 { vec![inner] } else { vec![*rows, inner] };
            let n: u64 = shape.iter().product();
            let data = random_blocks(*ty, n, *seed);
            let name = format!("blk.{i}.ffn_up.weight");
            w.dense_tensor(&name, *ty, &shape, |off, buf| {
                buf.copy_from_slice(&data[off as usize..off as usize + buf.len()]);
                Ok(())
            })
            .unwrap();
            dense.push((name, *ty, shape, data));
        }
        w.finish(&arch).unwrap();
        let p = write_file(dir.path(), "m.rknot", &bytes);
        let b = backend::open_single(&p, Role::Primary).unwrap();
        prop_assert_eq!(b.tensors().len(), 1 + dense.len());
        let idx = b.find("blk_3_ffn_down_weight").unwrap();
        check_reads(b.as_ref(), idx, &rknot_expected(&case, &grid), &ranges)?;
        for (name, ty, shape, data) in &dense {
            let idx = b.find(name).unwrap();
            prop_assert_eq!(&b.tensors().entries()[idx].shape, shape);
            let mut want = vec![0f32; shape.iter().product::<u64>() as usize];
            quant::dequantize(*ty, data, &mut want).unwrap();
            check_reads(b.as_ref(), idx, &want, &ranges)?;
        }
    }
}
