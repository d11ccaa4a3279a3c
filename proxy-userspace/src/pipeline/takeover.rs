//! Taking a node over from kube-proxy with its live connections: which of netfilter's NAT
//! bindings become the datapath's flows, and the conntrack and SNAT entries that carry each one
//! on (pure; the netlink dump, the map writes and the order of the switch are in
//! `dataplane::takeover`).
//!
//! kube-proxy's rules DNAT a flow to a Service once, at its first packet; netfilter's conntrack
//! entry keeps that binding (original tuple client → frontend, reply tuple endpoint → client,
//! or → node address:port when the flow was masqueraded, or → another client port when a
//! reply-tuple clash moved it). Each such binding toward a frontend this agent serves, to an
//! endpoint it knows, is written as the flow the datapath would have created for it: the same
//! backend, the same translated source port, the same reply translation. Flows the node itself
//! opened (NATed in netfilter's OUTPUT hook, where tc never sees them before netfilter) stay
//! netfilter's.

use std::net::{Ipv4Addr, Ipv6Addr};

use proxy_common::{
    CtKey, CtValue, SCOPE_EXTERNAL, SCOPE_INTERNAL, SNAT_NODE_PORT_MIN, SNAT_PORT_MIN, SnatValue,
    ct_dir, ct_flags, ct_state,
    ipv6::{Ct6Key, Ct6Value, Snat6Value},
    proto,
};

use crate::pipeline::{
    encode::{FamilyAbi, SlotKey},
    programmed::Programmed,
};

/// netfilter's `IPS_*` status bits (ctnetlink's `CTA_STATUS`).
pub mod nf_status {
    pub const SEEN_REPLY: u32 = 1 << 1;
    pub const DYING: u32 = 1 << 9;
}

/// netfilter's TCP states (`TCP_CONNTRACK_*`, ctnetlink's `CTA_PROTOINFO_TCP_STATE`).
pub mod nf_tcp {
    pub const SYN_SENT: u8 = 1;
    pub const SYN_RECV: u8 = 2;
    pub const ESTABLISHED: u8 = 3;
    pub const FIN_WAIT: u8 = 4;
    pub const CLOSE_WAIT: u8 = 5;
    pub const LAST_ACK: u8 = 6;
    pub const TIME_WAIT: u8 = 7;
    pub const CLOSE: u8 = 8;
    pub const SYN_SENT2: u8 = 9;
}

/// One direction of a netfilter entry, in one family.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NfTuple<A> {
    pub src: A,
    pub dst: A,
    pub sport: u16,
    pub dport: u16,
}

/// A netfilter conntrack entry as the takeover reads it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NfFlow<A> {
    pub proto: u8,
    pub original: NfTuple<A>,
    pub reply: NfTuple<A>,
    /// The endpoint has answered (`IPS_SEEN_REPLY`).
    pub seen_reply: bool,
    /// netfilter's TCP state (`TCP_CONNTRACK_*`); `None` for UDP.
    pub tcp_state: Option<u8>,
}

/// A netfilter binding carried on by the datapath.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Imported<A> {
    pub proto: u8,
    pub client: A,
    pub client_port: u16,
    pub frontend: A,
    pub frontend_port: u16,
    pub backend: A,
    pub backend_port: u16,
    pub backend_id: u32,
    pub rev_nat_id: u32,
    /// `ct_state::*`.
    pub state: u8,
    pub seen_reply: bool,
    /// The source port netfilter moved the flow to after a reply-tuple clash (its packets leave
    /// with it, replies come back to it).
    pub moved_sport: Option<u16>,
    /// Masqueraded: the source address and port the flow's packets leave with.
    pub snat: Option<(A, u16)>,
}

impl<A: Copy> Imported<A> {
    /// The source port the client's packets leave with after DNAT (before any SNAT).
    pub fn sport_after_dnat(&self) -> u16 {
        self.moved_sport.unwrap_or(self.client_port)
    }

    /// Can netfilter's entry be deleted and the flow translated here? Only if the datapath
    /// recognises its replies as SNAT replies: a masquerade port of the dedicated range, or an
    /// unprivileged one on the node's SNAT address (`is_node_snat`). Other flows stay
    /// netfilter's (their binding keeps working without kube-proxy's rules) until they end.
    pub fn movable(&self, is_node_snat: impl Fn(A) -> bool) -> bool {
        self.snat.is_none_or(|(addr, port)| {
            port >= SNAT_PORT_MIN || (port >= SNAT_NODE_PORT_MIN && is_node_snat(addr))
        })
    }
}

/// Why a netfilter entry is not taken over.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Skipped {
    /// Not DNATed: no Service binding (most of the table).
    NotTranslated,
    /// Neither TCP nor UDP.
    Protocol,
    /// Opened by the node itself: NATed in netfilter's output hook, left there.
    FromNode,
    /// To an address and port that is no frontend this agent serves.
    NotAFrontend,
    /// To an endpoint that is none of this agent's backends (gone since).
    UnknownEndpoint,
    /// Closed already (TIME_WAIT, CLOSE): nothing left to carry.
    Closed,
}

/// Pure: the flow `nf` becomes, or why it does not. `from_node`: is an address one of the
/// node's own.
pub fn import<A: FamilyAbi>(
    nf: &NfFlow<A>,
    programmed: &Programmed<A>,
    from_node: impl Fn(A) -> bool,
) -> Result<Imported<A>, Skipped> {
    let (o, r) = (&nf.original, &nf.reply);
    if r.src == o.dst && r.sport == o.dport {
        return Err(Skipped::NotTranslated);
    }
    let state = match (nf.proto, nf.tcp_state) {
        (proto::UDP, _) => ct_state::UDP,
        (proto::TCP, Some(s)) => tcp_state(s).ok_or(Skipped::Closed)?,
        _ => return Err(Skipped::Protocol),
    };
    if from_node(o.src) {
        return Err(Skipped::FromNode);
    }
    let (backend_id, rev_nat_id) =
        find_backend(programmed, nf.proto, (o.dst, o.dport), (r.src, r.sport))?;
    let (moved_sport, snat) = if r.dst == o.src {
        ((r.dport != o.sport).then_some(r.dport), None)
    } else {
        (None, Some((r.dst, r.dport)))
    };
    Ok(Imported {
        proto: nf.proto,
        client: o.src,
        client_port: o.sport,
        frontend: o.dst,
        frontend_port: o.dport,
        backend: r.src,
        backend_port: r.sport,
        backend_id,
        rev_nat_id,
        state,
        seen_reply: nf.seen_reply,
        moved_sport,
        snat,
    })
}

/// netfilter's TCP state as the datapath's; `None` for a closed connection.
fn tcp_state(nf: u8) -> Option<u8> {
    Some(match nf {
        nf_tcp::SYN_SENT | nf_tcp::SYN_SENT2 => ct_state::SYN_SENT,
        nf_tcp::SYN_RECV => ct_state::SYN_RECV,
        nf_tcp::ESTABLISHED => ct_state::ESTABLISHED,
        // One side's FIN (netfilter does not say whose): half-closed, the other may still send.
        nf_tcp::FIN_WAIT | nf_tcp::CLOSE_WAIT => ct_state::FIN_ORIGINAL,
        nf_tcp::LAST_ACK => ct_state::CLOSING,
        _ => return None,
    })
}

/// The backend id of `endpoint` behind `frontend` (either scope), and the frontend's rev-NAT
/// id; else any backend with that address (a terminating endpoint no slot names any more).
fn find_backend<A: FamilyAbi>(
    programmed: &Programmed<A>,
    proto: u8,
    frontend: (A, u16),
    endpoint: (A, u16),
) -> Result<(u32, u32), Skipped> {
    let port = frontend.1.to_be_bytes();
    let is_endpoint = |b: &A::Backend| {
        let (addr, port, p, _) = A::backend_parts(b);
        (addr, port, p) == (endpoint.0, endpoint.1.to_be_bytes(), proto)
    };
    let mut rev_nat = None;
    for scope in [SCOPE_EXTERNAL, SCOPE_INTERNAL] {
        let key = A::service_key(frontend.0, port, proto, scope, 0);
        let Some(value) = programmed.services.get(&key) else {
            continue;
        };
        rev_nat = Some(value.rev_nat_id);
        for slot in 1..=value.count {
            let Some(s) = programmed.services.get(&key.with_slot(slot)) else {
                continue;
            };
            if programmed
                .backends
                .get(&s.backend_id)
                .is_some_and(is_endpoint)
            {
                return Ok((s.backend_id, value.rev_nat_id));
            }
        }
    }
    let rev_nat = rev_nat.ok_or(Skipped::NotAFrontend)?;
    programmed
        .backends
        .iter()
        .find(|(_, b)| is_endpoint(b))
        .map(|(id, _)| (id, rev_nat))
        .ok_or(Skipped::UnknownEndpoint)
}

/// The conntrack and SNAT entries of a family (`CONNTRACK_V1`/`SNAT_V1`,
/// `CONNTRACK6_V1`/`SNAT6_V1`), as [`entries`] lays them out.
pub trait FlowAbi: FamilyAbi + Into<std::net::IpAddr> {
    type CtKey: Copy + std::fmt::Debug + aya::Pod;
    type CtValue: Copy + std::fmt::Debug + aya::Pod;
    type SnatValue: Copy + std::fmt::Debug + aya::Pod;
    const MAP_CONNTRACK: &'static str;
    const MAP_SNAT: &'static str;
    fn ct_key(src: (Self, u16), dst: (Self, u16), proto: u8, dir: u8) -> Self::CtKey;
    fn ct_value(f: &Imported<Self>, now_ns: u64, flags: u8, nat_sport: u16) -> Self::CtValue;
    fn snat_value(addr: Self, port: u16, state: u8, flags: u8, now_ns: u64) -> Self::SnatValue;
    fn ct_flags(v: &Self::CtValue) -> u8;
    /// When the datapath created the entry (CLOCK_MONOTONIC ns).
    fn ct_created(v: &Self::CtValue) -> u64;
    fn set_ct_flags(v: &mut Self::CtValue, flags: u8);
    fn snat_flags(v: &Self::SnatValue) -> u8;
    fn set_snat_flags(v: &mut Self::SnatValue, flags: u8);
}

macro_rules! flow_abi {
    ($family:ty, $key:ident, $value:ident, $snat:ident, $ct_map:expr, $snat_map:expr) => {
        impl FlowAbi for $family {
            type CtKey = $key;
            type CtValue = $value;
            type SnatValue = $snat;
            const MAP_CONNTRACK: &'static str = $ct_map;
            const MAP_SNAT: &'static str = $snat_map;
            fn ct_key(src: (Self, u16), dst: (Self, u16), proto: u8, dir: u8) -> $key {
                $key {
                    saddr: src.0.octets(),
                    daddr: dst.0.octets(),
                    sport: src.1.to_be_bytes(),
                    dport: dst.1.to_be_bytes(),
                    proto,
                    dir,
                    _pad: [0; 2],
                }
            }
            fn ct_value(f: &Imported<Self>, now_ns: u64, flags: u8, nat_sport: u16) -> $value {
                $value {
                    last_seen_ns: now_ns,
                    created_ns: now_ns,
                    backend_id: f.backend_id,
                    rev_nat_id: f.rev_nat_id,
                    frontend_addr: f.frontend.octets(),
                    backend_addr: f.backend.octets(),
                    frontend_port: f.frontend_port.to_be_bytes(),
                    backend_port: f.backend_port.to_be_bytes(),
                    state: f.state,
                    flags,
                    nat_sport: nat_sport.to_be_bytes(),
                }
            }
            fn snat_value(addr: Self, port: u16, state: u8, flags: u8, now_ns: u64) -> $snat {
                let mut v: $snat = bytemuck::Zeroable::zeroed();
                v.last_seen_ns = now_ns;
                v.addr = addr.octets();
                v.port = port.to_be_bytes();
                v.state = state;
                v.flags = flags;
                v
            }
            fn ct_flags(v: &$value) -> u8 {
                v.flags
            }
            fn ct_created(v: &$value) -> u64 {
                v.created_ns
            }
            fn set_ct_flags(v: &mut $value, flags: u8) {
                v.flags = flags;
            }
            fn snat_flags(v: &$snat) -> u8 {
                v.flags
            }
            fn set_snat_flags(v: &mut $snat, flags: u8) {
                v.flags = flags;
            }
        }
    };
}

flow_abi!(
    Ipv4Addr,
    CtKey,
    CtValue,
    SnatValue,
    proxy_common::MAP_CONNTRACK,
    proxy_common::MAP_SNAT
);
flow_abi!(
    Ipv6Addr,
    Ct6Key,
    Ct6Value,
    Snat6Value,
    proxy_common::ipv6::MAP_CONNTRACK6,
    proxy_common::ipv6::MAP_SNAT6
);

/// The entries of one taken-over flow, all flagged `flags` (`ct_flags::NETFILTER` while
/// netfilter still translates it).
#[derive(Clone, Copy, Debug)]
pub struct FlowEntries<A: FlowAbi> {
    /// ORIGINAL (client → frontend, as the client's packets arrive) and REPLY (backend →
    /// client's translated port, as replies leave) conntrack entries.
    pub original: (A::CtKey, A::CtValue),
    pub reply: (A::CtKey, A::CtValue),
    /// SNAT `out` (client → backend after DNAT) and `in` (backend → node address:port).
    pub snat: Option<[(A::CtKey, A::SnatValue); 2]>,
}

/// Pure: the entries the datapath would hold for `f`, as if it had opened the flow itself.
pub fn entries<A: FlowAbi>(f: &Imported<A>, now_ns: u64, extra_flags: u8) -> FlowEntries<A> {
    let mut flags = extra_flags;
    if f.seen_reply {
        flags |= ct_flags::SEEN_REPLY;
    }
    let sport = f.sport_after_dnat();
    let (ct_flags_, original_nat, reply_nat) = match f.moved_sport {
        Some(moved) => (flags | ct_flags::SPORT_NAT, moved, f.client_port),
        None => (flags, 0, 0),
    };
    let original = (
        A::ct_key(
            (f.client, f.client_port),
            (f.frontend, f.frontend_port),
            f.proto,
            ct_dir::ORIGINAL,
        ),
        A::ct_value(f, now_ns, ct_flags_, original_nat),
    );
    let reply = (
        A::ct_key(
            (f.backend, f.backend_port),
            (f.client, sport),
            f.proto,
            ct_dir::REPLY,
        ),
        A::ct_value(f, now_ns, ct_flags_, reply_nat),
    );
    let snat = f.snat.map(|(node, port)| {
        [
            (
                A::ct_key(
                    (f.client, sport),
                    (f.backend, f.backend_port),
                    f.proto,
                    ct_dir::ORIGINAL,
                ),
                A::snat_value(node, port, f.state, flags, now_ns),
            ),
            (
                A::ct_key(
                    (f.backend, f.backend_port),
                    (node, port),
                    f.proto,
                    ct_dir::REPLY,
                ),
                A::snat_value(f.client, sport, f.state, flags, now_ns),
            ),
        ]
    });
    FlowEntries {
        original,
        reply,
        snat,
    }
}

#[cfg(test)]
mod tests {
    use proxy_common::{Backend, ServiceKey, ServiceValue};

    use super::*;

    const VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
    const NODE: Ipv4Addr = Ipv4Addr::new(192, 168, 50, 2);
    const POD: Ipv4Addr = Ipv4Addr::new(10, 244, 0, 5);
    const EP: Ipv4Addr = Ipv4Addr::new(10, 244, 1, 7);

    /// A ClusterIP 10.96.0.10:80 and a NodePort 30080 on the node address, one endpoint
    /// 10.244.1.7:8080 (backend id 4).
    fn programmed() -> Programmed {
        let mut p = Programmed::default();
        for (addr, port, rev) in [(VIP, 80, 1), (NODE, 30080, 2)] {
            let key = ServiceKey::new(addr.octets(), u16::to_be_bytes(port), proto::TCP, 0);
            p.services.insert(key, ServiceValue::frontend(1, rev));
            p.services.insert(key.with_slot(1), ServiceValue::slot(4));
        }
        p.backends.insert(
            4,
            Backend {
                addr: EP.octets(),
                port: 8080u16.to_be_bytes(),
                proto: proto::TCP,
                flags: 0,
            },
        );
        p
    }

    fn tcp(
        original: (Ipv4Addr, u16, Ipv4Addr, u16),
        reply: (Ipv4Addr, u16, Ipv4Addr, u16),
    ) -> NfFlow<Ipv4Addr> {
        NfFlow {
            proto: proto::TCP,
            original: NfTuple {
                src: original.0,
                sport: original.1,
                dst: original.2,
                dport: original.3,
            },
            reply: NfTuple {
                src: reply.0,
                sport: reply.1,
                dst: reply.2,
                dport: reply.3,
            },
            seen_reply: true,
            tcp_state: Some(nf_tcp::ESTABLISHED),
        }
    }

    #[test]
    fn a_cluster_ip_binding_becomes_the_flow_the_datapath_would_have_opened() {
        let nf = tcp((POD, 40000, VIP, 80), (EP, 8080, POD, 40000));
        let f = import(&nf, &programmed(), |_| false).expect("imported");
        assert_eq!(
            (f.backend_id, f.rev_nat_id, f.state),
            (4, 1, ct_state::ESTABLISHED)
        );
        assert_eq!((f.moved_sport, f.snat), (None, None));
        assert!(f.movable(|_| false));
        let e = entries(&f, 7, ct_flags::NETFILTER);
        let (ok, ov) = e.original;
        assert_eq!(
            (ok.saddr, ok.daddr, ok.dir),
            (POD.octets(), VIP.octets(), ct_dir::ORIGINAL)
        );
        assert_eq!(
            (ov.backend_addr, ov.backend_port),
            (EP.octets(), 8080u16.to_be_bytes())
        );
        assert_eq!(ov.flags, ct_flags::NETFILTER | ct_flags::SEEN_REPLY);
        let (rk, _) = e.reply;
        assert_eq!(
            (rk.saddr, rk.daddr, rk.dport),
            (EP.octets(), POD.octets(), 40000u16.to_be_bytes())
        );
        assert!(e.snat.is_none());
    }

    #[test]
    fn a_moved_source_port_and_a_masquerade_are_carried_over() {
        // A reply-tuple clash: netfilter gave the flow source port 1200.
        let nf = tcp((POD, 40000, VIP, 80), (EP, 8080, POD, 1200));
        let f = import(&nf, &programmed(), |_| false).unwrap();
        assert_eq!(f.moved_sport, Some(1200));
        let e = entries(&f, 7, 0);
        assert_eq!(e.original.1.nat_sport, 1200u16.to_be_bytes());
        assert_eq!(e.reply.0.dport, 1200u16.to_be_bytes());
        assert_eq!(e.reply.1.nat_sport, 40000u16.to_be_bytes());
        assert_ne!(e.original.1.flags & ct_flags::SPORT_NAT, 0);

        // An external client to the NodePort, masqueraded to the node's 62000.
        let client = Ipv4Addr::new(192, 168, 50, 9);
        let nf = tcp((client, 51000, NODE, 30080), (EP, 8080, NODE, 62000));
        let f = import(&nf, &programmed(), |_| false).unwrap();
        assert_eq!((f.rev_nat_id, f.snat), (2, Some((NODE, 62000))));
        assert!(f.movable(|_| false));
        let [out, inn] = entries(&f, 7, 0).snat.unwrap();
        assert_eq!((out.0.saddr, out.0.daddr), (client.octets(), EP.octets()));
        assert_eq!(
            (out.1.addr, out.1.port),
            (NODE.octets(), 62000u16.to_be_bytes())
        );
        assert_eq!(
            (inn.0.daddr, inn.0.dport),
            (NODE.octets(), 62000u16.to_be_bytes())
        );
        assert_eq!(
            (inn.1.addr, inn.1.port),
            (client.octets(), 51000u16.to_be_bytes())
        );
        // A masquerade port below the dedicated range: the datapath's when it is on the node's
        // SNAT address, netfilter's on another address or when privileged.
        let nf = tcp((client, 51000, NODE, 30080), (EP, 8080, NODE, 41000));
        let f = import(&nf, &programmed(), |_| false).unwrap();
        assert!(f.movable(|a| a == NODE));
        assert!(!f.movable(|_| false));
        let nf = tcp((client, 51000, NODE, 30080), (EP, 8080, NODE, 1000));
        assert!(
            !import(&nf, &programmed(), |_| false)
                .unwrap()
                .movable(|a| a == NODE)
        );
    }

    #[test]
    fn what_is_not_taken_over() {
        let p = programmed();
        let plain = tcp((POD, 40000, EP, 8080), (EP, 8080, POD, 40000));
        assert_eq!(import(&plain, &p, |_| false), Err(Skipped::NotTranslated));
        let from_node = tcp((NODE, 40000, VIP, 80), (EP, 8080, NODE, 40000));
        assert_eq!(
            import(&from_node, &p, |a| a == NODE),
            Err(Skipped::FromNode)
        );
        let other = tcp(
            (POD, 40000, Ipv4Addr::new(10, 96, 0, 99), 80),
            (EP, 8080, POD, 40000),
        );
        assert_eq!(import(&other, &p, |_| false), Err(Skipped::NotAFrontend));
        let gone = tcp(
            (POD, 40000, VIP, 80),
            (Ipv4Addr::new(10, 244, 1, 99), 8080, POD, 40000),
        );
        assert_eq!(import(&gone, &p, |_| false), Err(Skipped::UnknownEndpoint));
        let mut closed = tcp((POD, 40000, VIP, 80), (EP, 8080, POD, 40000));
        closed.tcp_state = Some(nf_tcp::TIME_WAIT);
        assert_eq!(import(&closed, &p, |_| false), Err(Skipped::Closed));
    }
}
