use std::collections::BTreeMap;

use serde_json::{Map, Value};

use crate::error::{Error, Result};

/// What a tensor's numbers mean: the code path that computed them, the attention mask, the
/// absolute token positions its rows hold, the decode step. These are content: two tensors
/// that differ here are not comparable, and the whole-trace digest covers them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Attributes {
    pub path: Option<String>,
    pub mask: Option<String>,
    pub positions: Option<Vec<i64>>,
    pub step: Option<i64>,
    /// Any other attribute, string-valued. Keys may not reuse the four names above.
    pub extra: BTreeMap<String, String>,
}

/// One attribute value in canonical form; the tag byte is part of the content encoding.
pub(crate) enum AttrValue<'a> {
    Str(&'a str),
    Int(i64),
    Ints(&'a [i64]),
}

pub(crate) const RESERVED: [&str; 4] = ["path", "mask", "positions", "step"];

impl Attributes {
    pub fn with_path(mut self, path: &str) -> Self {
        self.path = Some(path.to_string());
        self
    }
    pub fn with_mask(mut self, mask: &str) -> Self {
        self.mask = Some(mask.to_string());
        self
    }
    pub fn with_positions(mut self, positions: Vec<i64>) -> Self {
        self.positions = Some(positions);
        self
    }
    pub fn with_step(mut self, step: i64) -> Self {
        self.step = Some(step);
        self
    }

    /// All present attributes, sorted by key bytes (the canonical order).
    pub(crate) fn sorted(&self) -> Vec<(&str, AttrValue<'_>)> {
        let mut out: Vec<(&str, AttrValue<'_>)> = Vec::new();
        if let Some(p) = &self.path {
            out.push(("path", AttrValue::Str(p)));
        }
        if let Some(m) = &self.mask {
            out.push(("mask", AttrValue::Str(m)));
        }
        if let Some(p) = &self.positions {
            out.push(("positions", AttrValue::Ints(p)));
        }
        if let Some(s) = self.step {
            out.push(("step", AttrValue::Int(s)));
        }
        for (k, v) in &self.extra {
            out.push((k, AttrValue::Str(v)));
        }
        out.sort_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
        out
    }

    pub(crate) fn validate(&self) -> Result<()> {
        for key in self.extra.keys() {
            if RESERVED.contains(&key.as_str()) {
                return Err(Error::Invalid(format!("attribute {key:?} is typed; set the field, not an extra string")));
            }
            if key.is_empty() {
                return Err(Error::Invalid("attribute with an empty name".into()));
            }
        }
        Ok(())
    }

    pub(crate) fn to_json(&self) -> Value {
        let mut map = Map::new();
        for (k, v) in self.sorted() {
            let value = match v {
                AttrValue::Str(s) => Value::from(s),
                AttrValue::Int(i) => Value::from(i),
                AttrValue::Ints(list) => Value::from(list.to_vec()),
            };
            map.insert(k.to_string(), value);
        }
        Value::Object(map)
    }

    /// Parses the index form; `Err` carries a reason without the file name.
    pub(crate) fn from_json(value: &Value) -> std::result::Result<Attributes, String> {
        let map = value.as_object().ok_or("attributes is not an object")?;
        let mut attrs = Attributes::default();
        for (k, v) in map {
            if k.is_empty() {
                return Err("an attribute has an empty name".into());
            }
            match k.as_str() {
                "path" => attrs.path = Some(v.as_str().ok_or("attribute path is not a string")?.to_string()),
                "mask" => attrs.mask = Some(v.as_str().ok_or("attribute mask is not a string")?.to_string()),
                "step" => attrs.step = Some(v.as_i64().ok_or("attribute step is not an integer")?),
                "positions" => {
                    let list = v.as_array().ok_or("attribute positions is not a list")?;
                    let ints: Option<Vec<i64>> = list.iter().map(|x| x.as_i64()).collect();
                    attrs.positions = Some(ints.ok_or("attribute positions holds a non-integer")?);
                }
                other => {
                    let s = v.as_str().ok_or_else(|| format!("attribute {other:?} is not a string"))?;
                    attrs.extra.insert(other.to_string(), s.to_string());
                }
            }
        }
        Ok(attrs)
    }
}
