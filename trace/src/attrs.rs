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
    pub extra: ExtraAttrs,
}

/// String attributes by key, kept sorted by key bytes with each key once: a map in a vector, so
/// a tensor with one extra attribute costs one small allocation, not a B-tree node (~540 bytes),
/// which is what keeps a reader's memory within 3x its index (docs/trace-format.md, "Memory").
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ExtraAttrs(Vec<(String, String)>);

impl ExtraAttrs {
    /// Sets `key` to `value`, replacing an earlier value; returns the replaced one.
    pub fn insert(&mut self, key: String, value: String) -> Option<String> {
        match self
            .0
            .binary_search_by(|(k, _)| k.as_bytes().cmp(key.as_bytes()))
        {
            Ok(i) => Some(std::mem::replace(&mut self.0[i].1, value)),
            Err(i) => {
                self.0.insert(i, (key, value));
                None
            }
        }
    }
    pub fn get(&self, key: &str) -> Option<&String> {
        self.0
            .binary_search_by(|(k, _)| k.as_bytes().cmp(key.as_bytes()))
            .ok()
            .map(|i| &self.0[i].1)
    }
    pub fn keys(&self) -> impl Iterator<Item = &String> {
        self.0.iter().map(|(k, _)| k)
    }
    pub fn iter(&self) -> impl Iterator<Item = (&String, &String)> {
        self.0.iter().map(|(k, v)| (k, v))
    }
    pub fn len(&self) -> usize {
        self.0.len()
    }
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl<'a> IntoIterator for &'a ExtraAttrs {
    type Item = (&'a String, &'a String);
    type IntoIter = std::iter::Map<
        std::slice::Iter<'a, (String, String)>,
        fn(&'a (String, String)) -> (&'a String, &'a String),
    >;
    fn into_iter(self) -> Self::IntoIter {
        self.0.iter().map(|(k, v)| (k, v))
    }
}

impl FromIterator<(String, String)> for ExtraAttrs {
    /// Sorts once (an index may hold many keys, in any order); a repeated key keeps its last value.
    fn from_iter<I: IntoIterator<Item = (String, String)>>(iter: I) -> Self {
        let mut all: Vec<(String, String)> = iter.into_iter().collect();
        all.sort_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
        let mut out: Vec<(String, String)> = Vec::with_capacity(all.len());
        for (k, v) in all {
            match out.last_mut() {
                Some(last) if last.0 == k => last.1 = v,
                _ => out.push((k, v)),
            }
        }
        ExtraAttrs(out)
    }
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

    /// Records which part of the logical tensor this rank holds (the `shard` extra attribute).
    pub fn with_shard(mut self, shard: &crate::shard::Shard) -> Self {
        self.extra
            .insert(crate::shard::KEY.to_string(), shard.to_string());
        self
    }

    /// The `shard` attribute parsed: `Ok(None)` without one; `Err` names the value and why it
    /// is malformed (docs/trace-format.md, "Sharded traces").
    pub fn shard(&self) -> std::result::Result<Option<crate::shard::Shard>, String> {
        match self.extra.get(crate::shard::KEY) {
            None => Ok(None),
            Some(v) => crate::shard::Shard::parse(v)
                .map(Some)
                .map_err(|e| format!("attribute shard {v:?} is malformed: {e}")),
        }
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
                return Err(Error::Invalid(format!(
                    "attribute {key:?} is typed; set the field, not an extra string"
                )));
            }
            if key.is_empty() {
                return Err(Error::Invalid("attribute with an empty name".into()));
            }
        }
        self.shard().map_err(Error::Invalid)?;
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
        let mut extra = Vec::new();
        for (k, v) in map {
            if k.is_empty() {
                return Err("an attribute has an empty name".into());
            }
            match k.as_str() {
                "path" => {
                    attrs.path = Some(
                        v.as_str()
                            .ok_or("attribute path is not a string")?
                            .to_string(),
                    )
                }
                "mask" => {
                    attrs.mask = Some(
                        v.as_str()
                            .ok_or("attribute mask is not a string")?
                            .to_string(),
                    )
                }
                "step" => attrs.step = Some(v.as_i64().ok_or("attribute step is not an integer")?),
                "positions" => {
                    let list = v.as_array().ok_or("attribute positions is not a list")?;
                    let ints: Option<Vec<i64>> = list.iter().map(|x| x.as_i64()).collect();
                    attrs.positions = Some(ints.ok_or("attribute positions holds a non-integer")?);
                }
                other => {
                    let s = v
                        .as_str()
                        .ok_or_else(|| format!("attribute {other:?} is not a string"))?;
                    extra.push((other.to_string(), s.to_string()));
                }
            }
        }
        attrs.extra = extra.into_iter().collect();
        attrs.shard()?;
        Ok(attrs)
    }
}

#[cfg(test)]
mod tests {
    use super::ExtraAttrs;

    #[test]
    fn extra_attributes_are_a_sorted_map_with_each_key_once() {
        let mut e: ExtraAttrs = [("b", "1"), ("a", "2"), ("b", "3")]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        assert_eq!(
            e.iter()
                .map(|(k, v)| (k.as_str(), v.as_str()))
                .collect::<Vec<_>>(),
            [("a", "2"), ("b", "3")]
        );
        assert_eq!(e.insert("0".into(), "x".into()), None);
        assert_eq!(e.insert("a".into(), "y".into()), Some("2".into()));
        assert_eq!(
            e.keys().map(String::as_str).collect::<Vec<_>>(),
            ["0", "a", "b"]
        );
        assert_eq!(e.get("a").map(String::as_str), Some("y"));
        assert_eq!(e.get("c"), None);
        assert_eq!(e.len(), 3);
    }
}
