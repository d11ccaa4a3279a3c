//! The status file: a small JSON document rewritten atomically after every sync, so scripts and
//! tests can wait for the agent without scraping logs.

use std::{io, path::Path};

use serde::Serialize;

#[derive(Clone, Debug, Default, Serialize, PartialEq, Eq)]
pub struct Status {
    /// Successful syncs since start.
    pub syncs: u64,
    /// Frontends programmed.
    pub frontends: usize,
    /// Backends programmed.
    pub backends: usize,
    /// Interfaces carrying the programs.
    pub interfaces: Vec<String>,
    /// Input problems (objects skipped) in the last sync.
    pub problems: usize,
}

/// Writes `status` to `path` via a temporary file and rename (readers never see half a file).
pub fn write(path: &Path, status: &Status) -> io::Result<()> {
    let tmp = path.with_extension("tmp");
    let json = serde_json::to_vec_pretty(status).map_err(io::Error::other)?;
    std::fs::write(&tmp, json)?;
    std::fs::rename(&tmp, path)
}
