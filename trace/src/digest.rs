/// The whole-trace content digest: sha256 over the canonical encoding.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Digest(pub [u8; 32]);

impl Digest {
    pub fn hex(&self) -> String {
        hex::encode(self.0)
    }
    /// The first 16 hex digits, for tables.
    pub fn short(&self) -> String {
        self.hex()[..16].to_string()
    }
    pub fn from_hex(s: &str) -> Option<Digest> {
        let mut out = [0u8; 32];
        hex::decode_to_slice(s, &mut out).ok()?;
        Some(Digest(out))
    }
}

impl std::fmt::Debug for Digest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Digest({})", self.hex())
    }
}
impl std::fmt::Display for Digest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.hex())
    }
}

/// xxh3-128 as 32 hex digits, big-endian (xxHash's canonical representation).
pub fn xxh3_hex(h: u128) -> String {
    hex::encode(h.to_be_bytes())
}

/// Only the canonical (lowercase) form: one value, one spelling.
pub(crate) fn parse_xxh3_hex(s: &str) -> Option<u128> {
    if !crate::layout::is_lower_hex(s) {
        return None;
    }
    let mut out = [0u8; 16];
    hex::decode_to_slice(s, &mut out).ok()?;
    Some(u128::from_be_bytes(out))
}
