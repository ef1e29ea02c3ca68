//! The producers' errors, by kind, each with its whole message; the gate keeps each as the kind
//! of its own error of the same name (`tracegate_gate::Error`), so what the CLI prints and its
//! exit status are the same whichever side refused.

/// What went wrong running or asking a producer.
#[derive(Debug)]
pub enum Error {
    /// What was asked cannot be done as asked (a command template, a verb's arguments, token ids).
    Refused(String),
    /// A producer run failed, timed out, or could not start.
    Producer(String),
    /// The engine, run as the gate's own child (the engine crate's error, kept whole).
    Engine(tracegate_engine::Error),
}

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Error::Refused(s) | Error::Producer(s) => f.write_str(s),
            Error::Engine(e) => e.fmt(f),
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Engine(e) => Some(e),
            _ => None,
        }
    }
}

impl From<tracegate_engine::Error> for Error {
    fn from(e: tracegate_engine::Error) -> Error {
        Error::Engine(e)
    }
}

pub type Result<T> = std::result::Result<T, Error>;

/// `gerr!("...", args)`: a refusal; `gerr!(Kind: "...", args)`: an error of that kind (as the
/// gate's macro of the same name).
macro_rules! gerr {
    ($kind:ident: $($t:tt)*) => { $crate::Error::$kind(format!($($t)*)) };
    ($($t:tt)*) => { $crate::Error::Refused(format!($($t)*)) };
}
pub(crate) use gerr;
