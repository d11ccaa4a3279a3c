//! The test-only tap (`tc_tap`): a stand-in for "another program on the same hook" (a CNI's
//! program, a policy agent). It counts every TCP/UDP over IPv4 packet by the 5-tuple it sees, so
//! a test attached before our program sees Service addresses and one attached after sees the
//! translated packet. It never changes a packet and never ends the chain.

use aya_ebpf::programs::TcContext;
use proxy_common::TapKey;

use crate::{
    maps,
    packet::{self, Parsed},
};

#[inline(always)]
pub fn count(ctx: &TcContext) {
    if let Parsed::Packet(p) = packet::parse(ctx, packet::ETH_HLEN) {
        maps::tap_count(&TapKey {
            saddr: p.saddr,
            daddr: p.daddr,
            sport: p.sport,
            dport: p.dport,
            proto: p.proto,
            _pad: [0; 3],
        });
    }
}
