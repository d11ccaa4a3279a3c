//! One agent per pin directory: an exclusive `flock` on the directory, held for the agent's
//! life.
//!
//! Two agents on the same pins would both adopt the maps and swap their programs into the same
//! links, then each overwrite the other's Services, conntrack walks and pins (a second copy
//! started by hand on a node to debug, or a DaemonSet rolled with `maxSurge`). The second agent
//! therefore waits for the lock before it touches anything: until the first exits (the kernel
//! drops the lock with its last fd, also on SIGKILL), then it adopts the pins as after any
//! restart. `cleanup` refuses to run while an agent holds the lock.
//!
//! The lock is on the directory's inode, so a directory removed and recreated under a running
//! agent would come back unlocked: `super::pin_keeper` holds the lock and takes it again on the
//! new directory ([`PinDirLock::covers`]) before it pins anything back there.

use std::{
    fs::{File, TryLockError},
    os::unix::fs::MetadataExt as _,
    path::Path,
};

use super::{Error, Result, bpffs::PinLayout};

/// The held lock (released when dropped or when the process exits).
#[derive(Debug)]
pub struct PinDirLock {
    /// The open directory the `flock` is on.
    dir: File,
}

impl PinDirLock {
    /// Takes the pin directory's lock if no other process holds it (`None` if one does). The
    /// directory must exist.
    pub fn try_acquire(pins: &PinLayout) -> Result<Option<Self>> {
        let dir = open(&pins.dir)?;
        match dir.try_lock() {
            Ok(()) => Ok(Some(Self { dir })),
            Err(TryLockError::WouldBlock) => Ok(None),
            Err(TryLockError::Error(source)) => Err(Error::Io {
                what: format!("locking the pin directory {}", pins.dir.display()),
                source,
            }),
        }
    }

    /// Whether `dir` is still the directory this lock is on (same device and inode), and not
    /// one recreated at its path since.
    pub fn covers(&self, dir: &Path) -> bool {
        match (self.dir.metadata(), std::fs::metadata(dir)) {
            (Ok(held), Ok(now)) => held.dev() == now.dev() && held.ino() == now.ino(),
            _ => false,
        }
    }
}

fn open(dir: &Path) -> Result<File> {
    File::open(dir).map_err(|source| Error::Io {
        what: format!("opening the pin directory {} to lock it", dir.display()),
        source,
    })
}

/// What the agent says while another process holds the lock.
pub fn held_message(pins: &PinLayout) -> String {
    format!(
        "another kube-proxy-ebpf holds the pin directory {} (a second agent on this node?); \
         waiting for it to exit before touching the maps and links",
        pins.dir.display()
    )
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;

    /// A fresh pin directory under the temp dir, removed when dropped (also when a test fails).
    struct TempPins {
        dir: PathBuf,
        pins: PinLayout,
    }

    impl TempPins {
        fn new(name: &str) -> Self {
            let dir = std::env::temp_dir().join(format!("kpe-{name}-{}", std::process::id()));
            std::fs::create_dir_all(&dir).expect("temp dir");
            let pins = PinLayout::new(&dir);
            Self { dir, pins }
        }

        fn lock(&self) -> Option<PinDirLock> {
            PinDirLock::try_acquire(&self.pins).expect("lock")
        }
    }

    impl Drop for TempPins {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }

    #[test]
    fn one_holder_at_a_time_and_the_next_gets_it_once_the_first_lets_go() {
        let temp = TempPins::new("pin-lock");
        let first = temp.lock().expect("free");
        // flock locks belong to the open file: a second open, even in this process, is refused.
        assert!(temp.lock().is_none());
        drop(first);
        assert!(
            temp.lock().is_some(),
            "free again once the first is dropped"
        );
    }

    #[test]
    fn a_lock_covers_its_directory_and_not_one_recreated_at_the_same_path() {
        let temp = TempPins::new("pin-relock");
        let lock = temp.lock().expect("free");
        assert!(lock.covers(&temp.dir));
        // Recreated while the old inode is still open (held by the lock): a new inode.
        std::fs::remove_dir(&temp.dir).expect("removing");
        assert!(!lock.covers(&temp.dir), "gone");
        std::fs::create_dir(&temp.dir).expect("recreating");
        assert!(!lock.covers(&temp.dir), "recreated");
        assert!(
            temp.lock().is_some(),
            "the new directory is not locked by the old lock"
        );
    }

    #[test]
    fn a_missing_directory_is_an_error_naming_it() {
        let pins = PinLayout::new("/nonexistent/kpe-pins");
        let e = PinDirLock::try_acquire(&pins).expect_err("missing");
        assert!(e.to_string().contains("/nonexistent/kpe-pins"), "{e}");
    }
}
