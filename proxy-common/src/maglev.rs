//! Maglev consistent hashing (`sched::code::MAGLEV`, IPVS `mh`): the lookup table the agent
//! builds per backend set, how it is stored in `MAGLEV_V1`, and the index a flow takes in it.
//! Pure and allocation-free, shared by the agent (builder) and the datapath (lookup).
//!
//! Construction is the Maglev paper's (Eisenbud et al., NSDI 2016), as katran's `MaglevBase`
//! and Cilium's `pkg/maglev`: each backend has a permutation of the table's M positions
//! (offset = h1 % M, skip = h2 % (M − 1) + 1, M prime), and the backends take turns claiming
//! their next free position until the table is full. Each backend gets M/N entries (±1), and
//! removing one of N backends moves only ≈ 1/N of the entries.
//!
//! Node independence: the permutations hash the backend's identity (address, port, protocol),
//! never a node-local backend id, and the backends take turns in identity order (the agent's
//! slot order: `DesiredFrontend::backends` is sorted). Two nodes with the same endpoints build
//! the same table, and the flow index hash is unseeded ([`flow_index`]), so a flow that ECMP
//! moves to another node meets the same backend.
//!
//! Entries name a backend *slot* (1..=count, 0 = empty): the table's content stays
//! node-independent, entries are `u16` (half the memory of ids), and the datapath resolves the
//! slot through `SERVICES` as every other scheduler does.

use bytemuck::{Pod, Zeroable};

use crate::hash::{fmix, mix};

/// Table sizes accepted by `--maglev-table-size`: primes (Cilium's list). M should be well
/// above the backends of a Service (≥ 100 × N keeps each within ~1 % of its share).
pub const TABLE_SIZES: [u32; 10] = [
    251, 509, 1_021, 2_039, 4_093, 8_191, 16_381, 32_749, 65_521, 131_071,
];

/// The default M (Cilium's): 16,381 entries (18 chunks, 36 KiB of kernel memory per table),
/// balanced within ~1 % up to ~160 backends; 10,000 Maglev Services of any size take ~360 MiB.
pub const DEFAULT_TABLE_SIZE: u32 = 16_381;

/// Entries per `MAGLEV_V1` value. Not a power of two on purpose: a hash element without
/// preallocation is its header (48 bytes), key (8), value and the allocator's list node (8) in
/// one kmalloc object, so a 1 KiB value would take a 2 KiB object and waste half; 960 entries
/// (1,920 bytes) fill a 2 KiB object. The datapath divides by this constant (the verifier
/// bounds the remainder).
pub const CHUNK_ENTRIES: usize = 960;

/// Kernel memory one chunk takes (its 2 KiB kmalloc object).
pub const CHUNK_KERNEL_BYTES: u64 = 2_048;
const _: () = assert!(48 + 8 + 8 + 2 * CHUNK_ENTRIES <= CHUNK_KERNEL_BYTES as usize);

/// One `MAGLEV_V1` value: `CHUNK_ENTRIES` consecutive table entries (slots, 0 = empty).
pub type Chunk = [u16; CHUNK_ENTRIES];

/// `MAGLEV_V1` (hash, `BPF_F_NO_PREALLOC`: memory only for the tables that exist) key: one chunk
/// of one table. A table of M entries is chunks `0..chunks(M)`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default, Pod, Zeroable)]
pub struct MaglevKey {
    /// `ServiceValue::maglev_table` (from 1).
    pub table: u32,
    pub chunk: u32,
}
const _: () = assert!(core::mem::size_of::<MaglevKey>() == 8);

/// Is `m` one of the accepted table sizes?
pub fn valid_size(m: u32) -> bool {
    TABLE_SIZES.contains(&m)
}

/// Chunks one table of `m` entries takes.
pub const fn chunks(m: u32) -> u32 {
    m.div_ceil(CHUNK_ENTRIES as u32)
}

/// A backend's identity as the permutation hashes it: address, port (network order) and
/// protocol — what the backend is, whatever id a node gave it.
#[inline(always)]
pub const fn identity(addr: [u8; 4], port: [u8; 2], proto: u8) -> [u32; 2] {
    [
        u32::from_be_bytes(addr),
        ((port[0] as u32) << 24) | ((port[1] as u32) << 16) | proto as u32,
    ]
}

const fn identity_hash(seed: u32, id: [u32; 2]) -> u32 {
    fmix(mix(mix(seed, id[0]), id[1]) ^ 8)
}

/// One backend's walk over the table: where it starts and how far it steps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Permutation {
    /// The next position the backend tries.
    pub next: u32,
    pub skip: u32,
}

impl Permutation {
    /// The paper's offset = h1 % M, skip = h2 % (M − 1) + 1 (M prime, so every skip visits
    /// every position).
    pub const fn new(id: [u32; 2], m: u32) -> Self {
        let h1 = identity_hash(0x6d61_676c, id); // "magl"
        let h2 = identity_hash(0x6576_3031, id); // "ev01"
        Self {
            next: h1 % m,
            skip: if m > 1 { h2 % (m - 1) + 1 } else { 1 },
        }
    }
}

/// Fill `table` (M = its length, prime) from the backends' permutations, in slot order
/// (`perms[i]` is slot i + 1): they take turns claiming their next free position. Every entry
/// is set when `perms` is non-empty; all stay 0 otherwise. With more backends than entries the
/// first M of a round get one each. O(M log M) expected, bounded by M × N steps.
pub fn fill(perms: &mut [Permutation], table: &mut [u16]) {
    table.fill(0);
    let m = table.len() as u32;
    if perms.is_empty() || m == 0 {
        return;
    }
    let mut filled = 0u32;
    loop {
        for (i, p) in perms.iter_mut().enumerate() {
            // A free position is always found: the walk visits all M and one is free.
            while table[p.next as usize] != 0 {
                p.next = step(p.next, p.skip, m);
            }
            table[p.next as usize] = (i + 1) as u16;
            p.next = step(p.next, p.skip, m);
            filled += 1;
            if filled == m {
                return;
            }
        }
    }
}

const fn step(pos: u32, skip: u32, m: u32) -> u32 {
    let n = pos as u64 + skip as u64;
    if n >= m as u64 {
        (n - m as u64) as u32
    } else {
        n as u32
    }
}

/// The unseeded flow hash a Maglev frontend's new flows are placed with (tc: the 5-tuple as
/// it arrives). Unseeded on purpose, unlike the other schedulers' hash: every node must put a
/// flow at the same table position (the price: a client can learn which of its source ports
/// reach which backend, as with `sh`/`dh`).
pub const FLOW_SEED: u32 = 0;

/// The table position (0..m) of a flow hash: multiply-shift, no division in the datapath.
#[inline(always)]
pub const fn flow_index(hash: u32, m: u32) -> u32 {
    ((hash as u64 * m as u64) >> 32) as u32
}

/// The chunk and the entry within it of a table position.
#[inline(always)]
pub const fn split(index: u32) -> (u32, usize) {
    (
        index / CHUNK_ENTRIES as u32,
        (index % CHUNK_ENTRIES as u32) as usize,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hash::flow_hash;

    fn ids(n: u32) -> Vec<[u32; 2]> {
        (0..n)
            .map(|i| {
                identity(
                    [10, 244, (i / 250) as u8, (i % 250 + 1) as u8],
                    [0x1f, 0x90],
                    6,
                )
            })
            .collect()
    }

    fn table(ids: &[[u32; 2]], m: u32) -> Vec<u16> {
        let mut perms: Vec<Permutation> = ids.iter().map(|id| Permutation::new(*id, m)).collect();
        let mut t = vec![0; m as usize];
        fill(&mut perms, &mut t);
        t
    }

    /// The identity each entry names.
    fn owners(ids: &[[u32; 2]], m: u32) -> Vec<[u32; 2]> {
        table(ids, m).iter().map(|s| ids[*s as usize - 1]).collect()
    }

    #[test]
    fn sizes_are_prime_and_the_default_is_one_of_them() {
        for m in TABLE_SIZES {
            assert!((2..m).take_while(|d| d * d <= m).all(|d| m % d != 0), "{m}");
        }
        assert!(valid_size(DEFAULT_TABLE_SIZE));
        assert!(!valid_size(16_384));
        assert_eq!(chunks(16_381), 18);
        assert_eq!(chunks(251), 1);
        assert_eq!(chunks(131_071), 137);
    }

    #[test]
    fn every_backend_gets_its_share_within_a_few_percent() {
        for (n, m) in [(3, 251), (10, 16_381), (100, 16_381), (7, 65_521)] {
            let t = table(&ids(n), m);
            assert!(t.iter().all(|s| (1..=n as u16).contains(s)), "all set");
            let mut per = vec![0u32; n as usize];
            for s in &t {
                per[*s as usize - 1] += 1;
            }
            let share = f64::from(m) / f64::from(n);
            for (i, c) in per.iter().enumerate() {
                let dev = (f64::from(*c) - share).abs() / share;
                assert!(
                    dev < 0.03,
                    "N={n} M={m}: backend {i} has {c}, share {share:.0}"
                );
            }
        }
    }

    #[test]
    fn removing_one_of_n_backends_moves_about_one_nth_of_the_entries() {
        for n in [4u32, 5, 10, 50] {
            let m = 16_381;
            let all = ids(n);
            let before = owners(&all, m);
            for gone in [0, n as usize / 2, n as usize - 1] {
                let mut rest = all.clone();
                rest.remove(gone);
                let after = owners(&rest, m);
                let moved = before.iter().zip(&after).filter(|(a, b)| a != b).count();
                // The gone backend's own entries (1/N) must move; the paper bounds the rest.
                let own = before.iter().filter(|o| **o == all[gone]).count();
                let others_moved = moved - own;
                std::println!(
                    "N={n} remove {gone}: {moved} of {m} entries moved ({own} of the gone backend)"
                );
                assert!(
                    moved as f64 / f64::from(m) < 1.0 / f64::from(n) + 0.04,
                    "N={n}: {moved} of {m} moved"
                );
                // Measured: 0.2-1 % of the table (N=5: ~40 of 16,381).
                assert!(
                    (others_moved as f64) < 0.02 * f64::from(m),
                    "N={n}: {others_moved} entries of surviving backends moved"
                );
            }
        }
    }

    #[test]
    fn the_same_identities_build_the_same_table_whatever_the_node() {
        // Two "nodes" know the same endpoints under other local ids: the table names slots in
        // identity order, so sorting the identities (the agent's slot order) gives the same
        // content; the input order of the endpoints does not matter.
        let mut a = ids(10);
        let mut b = a.clone();
        b.reverse();
        b.swap(2, 7);
        a.sort();
        b.sort();
        assert_eq!(table(&a, 16_381), table(&b, 16_381));
        assert_eq!(owners(&a, 1_021), owners(&b, 1_021));
        // Another port is another backend: another table.
        let other: Vec<_> = ids(10)
            .into_iter()
            .map(|[a, p]| [a, p ^ 0x0001_0000])
            .collect();
        assert_ne!(table(&a, 1_021), table(&other, 1_021));
    }

    #[test]
    fn more_backends_than_entries_and_none_terminate() {
        let t = table(&ids(300), 251);
        assert!(t.iter().all(|s| *s != 0));
        assert_eq!(
            t.iter().collect::<std::collections::HashSet<_>>().len(),
            251
        );
        assert!(table(&[], 251).iter().all(|s| *s == 0));
        assert!(table(&ids(1), 251).iter().all(|s| *s == 1));
    }

    #[test]
    fn flow_index_and_split_stay_in_the_table() {
        for m in TABLE_SIZES {
            for h in [0, 1, u32::MAX / 3, u32::MAX] {
                let i = flow_index(h, m);
                assert!(i < m);
                let (c, off) = split(i);
                assert!(c < chunks(m) && off < CHUNK_ENTRIES);
                assert_eq!(c as usize * CHUNK_ENTRIES + off, i as usize);
            }
        }
    }

    #[test]
    fn flows_spread_over_the_table_like_its_entries() {
        // 30,000 client ports through a 3-backend table: each backend within 3 % of a third.
        let m = 16_381;
        let t = table(&ids(3), m);
        let mut hits = [0u32; 3];
        for port in 20_000u16..50_000 {
            let h = flow_hash(
                FLOW_SEED,
                [10, 244, 1, 2],
                [10, 96, 0, 10],
                port.to_be_bytes(),
                [0, 80],
                17,
            );
            hits[t[flow_index(h, m) as usize] as usize - 1] += 1;
        }
        assert!(
            hits.iter().all(|n| (9_700..=10_300).contains(n)),
            "{hits:?}"
        );
    }
}
