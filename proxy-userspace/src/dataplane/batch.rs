//! Batched map writes (BPF_MAP_UPDATE_BATCH / BPF_MAP_DELETE_BATCH): one syscall for a run of
//! writes to one map instead of one per entry. aya 0.14 has no batch calls, so this module makes
//! the two syscalls itself; the layout is the kernel's `union bpf_attr` member `batch`.

use std::os::fd::{AsRawFd as _, BorrowedFd};

const BPF_MAP_UPDATE_BATCH: libc::c_long = 26;
const BPF_MAP_DELETE_BATCH: libc::c_long = 27;

#[repr(C)]
#[derive(Default)]
struct BatchAttr {
    in_batch: u64,
    out_batch: u64,
    keys: u64,
    values: u64,
    count: u32,
    map_fd: u32,
    elem_flags: u64,
    flags: u64,
}

/// Result of a batch call: how many elements the kernel processed, and the error that stopped it.
pub struct BatchOutcome {
    pub done: usize,
    pub error: Option<std::io::Error>,
}

fn call(
    cmd: libc::c_long,
    fd: BorrowedFd<'_>,
    keys: *const u8,
    values: *const u8,
    count: usize,
) -> BatchOutcome {
    let Ok(count32) = u32::try_from(count) else {
        return BatchOutcome {
            done: 0,
            error: Some(std::io::Error::other("batch too large")),
        };
    };
    let mut attr = BatchAttr {
        keys: keys as u64,
        values: values as u64,
        count: count32,
        map_fd: fd.as_raw_fd() as u32,
        ..Default::default()
    };
    // SAFETY: `attr` is a valid batch attr; `keys`/`values` point to `count` contiguous
    // elements of the map's key/value size (callers pass slices of the map's Pod types), alive
    // for the call. The kernel writes back only `attr.count`.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            &mut attr as *mut BatchAttr,
            size_of::<BatchAttr>(),
        )
    };
    if rc < 0 {
        BatchOutcome {
            done: attr.count as usize,
            error: Some(std::io::Error::last_os_error()),
        }
    } else {
        BatchOutcome {
            done: count,
            error: None,
        }
    }
}

/// Writes `keys[i] → values[i]` (BPF_ANY). `K`/`V` must be the map's key/value types.
pub fn update<K: aya::Pod, V: aya::Pod>(
    fd: BorrowedFd<'_>,
    keys: &[K],
    values: &[V],
) -> BatchOutcome {
    debug_assert_eq!(keys.len(), values.len());
    if keys.is_empty() {
        return BatchOutcome {
            done: 0,
            error: None,
        };
    }
    call(
        BPF_MAP_UPDATE_BATCH,
        fd,
        keys.as_ptr().cast(),
        values.as_ptr().cast(),
        keys.len(),
    )
}

/// Below this many elements a batch is written by the calling thread alone (a thread costs tens
/// of µs; incremental syncs write a handful of entries).
const PARALLEL_MIN: usize = 8_192;

/// [`update`] split over two threads when large: the kernel's hash-map update takes only a
/// per-bucket lock, so two CPUs write a first sync's 100,000s of entries nearly twice as fast.
/// Only for runs whose order does not matter. `done` keeps `update`'s meaning: every element
/// before it was written (a failed first half reports where it stopped; the second half may have
/// been written too, which a retry of the rest repeats harmlessly).
pub fn update_parallel<K: aya::Pod + Sync, V: aya::Pod + Sync>(
    fd: BorrowedFd<'_>,
    keys: &[K],
    values: &[V],
) -> BatchOutcome {
    if keys.len() < PARALLEL_MIN {
        return update(fd, keys, values);
    }
    let mid = keys.len() / 2;
    let (first, second) = std::thread::scope(|s| {
        let second = s.spawn(|| update(fd, &keys[mid..], &values[mid..]));
        let first = update(fd, &keys[..mid], &values[..mid]);
        (first, second.join())
    });
    let second = second.unwrap_or_else(|_| BatchOutcome {
        done: 0,
        error: Some(std::io::Error::other("batch thread panicked")),
    });
    if first.error.is_some() {
        return first;
    }
    BatchOutcome {
        done: mid + second.done,
        error: second.error,
    }
}

/// Deletes `keys`. The kernel stops at the first missing key (ENOENT) and reports how far it got.
pub fn delete<K: aya::Pod>(fd: BorrowedFd<'_>, keys: &[K]) -> BatchOutcome {
    if keys.is_empty() {
        return BatchOutcome {
            done: 0,
            error: None,
        };
    }
    call(
        BPF_MAP_DELETE_BATCH,
        fd,
        keys.as_ptr().cast(),
        std::ptr::null(),
        keys.len(),
    )
}
