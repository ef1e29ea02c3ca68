//! Typed, zero-copy views of a tensor's payload over the mapped file: `&[T]` always, and an
//! `ndarray::ArrayViewD<T>` with the tensor's shape under the default-on `ndarray` feature.
//! Payloads start at a multiple of 64 in a page-aligned map, so they are aligned for every
//! dtype; the checks below still refuse, never assume, so a view is never unsound.

use half::{bf16, f16};

use crate::dtype::{first_bad_bool, DType};
use crate::error::{Error, Malformed, Result};
use crate::reader::{TensorInfo, Trace};

mod sealed {
    pub trait Sealed {}
}

/// A Rust type a tensor's elements can be viewed as in place: one per dtype. `f16` and `bf16`
/// are the `half` crate's types (bit-for-bit the stored u16); `bool` is checked to hold only 0
/// and 1 before it is handed out, since any other byte would not be a Rust `bool`.
pub trait Element: sealed::Sealed + Copy + 'static {
    const DTYPE: DType;
    /// The first element that is not a valid `Self` (index, byte), for types with invalid
    /// bit patterns.
    #[doc(hidden)]
    fn first_invalid(_bytes: &[u8]) -> Option<(usize, u8)> {
        None
    }
}

macro_rules! element {
    ($($t:ty => $d:ident),* $(,)?) => {$(
        impl sealed::Sealed for $t {}
        impl Element for $t {
            const DTYPE: DType = DType::$d;
        }
    )*};
}
element!(f64 => F64, f32 => F32, f16 => F16, bf16 => BF16, i64 => I64, i32 => I32, i16 => I16,
    i8 => I8, u8 => U8);

impl sealed::Sealed for bool {}
impl Element for bool {
    const DTYPE: DType = DType::Bool;
    fn first_invalid(bytes: &[u8]) -> Option<(usize, u8)> {
        first_bad_bool(bytes)
    }
}

/// `bytes` as `&[T]` holding `count` elements; `Err` is the reason they cannot be.
fn cast<T: Element>(bytes: &[u8], count: u64) -> std::result::Result<&[T], String> {
    if cfg!(target_endian = "big") {
        return Err(
            "zero-copy views need a little-endian host (payloads are little-endian)".into(),
        );
    }
    let need = count.checked_mul(std::mem::size_of::<T>() as u64);
    if need != Some(bytes.len() as u64) {
        return Err(format!(
            "the payload is {} bytes but {count} elements of {} need {}",
            bytes.len(),
            T::DTYPE,
            need.map_or("more than 2^64".into(), |n| n.to_string())
        ));
    }
    let at = bytes.as_ptr() as usize;
    if !at.is_multiple_of(std::mem::align_of::<T>()) {
        return Err(format!(
            "the payload's address {at:#x} is not {}-byte aligned",
            std::mem::align_of::<T>()
        ));
    }
    // SAFETY: the pointer is aligned for T and the length is a whole number of T (both checked
    // above); every bit pattern is a valid T except for bool, whose bytes the caller checked.
    let (head, elems, tail) = unsafe { bytes.align_to::<T>() };
    debug_assert!(head.is_empty() && tail.is_empty());
    Ok(elems)
}

impl Trace {
    fn view_error(&self, info: &TensorInfo, asked: DType, reason: String) -> Error {
        Error::NotViewable {
            path: self.path().to_path_buf(),
            tensor: info.name.clone(),
            asked,
            reason,
        }
    }

    /// Tensor `name`'s elements as a zero-copy `&[T]` in row-major order. Refused, never a
    /// panic: an unknown name ([`Error::NotFound`]), another dtype ([`Error::WrongDType`]), a
    /// `bool` byte other than 0 or 1 ([`Malformed::BadBool`]), a file whose size changed since
    /// it was opened (reading its pages could raise SIGBUS; [`Trace::check_size`],
    /// [`Malformed::SizeChanged`]), and a
    /// payload not in place for `T` ([`Error::NotViewable`]).
    pub fn slice<T: Element>(&self, name: &str) -> Result<&[T]> {
        self.slice_of(self.tensor_or_err(name)?)
    }

    /// [`Trace::slice`] of an entry of [`Trace::tensors`].
    pub fn slice_of<T: Element>(&self, info: &TensorInfo) -> Result<&[T]> {
        if info.dtype != T::DTYPE {
            return Err(Error::WrongDType {
                path: self.path().to_path_buf(),
                tensor: info.name.clone(),
                asked: T::DTYPE,
                stored: info.dtype,
            });
        }
        self.check_size()?;
        let bytes = self.data(info);
        if let Some((element, value)) = T::first_invalid(bytes) {
            return Err(self.malformed(Malformed::BadBool {
                tensor: info.name.clone(),
                element,
                value,
            }));
        }
        cast(bytes, info.element_count()).map_err(|r| self.view_error(info, T::DTYPE, r))
    }

    /// Tensor `name` as a zero-copy `ndarray` view with its recorded shape (row-major; rank 0
    /// is a scalar, a zero dimension an empty view), refused as [`Trace::slice`] is.
    #[cfg(feature = "ndarray")]
    pub fn view<T: Element>(&self, name: &str) -> Result<ndarray::ArrayViewD<'_, T>> {
        self.view_of(self.tensor_or_err(name)?)
    }

    /// [`Trace::view`] of an entry of [`Trace::tensors`].
    #[cfg(feature = "ndarray")]
    pub fn view_of<T: Element>(&self, info: &TensorInfo) -> Result<ndarray::ArrayViewD<'_, T>> {
        let elems = self.slice_of::<T>(info)?;
        let shape = info
            .shape
            .iter()
            .map(|&d| usize::try_from(d))
            .collect::<std::result::Result<Vec<usize>, _>>()
            .map_err(|_| {
                let why = format!("shape {:?} does not fit this host's usize", info.shape);
                self.view_error(info, T::DTYPE, why)
            })?;
        ndarray::ArrayViewD::from_shape(ndarray::IxDyn(&shape), elems).map_err(|e| {
            let why = format!("shape {:?}: {e}", info.shape);
            self.view_error(info, T::DTYPE, why)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 64-byte aligned storage, so the planted offsets below are the only misalignment.
    #[repr(align(64))]
    struct Aligned([u8; 64]);

    #[test]
    fn cast_refuses_a_misaligned_or_short_payload_and_accepts_the_aligned_one() {
        let mut buf = Aligned([0; 64]);
        buf.0[..8].copy_from_slice(&[0, 0, 0x80, 0x3f, 0, 0, 0, 0xc0]);
        assert_eq!(cast::<f32>(&buf.0[..8], 2).unwrap(), &[1.0, -2.0]);
        let e = cast::<f32>(&buf.0[1..9], 2).unwrap_err();
        assert!(e.contains("is not 4-byte aligned"), "{e}");
        let e = cast::<f32>(&buf.0[..7], 2).unwrap_err();
        assert_eq!(e, "the payload is 7 bytes but 2 elements of f32 need 8");
        let e = cast::<f64>(&buf.0[..8], u64::MAX).unwrap_err();
        assert!(e.ends_with("need more than 2^64"), "{e}");
        // Alignment is per type: one byte in is fine for u8, not for i16.
        assert_eq!(cast::<u8>(&buf.0[1..3], 2).unwrap().len(), 2);
        assert!(cast::<i16>(&buf.0[1..5], 2).is_err());
    }

    #[test]
    fn bool_bytes_other_than_zero_and_one_are_found() {
        assert_eq!(first_bad_bool(&[0, 1, 1, 0]), None);
        assert_eq!(first_bad_bool(&[0, 1, 2, 7]), Some((2, 2)));
        assert_eq!(<f32 as Element>::first_invalid(&[2, 2, 2, 2]), None);
    }
}
