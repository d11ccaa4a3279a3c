//! Sockets of the node's own namespace, looked up from tc (`bpf_skc_lookup_tcp`,
//! `bpf_sk_lookup_udp`): SNAT ports on the node's address are shared with the node's sockets, so
//! a port is only given to a SNATed flow when no socket of the node holds the same tuple (or
//! listens on the port), both families.

use aya_ebpf::{
    bindings::{bpf_sock, bpf_sock_tuple},
    helpers::generated::{bpf_sk_lookup_udp, bpf_sk_release, bpf_skc_lookup_tcp},
    programs::TcContext,
};
use proxy_common::proto;

/// The lookup's netns argument for "the namespace of the packet's device" (`BPF_F_CURRENT_NETNS`).
const CURRENT_NETNS: u64 = u64::MAX;
/// `sizeof(bpf_sock_tuple.ipv4)` and `.ipv6`.
const TUPLE4_LEN: u32 = 12;
const TUPLE6_LEN: u32 = 36;

/// Does a socket of the node hold `local:local_port` ↔ `remote:remote_port` (connected, in
/// TIME_WAIT, or a listener / unconnected socket on `local_port`)? Ports in network order; only
/// TCP and UDP have sockets to find.
#[inline(always)]
pub fn owns_v4(
    ctx: &TcContext,
    proto: u8,
    local: [u8; 4],
    local_port: [u8; 2],
    remote: [u8; 4],
    remote_port: [u8; 2],
) -> bool {
    // SAFETY: all-zero is a valid tuple (plain integers).
    let mut tuple: bpf_sock_tuple = unsafe { core::mem::zeroed() };
    // SAFETY: writing the ipv4 member of the union.
    unsafe {
        let t = &mut tuple.__bindgen_anon_1.ipv4;
        t.saddr = u32::from_ne_bytes(remote);
        t.daddr = u32::from_ne_bytes(local);
        t.sport = u16::from_ne_bytes(remote_port);
        t.dport = u16::from_ne_bytes(local_port);
    }
    lookup(ctx, proto, &mut tuple, TUPLE4_LEN)
}

/// [`owns_v4`] for IPv6.
#[inline(always)]
pub fn owns_v6(
    ctx: &TcContext,
    proto: u8,
    local: &[u8; 16],
    local_port: [u8; 2],
    remote: &[u8; 16],
    remote_port: [u8; 2],
) -> bool {
    // SAFETY: as in `owns_v4`.
    let mut tuple: bpf_sock_tuple = unsafe { core::mem::zeroed() };
    // SAFETY: writing the ipv6 member of the union; [u8; 16] and [u32; 4] have the same size.
    unsafe {
        let t = &mut tuple.__bindgen_anon_1.ipv6;
        t.saddr = core::mem::transmute::<[u8; 16], [u32; 4]>(*remote);
        t.daddr = core::mem::transmute::<[u8; 16], [u32; 4]>(*local);
        t.sport = u16::from_ne_bytes(remote_port);
        t.dport = u16::from_ne_bytes(local_port);
    }
    lookup(ctx, proto, &mut tuple, TUPLE6_LEN)
}

#[inline(always)]
fn lookup(ctx: &TcContext, p: u8, tuple: &mut bpf_sock_tuple, len: u32) -> bool {
    let skb = ctx.skb.skb as *mut _;
    // SAFETY: helper calls with the program's skb and a tuple of `len` valid bytes; a socket
    // found is released before returning (the verifier checks it).
    unsafe {
        let sk: *mut bpf_sock = match p {
            proto::TCP => bpf_skc_lookup_tcp(skb, tuple, len, CURRENT_NETNS, 0),
            proto::UDP => bpf_sk_lookup_udp(skb, tuple, len, CURRENT_NETNS, 0),
            _ => return false,
        };
        if sk.is_null() {
            return false;
        }
        bpf_sk_release(sk as *mut _);
        true
    }
}
