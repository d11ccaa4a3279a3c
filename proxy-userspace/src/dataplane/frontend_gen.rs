//! What follows a sync that opened frontends (`crate::pipeline::opened`): the frontend
//! generation in `FRONTGEN_V1` moves on, so every direct flow of the datapath is checked again at
//! its next packet (one that began before its destination was a Service frontend becomes a new,
//! translated flow), and the kernel's UDP conntrack entries toward the opened serving frontends
//! are deleted (`crate::dataplane::ct_netlink`).

use aya::maps::{Array, MapData};
use proxy_common::MAP_FRONTEND_GEN;

use super::{Error, Result, ct_netlink::UdpPurge};
use crate::pipeline::opened::OpenedFrontends;

fn map_err(source: aya::maps::MapError) -> Error {
    Error::Map {
        name: MAP_FRONTEND_GEN,
        source,
    }
}

/// `FRONTGEN_V1` and the kernel conntrack purge.
pub struct FreshFrontends {
    generation: Array<MapData, u32>,
    purge: Option<UdpPurge>,
}

impl FreshFrontends {
    pub fn from_ebpf(ebpf: &mut aya::Ebpf) -> Result<Self> {
        let map = ebpf.take_map(MAP_FRONTEND_GEN).ok_or(Error::Missing {
            what: "map",
            name: MAP_FRONTEND_GEN,
        })?;
        let purge = UdpPurge::start()
            .inspect_err(|e| {
                tracing::warn!("starting the conntrack purge thread: {e}; the kernel's UDP conntrack entries toward new frontends stay")
            })
            .ok();
        Ok(Self {
            generation: Array::try_from(map).map_err(map_err)?,
            purge,
        })
    }

    /// The generation the datapath checks direct flows against.
    pub fn generation(&self) -> Result<u32> {
        self.generation.get(&0, 0).map_err(map_err)
    }

    /// The plans just written opened `opened`. Call after the writes: a direct flow that reads
    /// the new generation must find the frontend.
    pub fn opened(&mut self, opened: &OpenedFrontends) {
        if opened.is_empty() {
            return;
        }
        if let Err(e) = self.advance() {
            tracing::warn!(
                "moving the frontend generation on: {e}; flows that began before their Service keep going straight until it moves"
            );
        }
        if let Some(purge) = &self.purge {
            purge.request(opened.udp_serving());
        }
    }

    fn advance(&mut self) -> Result<()> {
        let next = match self.generation()?.wrapping_add(1) {
            0 => 1, // 0 is what direct flows of older programs hold.
            n => n,
        };
        self.generation.set(0, next, 0).map_err(map_err)
    }
}
