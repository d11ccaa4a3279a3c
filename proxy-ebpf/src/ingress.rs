//! tc ingress: conntrack → service → backend pick → conntrack entries → DNAT.

use aya_ebpf::programs::TcContext;
use proxy_common::{
    Counter, CtKey, CtValue, ServiceKey, SourceRangeKey, ct_state,
    hash::{flow_hash, pick_slot},
    service_flags,
};

use crate::{
    Action, Drop,
    conntrack::{self, NewFlow},
    icmp, maps, nat,
    packet::{self, Packet, Parsed, tcp_flags},
    reject, snat, stats, svc_cidr,
};

/// Why a packet goes through the new-flow path although it had a conntrack entry.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Replacing {
    /// No entry: a new flow.
    Nothing,
    /// The entry was idle for longer than its timeout, or a SYN reuses a closing flow's tuple.
    Old,
    /// The entry's backend is gone (UDP, or a TCP SYN).
    Stale,
}

#[inline(always)]
pub fn try_tc_ingress(ctx: &TcContext) -> Result<Action, Drop> {
    let p = match packet::parse(ctx) {
        Parsed::Packet(p) => p,
        Parsed::NotIpv4 => return Ok(Action::pass(Counter::NotIpv4)),
        Parsed::IcmpError(e) => return icmp::snat_reply(ctx, &e),
        Parsed::Pass(counter) => return Ok(Action::pass(counter)),
        Parsed::Untranslatable {
            daddr,
            dport,
            proto,
            reason,
        } => {
            return match maps::service(&ServiceKey::new(daddr, dport, proto, 0)) {
                Some(_) => Err(reason),
                None => Ok(Action::pass(Counter::NotService)),
            };
        }
    };
    if p.has_ip_options() {
        stats::count(Counter::IpOptions);
    }
    let now = maps::now_ns();
    let key = conntrack::original_key(&p);
    let mut old = None;
    let mut replacing = Replacing::Nothing;
    if let Some(entry) = maps::ct_entry(&key) {
        let ct = entry.get();
        if conntrack::expired(&ct, p.proto, now, &maps::config()) {
            stats::count(Counter::ConntrackExpired);
            replacing = Replacing::Old;
        } else if p.is_syn() && ct.state == ct_state::CLOSING {
            // A new connection on the tuple of a closed one: choose again, like netfilter does.
            replacing = Replacing::Old;
        } else if conntrack::backend_valid(&ct) {
            entry.touch(now, conntrack::next_state(&p, ct.state));
            nat::dnat(ctx, &p, ct.backend_addr, ct.backend_port)?;
            return Ok(Action::pass(Counter::EstablishedFlow));
        } else if p.is_tcp() && !p.is_syn() {
            // Mid-connection and the backend is gone: never send to the dead address, reset.
            conntrack::remove(&key, &ct);
            if p.tcp_flags & tcp_flags::RST != 0 {
                // Never answer a RST with a RST (RFC 9293): the flow is gone, drop it.
                return Err(Drop::NoBackend);
            }
            let verdict = reject::tcp_reset(ctx, &p)?;
            return Ok(Action::redirect(verdict, Counter::StaleBackendReset));
        } else {
            replacing = Replacing::Stale;
        }
        old = Some(ct);
    }
    if old.is_none()
        && snat::may_be_reply(&p)
        && let Some(entry) = maps::snat_entry(&snat::in_key_of_reply(&p))
    {
        // A remote backend's reply to a SNATed flow: back to the client; tc egress toward the
        // client then reverse-DNATs it like any reply.
        let client = entry.get();
        entry.touch(now, conntrack::next_reply_state(&p, client.state));
        nat::dnat(ctx, &p, client.addr, client.port)?;
        return Ok(Action::pass(Counter::SnatReplyTranslated));
    }
    new_flow(ctx, &p, &key, now, old.as_ref(), replacing)
}

/// Service lookup, backend pick, conntrack entries, DNAT.
#[inline(always)]
fn new_flow(
    ctx: &TcContext,
    p: &Packet,
    key: &CtKey,
    now: u64,
    old: Option<&CtValue>,
    replacing: Replacing,
) -> Result<Action, Drop> {
    // Clients inside the cluster reach an eTP=Local frontend through its in-cluster entry.
    let external_key = ServiceKey::new(p.daddr, p.dport, p.proto, 0);
    let Some((frontend_key, frontend)) =
        maps::frontend_for(&external_key, || maps::in_cluster(p.saddr))
    else {
        if let Some(old) = old {
            // The Service itself is gone: its flow is over.
            conntrack::remove(key, old);
        }
        return svc_cidr::not_a_frontend(ctx, p);
    };
    if frontend.flags & service_flags::SOURCE_RANGES != 0
        && !maps::source_in_range(SourceRangeKey {
            frontend_addr: p.daddr,
            frontend_port: p.dport,
            proto: p.proto,
            _pad: 0,
            source: p.saddr,
        })
    {
        if let Some(old) = old {
            conntrack::remove(key, old);
        }
        return Err(Drop::SourceRange);
    }
    let hash = flow_hash(p.saddr, p.daddr, p.sport, p.dport, p.proto);
    let Some(slot) = pick_slot(hash, frontend.count) else {
        if let Some(old) = old {
            conntrack::remove(key, old);
        }
        if frontend.flags & service_flags::DROP_WHEN_EMPTY != 0 {
            // Like kube-proxy: a Local policy with endpoints only on other nodes drops; no
            // usable endpoint anywhere rejects (below).
            return Err(Drop::NoLocalEndpoints);
        }
        let verdict = reject::icmp_port_unreachable(ctx, p)?;
        return Ok(Action::redirect(verdict, Counter::NoEndpointsRejected));
    };
    let backend_id = maps::service(&frontend_key.with_slot(slot))
        .ok_or(Drop::NoBackend)?
        .backend_id;
    let backend = maps::backend(backend_id).ok_or(Drop::NoBackend)?;
    let flow = NewFlow {
        original: key,
        backend_id,
        backend: &backend,
        rev_nat_id: frontend.rev_nat_id,
        now_ns: now,
    };
    if snat::needed(p.saddr, &frontend, &backend) {
        let f = snat::Flow {
            client: p.saddr,
            client_port: p.sport,
            backend: backend.addr,
            backend_port: backend.port,
            proto: p.proto,
        };
        snat::allocate(&f, conntrack::next_state(p, ct_state::UDP), now)?;
    }
    conntrack::create(p, &flow, old)?;
    nat::dnat(ctx, p, backend.addr, backend.port)?;
    Ok(Action::pass(
        if replacing == Replacing::Stale && !p.is_tcp() {
            Counter::StaleBackendReselected
        } else {
            Counter::NewFlow
        },
    ))
}
