//! bpffs checks and the pin directory layout.

use std::path::{Path, PathBuf};

use nix::sys::statfs::{BPF_FS_MAGIC, statfs};

use super::{Error, Result};

/// Is `path` on a bpffs?
pub fn is_bpffs(path: &Path) -> bool {
    statfs(path).is_ok_and(|st| st.filesystem_type() == BPF_FS_MAGIC)
}

/// The pin directory: maps at `<dir>/<MAP_NAME>`, links under `<dir>/links/`.
#[derive(Clone, Debug)]
pub struct PinLayout {
    pub dir: PathBuf,
}

impl PinLayout {
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self { dir: dir.into() }
    }

    pub fn map(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    pub fn links_dir(&self) -> PathBuf {
        self.dir.join("links")
    }

    /// Loaded programs by fingerprint (`super::program_pins`).
    pub fn programs_dir(&self) -> PathBuf {
        self.dir.join("programs")
    }

    /// Creates the directories after checking the parent is a bpffs.
    pub fn create(&self) -> Result<()> {
        let parent = self.dir.parent().unwrap_or(Path::new("/"));
        if !is_bpffs(parent) && !is_bpffs(&self.dir) {
            return Err(Error::NotBpffs {
                path: parent.to_path_buf(),
            });
        }
        for d in [self.dir.clone(), self.links_dir()] {
            std::fs::create_dir_all(&d).map_err(|source| Error::PinDir { path: d, source })?;
        }
        Ok(())
    }

    /// Do pinned maps exist here (an agent ran before)?
    pub fn has_maps(&self) -> bool {
        proxy_common::ALL_MAPS.iter().all(|m| self.map(m).exists())
    }
}
