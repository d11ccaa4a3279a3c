//! Loaded tc programs pinned under `<pin dir>/programs/<fingerprint>/`, so a restarted agent
//! whose programs would come out the same takes them instead of verifying them again: loading
//! is the verifier's work and almost all of a start, while a pinned program is opened in
//! microseconds.
//!
//! The fingerprint covers everything a loaded program is made of: the object's bytes (code,
//! BTF), the globals written at load (datapath config with the node's hash seed, socket-hook
//! config, trace level), and the identity of every pinned map it references. A map replaced
//! at start (another shape, a layout migration) changes it, and so does any new release. What
//! it does not cover is the object's own unpinned maps: the read-only globals (covered by their
//! values) and per-CPU scratch arrays, which a tail-call chain uses within one packet and within
//! one [`super::loader::ProgramGroup`] — hence a group is taken whole or loaded whole. With the
//! datapath trace on, programs are always loaded: they write to the object's own ring buffer,
//! which the agent reads.

use std::{
    hash::Hasher,
    path::{Path, PathBuf},
};

use aya::programs::{CgroupSockAddr, Program, SchedClassifier};

use super::{Error, Result, bpffs::PinLayout, sock_hooks::SockHook};

/// Pure: the fingerprint of programs loaded from `object` with the globals `globals` against
/// maps of the given kernel ids (in a fixed order). 64 bits of SipHash with fixed keys: a
/// collision would need two different loads to agree by chance, and any mismatch merely loads.
pub fn fingerprint(object: &[u8], globals: &[&[u8]], map_ids: &[u32]) -> u64 {
    // SipHash 2-4, the one std keeps stable (deprecated only in favour of DefaultHasher, whose
    // algorithm may change between releases: that would merely load once more).
    #[allow(deprecated)]
    let mut h = std::hash::SipHasher::new_with_keys(0x6b70_652d_7072_6f67, 0x7261_6d73_2d76_3100);
    h.write_usize(object.len());
    h.write(object);
    for g in globals {
        h.write_usize(g.len());
        h.write(g);
    }
    for id in map_ids {
        h.write_u32(*id);
    }
    h.finish()
}

/// The pins of one fingerprint's programs.
pub struct ProgramPins {
    dir: PathBuf,
}

impl ProgramPins {
    pub fn new(pins: &PinLayout, fingerprint: u64) -> Self {
        Self {
            dir: pins.programs_dir().join(format!("{fingerprint:016x}")),
        }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// Whether every one of `names` is pinned here (a group is taken whole or not at all).
    pub fn has_all(&self, names: &[&str]) -> bool {
        names.iter().all(|n| self.path(n).exists())
    }

    /// Replaces the object's unloaded `program` by the pinned one of `name`.
    pub fn take(&self, name: &'static str, program: &mut Program) -> Result<()> {
        let path = self.path(name);
        let err = |source| Error::Program { name, source };
        *program = match SockHook::of_program(name) {
            Some(hook) => Program::CgroupSockAddr(
                CgroupSockAddr::from_pin(path, hook.attach_type()).map_err(err)?,
            ),
            None => Program::SchedClassifier(SchedClassifier::from_pin(path).map_err(err)?),
        };
        Ok(())
    }

    /// Pins a program this agent loaded, for the next one.
    pub fn pin(&self, name: &'static str, program: &mut Program) -> Result<()> {
        std::fs::create_dir_all(&self.dir).map_err(|source| Error::Io {
            what: format!("creating {}", self.dir.display()),
            source,
        })?;
        let path = self.path(name);
        super::maps::remove_if_exists(&path).map_err(|source| Error::Io {
            what: format!("replacing {}", path.display()),
            source,
        })?;
        program.pin(&path).map_err(|e| Error::Io {
            what: format!("pinning program {name} at {}", path.display()),
            source: std::io::Error::other(e.to_string()),
        })
    }

    /// Removes the pins of every other fingerprint (programs an older agent or configuration
    /// loaded; the kernel frees them once no link or program array holds them either).
    pub fn remove_others(&self) {
        let Some(parent) = self.dir.parent() else {
            return;
        };
        let Ok(entries) = std::fs::read_dir(parent) else {
            return;
        };
        for entry in entries.flatten() {
            if entry.path() != self.dir
                && let Err(e) = remove_dir(&entry.path())
            {
                tracing::warn!(dir = %entry.path().display(), "removing old program pins: {e}");
            }
        }
    }
}

/// Removes every program pin under the pin directory (uninstall).
pub fn remove_all(pins: &PinLayout) -> std::io::Result<()> {
    match remove_dir(&pins.programs_dir()) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        r => r,
    }
}

fn remove_dir(dir: &Path) -> std::io::Result<()> {
    std::fs::remove_dir_all(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fingerprint_changes_with_every_input() {
        let base = fingerprint(b"object", &[b"config", b"sock"], &[1, 2, 3]);
        assert_eq!(
            base,
            fingerprint(b"object", &[b"config", b"sock"], &[1, 2, 3])
        );
        for other in [
            fingerprint(b"object2", &[b"config", b"sock"], &[1, 2, 3]),
            fingerprint(b"object", &[b"config2", b"sock"], &[1, 2, 3]),
            fingerprint(b"object", &[b"config", b"sock2"], &[1, 2, 3]),
            fingerprint(b"object", &[b"config", b"sock"], &[1, 2, 4]),
            fingerprint(b"object", &[b"configsock"], &[1, 2, 3]),
        ] {
            assert_ne!(base, other);
        }
    }
}
