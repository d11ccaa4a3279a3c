//! IPv6 fragments: the later fragments of a datagram get what its first fragment got, under the
//! IPv4 policy (`crate::frag`): records in `FRAGMENTS6_V1` keyed by {saddr, daddr, 32-bit
//! fragment id, next header, hook} as the fragments arrive; a later fragment whose first one was
//! not seen (or more than 30 s ago) passes untouched (`fragment_unmatched`). The IPv6 programs
//! run tail-called, with a stack of their own, so the record is built on the stack in one step.

use aya_ebpf::{bindings::TC_ACT_UNSPEC, programs::TcContext};
use proxy_common::{
    Counter, FRAGMENT_TIMEOUT_NS, frag_action,
    ipv6::{Frag6Key, Frag6Value},
};

use super::{
    nat,
    packet::{self, Fragment6, Packet6},
};
use crate::{Action, Drop, maps, stats};

#[inline(always)]
fn key(saddr: [u8; 16], daddr: [u8; 16], id: [u8; 4], nexthdr: u8, hook: u8) -> Frag6Key {
    Frag6Key {
        saddr,
        daddr,
        id,
        proto: nexthdr,
        hook,
        _pad: [0; 2],
    }
}

/// A `FRAGMENTS6_V1` entry being written, built in per-CPU map memory (`maps::frag6_record`)
/// rather than on the stack.
#[derive(Clone, Copy)]
pub struct Frag6Record {
    pub key: Frag6Key,
    pub value: Frag6Value,
}

/// After the hook's flow: if `p` is a first fragment, record what it got (dropped or answered:
/// drop; passed on: the addresses it leaves with). `l2_len` is the program entry's constant
/// (the verifier cannot bound `p.l2_len`, read back from the scratch map, for a packet read).
#[inline(always)]
pub fn first_done(
    ctx: &TcContext,
    l2_len: usize,
    p: &Packet6,
    hook: u8,
    result: &Result<Action, Drop>,
) {
    first_done_from(ctx, l2_len, p, (&p.saddr, &p.daddr), hook, result);
}

/// As [`first_done`], for a program that parsed the packet after an earlier one rewrote it:
/// `arrived` are the addresses it arrived at the hook with (what its later fragments carry).
#[inline(always)]
pub fn first_done_from(
    ctx: &TcContext,
    l2_len: usize,
    p: &Packet6,
    arrived: (&[u8; 16], &[u8; 16]),
    hook: u8,
    result: &Result<Action, Drop>,
) {
    if !p.is_first_fragment {
        return;
    }
    let Some(rec) = maps::frag6_record() else {
        stats::count(Counter::FragmentNotRecorded);
        return;
    };
    rec.key = key(*arrived.0, *arrived.1, p.frag.id, p.frag.nexthdr, hook);
    rec.value.created_ns = maps::now_ns();
    rec.value.action = frag_action::DROP;
    if matches!(result, Ok(a) if a.verdict == TC_ACT_UNSPEC) {
        let Some((saddr, daddr)) = packet::addrs(ctx, l2_len) else {
            return;
        };
        rec.value.action = if saddr == p.saddr && daddr == p.daddr {
            frag_action::PASS
        } else {
            frag_action::TRANSLATE
        };
        rec.value.saddr = saddr;
        rec.value.daddr = daddr;
    }
    if maps::fragment6_insert(&rec.key, &rec.value).is_err() {
        stats::count(Counter::FragmentNotRecorded);
    }
}

/// A later fragment: what its first fragment got at this hook, or untouched if unknown.
#[inline(always)]
pub fn later(ctx: &TcContext, f: &Fragment6, hook: u8) -> Result<Action, Drop> {
    let k = key(f.saddr, f.daddr, f.frag.id, f.frag.nexthdr, hook);
    let Some(v) = maps::fragment6(&k) else {
        return Ok(Action::pass(Counter::FragmentUnmatched));
    };
    if maps::now_ns().wrapping_sub(v.created_ns) > FRAGMENT_TIMEOUT_NS {
        return Ok(Action::pass(Counter::FragmentUnmatched));
    }
    match v.action {
        frag_action::TRANSLATE => {
            nat::replace_bare_addr(ctx, f.saddr_off(), f.saddr, v.saddr)?;
            nat::replace_bare_addr(ctx, f.daddr_off(), f.daddr, v.daddr)?;
            Ok(Action::pass(Counter::FragmentTranslated))
        }
        frag_action::DROP => Err(Drop::Fragment),
        _ => Ok(Action::pass(Counter::FragmentPassed)),
    }
}
