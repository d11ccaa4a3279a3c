//! New flows to no frontend inside the Service address space, like upstream nftables'
//! cluster-ips-check: an allocated ClusterIP on a port none of its Services has is rejected
//! (ICMP port unreachable), an unallocated address inside the Service CIDRs is dropped; instead
//! of leaking to the node's default route. One LPM lookup (`SVCCIDRS_V1`), only on a Service
//! lookup miss.

use aya_ebpf::programs::TcContext;
use proxy_common::{Counter, service_cidr};

use crate::{Action, Drop, maps, packet::Packet, reject};

/// The verdict for a new TCP/UDP flow whose destination is no frontend.
#[inline(always)]
pub fn not_a_frontend(ctx: &TcContext, p: &Packet) -> Result<Action, Drop> {
    match maps::service_cidr(p.daddr) {
        Some(service_cidr::CLUSTER_IP) => {
            let verdict = reject::icmp_port_unreachable(ctx, p)?;
            Ok(Action::redirect(verdict, Counter::ClusterIpPortRejected))
        }
        Some(service_cidr::UNALLOCATED) => Err(Drop::UnallocatedServiceIp),
        _ => Ok(Action::pass(Counter::NotService)),
    }
}
