//! What a trace records about the run that wrote it (docs/producers.md, "Provenance a producer
//! must record"): the engine's common provenance, the tensors a checkpoint carries and no
//! forward runs, the weights digest, hashed beside the forward; and the trace finished with it.

use std::path::Path;

use serde_json::{json, Value};

use crate::capture::Capture;
use crate::force::Forcing;
use crate::weights::Store;
use crate::{err, Result};
use tracegate_trace::Digest;

pub(crate) fn provenance(
    dir: &Path,
    raw_cfg: &Value,
    weights_digest: &str,
    threads: usize,
    internals: bool,
    cmd: &[String],
) -> Value {
    json!({
        "producer": "engine",
        "versions": {
            "tracegate": env!("CARGO_PKG_VERSION"),
            "tracegate-engine": env!("CARGO_PKG_VERSION"),
            "rustc": env!("ENGINE_RUSTC_VERSION"),
        },
        "build": format!("tracegate-engine {} {} {} src {}", env!("CARGO_PKG_VERSION"), env!("ENGINE_TARGET"), env!("ENGINE_PROFILE"), env!("ENGINE_SOURCE_DIGEST")),
        "device": "cpu",
        "dtype": "f32",
        "threads": threads,
        "seed": null,
        "determinism": "docs/numerics.md ordered fp32; threads across outputs only",
        "model_dir": dir.display().to_string(),
        "weights_digest": weights_digest,
        "config": raw_cfg,
        "capture": if internals { "internals" } else { "default" },
        "command_line": cmd,
    })
}

/// Qwen3.5 (docs/numerics.md §20), diffusion Gemma's vision tower: the tensors present and not
/// run, as `unused_tensors` = `{prefix: count}`; absent when there are none.
pub(crate) fn unused_provenance(prov: &mut Value, unused: &[(String, usize)]) {
    if !unused.is_empty() {
        let by_prefix: serde_json::Map<String, Value> =
            unused.iter().map(|(p, n)| (p.clone(), json!(n))).collect();
        prov["unused_tensors"] = Value::Object(by_prefix);
    }
}

/// Runs `work` while another thread hashes the checkpoint for provenance: the digest reads every
/// weight byte once and does not depend on the forward, so on a large model it would otherwise
/// add its whole time to every run.
///
/// The digest is of `store`'s mappings, the bytes the model computes with, not of the files
/// their paths name now: a checkpoint renamed over mid-run would otherwise be recorded with the
/// new file's digest beside tensors of the old one. One written in place during the run is
/// refused (`Store::unchanged`, checked again once `work` is done).
pub(crate) fn beside_weights_digest<T>(
    store: &Store,
    work: impl FnOnce() -> Result<T>,
) -> Result<(String, T)> {
    std::thread::scope(|s| {
        let digest = s.spawn(|| store.weights_digest());
        let out = work();
        let wd = digest
            .join()
            .map_err(|_| err!(Internal: "the weights digest thread panicked"))??;
        let out = out?;
        store.unchanged()?;
        Ok((wd, out))
    })
}

/// Finishes the trace; under `--force-decisions` (its weights checked against this run's) with
/// the provenance record.
pub(crate) fn finish(
    mut prov: Value,
    cap: Capture,
    forcing: Option<&Forcing>,
    weights_digest: &str,
) -> Result<Digest> {
    if let Some(f) = forcing {
        f.check_weights(weights_digest)?;
        prov["forced_decisions"] = f.provenance(&cap.forced);
    }
    cap.finish(prov)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A one-tensor safetensors file of `fill` bytes; returns its bytes.
    fn checkpoint(path: &Path, fill: u8) -> Vec<u8> {
        let header = br#"{"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}}"#;
        let mut file = (header.len() as u64).to_le_bytes().to_vec();
        file.extend_from_slice(header);
        file.extend_from_slice(&[fill; 16]);
        std::fs::write(path, &file).unwrap();
        file
    }

    #[test]
    fn a_checkpoint_renamed_over_mid_run_records_the_digest_of_the_weights_computed_with() {
        let dir = tempfile::tempdir().unwrap();
        let model = dir.path().join("model");
        std::fs::create_dir(&model).unwrap();
        let old = checkpoint(&model.join("model.safetensors"), 1);
        let new = checkpoint(&dir.path().join("other.safetensors"), 2);
        let store = crate::open_store(&model).unwrap();
        let (wd, seen) = beside_weights_digest(&store, || {
            // Mid-run: another checkpoint renamed over the one loaded, then the model reads.
            std::fs::rename(
                dir.path().join("other.safetensors"),
                model.join("model.safetensors"),
            )
            .unwrap();
            let mut row = vec![0.0f32; 2];
            store.take("w", &[2, 2]).unwrap().widen_row(0, 0, &mut row);
            Ok(row)
        })
        .unwrap();
        assert_eq!(
            seen,
            vec![f32::from_le_bytes([1; 4]); 2],
            "the run read the old file"
        );
        assert_eq!(wd, tracegate_trace::weights_digest_of([&old[..]]));
        // Control: the path now names the other weights, whose digest differs.
        let now = tracegate_trace::weights_digest(&model).unwrap();
        assert_eq!(now, tracegate_trace::weights_digest_of([&new[..]]));
        assert_ne!(wd, now);
    }

    #[test]
    fn a_checkpoint_written_in_place_mid_run_is_refused() {
        use std::io::Write;
        for how in ["append", "mtime"] {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("model.safetensors");
            checkpoint(&path, 1);
            let store = crate::open_store(dir.path()).unwrap();
            let e = beside_weights_digest(&store, || {
                let mut f = std::fs::OpenOptions::new()
                    .append(true)
                    .open(&path)
                    .unwrap();
                if how == "append" {
                    f.write_all(b"x").unwrap();
                } else {
                    // Same size, a modification time no earlier write gave it.
                    f.set_modified(std::time::UNIX_EPOCH + std::time::Duration::from_secs(7))
                        .unwrap();
                }
                Ok(())
            })
            .expect_err(how)
            .to_string();
            assert!(
                e.contains("model.safetensors: the weights file was written while the engine ran")
                    && !e.contains('\n'),
                "{how}: {e}"
            );
        }
        // Control: untouched, the same run is accepted.
        let dir = tempfile::tempdir().unwrap();
        let bytes = checkpoint(&dir.path().join("model.safetensors"), 1);
        let store = crate::open_store(dir.path()).unwrap();
        let (wd, ()) = beside_weights_digest(&store, || Ok(())).unwrap();
        assert_eq!(wd, tracegate_trace::weights_digest_of([&bytes[..]]));
        assert_eq!(wd, crate::weights_digest(dir.path()).unwrap());
    }
}
