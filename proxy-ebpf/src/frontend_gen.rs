//! Direct flows that began before their destination was a Service frontend: a client that sent
//! to a ClusterIP or a NodePort a moment before the Service (or the agent's first sync) existed.
//! Its datagrams were tracked as a direct flow, and every later one would refresh that entry and
//! pass untranslated for as long as the client keeps its source port. netfilter never keeps
//! such a flow: it does not confirm what routing dropped, and kube-proxy deletes the UDP entries
//! toward a frontend that gains endpoints.
//!
//! The agent moves the frontend generation on (`proxy_common::MAP_FRONTEND_GEN`) after every
//! sync that adds a frontend; a direct flow remembers the generation it was checked at. Per
//! packet of a direct flow this costs one array read and a compare; only the first packet after
//! a new generation looks the destination up again (one hash lookup), then records the new
//! generation or starts the flow anew.

use proxy_common::Counter;

use crate::{
    maps::{self, Checked, FlowEntry},
    stats,
};

/// Must the packet of the direct flow `entry` (checked at generation `checked_at`) start a new
/// flow, because its destination became a Service frontend since? `opens`: the packet may
/// start a flow (UDP, a TCP SYN, an SCTP INIT); a connection already established keeps going
/// straight, as netfilter keeps a connection's NAT decision. `is_frontend` looks the
/// destination up in the Service map.
#[inline(always)]
pub fn direct_outdated<V: Checked>(
    entry: &FlowEntry<V>,
    checked_at: u32,
    opens: bool,
    is_frontend: impl FnOnce() -> bool,
) -> bool {
    let current = maps::frontend_generation();
    if checked_at == current {
        return false;
    }
    if opens && is_frontend() {
        stats::count(Counter::DirectBecameFrontend);
        return true;
    }
    entry.set_checked_at(current);
    false
}

/// The generation a new direct flow records, or `None` when its destination became a frontend
/// since the caller found none (the agent writes the frontend, then the generation, so a
/// generation read before the lookup below can only be older than the frontend: then the next
/// packet checks again). `None`: pass the packet without tracking it; the next one is a new flow.
#[inline(always)]
pub fn for_new_direct(is_frontend: impl FnOnce() -> bool) -> Option<u32> {
    let current = maps::frontend_generation();
    (!is_frontend()).then_some(current)
}
