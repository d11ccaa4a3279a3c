//! New flows to no frontend inside the Service address space, like upstream nftables'
//! cluster-ips-check: an allocated ClusterIP on a port none of its Services has is rejected
//! (ICMP port unreachable, built by the reject program), an unallocated address inside the
//! Service CIDRs is dropped; instead of leaking to the node's default route. One LPM lookup
//! (`SVCCIDRS_V1`), only for a flow's first packet to no Service (in the direct-flow program).

use aya_ebpf::programs::TcContext;
use proxy_common::{TAIL_CALL_REJECT, service_cidr};

use crate::{Action, Drop, maps, packet::Packet};

/// The verdict for a new TCP/UDP flow whose destination is no frontend, if its address is in
/// the Service address space; `None`: it is not, carry on.
#[inline(always)]
pub fn not_a_frontend(ctx: &TcContext, p: &Packet) -> Option<Result<Action, Drop>> {
    match maps::service_cidr(p.daddr) {
        Some(service_cidr::CLUSTER_IP) => {
            maps::tail_call(ctx, TAIL_CALL_REJECT, p.l2_len);
            Some(Err(Drop::TailCall))
        }
        Some(service_cidr::UNALLOCATED) => Some(Err(Drop::UnallocatedServiceIp)),
        _ => None,
    }
}
