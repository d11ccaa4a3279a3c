//! IP fragments: the later fragments of a datagram get what its first fragment got.
//!
//! Nothing reassembles before tc (no conntrack defrag on the hook), so a UDP datagram larger than
//! the MTU crosses both hooks as fragments, and only the first one carries the ports. Like
//! cilium's `IPV4_FRAG_DATAGRAMS_MAP`, a bounded LRU map (`FRAGMENTS_V1`) remembers datagrams
//! whose first fragment passed the hook, keyed as the fragments arrive: {saddr, daddr, IP id,
//! proto} (the kernel's reassembly key) plus the hook, since a datagram crosses an ingress and an
//! egress hook of the node with the same addresses at both. Unlike cilium, which stores the ports
//! and runs the whole lookup again per fragment, the value is the outcome: the IPv4 source and
//! destination the first fragment left with (translated), or "passed", or "dropped" (also when it
//! was answered in its place by an ICMP error or a RST). A later fragment then only needs one
//! lookup and, when translated, the two address rewrites with their IPv4 checksum update: it has
//! no L4 header, and the first fragment's incremental L4 checksum update already accounts for the
//! new pseudo-header of the whole datagram.
//!
//! The first fragment's record is written in two steps around the hook's usual flow, so that
//! nothing of it stays live on tc ingress's stack (its frame is at LLVM's 512-byte limit):
//! [`first_seen`], after parsing, writes it as "dropped" from a per-CPU scratch slot and marks
//! the slot pending; [`first_done`], in the program entry after the flow, updates it with the
//! addresses the packet leaves with if it was passed on, and clears the mark in every case.
//!
//! A later fragment that arrives before its first fragment (or whose record was evicted, lost to
//! a failed update, or is older than the kernel's 30 s reassembly timeout) cannot be matched:
//! buffering is not possible here, so it is passed untouched and counted as `fragment_unmatched`,
//! and its datagram does not reassemble at the receiver, which netfilter would have reassembled.
//! Linux sends a datagram's fragments in order, first one first, so this needs reordering on the
//! way to the node. Records are not removed after the last fragment (fragments may be reordered
//! among themselves); an IP id reused by a later datagram overwrites its record with the new
//! first fragment's.

use aya_ebpf::{bindings::TC_ACT_UNSPEC, programs::TcContext};
use proxy_common::{Counter, FRAGMENT_TIMEOUT_NS, FragKey, FragValue, frag_action};

use crate::{
    Action, Drop, maps, nat,
    packet::{self, Fragment, Packet},
    stats,
};

#[inline(always)]
fn key(saddr: [u8; 4], daddr: [u8; 4], id: [u8; 2], proto: u8, hook: u8) -> FragKey {
    FragKey {
        saddr,
        daddr,
        id,
        proto,
        hook,
    }
}

/// Before `p` is translated: if it is a datagram's first fragment, record the datagram as
/// dropped — what its later fragments get if the translation fails or answers it instead — and
/// leave the record, marked pending, in this CPU's scratch slot for [`first_done`]. Nothing is
/// kept on the stack across the translation: tc ingress has no stack left to spare.
#[inline(always)]
pub fn first_seen(ctx: &TcContext, p: &Packet, hook: u8) {
    let Some(id) = packet::first_fragment_id(ctx, p.l2_len) else {
        return;
    };
    let Some(scratch) = maps::frag_scratch() else {
        stats::count(Counter::FragmentNotRecorded);
        return;
    };
    scratch.set(
        key(p.saddr, p.daddr, id, p.proto, hook),
        FragValue {
            created_ns: maps::now_ns(),
            saddr: p.saddr,
            daddr: p.daddr,
            action: frag_action::DROP,
            _pad: [0; 7],
        },
    );
    if scratch.commit().is_err() {
        stats::count(Counter::FragmentNotRecorded);
    }
}

/// After the hook's flow, for every packet: if this run's [`first_seen`] recorded a first
/// fragment and it was passed on (translated or not), its record gets the addresses it leaves
/// with. A first fragment keeps its MF bit and IP id through the translation, so only packets
/// that still carry MF look at the scratch slot; dropped and answered ones (rare) clear it.
/// `result` is returned unchanged; `l2_len` is the program entry's (`packet::parse`).
#[inline(always)]
pub fn first_done(
    ctx: &TcContext,
    l2_len: usize,
    result: Result<Action, Drop>,
) -> Result<Action, Drop> {
    let passed = matches!(&result, Ok(a) if a.verdict == TC_ACT_UNSPEC);
    if passed && packet::first_fragment_id(ctx, l2_len).is_none() {
        return result;
    }
    let Some(scratch) = maps::frag_scratch() else {
        return result;
    };
    let rec = scratch.get();
    if rec.pending == 0 {
        return result;
    }
    scratch.clear_pending();
    if !passed {
        // The DROP record written before the translation stands.
        return result;
    }
    let Some((saddr, daddr)) = packet::ip_addrs(ctx, l2_len) else {
        return result;
    };
    let action = if saddr == rec.key.saddr && daddr == rec.key.daddr {
        frag_action::PASS
    } else {
        frag_action::TRANSLATE
    };
    scratch.set_value(FragValue {
        saddr,
        daddr,
        action,
        ..rec.value
    });
    if scratch.commit().is_err() {
        stats::count(Counter::FragmentNotRecorded);
    }
    result
}

/// A later fragment: what its first fragment got at this hook, or untouched if it is unknown.
#[inline(always)]
pub fn later(ctx: &TcContext, f: &Fragment, hook: u8) -> Result<Action, Drop> {
    let Some(v) = maps::fragment(&key(f.saddr, f.daddr, f.id, f.proto, hook)) else {
        return Ok(Action::pass(Counter::FragmentUnmatched));
    };
    // Within [created, created + 30 s] only: a stamp after now (which no record gets) wraps
    // around to a huge age.
    if maps::now_ns().wrapping_sub(v.created_ns) > FRAGMENT_TIMEOUT_NS {
        return Ok(Action::pass(Counter::FragmentUnmatched));
    }
    match v.action {
        frag_action::TRANSLATE => {
            nat::replace_ip_addr(ctx, f.saddr_off(), f.ip_csum_off(), f.saddr, v.saddr)?;
            nat::replace_ip_addr(ctx, f.daddr_off(), f.ip_csum_off(), f.daddr, v.daddr)?;
            Ok(Action::pass(Counter::FragmentTranslated))
        }
        frag_action::DROP => Err(Drop::Fragment),
        _ => Ok(Action::pass(Counter::FragmentPassed)),
    }
}
