//! The IPv6 datapath: ClusterIP (and every frontend in `SERVICES6_V1`) DNAT with conntrack on tc
//! ingress for TCP, UDP and SCTP (its chunks as TCP flags and its CRC32c updated as on IPv4:
//! `crate::sctp`), reverse NAT on tc egress, ICMPv6 port unreachable / TCP RST for Services without
//! endpoints, extension headers walked under a bounded policy, fragments, and ICMPv6 errors about
//! translated flows reverse-translated, loadBalancerSourceRanges with IPv6 prefixes
//! (`SRCRANGES6_V1`).
//!
//! A parallel module rather than the IPv4 code made generic over the address: the IPv4 flow
//! keeps its code, stack frame and per-packet cost exactly as they are, and the IPv6 programs are
//! separate tail-called programs (`tc_ingress` and `tc_egress` jump here on EtherType 0x86DD,
//! or version 6 on an L3 device), each with a 512-byte stack of its own. What is family-neutral
//! is shared: the TCP state machine and idle timeouts (`proxy_common::flow_state`,
//! `timeouts`), the hashes and slot picks, Maglev tables, counters, the reject rate limit, the
//! conntrack entry handle (`maps::FlowEntry`) and the quoted-port rewrite.
//!
//! Reply tuples stay unique as on IPv4 (source-port clash resolution, direct flows tracked:
//! `conntrack`).
//!
//! Every scheduler and session affinity pick as on IPv4 (`pick`); an eTP=Local frontend's
//! in-cluster entry for clients in the IPv6 cluster CIDRs (`CLUSTERCIDRS6_V1`), as on IPv4.
//!
//! SNAT to the node of external flows to remote backends (and from outside the cluster CIDRs),
//! as on IPv4 (`snat`, `SNAT6_V1`, the node address in `NODE6_V1`); hairpin flows SNATed to
//! their frontend address (`snat` says why not a link-local one as on IPv4).
//!
//! Not carried on IPv6 yet: per-device SNAT addresses and the datapath trace.

pub(crate) mod conntrack;
mod egress;
pub(crate) mod frag;
mod icmp;
mod ingress;
mod nat;
pub(crate) mod packet;
pub(crate) mod pick;
mod reject;
pub(crate) mod snat;

pub use egress::{try_egress, try_egress_snat};
pub use ingress::{try_ingress, try_new_flow, try_new_snat, try_reject};
