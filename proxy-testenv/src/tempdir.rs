//! A temporary directory removed on drop.

use std::path::{Path, PathBuf};

use anyhow::{Context as _, Result};

/// A fresh directory under the system temp dir, removed recursively on drop.
/// Set `KPE_KEEP_TMP=1` to keep it (to read agent logs after a failure).
#[derive(Debug)]
pub struct TempDir {
    path: PathBuf,
}

impl TempDir {
    /// Creates `<tmp>/<prefix>-<pid>-<n>`.
    pub fn new(prefix: &str) -> Result<Self> {
        let base = std::env::temp_dir();
        let mut n = 0u32;
        loop {
            let path = base.join(format!("{prefix}-{}-{n}", std::process::id()));
            match std::fs::create_dir(&path) {
                Ok(()) => return Ok(Self { path }),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && n < 1000 => n += 1,
                Err(e) => {
                    return Err(e).with_context(|| format!("creating {}", path.display()));
                }
            }
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// `self.path().join(name)`.
    pub fn join(&self, name: &str) -> PathBuf {
        self.path.join(name)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        if std::env::var_os("KPE_KEEP_TMP").is_some_and(|v| v == "1") {
            eprintln!("keeping {} (KPE_KEEP_TMP=1)", self.path.display());
            return;
        }
        let _ = std::fs::remove_dir_all(&self.path);
    }
}
