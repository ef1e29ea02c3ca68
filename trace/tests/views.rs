//! Typed zero-copy views (`Trace::slice`, `Trace::view`): each dtype reads back the bytes
//! written, with the recorded shape, in place in the map; every misuse is a typed refusal.
use half::{bf16, f16};
use serde_json::json;
use tracegate_trace::{Attributes, DType, Element, Error, Malformed, Resized, Trace, TraceWriter};

const SHAPES: [&[u64]; 5] = [&[], &[0], &[3], &[2, 0, 4], &[1, 2, 1, 3, 2]];

/// Element `i` of a test tensor, as its little-endian bytes (so the expected values are built
/// from bytes, not by the reader under test).
fn element_bytes(dtype: DType, i: usize) -> Vec<u8> {
    let v = i as i64 * 37 - 50;
    match dtype {
        DType::F64 => (v as f64 * 0.25).to_le_bytes().to_vec(),
        DType::F32 => (v as f32 * 0.25).to_le_bytes().to_vec(),
        DType::F16 | DType::BF16 | DType::I16 => {
            (v as i16).wrapping_mul(301).to_le_bytes().to_vec()
        }
        DType::I64 => (v << 40).to_le_bytes().to_vec(),
        DType::I32 => (v as i32 * 70001).to_le_bytes().to_vec(),
        DType::I8 => (v as i8).to_le_bytes().to_vec(),
        DType::U8 => (v as u8).to_le_bytes().to_vec(),
        DType::Bool => vec![(i % 3 == 1) as u8],
    }
}

fn count(shape: &[u64]) -> usize {
    shape.iter().product::<u64>() as usize
}

/// One tensor per dtype and shape, named `{dtype}.{k}` for the k-th shape of [`SHAPES`].
fn write_all(path: &std::path::Path) {
    let mut w = TraceWriter::create(path, json!({})).unwrap();
    for dtype in DType::ALL {
        for (k, shape) in SHAPES.iter().enumerate() {
            let bytes: Vec<u8> = (0..count(shape))
                .flat_map(|i| element_bytes(dtype, i))
                .collect();
            w.tensor(
                &format!("{dtype}.{k}"),
                dtype,
                shape,
                &bytes,
                &Attributes::default(),
            )
            .unwrap();
        }
    }
    w.finish().unwrap();
}

/// Checks every shape of `T`'s dtype: the view's shape, each element's bytes (through
/// `to_bytes`), and that the view lies in the map (zero-copy), not in a copy.
fn check<T: Element + std::fmt::Debug>(t: &Trace, to_bytes: fn(T) -> Vec<u8>) {
    for (k, shape) in SHAPES.iter().enumerate() {
        let name = format!("{}.{k}", T::DTYPE);
        let view = t.view::<T>(&name).unwrap();
        let dims: Vec<usize> = shape.iter().map(|&d| d as usize).collect();
        assert_eq!(view.shape(), &dims[..], "{name}");
        let got: Vec<u8> = view.iter().flat_map(|&x| to_bytes(x)).collect();
        let info = t.tensor_info(&name).unwrap();
        let expected: Vec<u8> = (0..count(shape))
            .flat_map(|i| element_bytes(T::DTYPE, i))
            .collect();
        assert_eq!(got, expected, "{name}");
        assert_eq!(t.data(info), &expected[..], "{name}");
        // Zero-copy: the view and the slice point at the payload inside the map.
        assert_eq!(
            view.as_ptr() as usize,
            t.data(info).as_ptr() as usize,
            "{name}"
        );
        assert_eq!(
            t.slice::<T>(&name).unwrap().as_ptr(),
            view.as_ptr(),
            "{name}"
        );
    }
}

#[test]
fn every_dtype_and_shape_views_the_bytes_written_in_place() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("a.trace");
    write_all(&p);
    let t = Trace::open(&p).unwrap();
    check::<f64>(&t, |x| x.to_le_bytes().to_vec());
    check::<f32>(&t, |x| x.to_le_bytes().to_vec());
    check::<f16>(&t, |x| x.to_bits().to_le_bytes().to_vec());
    check::<bf16>(&t, |x| x.to_bits().to_le_bytes().to_vec());
    check::<i64>(&t, |x| x.to_le_bytes().to_vec());
    check::<i32>(&t, |x| x.to_le_bytes().to_vec());
    check::<i16>(&t, |x| x.to_le_bytes().to_vec());
    check::<i8>(&t, |x| x.to_le_bytes().to_vec());
    check::<u8>(&t, |x| x.to_le_bytes().to_vec());
    check::<bool>(&t, |x| vec![x as u8]);
    // A value read through the view, against one spelled out (not derived from the writer).
    assert_eq!(t.view::<f32>("f32.2").unwrap()[[1]], -3.25);
    assert_eq!(t.view::<f32>("f32.0").unwrap()[[]], -12.5);
    let b = t.view::<bool>("bool.4").unwrap();
    assert_eq!(b.iter().filter(|&&x| x).count(), 4);
}

#[test]
fn a_zero_dimension_beside_a_huge_one_is_an_empty_view() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("wide.trace");
    let mut w = TraceWriter::create(&p, json!({})).unwrap();
    let attrs = Attributes::default();
    w.tensor("empty", DType::F32, &[0, 1 << 62], &[], &attrs)
        .unwrap();
    w.tensor("zero", DType::I8, &[5, 0], &[], &attrs).unwrap();
    w.tensor("huge", DType::U8, &[0, 1 << 63], &[], &attrs)
        .unwrap();
    w.finish().unwrap();
    let t = Trace::open(&p).unwrap();
    let v = t.view::<f32>("empty").unwrap();
    assert_eq!((v.shape(), v.len()), (&[0, 1usize << 62][..], 0));
    let v = t.view::<i8>("zero").unwrap();
    assert_eq!((v.shape(), v.len()), (&[5, 0][..], 0));
    // Empty, so a valid trace, but ndarray bounds the product of the non-zero dimensions by
    // isize::MAX: refused as a value, while its (empty) slice is still handed out.
    let e = t.view::<u8>("huge").unwrap_err();
    assert!(matches!(e, Error::NotViewable { .. }), "{e:?}");
    let shown = "tensor \"huge\" cannot be viewed as u8 in place: shape [0, 9223372036854775808]";
    assert!(e.to_string().contains(shown), "{e}");
    assert_eq!(t.slice::<u8>("huge").unwrap(), &[] as &[u8]);
}

#[test]
fn the_wrong_dtype_is_a_typed_error_naming_the_tensor_and_both_dtypes() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("a.trace");
    write_all(&p);
    let t = Trace::open(&p).unwrap();
    for e in [
        t.view::<f64>("f32.2").unwrap_err(),
        t.slice::<f64>("f32.2").unwrap_err(),
    ] {
        match &e {
            Error::WrongDType {
                path,
                tensor,
                asked,
                stored,
            } => {
                assert_eq!((path, tensor.as_str()), (&p, "f32.2"));
                assert_eq!((*asked, *stored), (DType::F64, DType::F32));
            }
            other => panic!("expected WrongDType, got {other:?}"),
        }
        assert_eq!(
            e.to_string(),
            format!("{}: tensor \"f32.2\" is f32, not f64", p.display())
        );
    }
    // Same size, other meaning: bf16 bits are not f16 bits, nor i16.
    assert!(matches!(
        t.view::<f16>("bf16.2"),
        Err(Error::WrongDType { .. })
    ));
    assert!(matches!(
        t.slice::<i16>("f16.2"),
        Err(Error::WrongDType { .. })
    ));
    assert!(matches!(t.view::<f32>("nope"), Err(Error::NotFound(_))));
}

/// The byte offset of tensor `name`'s payload in the file.
fn offset_of(p: &std::path::Path, name: &str) -> usize {
    Trace::open(p).unwrap().tensor_info(name).unwrap().offset as usize
}

#[test]
fn a_bool_byte_other_than_zero_or_one_is_refused_before_it_is_a_rust_bool() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("a.trace");
    write_all(&p);
    assert_eq!(
        Trace::open(&p)
            .unwrap()
            .view::<bool>("bool.2")
            .unwrap()
            .len(),
        3
    );
    let at = offset_of(&p, "bool.2");
    let mut bytes = std::fs::read(&p).unwrap();
    bytes[at + 1] = 2;
    std::fs::write(&p, &bytes).unwrap();
    let t = Trace::open(&p).unwrap(); // opening does not read payloads
    let e = t.view::<bool>("bool.2").unwrap_err();
    assert!(
        matches!(
            e,
            Error::Malformed {
                kind: Malformed::BadBool {
                    element: 1,
                    value: 2,
                    ..
                },
                ..
            }
        ),
        "{e:?}"
    );
    assert!(
        e.to_string()
            .ends_with("tensor \"bool.2\": bool element 1 is 2 (must be 0 or 1)"),
        "{e}"
    );
    assert!(
        t.view::<bool>("bool.4").is_ok(),
        "only the planted tensor is refused"
    );
}

#[test]
fn a_file_truncated_while_open_is_refused_not_a_sigbus() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("a.trace");
    write_all(&p);
    let t = Trace::open(&p).unwrap();
    assert!(t.view::<f32>("f32.4").is_ok());
    std::fs::OpenOptions::new()
        .write(true)
        .open(&p)
        .unwrap()
        .set_len(64)
        .unwrap();
    // The payload's pages are gone from under the map: touching them would raise SIGBUS.
    for e in [
        t.view::<f32>("f32.4").unwrap_err(),
        t.slice::<i64>("i64.4").unwrap_err(),
    ] {
        assert!(
            matches!(
                e,
                Error::Malformed {
                    kind: Malformed::SizeChanged(Resized::InUse { was, now: 64 }),
                    ..
                } if was > 64
            ),
            "{e:?}"
        );
        assert!(
            e.to_string()
                .contains("truncated or rewritten while in use"),
            "{e}"
        );
    }
}
