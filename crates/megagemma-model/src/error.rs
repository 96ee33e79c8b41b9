//! One error type for the model crate: every failure is a single human-readable line
//! (which tensor, which file, what was expected), never a panic.
//!
//! Each error has a kind so that a server can tell the client's fault (400) from its own (500).

use std::fmt;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorKind {
    /// The request is wrong: a token id outside the vocabulary, an empty prompt, an unknown sequence.
    InvalidInput,
    /// The request would not fit: a sequence would outgrow its context, or no sequence slot is free.
    Capacity,
    /// Anything else: unreadable files, a failed device call, a broken invariant.
    Other,
}

#[derive(Debug)]
pub struct Error {
    kind: ErrorKind,
    msg: String,
}

impl Error {
    pub fn msg(m: impl Into<String>) -> Self {
        Error { kind: ErrorKind::Other, msg: m.into() }
    }
    pub fn invalid_input(m: impl Into<String>) -> Self {
        Error { kind: ErrorKind::InvalidInput, msg: m.into() }
    }
    pub fn capacity(m: impl Into<String>) -> Self {
        Error { kind: ErrorKind::Capacity, msg: m.into() }
    }
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.msg)
    }
}

impl std::error::Error for Error {}

pub type Result<T> = std::result::Result<T, Error>;

/// `bail!("...")` returns an [`Error`] built from a format string.
#[macro_export]
macro_rules! bail {
    ($($arg:tt)*) => { return Err($crate::error::Error::msg(format!($($arg)*))) };
}
