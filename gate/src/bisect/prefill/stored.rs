//! `--reference trace:PATH`: a reference trace recorded once (on a GPU box, say) stands in for a
//! reference producer. The bisection needs of the reference only its whole trace — each layer's
//! isolated output is judged against the reference's whole-run `layer.LL.*`, and its inputs are
//! the reference's `hidden_in` rows — so a stored trace serves for everything but calibration,
//! which runs the reference's `layer` verb (NOT CHECKED, with that reason).
//!
//! Soundness: the stored trace is copied into the work directory and the copy is verified (every
//! tensor's digest, and its whole-trace digest against the one read when it was opened) before
//! the candidate runs, so an edited, truncated or replaced file is refused rather than judged. It is used only for the prompt, decode steps and capture it was recorded
//! with; another is refused naming both. One recorded with the default capture (`gate init`'s
//! golden traces) is bisected with what it holds: each layer's boundaries, and a decode step's
//! logits and token (its layers are not isolated, NOT CHECKED saying why). It counts as an ordered producer only when its provenance
//! names the engine or the contract and no oracle stack: a mislabelled trace can only make the
//! judge stricter (by bits), never looser.

use super::*;

impl StoredReference {
    /// Opens `path` and reads what it was recorded for; refuses a trace that is not a whole run
    /// (`verb` other than `trace`) or lacks the provenance a bisection needs. Its payloads are
    /// verified on the copy that is judged (`adopt`), once.
    pub fn open(path: &Path, shown: &str) -> Result<StoredReference> {
        let at = |what: String| gerr!(File: "--reference trace:{shown}: {what}");
        let t = Trace::open(path).map_err(|e| at(e.to_string()))?;
        let p = t.provenance();
        let producer = p["producer"].as_str().unwrap_or_default().to_string();
        match p["verb"].as_str() {
            Some("trace") => {}
            other => {
                return Err(at(format!(
                    "provenance verb is {}, not \"trace\": a reference must be a whole run (a producer's `trace` verb), not one layer",
                    other.map_or_else(|| "absent".to_string(), |v| format!("{v:?}"))
                )))
            }
        }
        let tokens: Vec<i64> = p["prompt_tokens"]
            .as_array()
            .and_then(|a| a.iter().map(|v| v.as_i64()).collect())
            .ok_or_else(|| at("provenance has no prompt_tokens (a list of token ids)".into()))?;
        let generate = match &p["generate"] {
            serde_json::Value::Null => 0,
            g => g
                .as_u64()
                .ok_or_else(|| at(format!("provenance generate {g} is not a count")))?
                as usize,
        };
        let internals = match p["capture"].as_str() {
            None | Some("default") => false,
            Some("internals") => true,
            Some(other) => {
                return Err(at(format!(
                    "provenance capture {other:?} is neither \"default\" nor \"internals\""
                )))
            }
        };
        let seed = match &p["seed"] {
            serde_json::Value::Null => None,
            s => Some(
                s.as_u64()
                    .ok_or_else(|| at(format!("provenance seed {s} is not a count")))?,
            ),
        };
        let ordered = matches!(producer.as_str(), "engine" | "contract") && !is_oracle(&t);
        Ok(StoredReference {
            path: path.to_path_buf(),
            shown: shown.to_string(),
            digest: t.digest().hex(),
            producer,
            tokens,
            generate,
            internals,
            seed,
            ordered,
        })
    }

    /// Refuses a bisection this trace was not recorded for, naming both sides.
    pub(crate) fn fits(&self, o: &BisectOptions) -> Result<()> {
        let refuse = |what: String| {
            gerr!("--reference trace:{}: {what}; record the reference for this bisection, or bisect what it was recorded for", self.shown)
        };
        if o.tokens != self.tokens {
            return Err(refuse(format!(
                "recorded for prompt tokens {:?}, this bisection asks {:?}",
                self.tokens, o.tokens
            )));
        }
        if o.generate != self.generate {
            return Err(refuse(format!(
                "recorded with --generate {}, this bisection asks --generate {} (without --generate it takes the trace's own)",
                self.generate, o.generate
            )));
        }
        if o.sampling && self.seed.is_some_and(|s| s != o.sampler_seed) {
            return Err(refuse(format!(
                "recorded with --seed {}, this bisection asks --seed {}",
                self.seed.unwrap_or(0),
                o.sampler_seed
            )));
        }
        if o.internals && !self.internals {
            return Err(gerr!(
                "--reference trace:{}: recorded with --capture default, this bisection asks --capture internals; without --capture it is bisected with what the trace holds (each layer's boundaries, so a stage is named by its block, not its sub-stage; a decode step by its logits and token, its layers not isolated), or re-record the reference with --capture internals (a port's golden traces: `gate init --capture internals`)",
                self.shown
            ));
        }
        if o.calibrate {
            return Err(gerr!("--calibrate runs the reference's own layer verb, and a stored reference (trace:{}) has none: bisect against a reference producer to calibrate", self.shown));
        }
        Ok(())
    }

    /// Copies the trace to `rel` under the root and verifies the copy: what is judged is what was
    /// verified.
    pub(crate) fn adopt(&self, o: &BisectOptions, rel: &str) -> Result<Trace> {
        std::fs::copy(&self.path, o.root.join(rel))
            .map_err(|e| gerr!(File: "--reference trace:{} → {rel}: {e}", self.shown))?;
        let t = open(&o.root, rel)?;
        t.verify().map_err(|e| {
            gerr!(File: "--reference trace:{} (copied to {rel}): {e}; a stored reference must be the file as recorded", self.shown)
        })?;
        if t.digest().hex() != self.digest {
            return Err(
                gerr!(File: "--reference trace:{}: the file changed while the bisection read it (digest {} then {})", self.shown, self.digest, t.digest().hex()),
            );
        }
        Ok(t)
    }
}
