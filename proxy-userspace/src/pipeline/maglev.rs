//! Maglev tables as the agent reasons about them: what a table holds is fully given by its
//! size M and its backend set in slot order (identities, no node-local ids), so the planner
//! compares and shares tables by that description and the map layer builds the entries only
//! when it writes them (the shadow never holds 32 KiB per table). The shadow
//! ([`crate::pipeline::programmed`]) holds these descriptions and adopts read-back tables by them.

use std::{net::Ipv4Addr, sync::Arc};

use proxy_common::maglev::{self, CHUNK_ENTRIES, Chunk, MaglevKey, Permutation};

use crate::pipeline::model::{EndpointAddr, Family};

/// One Maglev table: M and the endpoints of slots 1..=n (the frontend's sorted backends).
/// An adopted table whose content did not match what this agent would build has no endpoints
/// ([`MaglevTable::unknown`]): no frontend wants it, so it is replaced and deleted.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct MaglevTable<A: Family = Ipv4Addr> {
    pub size: u32,
    pub endpoints: Vec<EndpointAddr<A>>,
}

impl<A: Family> MaglevTable<A> {
    pub fn new(size: u32, endpoints: Vec<EndpointAddr<A>>) -> Arc<Self> {
        Arc::new(Self { size, endpoints })
    }

    /// A table read back without a known content, `chunks` long.
    pub fn unknown(chunks: u32) -> Arc<Self> {
        Arc::new(Self {
            size: chunks * CHUNK_ENTRIES as u32,
            endpoints: Vec::new(),
        })
    }

    /// `MAGLEV_V1` values the table takes.
    pub fn chunks(&self) -> u32 {
        maglev::chunks(self.size)
    }

    /// The entries (slots; 0 only when there are no endpoints).
    pub fn entries(&self) -> Vec<u16> {
        let mut perms: Vec<Permutation> = self
            .endpoints
            .iter()
            .map(|e| {
                let addr = e.addr.maglev_word().to_be_bytes();
                let id = maglev::identity(addr, e.port.to_be_bytes(), e.protocol.number());
                Permutation::new(id, self.size)
            })
            .collect();
        let mut table = vec![0; self.size as usize];
        maglev::fill(&mut perms, &mut table);
        table
    }

    /// The `MAGLEV_V1` entries of table `id` (the last chunk padded with 0).
    pub fn map_entries(&self, id: u32) -> Vec<(MaglevKey, Chunk)> {
        self.entries()
            .chunks(CHUNK_ENTRIES)
            .zip(0..)
            .map(|(part, chunk)| {
                let mut value = [0u16; CHUNK_ENTRIES];
                value[..part.len()].copy_from_slice(part);
                (MaglevKey { table: id, chunk }, value)
            })
            .collect()
    }
}

/// Kernel memory `tables` Maglev tables of size `m` take (`maglev::CHUNK_KERNEL_BYTES` per
/// chunk).
pub fn kernel_bytes(tables: u64, m: u32) -> u64 {
    tables * u64::from(maglev::chunks(m)) * maglev::CHUNK_KERNEL_BYTES
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;
    use crate::pipeline::model::Protocol;

    fn ep(i: u8) -> EndpointAddr {
        EndpointAddr {
            addr: Ipv4Addr::new(10, 244, 1, i),
            port: 8080,
            protocol: Protocol::Udp,
        }
    }

    #[test]
    fn map_entries_cover_the_table_in_chunks_and_pad_the_last() {
        let t = MaglevTable::new(1_021, (1..=4).map(ep).collect());
        let entries = t.entries();
        let chunks = t.map_entries(7);
        assert_eq!(chunks.len(), 2);
        assert_eq!(chunks[1].0, MaglevKey { table: 7, chunk: 1 });
        assert_eq!(&chunks[0].1[..], &entries[..960]);
        assert_eq!(&chunks[1].1[..61], &entries[960..]);
        assert!(chunks[1].1[61..].iter().all(|s| *s == 0));
        assert!(entries.iter().all(|s| (1..=4).contains(s)));
    }

    #[test]
    fn ten_thousand_services_of_ten_endpoints_fit_a_node_with_room_to_spare() {
        let bytes = kernel_bytes(10_000, maglev::DEFAULT_TABLE_SIZE);
        // 10,000 × 18 chunks × 2 KiB ≈ 352 MiB: 1.4 % of 24 GiB.
        assert_eq!(bytes, 10_000 * 18 * 2_048);
        assert!(bytes < 24 * (1 << 30) / 50);
    }
}
