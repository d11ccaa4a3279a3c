//! IPv6 tc ingress: conntrack → service → backend pick → conntrack entries → DNAT; a Service
//! without endpoints goes to the reject program.

use aya_ebpf::programs::TcContext;
use proxy_common::{
    Counter, TAIL_CALL_NEW6, TAIL_CALL_REJECT6, TAIL_CALL_SNAT6_NEW, ct_flags, ct_state,
    flow_state::{TakenOver, taken_over},
    frag_hook,
    ipv6::{Ct6Key, Ct6Value, Service6Key, SourceRange6Key},
    service_cidr, service_flags,
};

use super::{
    conntrack::{self, NewFlow6, Sent},
    frag, icmp, nat,
    packet::{self, Packet6, Parsed6},
    pick, reject, snat,
};
use crate::{
    Action, Drop, frontend_gen,
    log::{self, Refused},
    maps::{self, Ct6Entry},
    packet::tcp_flags,
    stats,
};

/// The entry half: a packet of a tracked flow is DNATed here; anything else goes to the
/// new-flow program (its own 512-byte stack).
#[inline(always)]
pub fn try_ingress(ctx: &TcContext, l2_len: usize) -> Result<Action, Drop> {
    let p = match packet::parse(ctx, l2_len) {
        Parsed6::Packet(p) => p,
        Parsed6::Fragment(f) => return frag::later(ctx, f, frag_hook::INGRESS),
        // An error about a SNATed flow goes back to its client here; the reverse DNAT of errors
        // toward a client is on egress.
        Parsed6::IcmpError(e) => {
            // About a SNATed flow's packet to its backend, else about a reply to a client.
            let done = icmp::snat_reply(ctx, e);
            if matches!(&done, Ok(a) if a.counter == Counter::NotService) {
                return icmp::toward_backend(ctx, e);
            }
            return done;
        }
        Parsed6::Pass(counter) => return Ok(Action::pass(counter)),
        Parsed6::Untranslatable { to, reason } => {
            return match maps::service6(&Service6Key::new(to.daddr, to.dport, to.proto, 0)) {
                Some(_) if !maps::handed_over(maps::now_ns()) => Err(reason),
                _ => Ok(Action::pass(Counter::NotService)),
            };
        }
    };
    if p.has_ext {
        stats::count(Counter::Ipv6ExtHeaders);
    }
    let result = match established(ctx, p) {
        Some(result) => result,
        None => {
            maps::tail_call6(ctx, TAIL_CALL_NEW6, l2_len);
            Err(Drop::TailCall)
        }
    };
    frag::first_done(ctx, l2_len, p, frag_hook::INGRESS, &result);
    result
}

/// A packet of a tracked flow whose entry is usable (not expired, not a SYN on a closed flow,
/// backend still there): DNATed to its backend. `None`: for the new-flow program.
#[inline(always)]
fn established(ctx: &TcContext, p: &Packet6) -> Option<Result<Action, Drop>> {
    let key = conntrack::original_key(p);
    let now = maps::now_ns();
    let Some(entry) = maps::ct6_entry(&key) else {
        return snat_reply(ctx, p, now);
    };
    let ct = entry.peek();
    if conntrack::expired(ct, p.proto, now) || (p.is_syn() && ct.state == ct_state::CLOSING) {
        return None;
    }
    if let Some(held) = taken_over(ct.flags) {
        // Taken over from netfilter, which still translates it (or is letting go of it).
        if held == TakenOver::Handoff {
            return Some(Err(Drop::TakeoverHandoff));
        }
        conntrack::client_passed(p, &key, &entry, ct, now);
        return Some(Ok(Action::pass(Counter::NetfilterFlow)));
    }
    if ct.flags & ct_flags::DIRECT == 0 && !conntrack::backend_valid(ct) {
        return None;
    }
    if ct.flags & ct_flags::DIRECT != 0 && direct_outdated(p, &entry, ct) {
        // It began before its destination became a Service frontend: forgotten here (the
        // new-flow program has no room for the check), so that program starts it anew.
        conntrack::remove(&key, Sent::of(&key, ct));
        return None;
    }
    Some(pass_tracked(ctx, p, &key, &entry, ct, now))
}

/// Must this packet of a direct flow start a new flow (see `crate::frontend_gen`)?
#[inline(always)]
fn direct_outdated(p: &Packet6, entry: &Ct6Entry, ct: &Ct6Value) -> bool {
    frontend_gen::direct_outdated(entry, ct.backend_id, p.may_open_flow(), || {
        maps::service6(&Service6Key::new(p.daddr, p.dport, p.proto, 0)).is_some()
    })
}

/// A remote backend's reply to a SNATed flow (no conntrack entry of its own): back to the
/// client; tc egress toward the client then reverse-DNATs it like any reply. `None`: not one.
#[inline(always)]
fn snat_reply(ctx: &TcContext, p: &Packet6, now: u64) -> Option<Result<Action, Drop>> {
    if !crate::snat::may_be_snat(p.dport, || maps::is_node6_addr(&p.daddr)) {
        return None;
    }
    let entry = maps::snat6_entry(&snat::in_key_of_reply(p))?;
    let client = entry.get();
    snat::reply_passed(p, &entry, &client, now);
    match taken_over(client.flags) {
        Some(TakenOver::Handoff) => return Some(Err(Drop::TakeoverHandoff)),
        Some(TakenOver::Netfilter) => return Some(Ok(Action::pass(Counter::NetfilterFlow))),
        None => {}
    }
    Some(
        nat::dnat(ctx, p, &client.addr, client.port)
            .map(|()| Action::pass(Counter::SnatReplyTranslated)),
    )
}

/// A packet of a tracked flow with a usable entry: straight to a pod (only its source port moves,
/// after a clash) or DNATed to its backend (and its source port moved after a clash).
#[inline(always)]
fn pass_tracked(
    ctx: &TcContext,
    p: &Packet6,
    key: &Ct6Key,
    entry: &Ct6Entry,
    ct: &Ct6Value,
    now: u64,
) -> Result<Action, Drop> {
    conntrack::client_passed(p, key, entry, ct, now);
    let counter = if ct.flags & ct_flags::DIRECT != 0 {
        Counter::DirectFlow
    } else {
        nat::dnat(ctx, p, &ct.backend_addr, ct.backend_port)?;
        Counter::EstablishedFlow
    };
    if ct.flags & ct_flags::SPORT_NAT != 0 {
        nat::source_port(ctx, p, ct.nat_sport)?;
    }
    Ok(Action::pass(counter))
}

/// The new-flow program, tail-called by `tc_ingress6`: parses again, replaces an unusable
/// entry (expired, closed, stale backend) or creates the flow.
#[inline(always)]
pub fn try_new_flow(ctx: &TcContext, l2_len: usize) -> Result<Action, Drop> {
    let Parsed6::Packet(p) = packet::parse(ctx, l2_len) else {
        return Err(Drop::TailCall);
    };
    let result = flow(ctx, p);
    frag::first_done(ctx, l2_len, p, frag_hook::INGRESS, &result);
    result
}

#[inline(always)]
fn flow(ctx: &TcContext, p: &Packet6) -> Result<Action, Drop> {
    let now = maps::now_ns();
    let key = conntrack::original_key(p);
    let mut old = None;
    let mut stale = false;
    if let Some(entry) = maps::ct6_entry(&key) {
        let ct = entry.peek();
        if conntrack::expired(ct, p.proto, now) {
            stats::count(Counter::ConntrackExpired);
        } else if p.is_syn() && ct.state == ct_state::CLOSING {
            // A new connection on a closed one's tuple: choose again.
        } else if ct.flags & ct_flags::DIRECT != 0 || conntrack::backend_valid(ct) {
            // Became usable since `tc_ingress6` looked (another CPU): carry on with it.
            return pass_tracked(ctx, p, &key, &entry, ct, now);
        } else if maps::handed_over(now) {
            // Its backend is gone and another proxy carries the node's Services now.
            return Ok(Action::pass(Counter::HandedOver));
        } else if p.is_tcp() && !p.is_syn() {
            // Mid-connection and the backend is gone (a not-serving one keeps its TCP flows):
            // reset, never send to the dead address.
            conntrack::remove(&key, Sent::of(&key, ct));
            log::refused6(
                Refused::BackendGone,
                p.proto,
                (&p.saddr, p.sport),
                (&p.daddr, p.dport),
            );
            if p.tcp_flags & tcp_flags::RST != 0 {
                return Err(Drop::NoBackend);
            }
            maps::tail_call6(ctx, TAIL_CALL_REJECT6, p.l2_len);
            return Err(Drop::TailCall);
        } else {
            stale = true;
        }
        old = Some(Sent::of(&key, ct));
    }
    if maps::handed_over(now) {
        // Another proxy took over while no agent ran: new flows are its.
        return Ok(Action::pass(Counter::HandedOver));
    }
    new_flow(ctx, p, &key, now, old, stale)
}

/// Service lookup, backend pick, conntrack entries, DNAT; a packet to no Service is tracked as
/// a direct flow (TCP: from its SYN on) so that its reply tuple stays its own.
#[inline(always)]
fn new_flow(
    ctx: &TcContext,
    p: &Packet6,
    key: &Ct6Key,
    now: u64,
    old: Option<Sent>,
    stale: bool,
) -> Result<Action, Drop> {
    // Read before the lookup: a direct flow recorded below holds a generation no newer than
    // the frontends it was looked up in (see `crate::frontend_gen`).
    let checked_at = maps::frontend_generation();
    // Clients inside the cluster reach an eTP=Local frontend through its in-cluster entry.
    let mut frontend_key = Service6Key::new(p.daddr, p.dport, p.proto, 0);
    let scoped = maps::frontend6_for(&mut frontend_key, || maps::in_cluster6(&p.saddr));
    // The flow's target: a Service's backend, or (to no Service) the destination itself.
    let (backend_id, backend_addr, backend_port, rev_nat_id) = match scoped {
        None => {
            if let Some(old) = old {
                // A direct flow's entry that expired, or a gone Service.
                conntrack::remove(key, old);
            }
            if p.is_tcp() && !p.is_syn() {
                return Ok(Action::pass(Counter::NotService)); // Mid-connection: untracked.
            }
            // Inside the Service address space (as `crate::svc_cidr`, upstream's
            // cluster-ips-check): an allocated ClusterIP on a port none of its Services has is
            // rejected, an unallocated address dropped, instead of leaking to the default route.
            match maps::service_cidr6(&p.daddr) {
                Some(service_cidr::CLUSTER_IP) => {
                    maps::tail_call6(ctx, TAIL_CALL_REJECT6, p.l2_len);
                    return Err(Drop::TailCall);
                }
                Some(service_cidr::UNALLOCATED) => return Err(Drop::UnallocatedServiceIp),
                _ => {}
            }
            if !p.is_tcp() && conntrack::reply_tracked(p) {
                // A UDP reply of a translated flow from a remote backend on its way to the
                // client: untracked.
                return Ok(Action::pass(Counter::NotService));
            }
            (checked_at, &p.daddr, &p.dport, 0)
        }
        Some(frontend) => {
            if frontend.flags & service_flags::SOURCE_RANGES != 0
                && !maps::source_in_range6(SourceRange6Key {
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
                log::refused6(
                    Refused::SourceRange,
                    p.proto,
                    (&p.saddr, p.sport),
                    (&p.daddr, p.dport),
                );
                return Err(Drop::SourceRange);
            }
            let Some(backend_id) = pick::choose(&frontend_key, &frontend, p)? else {
                if let Some(old) = old {
                    conntrack::remove(key, old);
                }
                if frontend.flags & service_flags::DROP_WHEN_EMPTY != 0 {
                    log::refused6(
                        Refused::NoLocalEndpoints,
                        p.proto,
                        (&p.saddr, p.sport),
                        (&p.daddr, p.dport),
                    );
                    return Err(Drop::NoLocalEndpoints);
                }
                maps::tail_call6(ctx, TAIL_CALL_REJECT6, p.l2_len);
                return Err(Drop::TailCall);
            };
            let backend = maps::backend6_ref(backend_id).ok_or(Drop::NoBackend)?;
            // Whether the flow needs SNAT lives in per-CPU map memory, not in a register: the
            // verifier then sees the paths after the decision as one (its program stays under
            // the 1M limit). Read below for Service flows only (written on their every path).
            if let Some(s) = maps::snat6_scratch() {
                // Hairpin (the client picked as its own backend) or an external flow.
                s.masquerade = p.saddr == backend.addr
                    || crate::snat::external_needed(&frontend, backend.flags, || {
                        maps::in_cluster6(&p.saddr)
                    });
            }
            (
                backend_id,
                &backend.addr,
                &backend.port,
                frontend.rev_nat_id,
            )
        }
    };
    // A direct flow's `backend_id` is the frontend generation it was checked at.
    let direct = scoped.is_none();
    let flow = NewFlow6 {
        original: key,
        backend_id,
        backend_addr,
        backend_port,
        rev_nat_id,
        now_ns: now,
        direct,
    };
    // The port the client's packets leave with: its own, or another if its reply tuple clashed.
    let created = conntrack::create(p, &flow, if direct { None } else { old })?;
    let moved = created.sport;
    if !direct {
        // A flow created on another CPU meanwhile: this packet follows its pick.
        let adopted = if created.theirs {
            maps::ct6_new_value()
        } else {
            None
        };
        let (addr, port) = match adopted {
            Some(v) => (&v.backend_addr, v.backend_port),
            None => (backend_addr, *backend_port),
        };
        nat::dnat(ctx, p, addr, port)?;
    }
    if let Some(sport) = moved {
        nat::source_port(ctx, p, sport)?;
    }
    if !direct
        && let Some(s) = maps::snat6_scratch()
        && s.masquerade
    {
        // The port is allocated by the SNAT program (its own stack), on the DNATed packet. If
        // it is not there the packet is dropped; the entries expire unused.
        s.original = *key;
        // A hairpin flow leaves from the frontend the client sent to (`snat`).
        s.hairpin = key.daddr;
        s.state = conntrack::next_state(p, ct_state::UDP);
        s.stale = stale;
        maps::tail_call6(ctx, TAIL_CALL_SNAT6_NEW, p.l2_len);
        return Err(Drop::TailCall);
    }
    Ok(Action::pass(if direct {
        if moved.is_some() {
            Counter::DirectFlow
        } else {
            Counter::NotService
        }
    } else if stale && !p.is_tcp() {
        Counter::StaleBackendReselected
    } else {
        Counter::NewFlow
    }))
}

/// The ingress SNAT program, tail-called by the new-flow program for a new flow that needs SNAT
/// to the node (`snat`): parses the DNATed packet again and allocates the flow's node port; a
/// flow that gets none is dropped and its conntrack entries removed.
#[inline(always)]
pub fn try_new_snat(ctx: &TcContext, l2_len: usize) -> Result<Action, Drop> {
    let Parsed6::Packet(p) = packet::parse(ctx, l2_len) else {
        return Err(Drop::TailCall);
    };
    let Some(s) = maps::snat6_scratch() else {
        return Err(Drop::TailCall);
    };
    let (state, stale) = (s.state, s.stale);
    let result = match snat::allocate(ctx, &snat::Flow6::of_forwarded(p), s, state, maps::now_ns())
    {
        Ok(_) => Ok(Action::pass(if stale && !p.is_tcp() {
            Counter::StaleBackendReselected
        } else {
            Counter::NewFlow
        })),
        Err(drop) => {
            conntrack::remove(
                &s.original,
                Sent {
                    backend_addr: p.daddr,
                    backend_port: p.dport,
                    sport: p.sport,
                    has_reply: true,
                    closed: false,
                },
            );
            Err(drop)
        }
    };
    frag::first_done_from(
        ctx,
        l2_len,
        p,
        (&s.original.saddr, &s.original.daddr),
        frag_hook::INGRESS,
        &result,
    );
    result
}

/// The reject program: ICMPv6 port unreachable for a new flow to a Service without endpoints, a
/// RST for a TCP segment of a flow whose backend is gone.
#[inline(always)]
pub fn try_reject(ctx: &TcContext, l2_len: usize) -> Result<Action, Drop> {
    let Parsed6::Packet(p) = packet::parse(ctx, l2_len) else {
        return Err(Drop::TailCall);
    };
    let result = answer(ctx, p);
    // A first fragment answered in its place: its later fragments are dropped.
    frag::first_done(ctx, l2_len, p, frag_hook::INGRESS, &result);
    result
}

#[inline(always)]
fn answer(ctx: &TcContext, p: &Packet6) -> Result<Action, Drop> {
    let frontend = maps::service6(&Service6Key::new(p.daddr, p.dport, p.proto, 0));
    // Tail-called for a flow whose backend is gone (a TCP segment of a flow whose Service still
    // has endpoints) or for a new flow to a Service without endpoints.
    if p.is_tcp() && !p.is_syn() && frontend.is_none_or(|f| f.count != 0) {
        // Logged where the flow was found without its backend (`flow`).
        let verdict = reject::tcp_reset(ctx, p)?;
        return Ok(Action::redirect(verdict, Counter::StaleBackendReset));
    }
    let verdict = reject::port_unreachable(ctx, p)?;
    // A Service without endpoints, or (`new_flow`) a ClusterIP's port that is none of its
    // Services'.
    let (counter, why) = if frontend.is_some() {
        (Counter::NoEndpointsRejected, Refused::NoEndpoints)
    } else {
        (Counter::ClusterIpPortRejected, Refused::NoSuchPort)
    };
    log::refused6(why, p.proto, (&p.saddr, p.sport), (&p.daddr, p.dport));
    Ok(Action::redirect(verdict, counter))
}
