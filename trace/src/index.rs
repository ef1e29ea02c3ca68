//! Parsing the index as a stream: each tensor and decision entry is handed to the reader's
//! check as soon as it is parsed, so the JSON form of only one entry is alive at a time and
//! the reader's memory is its own compact entries, not a second copy of the index.

use std::fmt;

use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;

use crate::error::Malformed;
use crate::json::UniqueValue;
use crate::layout::{DecisionJson, TensorJson};

/// The index's scalar fields; the entries went to the sink.
pub(crate) struct Head {
    pub format: String,
    pub version: [u16; 2],
    pub digest: String,
    /// Checked for repeated keys: the reader refuses one, naming it.
    pub provenance: UniqueValue,
}

type Each<'a, T> = &'a mut dyn FnMut(T) -> Result<(), Malformed>;

/// Where parsed entries go. A refusal from `tensor` or `decision` stops the parse; its reason
/// is kept in `refusal` so the caller reports it, not serde's wrapped copy of its words.
pub(crate) struct Sink<'a> {
    pub tensor: Each<'a, TensorJson>,
    pub decision: Each<'a, DecisionJson>,
    pub refusal: Option<Malformed>,
}

pub(crate) fn parse<'de, D: Deserializer<'de>>(
    de: D,
    sink: &mut Sink<'_>,
) -> Result<Head, D::Error> {
    de.deserialize_map(IndexVisitor { sink })
}

struct IndexVisitor<'s, 'a> {
    sink: &'s mut Sink<'a>,
}

fn once<T, E: de::Error>(slot: &mut Option<T>, key: &'static str, value: T) -> Result<(), E> {
    if slot.replace(value).is_some() {
        return Err(E::duplicate_field(key));
    }
    Ok(())
}

impl<'de> Visitor<'de> for IndexVisitor<'_, '_> {
    type Value = Head;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("the index object")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Head, A::Error> {
        let (mut format, mut version, mut digest, mut provenance) = (None, None, None, None);
        let (mut tensors, mut decisions) = (None, None);
        while let Some(key) = map.next_key::<String>()? {
            match key.as_str() {
                "format" => once(&mut format, "format", map.next_value()?)?,
                "version" => once(&mut version, "version", map.next_value()?)?,
                "digest" => once(&mut digest, "digest", map.next_value()?)?,
                "provenance" => once(&mut provenance, "provenance", map.next_value()?)?,
                "tensors" => {
                    once(&mut tensors, "tensors", ())?;
                    map.next_value_seed(Entries {
                        each: &mut *self.sink.tensor,
                        refusal: &mut self.sink.refusal,
                    })?;
                }
                "decisions" => {
                    once(&mut decisions, "decisions", ())?;
                    map.next_value_seed(Entries {
                        each: &mut *self.sink.decision,
                        refusal: &mut self.sink.refusal,
                    })?;
                }
                // Seen by serde_ignored's callback, which decides whether it is damage or news.
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        tensors.ok_or_else(|| de::Error::missing_field("tensors"))?;
        decisions.ok_or_else(|| de::Error::missing_field("decisions"))?;
        Ok(Head {
            format: format.ok_or_else(|| de::Error::missing_field("format"))?,
            version: version.ok_or_else(|| de::Error::missing_field("version"))?,
            digest: digest.ok_or_else(|| de::Error::missing_field("digest"))?,
            provenance: provenance.ok_or_else(|| de::Error::missing_field("provenance"))?,
        })
    }
}

struct Entries<'s, T> {
    each: Each<'s, T>,
    refusal: &'s mut Option<Malformed>,
}

impl<'de, T: Deserialize<'de>> DeserializeSeed<'de> for Entries<'_, T> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_seq(self)
    }
}

impl<'de, T: Deserialize<'de>> Visitor<'de> for Entries<'_, T> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a list of entries")
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while let Some(entry) = seq.next_element::<T>()? {
            if let Err(reason) = (self.each)(entry) {
                let e = de::Error::custom(&reason);
                *self.refusal = Some(reason);
                return Err(e);
            }
        }
        Ok(())
    }
}
