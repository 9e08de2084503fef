//! Element types, reduce operations and the reduction kernels.
//!
//! Every kernel computes `dst[i] = op(dst[i], src[i])` over raw bytes of one element type.
//! The operations are commutative element by element (IEEE addition and multiplication are;
//! `min`/`max` propagate NaN either way round), so two ranks combining the same two operands
//! in either order get the same bits, which keeps results identical on every rank.
//! `f16`/`bf16` are combined in `f32` and rounded back after each step, as accumulating
//! collectives commonly do; integers wrap on overflow.

use half::{bf16, f16};
use std::fmt;
use std::str::FromStr;

/// Element type of a buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum DType {
    /// 32-bit float.
    F32 = 1,
    /// 64-bit float.
    F64 = 2,
    /// IEEE half precision.
    F16 = 3,
    /// bfloat16.
    BF16 = 4,
    /// 32-bit signed integer.
    I32 = 5,
    /// 64-bit signed integer.
    I64 = 6,
    /// Unsigned byte.
    U8 = 7,
    /// 8-bit signed integer.
    I8 = 8,
    /// 16-bit signed integer.
    I16 = 9,
    /// Boolean, one byte (0 or 1; any non-zero byte reads as true).
    Bool = 10,
}

impl DType {
    /// Every supported type.
    pub const ALL: [DType; 10] =
        [DType::F32, DType::F64, DType::F16, DType::BF16, DType::I32, DType::I64, DType::U8, DType::I8, DType::I16, DType::Bool];

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::F64 | DType::I64 => 8,
            DType::F16 | DType::BF16 | DType::I16 => 2,
            DType::U8 | DType::I8 | DType::Bool => 1,
        }
    }

    /// Whether the type is a float (bitwise reduce ops are refused on floats).
    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F64 | DType::F16 | DType::BF16)
    }

    /// `Ok` when `op` is defined on this type; otherwise the reason, naming both (bitwise
    /// ops on floats, `avg` on bool). Checked before any byte moves, so an unsupported
    /// combination is an error and never wrong data.
    pub fn check_op(self, op: ReduceOp) -> Result<(), String> {
        if op.is_bitwise() && self.is_float() {
            return Err(format!("reduce op {op} is not defined on {self}; bitwise ops take integer or bool tensors"));
        }
        if op == ReduceOp::Avg && self == DType::Bool {
            return Err("reduce op avg is not defined on bool; use max (any) or min (all)".to_string());
        }
        Ok(())
    }

    /// Short name (`f32`, `bf16`, ...), as accepted by [`FromStr`].
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::I32 => "i32",
            DType::I64 => "i64",
            DType::U8 => "u8",
            DType::I8 => "i8",
            DType::I16 => "i16",
            DType::Bool => "bool",
        }
    }

    pub(crate) fn from_code(c: u8) -> Option<DType> {
        DType::ALL.into_iter().find(|d| *d as u8 == c)
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for DType {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let t = s.trim().to_ascii_lowercase();
        let t = t.strip_prefix("torch.").unwrap_or(&t);
        Ok(match t {
            "f32" | "float32" | "float" => DType::F32,
            "f64" | "float64" | "double" => DType::F64,
            "f16" | "float16" | "half" => DType::F16,
            "bf16" | "bfloat16" => DType::BF16,
            "i32" | "int32" | "int" => DType::I32,
            "i64" | "int64" | "long" => DType::I64,
            "u8" | "uint8" => DType::U8,
            "i8" | "int8" => DType::I8,
            "i16" | "int16" | "short" => DType::I16,
            "bool" => DType::Bool,
            _ => return Err(format!("unsupported dtype {s:?}; supported: {}", DType::ALL.map(|d| d.name()).join(" "))),
        })
    }
}

/// Reduce operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum ReduceOp {
    /// Sum.
    Sum = 1,
    /// Product.
    Prod = 2,
    /// Minimum (NaN wins).
    Min = 3,
    /// Maximum (NaN wins).
    Max = 4,
    /// Sum divided by the world size (integers: truncating division of the wrapped sum).
    Avg = 5,
    /// Bitwise and (integers and bool only).
    BAnd = 6,
    /// Bitwise or (integers and bool only).
    BOr = 7,
    /// Bitwise exclusive or (integers and bool only).
    BXor = 8,
}

impl ReduceOp {
    /// Every supported operation.
    pub const ALL: [ReduceOp; 8] = [
        ReduceOp::Sum,
        ReduceOp::Prod,
        ReduceOp::Min,
        ReduceOp::Max,
        ReduceOp::Avg,
        ReduceOp::BAnd,
        ReduceOp::BOr,
        ReduceOp::BXor,
    ];

    /// `band`, `bor` or `bxor`.
    pub fn is_bitwise(self) -> bool {
        matches!(self, ReduceOp::BAnd | ReduceOp::BOr | ReduceOp::BXor)
    }

    /// Short name (`sum`, `avg`, ...).
    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Prod => "prod",
            ReduceOp::Min => "min",
            ReduceOp::Max => "max",
            ReduceOp::Avg => "avg",
            ReduceOp::BAnd => "band",
            ReduceOp::BOr => "bor",
            ReduceOp::BXor => "bxor",
        }
    }

    pub(crate) fn from_code(c: u8) -> Option<ReduceOp> {
        ReduceOp::ALL.into_iter().find(|o| *o as u8 == c)
    }

    /// The operation applied pairwise during the collective (`Avg` sums, then divides once).
    pub(crate) fn combining(self) -> ReduceOp {
        if self == ReduceOp::Avg {
            ReduceOp::Sum
        } else {
            self
        }
    }
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for ReduceOp {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s.trim().to_ascii_lowercase().as_str() {
            "sum" => ReduceOp::Sum,
            "prod" | "product" => ReduceOp::Prod,
            "min" => ReduceOp::Min,
            "max" => ReduceOp::Max,
            "avg" | "mean" | "average" => ReduceOp::Avg,
            "band" => ReduceOp::BAnd,
            "bor" => ReduceOp::BOr,
            "bxor" => ReduceOp::BXor,
            _ => return Err(format!("unsupported reduce op {s:?}; supported: sum prod min max avg band bor bxor")),
        })
    }
}

/// A Rust element type Mobius can move and reduce.
pub trait Element: bytemuck::Pod + Send + Sync {
    /// Its [`DType`].
    const DTYPE: DType;
}

impl Element for f32 {
    const DTYPE: DType = DType::F32;
}
impl Element for f64 {
    const DTYPE: DType = DType::F64;
}
impl Element for f16 {
    const DTYPE: DType = DType::F16;
}
impl Element for bf16 {
    const DTYPE: DType = DType::BF16;
}
impl Element for i32 {
    const DTYPE: DType = DType::I32;
}
impl Element for i64 {
    const DTYPE: DType = DType::I64;
}
impl Element for u8 {
    const DTYPE: DType = DType::U8;
}
impl Element for i8 {
    const DTYPE: DType = DType::I8;
}
impl Element for i16 {
    const DTYPE: DType = DType::I16;
}

fn fmin<T: PartialOrd + Copy>(a: T, b: T, nan: impl Fn(T) -> bool) -> T {
    if nan(a) {
        a
    } else if nan(b) || b < a {
        b
    } else {
        a
    }
}

fn fmax<T: PartialOrd + Copy>(a: T, b: T, nan: impl Fn(T) -> bool) -> T {
    if nan(a) {
        a
    } else if nan(b) || b > a {
        b
    } else {
        a
    }
}

/// `dst[i] = f(dst[i], src[i])` over elements of `T` stored in raw bytes, taking the
/// vectorisable slice path when both sides are aligned for `T`.
fn combine<T: bytemuck::Pod>(dst: &mut [u8], src: &[u8], f: impl Fn(T, T) -> T) {
    match (bytemuck::try_cast_slice_mut::<u8, T>(dst), bytemuck::try_cast_slice::<u8, T>(src)) {
        (Ok(d), Ok(s)) => {
            for (a, b) in d.iter_mut().zip(s) {
                *a = f(*a, *b);
            }
        }
        _ => {
            let n = std::mem::size_of::<T>();
            for (a, b) in dst.chunks_exact_mut(n).zip(src.chunks_exact(n)) {
                let x: T = bytemuck::pod_read_unaligned(a);
                let y: T = bytemuck::pod_read_unaligned(b);
                a.copy_from_slice(bytemuck::bytes_of(&f(x, y)));
            }
        }
    }
}

fn combine_float<T: bytemuck::Pod + PartialOrd + std::ops::Add<Output = T> + std::ops::Mul<Output = T>>(
    dst: &mut [u8],
    src: &[u8],
    op: ReduceOp,
    nan: fn(T) -> bool,
) {
    match op.combining() {
        ReduceOp::Sum => combine::<T>(dst, src, |a, b| a + b),
        ReduceOp::Prod => combine::<T>(dst, src, |a, b| a * b),
        ReduceOp::Min => combine::<T>(dst, src, |a, b| fmin(a, b, nan)),
        _ => combine::<T>(dst, src, |a, b| fmax(a, b, nan)),
    }
}

fn combine_half<T: bytemuck::Pod>(dst: &mut [u8], src: &[u8], op: ReduceOp, to: fn(T) -> f32, from: fn(f32) -> T) {
    let nan = |x: f32| x.is_nan();
    match op.combining() {
        ReduceOp::Sum => combine::<T>(dst, src, |a, b| from(to(a) + to(b))),
        ReduceOp::Prod => combine::<T>(dst, src, |a, b| from(to(a) * to(b))),
        ReduceOp::Min => combine::<T>(dst, src, |a, b| from(fmin(to(a), to(b), nan))),
        _ => combine::<T>(dst, src, |a, b| from(fmax(to(a), to(b), nan))),
    }
}

macro_rules! combine_int {
    ($t:ty, $dst:expr, $src:expr, $op:expr) => {
        match $op.combining() {
            ReduceOp::Sum => combine::<$t>($dst, $src, |a, b| a.wrapping_add(b)),
            ReduceOp::Prod => combine::<$t>($dst, $src, |a, b| a.wrapping_mul(b)),
            ReduceOp::Min => combine::<$t>($dst, $src, |a, b| a.min(b)),
            ReduceOp::BAnd => combine::<$t>($dst, $src, |a, b| a & b),
            ReduceOp::BOr => combine::<$t>($dst, $src, |a, b| a | b),
            ReduceOp::BXor => combine::<$t>($dst, $src, |a, b| a ^ b),
            _ => combine::<$t>($dst, $src, |a, b| a.max(b)),
        }
    };
}

/// Bool as torch's gloo reduces it: sum and max are "any", prod and min are "all"; the
/// bitwise ops are logical. Inputs are read as non-zero = true; outputs are 0 or 1.
fn combine_bool(dst: &mut [u8], src: &[u8], op: ReduceOp) {
    let f: fn(bool, bool) -> bool = match op {
        ReduceOp::Sum | ReduceOp::Max | ReduceOp::BOr => |a, b| a | b,
        ReduceOp::Prod | ReduceOp::Min | ReduceOp::BAnd => |a, b| a & b,
        _ => |a, b| a ^ b,
    };
    for (a, b) in dst.iter_mut().zip(src) {
        *a = f(*a != 0, *b != 0) as u8;
    }
}

/// `dst = op(dst, src)` element-wise; `dst` and `src` hold the same number of `dtype`
/// elements (for `Avg` this sums; [`finish_avg`] divides at the end).
pub fn reduce_into(dtype: DType, op: ReduceOp, dst: &mut [u8], src: &[u8]) {
    debug_assert_eq!(dst.len(), src.len());
    debug_assert!(dtype.check_op(op).is_ok(), "{op} on {dtype} must be refused before the call");
    match dtype {
        DType::F32 => combine_float::<f32>(dst, src, op, f32::is_nan),
        DType::F64 => combine_float::<f64>(dst, src, op, f64::is_nan),
        DType::F16 => combine_half::<f16>(dst, src, op, f16::to_f32, f16::from_f32),
        DType::BF16 => combine_half::<bf16>(dst, src, op, bf16::to_f32, bf16::from_f32),
        DType::I32 => combine_int!(i32, dst, src, op),
        DType::I64 => combine_int!(i64, dst, src, op),
        DType::U8 => combine_int!(u8, dst, src, op),
        DType::I8 => combine_int!(i8, dst, src, op),
        DType::I16 => combine_int!(i16, dst, src, op),
        DType::Bool => combine_bool(dst, src, op),
    }
}

fn map<T: bytemuck::Pod>(buf: &mut [u8], f: impl Fn(T) -> T) {
    match bytemuck::try_cast_slice_mut::<u8, T>(buf) {
        Ok(d) => d.iter_mut().for_each(|a| *a = f(*a)),
        Err(_) => {
            for a in buf.chunks_exact_mut(std::mem::size_of::<T>()) {
                let x: T = bytemuck::pod_read_unaligned(a);
                a.copy_from_slice(bytemuck::bytes_of(&f(x)));
            }
        }
    }
}

/// Divides a summed buffer by `world` (the second half of `Avg`).
pub fn finish_avg(dtype: DType, buf: &mut [u8], world: usize) {
    let w = world as f64;
    match dtype {
        DType::F32 => map::<f32>(buf, |a| (a as f64 / w) as f32),
        DType::F64 => map::<f64>(buf, |a| a / w),
        DType::F16 => map::<f16>(buf, |a| f16::from_f64(a.to_f64() / w)),
        DType::BF16 => map::<bf16>(buf, |a| bf16::from_f64(a.to_f64() / w)),
        DType::I32 => map::<i32>(buf, |a| a / world as i32),
        DType::I64 => map::<i64>(buf, |a| a / world as i64),
        DType::U8 => map::<u8>(buf, |a| (a as usize / world) as u8),
        DType::I8 => map::<i8>(buf, |a| (a as i64 / world as i64) as i8),
        DType::I16 => map::<i16>(buf, |a| (a as i64 / world as i64) as i16),
        // Refused by `check_op` before the call; nothing to divide.
        DType::Bool => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes<T: bytemuck::Pod>(v: &[T]) -> Vec<u8> {
        bytemuck::cast_slice(v).to_vec()
    }

    #[test]
    fn every_op_on_every_type_matches_scalar_arithmetic() {
        let a = [1.5f32, -2.0, 3.0, f32::NAN];
        let b = [2.0f32, 4.0, -1.0, 1.0];
        for (op, want) in [
            (ReduceOp::Sum, [3.5f32, 2.0, 2.0, f32::NAN]),
            (ReduceOp::Prod, [3.0, -8.0, -3.0, f32::NAN]),
            (ReduceOp::Min, [1.5, -2.0, -1.0, f32::NAN]),
            (ReduceOp::Max, [2.0, 4.0, 3.0, f32::NAN]),
        ] {
            let mut d = bytes(&a);
            reduce_into(DType::F32, op, &mut d, &bytes(&b));
            let got: &[f32] = bytemuck::cast_slice(&d);
            assert_eq!(&got[..3], &want[..3], "{op}");
            assert!(got[3].is_nan(), "{op}: NaN must win");
            // The other order gives the same bits (commutativity keeps ranks identical).
            let mut e = bytes(&b);
            reduce_into(DType::F32, op, &mut e, &bytes(&a));
            assert_eq!(&bytemuck::cast_slice::<u8, f32>(&e)[..3], &want[..3]);
        }
        let mut d = bytes(&[250u8, 3]);
        reduce_into(DType::U8, ReduceOp::Sum, &mut d, &bytes(&[10u8, 4]));
        assert_eq!(d, vec![4, 7], "u8 sums wrap");
        let mut d = bytes(&[i64::MAX, -3]);
        reduce_into(DType::I64, ReduceOp::Min, &mut d, &bytes(&[0i64, -4]));
        assert_eq!(bytemuck::cast_slice::<u8, i64>(&d), &[0, -4]);
        let mut d = bytes(&[bf16::from_f32(1.0), bf16::from_f32(-3.0)]);
        reduce_into(DType::BF16, ReduceOp::Prod, &mut d, &bytes(&[bf16::from_f32(2.5), bf16::from_f32(2.0)]));
        assert_eq!(bytemuck::cast_slice::<u8, bf16>(&d), &[bf16::from_f32(2.5), bf16::from_f32(-6.0)]);
        let mut d = bytes(&[f16::from_f32(0.5)]);
        reduce_into(DType::F16, ReduceOp::Max, &mut d, &bytes(&[f16::from_f32(0.25)]));
        assert_eq!(bytemuck::cast_slice::<u8, f16>(&d), &[f16::from_f32(0.5)]);
    }

    #[test]
    fn unaligned_buffers_take_the_bytewise_path_with_the_same_result() {
        let a: Vec<f64> = (0..9).map(|i| i as f64 * 0.5).collect();
        let b: Vec<f64> = (0..9).map(|i| i as f64 * 2.0).collect();
        // Offsets that make both slices misaligned for f64, wherever the arrays landed.
        let mut store = [0u8; 8 * 10];
        let mut src = [0u8; 8 * 10];
        let skew = |p: *const u8, want: usize| (0..8).find(|o| (p as usize + o) % 8 == want).unwrap_or(0);
        let (d, s) = (skew(store.as_ptr(), 1), skew(src.as_ptr(), 3));
        store[d..d + 72].copy_from_slice(&bytes(&a));
        src[s..s + 72].copy_from_slice(&bytes(&b));
        assert!(bytemuck::try_cast_slice::<u8, f64>(&store[d..d + 72]).is_err());
        reduce_into(DType::F64, ReduceOp::Sum, &mut store[d..d + 72], &src[s..s + 72]);
        let got: Vec<f64> = store[d..d + 72].chunks_exact(8).map(bytemuck::pod_read_unaligned).collect();
        assert_eq!(got, (0..9).map(|i| i as f64 * 2.5).collect::<Vec<_>>());
    }

    #[test]
    fn bool_and_bitwise_ops_and_refusals() {
        for (op, want) in [
            (ReduceOp::Sum, [1u8, 1, 1, 0]),
            (ReduceOp::Max, [1, 1, 1, 0]),
            (ReduceOp::BOr, [1, 1, 1, 0]),
            (ReduceOp::Prod, [1, 0, 0, 0]),
            (ReduceOp::Min, [1, 0, 0, 0]),
            (ReduceOp::BAnd, [1, 0, 0, 0]),
            (ReduceOp::BXor, [0, 1, 1, 0]),
        ] {
            // 7 is a non-zero byte: read as true, written back as 1.
            let mut d = vec![7u8, 1, 0, 0];
            reduce_into(DType::Bool, op, &mut d, &[1, 0, 1, 0]);
            assert_eq!(d, want, "bool {op}");
        }
        let mut d = bytes(&[0b1100i16, -1]);
        reduce_into(DType::I16, ReduceOp::BXor, &mut d, &bytes(&[0b1010i16, 5]));
        assert_eq!(bytemuck::cast_slice::<u8, i16>(&d), &[0b0110, !5]);
        let mut d = bytes(&[-128i8, 100]);
        reduce_into(DType::I8, ReduceOp::Sum, &mut d, &bytes(&[-1i8, 100]));
        assert_eq!(bytemuck::cast_slice::<u8, i8>(&d), &[127, -56], "i8 sums wrap");
        assert!(DType::F32.check_op(ReduceOp::BAnd).unwrap_err().contains("band is not defined on f32"));
        assert!(DType::Bool.check_op(ReduceOp::Avg).unwrap_err().contains("avg is not defined on bool"));
        assert!(DType::I8.check_op(ReduceOp::BXor).is_ok());
    }

    #[test]
    fn avg_divides_once_and_names_parse() {
        let mut d = bytes(&[9i32, -9]);
        finish_avg(DType::I32, &mut d, 4);
        assert_eq!(bytemuck::cast_slice::<u8, i32>(&d), &[2, -2]);
        let mut d = bytes(&[3.0f32]);
        finish_avg(DType::F32, &mut d, 2);
        assert_eq!(bytemuck::cast_slice::<u8, f32>(&d), &[1.5]);
        for d in DType::ALL {
            assert_eq!(d.name().parse::<DType>().unwrap(), d);
            assert_eq!(DType::from_code(d as u8), Some(d));
        }
        assert_eq!("torch.bfloat16".parse::<DType>().unwrap(), DType::BF16);
        assert!("complex64".parse::<DType>().unwrap_err().contains("supported"));
        for o in ReduceOp::ALL {
            assert_eq!(o.name().parse::<ReduceOp>().unwrap(), o);
        }
    }
}
