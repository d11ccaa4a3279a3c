//! tc ingress: conntrack → service → backend pick → conntrack entries → DNAT.

use aya_ebpf::programs::TcContext;
use proxy_common::{
    Counter, CtKey, CtValue, PendingFlow, ServiceKey, SourceRangeKey, TAIL_CALL_DIRECT_FLOW,
    TAIL_CALL_INGRESS6, TAIL_CALL_REJECT, ct_flags, ct_state,
    flow_state::{TakenOver, taken_over},
    frag_hook,
    hash::flow_hash,
    maglev, sched, service_flags,
};

use crate::{
    Action, Drop,
    conntrack::{self, NewFlow, Written},
    frag, frontend_gen, icmp,
    log::{self, Refused},
    maps, nat,
    packet::{self, Packet, Parsed, tcp_flags},
    pick, reject, snat, stats, svc_cidr,
};

/// Why a packet goes through the new-flow path although it had a conntrack entry.
#[derive(Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
enum Replacing {
    /// No entry: a new flow.
    Nothing,
    /// The entry was idle for longer than its timeout, or a SYN reuses a closing flow's tuple.
    Old,
    /// The entry's backend is gone (UDP, SCTP, or a TCP SYN), or a UDP flow's backend is no
    /// longer serving (`backend_flags::NOT_SERVING`: TCP and SCTP flows keep such a backend).
    Stale,
}

#[inline(always)]
pub fn try_tc_ingress(ctx: &TcContext, l2_len: usize) -> Result<Action, Drop> {
    let p = match packet::parse(ctx, l2_len) {
        Parsed::Packet(p) => p,
        Parsed::Fragment(f) => return frag::later(ctx, &f, frag_hook::INGRESS),
        Parsed::NotIpv4 => return Ok(Action::pass(Counter::NotIpv4)),
        Parsed::Ipv6 => {
            // The IPv6 datapath is a program of its own; without it, IPv6 passes untouched.
            maps::tail_call6(ctx, TAIL_CALL_INGRESS6, l2_len);
            return Ok(Action::pass(Counter::NotIpv4));
        }
        Parsed::IcmpError(e) => return icmp::ingress(ctx, &e),
        Parsed::Pass(counter) => return Ok(Action::pass(counter)),
        Parsed::Untranslatable {
            daddr,
            dport,
            proto,
            reason,
        } => {
            return match maps::service(&ServiceKey::new(daddr, dport, proto, 0)) {
                Some(_) if !maps::handed_over(maps::now_ns()) => Err(reason),
                _ => Ok(Action::pass(Counter::NotService)),
            };
        }
    };
    frag::first_seen(ctx, &p, frag_hook::INGRESS);
    if p.has_ip_options() {
        stats::count(Counter::IpOptions);
    }
    let now = maps::now_ns();
    let key = conntrack::original_key(&p);
    let mut old = None;
    let mut replacing = Replacing::Nothing;
    if let Some(entry) = maps::ct_entry(&key) {
        let ct = entry.get();
        if conntrack::expired(&ct, p.proto, now, maps::config_ref()) {
            stats::count(Counter::ConntrackExpired);
            replacing = Replacing::Old;
        } else if p.is_syn() && ct.state == ct_state::CLOSING {
            // A new connection on the tuple of a closed one: choose again, like netfilter does.
            replacing = Replacing::Old;
        } else if let Some(held) = taken_over(ct.flags) {
            // Taken over from netfilter, which still translates it (or is letting go of it).
            if held == TakenOver::Handoff {
                return Err(Drop::TakeoverHandoff);
            }
            conntrack::client_passed(&p, &key, &entry, &ct, now);
            return Ok(Action::pass(Counter::NetfilterFlow));
        } else if ct.flags & ct_flags::DIRECT != 0
            && frontend_gen::direct_outdated(&entry, ct.backend_id, p.may_open_flow(), || {
                maps::service(&ServiceKey::new(p.daddr, p.dport, p.proto, 0)).is_some()
            })
        {
            // It began before its destination became a Service frontend: a new flow now.
            replacing = Replacing::Old;
        } else if ct.flags & ct_flags::DIRECT != 0 {
            // Straight to a pod: no address translation; a source port only after a clash.
            conntrack::client_passed(&p, &key, &entry, &ct, now);
            if ct.flags & ct_flags::SPORT_NAT != 0 {
                nat::source_port(ctx, &p, ct.nat_sport)?;
            }
            return Ok(Action::pass(Counter::DirectFlow));
        } else if conntrack::backend_valid(&ct) {
            conntrack::client_passed(&p, &key, &entry, &ct, now);
            nat::dnat(ctx, &p, ct.backend_addr, ct.backend_port)?;
            if ct.flags & ct_flags::SPORT_NAT != 0 {
                nat::source_port(ctx, &p, ct.nat_sport)?;
            }
            return Ok(Action::pass(Counter::EstablishedFlow));
        } else if maps::handed_over(now) {
            // Its backend is gone and another proxy carries the node's Services now: the packet
            // is that proxy's to decide on.
            return Ok(Action::pass(Counter::HandedOver));
        } else if p.is_tcp() && !p.is_syn() {
            // Mid-connection and the backend is gone (a not-serving one keeps its TCP flows):
            // never send to the dead address, reset.
            conntrack::remove(&key, &ct);
            log::refused(
                Refused::BackendGone,
                p.proto,
                (p.saddr, p.sport),
                (p.daddr, p.dport),
            );
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
        snat::reply_passed(&p, &entry, &client, now);
        match taken_over(client.flags) {
            Some(TakenOver::Handoff) => return Err(Drop::TakeoverHandoff),
            Some(TakenOver::Netfilter) => return Ok(Action::pass(Counter::NetfilterFlow)),
            None => {}
        }
        nat::dnat(ctx, &p, client.addr, client.port)?;
        return Ok(Action::pass(Counter::SnatReplyTranslated));
    }
    if maps::handed_over(now) {
        // Another proxy took over while no agent ran: new flows are its (flows translated before
        // keep their translation above, until they end).
        return Ok(Action::pass(Counter::HandedOver));
    }
    if maps::service(&ServiceKey::new(p.daddr, p.dport, p.proto, 0)).is_none() {
        // To no Service: mid-connection TCP passes right here; a connection's first packet or a
        // UDP datagram is tracked by the direct-flow program (its reply tuple stays its own).
        if let Some(old) = &old {
            conntrack::remove(&key, old); // A direct flow's entry that expired, or a gone Service.
        }
        if p.is_tcp() && !p.is_syn() {
            return Ok(Action::pass(Counter::NotService));
        }
        maps::tail_call(ctx, TAIL_CALL_DIRECT_FLOW, l2_len);
        return Err(Drop::TailCall);
    }
    // The rest runs in the new-flow program (its own 512-byte stack).
    let pending = PendingFlow {
        old: old.unwrap_or_default(),
        has_old: old.is_some() as u8,
        replacing: replacing as u8,
        _pad: [0; 6],
    };
    maps::tail_call_new_flow(ctx, &pending, l2_len);
    Err(Drop::TailCall)
}

/// The new-flow program, tail-called by `tc_ingress` for a packet without a usable conntrack
/// entry: parses the packet again (cheaper than handing it over) and takes the replaced entry
/// from the per-CPU scratch.
#[inline(always)]
pub fn try_new_flow(ctx: &TcContext, l2_len: usize) -> Result<Action, Drop> {
    let Parsed::Packet(p) = packet::parse(ctx, l2_len) else {
        return Err(Drop::TailCall); // tc_ingress only tail-calls for translatable packets.
    };
    let pending = maps::pending_flow().ok_or(Drop::TailCall)?;
    let replacing = match pending.replacing {
        x if x == Replacing::Old as u8 => Replacing::Old,
        x if x == Replacing::Stale as u8 => Replacing::Stale,
        _ => Replacing::Nothing,
    };
    let old = (pending.has_old != 0).then_some(&pending.old);
    new_flow(
        ctx,
        &p,
        &conntrack::original_key(&p),
        maps::now_ns(),
        old,
        replacing,
    )
}

/// The direct-flow program, tail-called by the new-flow program for a packet to no Service: see
/// [`conntrack::direct_flow`].
#[inline(always)]
pub fn try_direct_flow(ctx: &TcContext, l2_len: usize) -> Result<Action, Drop> {
    let Parsed::Packet(p) = packet::parse(ctx, l2_len) else {
        return Err(Drop::TailCall);
    };
    if let Some(verdict) = svc_cidr::not_a_frontend(ctx, &p) {
        return verdict;
    }
    match conntrack::direct_flow(&p, &conntrack::original_key(&p), maps::now_ns())? {
        Some(sport) => {
            nat::source_port(ctx, &p, sport)?;
            Ok(Action::pass(Counter::DirectFlow))
        }
        None => Ok(Action::pass(Counter::NotService)),
    }
}

/// The reject program, tail-called by the new-flow program for a new flow to a Service without
/// endpoints: ICMP port unreachable, sent back out.
#[inline(always)]
pub fn try_reject(ctx: &TcContext, l2_len: usize) -> Result<Action, Drop> {
    let Parsed::Packet(p) = packet::parse(ctx, l2_len) else {
        return Err(Drop::TailCall);
    };
    let verdict = reject::icmp_port_unreachable(ctx, &p)?;
    // A Service without endpoints, or (from the direct-flow program) a ClusterIP's port that is
    // none of its Services'.
    let (counter, why) = if maps::service(&ServiceKey::new(p.daddr, p.dport, p.proto, 0)).is_some()
    {
        (Counter::NoEndpointsRejected, Refused::NoEndpoints)
    } else {
        (Counter::ClusterIpPortRejected, Refused::NoSuchPort)
    };
    log::refused(why, p.proto, (p.saddr, p.sport), (p.daddr, p.dport));
    Ok(Action::redirect(verdict, counter))
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
            // The Service itself is gone (or a direct flow's entry expired): that flow is over.
            conntrack::remove(key, old);
        }
        // Straight to a pod (or anywhere else): tracked so its reply tuple stays its own, in a
        // program of its own (stack). Only a connection's first packet (TCP SYN) or a UDP
        // datagram starts tracking.
        if !p.is_tcp() || p.is_syn() {
            maps::tail_call(ctx, TAIL_CALL_DIRECT_FLOW, p.l2_len);
            return Err(Drop::TailCall);
        }
        return Ok(Action::pass(Counter::NotService));
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
        log::refused(
            Refused::SourceRange,
            p.proto,
            (p.saddr, p.sport),
            (p.daddr, p.dport),
        );
        return Err(Drop::SourceRange);
    }
    // Maglev places flows with an unseeded hash: every node must put a flow at the same
    // position of the same table (ECMP may move it between nodes).
    let seed = if frontend.scheduler == sched::code::MAGLEV {
        maglev::FLOW_SEED
    } else {
        maps::hash_seed()
    };
    let hash = flow_hash(seed, p.saddr, p.daddr, p.sport, p.dport, p.proto);
    let facts = pick::FlowFacts {
        client: p.saddr,
        frontend_addr: p.daddr,
        hash,
    };
    let Some(backend_id) = pick::choose(&frontend_key, &frontend, &facts)? else {
        if let Some(old) = old {
            conntrack::remove(key, old);
        }
        if frontend.flags & service_flags::DROP_WHEN_EMPTY != 0 {
            // Like kube-proxy: a Local policy with endpoints only on other nodes drops; no
            // usable endpoint anywhere rejects (below).
            log::refused(
                Refused::NoLocalEndpoints,
                p.proto,
                (p.saddr, p.sport),
                (p.daddr, p.dport),
            );
            return Err(Drop::NoLocalEndpoints);
        }
        // The answer is built in a program of its own (stack).
        maps::tail_call(ctx, TAIL_CALL_REJECT, p.l2_len);
        return Err(Drop::TailCall);
    };
    let backend = maps::backend(backend_id).ok_or(Drop::NoBackend)?;
    let flow = NewFlow {
        original: key,
        backend_id,
        backend: &backend,
        rev_nat_id: frontend.rev_nat_id,
        now_ns: now,
    };
    let (ct, backend) = match conntrack::create(p, &flow, old)? {
        Written::Ours(ct) => (ct, backend),
        // The flow was created on another CPU meanwhile: this packet follows its pick.
        Written::Theirs(ct) => (ct, maps::backend(ct.backend_id).ok_or(Drop::NoBackend)?),
    };
    // The port the client's packets leave with: its own, or another if its reply tuple clashed.
    let sport = conntrack::translated_sport(key, &ct);
    if snat::needed(p.saddr, &frontend, &backend) {
        let f = snat::Flow {
            client: p.saddr,
            client_port: sport,
            backend: backend.addr,
            backend_port: backend.port,
            proto: p.proto,
        };
        if let Err(drop) = snat::allocate(
            ctx,
            &f,
            conntrack::next_state(p, ct_state::UDP),
            now,
            snat::NO_DEVICE,
        ) {
            conntrack::remove(key, &ct);
            log::snat_failed(
                (p.saddr, sport),
                (p.daddr, p.dport),
                (backend.addr, backend.port),
            );
            return Err(drop);
        }
    }
    nat::dnat(ctx, p, backend.addr, backend.port)?;
    if sport != p.sport {
        nat::source_port(ctx, p, sport)?;
    }
    log::new_flow(
        p.proto,
        (p.saddr, sport),
        (p.daddr, p.dport),
        (backend.addr, backend.port),
        backend_id,
        frontend.scheduler,
    );
    Ok(Action::pass(
        if replacing == Replacing::Stale && !p.is_tcp() {
            Counter::StaleBackendReselected
        } else {
            Counter::NewFlow
        },
    ))
}
