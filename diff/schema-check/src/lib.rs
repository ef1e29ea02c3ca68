//! Checks the reports the tests produce against docs/*.schema.json (draft 2020-12; building a
//! validator also checks the schema against the draft's meta-schema). The diff report's schema
//! is registered by its `$id`, since the gate's and bisect's schemas refer to it.
//!
//! A crate of its own, used only as a dev-dependency, so that the validator's generic code is
//! compiled once and not again in every test binary that checks a report (about 40 s of CPU
//! each on the 2-core development machine).

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Mutex, OnceLock};

use serde_json::Value;

/// The compiled schema of one docs/ file.
pub struct Schema {
    name: String,
    validator: jsonschema::Validator,
}

fn read_schema(name: &str) -> Value {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../docs")
        .join(name);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

impl Schema {
    fn compile(name: &str) -> Schema {
        let diff = read_schema("diff-report.schema.json");
        let id = diff["$id"]
            .as_str()
            .expect("docs/diff-report.schema.json has a string $id")
            .to_string();
        let registry: &'static jsonschema::Registry = Box::leak(Box::new(
            jsonschema::Registry::new()
                .add(id, diff)
                .and_then(|r| r.prepare())
                .unwrap_or_else(|e| panic!("docs/diff-report.schema.json: {e}")),
        ));
        let validator = jsonschema::options()
            .with_draft(jsonschema::Draft::Draft202012)
            .with_registry(registry)
            .build(&read_schema(name))
            .unwrap_or_else(|e| panic!("docs/{name} is not a valid schema: {e}"));
        Schema {
            name: name.to_string(),
            validator,
        }
    }

    /// Every way `report` departs from the schema, each "at /json/pointer: why".
    pub fn errors(&self, report: &Value) -> Vec<String> {
        self.validator
            .iter_errors(report)
            .map(|e| format!("at {}: {e}", e.instance_path()))
            .collect()
    }

    pub fn is_valid(&self, report: &Value) -> bool {
        self.validator.is_valid(report)
    }

    /// Panics unless `report` is valid, naming each violation and showing the report.
    pub fn assert_valid(&self, report: &Value) {
        let errors = self.errors(report);
        assert!(
            errors.is_empty(),
            "the report does not match docs/{}:\n{}\n{report:#}",
            self.name,
            errors.join("\n")
        );
    }
}

/// docs/`name`'s schema, compiled once per test binary.
pub fn schema(name: &str) -> &'static Schema {
    static SCHEMAS: OnceLock<Mutex<HashMap<String, &'static Schema>>> = OnceLock::new();
    let mut schemas = SCHEMAS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    schemas
        .entry(name.to_string())
        .or_insert_with(|| Box::leak(Box::new(Schema::compile(name))))
}
