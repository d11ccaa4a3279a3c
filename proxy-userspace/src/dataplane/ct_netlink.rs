//! The kernel's own conntrack table (nf_conntrack), over ctnetlink: list its entries (both
//! tuples, status, TCP state) and delete them, without the `conntrack` binary.
//!
//! Packets the datapath passes to the stack untranslated (to a destination that was no Service
//! frontend yet, to node processes, while handed over) may be recorded there; once that
//! destination is a serving UDP frontend, such an entry would keep netfilter's decision for the
//! client's later datagrams. kube-proxy deletes them for the same reason (its conntrack
//! cleanup of UDP Service IPs, NodePorts, externalIPs and load-balancer IPs).

use std::{collections::HashSet, io, net::IpAddr, os::fd::AsRawFd};

use netlink_sys::{Socket, protocols::NETLINK_NETFILTER};
use proxy_common::proto;

const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const NLM_F_REQUEST: u16 = 1;
const NLM_F_ACK: u16 = 4;
const NLM_F_DUMP: u16 = 0x300;
const NLMSG_HDRLEN: usize = 16;
const NFGENMSG_LEN: usize = 4;
/// `NFNL_SUBSYS_CTNETLINK << 8 | IPCTNL_MSG_CT_GET` / `_DELETE`.
const CT_GET: u16 = (1 << 8) | 1;
const CT_DELETE: u16 = (1 << 8) | 2;
const NLA_TYPE_MASK: u16 = 0x3fff;
const CTA_TUPLE_ORIG: u16 = 1;
const CTA_TUPLE_REPLY: u16 = 2;
const CTA_STATUS: u16 = 3;
const CTA_PROTOINFO: u16 = 4;
const CTA_ZONE: u16 = 18;
const CTA_TUPLE_IP: u16 = 1;
const CTA_TUPLE_PROTO: u16 = 2;
const CTA_IP_V4_SRC: u16 = 1;
const CTA_IP_V4_DST: u16 = 2;
const CTA_IP_V6_SRC: u16 = 3;
const CTA_IP_V6_DST: u16 = 4;
const CTA_PROTO_NUM: u16 = 1;
const CTA_PROTO_SRC_PORT: u16 = 2;
const CTA_PROTO_DST_PORT: u16 = 3;
const CTA_PROTOINFO_TCP: u16 = 1;
const CTA_PROTOINFO_TCP_STATE: u16 = 1;

/// One direction's tuple of an entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Tuple {
    pub src: IpAddr,
    pub dst: IpAddr,
    /// Ports (0 for protocols without them).
    pub sport: u16,
    pub dport: u16,
    pub proto: u8,
}

/// One entry of a dump.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    /// The original direction's destination, port and protocol.
    pub daddr: IpAddr,
    pub dport: u16,
    pub proto: u8,
    /// The whole original tuple, and the reply tuple (where NAT shows: a DNAT's reply comes
    /// from the endpoint, a SNAT's goes to the translated source).
    pub original: Tuple,
    pub reply: Option<Tuple>,
    /// `IPS_*` status bits (`pipeline::takeover::nf_status`).
    pub status: u32,
    /// netfilter's TCP state (`TCP_CONNTRACK_*`, `pipeline::takeover::nf_tcp`) for a TCP entry.
    pub tcp_state: Option<u8>,
    /// The `CTA_TUPLE_ORIG` attribute as the kernel sent it (header included) and the
    /// `CTA_ZONE` one if any: a delete request names the entry with exactly these.
    identity: Vec<u8>,
}

impl Entry {
    /// Was the entry's destination translated (a DNAT binding: the reply comes from elsewhere)?
    /// Such a binding to a Service frontend is another proxy's (kube-proxy's rules): the agent
    /// takes it over (`dataplane::takeover`) and never just deletes it.
    pub fn translated(&self) -> bool {
        self.reply
            .is_some_and(|r| (r.src, r.sport) != (self.original.dst, self.original.dport))
    }
}

/// The attributes of a netlink attribute stream: (type without flags, payload, whole attribute).
fn attributes(mut buf: &[u8]) -> impl Iterator<Item = (u16, &[u8], &[u8])> {
    std::iter::from_fn(move || {
        if buf.len() < 4 {
            return None;
        }
        let len = u16::from_ne_bytes([buf[0], buf[1]]) as usize;
        if len < 4 || len > buf.len() {
            return None;
        }
        let kind = u16::from_ne_bytes([buf[2], buf[3]]) & NLA_TYPE_MASK;
        let whole = &buf[..len];
        buf = &buf[len.next_multiple_of(4).min(buf.len())..];
        Some((kind, &whole[4..], whole))
    })
}

fn find(buf: &[u8], kind: u16) -> Option<(&[u8], &[u8])> {
    attributes(buf)
        .find(|(k, ..)| *k == kind)
        .map(|(_, p, w)| (p, w))
}

fn address(ip: &[u8], v4: u16, v6: u16) -> Option<IpAddr> {
    match (find(ip, v4), find(ip, v6)) {
        (Some((a, _)), _) if a.len() == 4 => Some(IpAddr::from(<[u8; 4]>::try_from(a).ok()?)),
        (_, Some((a, _))) if a.len() == 16 => Some(IpAddr::from(<[u8; 16]>::try_from(a).ok()?)),
        _ => None,
    }
}

fn port(l4: &[u8], kind: u16) -> u16 {
    find(l4, kind)
        .and_then(|(p, _)| Some(u16::from_be_bytes(p.get(..2)?.try_into().ok()?)))
        .unwrap_or(0)
}

/// A `CTA_TUPLE_*` payload.
fn tuple(t: &[u8]) -> Option<Tuple> {
    let (ip, _) = find(t, CTA_TUPLE_IP)?;
    let dst = address(ip, CTA_IP_V4_DST, CTA_IP_V6_DST)?;
    let src = address(ip, CTA_IP_V4_SRC, CTA_IP_V6_SRC).unwrap_or(match dst {
        IpAddr::V4(_) => IpAddr::from([0u8; 4]),
        IpAddr::V6(_) => IpAddr::from([0u8; 16]),
    });
    let (l4, _) = find(t, CTA_TUPLE_PROTO)?;
    Some(Tuple {
        src,
        dst,
        sport: port(l4, CTA_PROTO_SRC_PORT),
        dport: port(l4, CTA_PROTO_DST_PORT),
        proto: *find(l4, CTA_PROTO_NUM)?.0.first()?,
    })
}

/// Pure: the entry a ctnetlink message payload (after the `nfgenmsg`) describes, if it has an
/// original tuple with a destination address and (TCP, UDP, SCTP) a port.
pub fn parse_entry(attrs: &[u8]) -> Option<Entry> {
    let (orig, tuple_whole) = find(attrs, CTA_TUPLE_ORIG)?;
    let original = tuple(orig)?;
    let reply = find(attrs, CTA_TUPLE_REPLY).and_then(|(t, _)| tuple(t));
    let status = find(attrs, CTA_STATUS)
        .and_then(|(p, _)| Some(u32::from_be_bytes(p.get(..4)?.try_into().ok()?)))
        .unwrap_or(0);
    let tcp_state = find(attrs, CTA_PROTOINFO)
        .and_then(|(p, _)| find(p, CTA_PROTOINFO_TCP))
        .and_then(|(p, _)| find(p, CTA_PROTOINFO_TCP_STATE))
        .and_then(|(p, _)| p.first().copied());
    let mut identity = tuple_whole.to_vec();
    identity.resize(identity.len().next_multiple_of(4), 0);
    if let Some((_, zone)) = find(attrs, CTA_ZONE) {
        identity.extend_from_slice(zone);
        identity.resize(identity.len().next_multiple_of(4), 0);
    }
    Some(Entry {
        daddr: original.dst,
        dport: original.dport,
        proto: original.proto,
        original,
        reply,
        status,
        tcp_state,
        identity,
    })
}

fn message(kind: u16, flags: u16, seq: u32, family: u8, attrs: &[u8]) -> Vec<u8> {
    let len = NLMSG_HDRLEN + NFGENMSG_LEN + attrs.len();
    let mut m = Vec::with_capacity(len);
    m.extend_from_slice(&(len as u32).to_ne_bytes());
    m.extend_from_slice(&kind.to_ne_bytes());
    m.extend_from_slice(&flags.to_ne_bytes());
    m.extend_from_slice(&seq.to_ne_bytes());
    m.extend_from_slice(&0u32.to_ne_bytes());
    m.extend_from_slice(&[family, 0, 0, 0]);
    m.extend_from_slice(attrs);
    m
}

/// The netlink messages in one datagram: (type, payload after the header).
fn messages(mut buf: &[u8]) -> impl Iterator<Item = (u16, &[u8])> {
    std::iter::from_fn(move || {
        if buf.len() < NLMSG_HDRLEN {
            return None;
        }
        let len = u32::from_ne_bytes(buf[..4].try_into().ok()?) as usize;
        if len < NLMSG_HDRLEN || len > buf.len() {
            return None;
        }
        let kind = u16::from_ne_bytes([buf[4], buf[5]]);
        let payload = &buf[NLMSG_HDRLEN..len];
        buf = &buf[len.next_multiple_of(4).min(buf.len())..];
        Some((kind, payload))
    })
}

/// A ctnetlink socket of this network namespace.
pub struct CtNetlink {
    socket: Socket,
    seq: u32,
    buf: Vec<u8>,
}

impl CtNetlink {
    pub fn open() -> io::Result<Self> {
        let mut socket = Socket::new(NETLINK_NETFILTER)?;
        socket.bind_auto()?;
        // Never wait forever on the kernel (a reply lost to ENOBUFS).
        let timeout = libc::timeval {
            tv_sec: 2,
            tv_usec: 0,
        };
        // SAFETY: a valid socket and a valid, correctly sized option value.
        let rc = unsafe {
            libc::setsockopt(
                socket.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                (&raw const timeout).cast(),
                std::mem::size_of::<libc::timeval>() as libc::socklen_t,
            )
        };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(Self {
            socket,
            seq: 0,
            buf: vec![0; 64 * 1024],
        })
    }

    fn next_seq(&mut self) -> u32 {
        self.seq = self.seq.wrapping_add(1);
        self.seq
    }

    /// Every entry of the `family` (`libc::AF_INET`/`AF_INET6`) table.
    pub fn list(&mut self, family: u8) -> io::Result<Vec<Entry>> {
        let seq = self.next_seq();
        let request = message(CT_GET, NLM_F_REQUEST | NLM_F_DUMP, seq, family, &[]);
        self.socket.send(&request, 0)?;
        let mut entries = Vec::new();
        loop {
            let n = self.socket.recv(&mut &mut self.buf[..], 0)?;
            for (kind, payload) in messages(&self.buf[..n]) {
                match kind {
                    NLMSG_DONE => return Ok(entries),
                    NLMSG_ERROR => {
                        let errno = error_of(payload);
                        if errno != 0 {
                            return Err(io::Error::from_raw_os_error(errno));
                        }
                    }
                    _ => entries.extend(payload.get(NFGENMSG_LEN..).and_then(parse_entry)),
                }
            }
        }
    }

    /// Deletes `entry` (of `family`); `false` if it was gone already.
    pub fn delete(&mut self, family: u8, entry: &Entry) -> io::Result<bool> {
        let seq = self.next_seq();
        let request = message(
            CT_DELETE,
            NLM_F_REQUEST | NLM_F_ACK,
            seq,
            family,
            &entry.identity,
        );
        self.socket.send(&request, 0)?;
        loop {
            let n = self.socket.recv(&mut &mut self.buf[..], 0)?;
            for (kind, payload) in messages(&self.buf[..n]) {
                if kind == NLMSG_ERROR {
                    return match error_of(payload) {
                        0 => Ok(true),
                        libc::ENOENT => Ok(false),
                        errno => Err(io::Error::from_raw_os_error(errno)),
                    };
                }
            }
        }
    }

    /// Deletes the UDP entries whose original destination is one of `destinations` (address,
    /// port) and that were passed there untranslated (see [`Entry::translated`]). Returns how
    /// many went.
    pub fn delete_udp_toward(&mut self, destinations: &[(IpAddr, u16)]) -> io::Result<usize> {
        let wanted: HashSet<(IpAddr, u16)> = destinations.iter().copied().collect();
        let mut deleted = 0;
        for (family, any) in [
            (
                libc::AF_INET as u8,
                destinations.iter().any(|d| d.0.is_ipv4()),
            ),
            (
                libc::AF_INET6 as u8,
                destinations.iter().any(|d| d.0.is_ipv6()),
            ),
        ] {
            if !any {
                continue;
            }
            let doomed: Vec<Entry> = (self.list(family)?.into_iter())
                .filter(|e| {
                    e.proto == proto::UDP && wanted.contains(&(e.daddr, e.dport)) && !e.translated()
                })
                .collect();
            for entry in &doomed {
                deleted += usize::from(self.delete(family, entry)?);
            }
        }
        Ok(deleted)
    }
}

/// The (positive) errno of an `NLMSG_ERROR` payload; 0 for an acknowledgement.
fn error_of(payload: &[u8]) -> i32 {
    payload.get(..4).map_or(libc::EIO, |b| {
        -i32::from_ne_bytes(b.try_into().unwrap_or([0; 4]))
    })
}

/// Deletes the kernel's UDP conntrack entries toward destinations the agent just opened, on a
/// thread of its own (a dump of a large table takes a while; the sync loop does not wait).
/// Requests that arrive while one runs are merged into the next.
pub struct UdpPurge {
    requests: Option<std::sync::mpsc::Sender<Vec<(IpAddr, u16)>>>,
}

impl UdpPurge {
    pub fn start() -> io::Result<Self> {
        let (tx, rx) = std::sync::mpsc::channel::<Vec<(IpAddr, u16)>>();
        std::thread::Builder::new()
            .name("ct-purge".into())
            .spawn(move || {
                let mut ct = None;
                while let Ok(mut destinations) = rx.recv() {
                    while let Ok(more) = rx.try_recv() {
                        destinations.extend(more);
                    }
                    if ct.is_none() {
                        match CtNetlink::open() {
                            Ok(c) => ct = Some(c),
                            Err(e) => {
                                tracing::warn!("ctnetlink: {e}; the kernel's UDP conntrack entries toward new frontends stay");
                                continue;
                            }
                        }
                    }
                    let Some(c) = ct.as_mut() else { continue };
                    match c.delete_udp_toward(&destinations) {
                        Ok(0) => {}
                        Ok(n) => tracing::info!(
                            deleted = n,
                            frontends = destinations.len(),
                            "deleted the kernel's UDP conntrack entries toward frontends that opened"
                        ),
                        Err(e) => {
                            tracing::warn!("deleting the kernel's UDP conntrack entries: {e}");
                            ct = None; // A fresh socket next time (a reply may be pending).
                        }
                    }
                }
            })?;
        Ok(Self { requests: Some(tx) })
    }

    /// Asks for the deletion; returns at once.
    pub fn request(&self, destinations: Vec<(IpAddr, u16)>) {
        if destinations.is_empty() {
            return;
        }
        if let Some(tx) = &self.requests {
            let _ = tx.send(destinations);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::net::Ipv6Addr;

    use super::*;

    fn attr(kind: u16, payload: &[u8]) -> Vec<u8> {
        let mut a = Vec::new();
        a.extend_from_slice(&((4 + payload.len()) as u16).to_ne_bytes());
        a.extend_from_slice(&kind.to_ne_bytes());
        a.extend_from_slice(payload);
        a.resize(a.len().next_multiple_of(4), 0);
        a
    }

    const NESTED: u16 = 0x8000;

    fn tuple(dst: &[u8], proto: u8, dport: u16) -> Vec<u8> {
        let dst_kind = if dst.len() == 4 {
            CTA_IP_V4_DST
        } else {
            CTA_IP_V6_DST
        };
        let ip = attr(CTA_TUPLE_IP | NESTED, &attr(dst_kind, dst));
        let mut l4 = attr(CTA_PROTO_NUM, &[proto]);
        l4.extend(attr(2, &40000u16.to_be_bytes()));
        l4.extend(attr(CTA_PROTO_DST_PORT, &dport.to_be_bytes()));
        let mut t = ip;
        t.extend(attr(CTA_TUPLE_PROTO | NESTED, &l4));
        attr(CTA_TUPLE_ORIG | NESTED, &t)
    }

    #[test]
    fn an_entry_is_read_from_its_original_tuple_and_named_by_it() {
        let orig = tuple(&[192, 168, 50, 2], proto::UDP, 30053);
        let mut attrs = orig.clone();
        // The reply tuple and a status come after it; the zone is part of the identity.
        attrs.extend(attr(2 | NESTED, &tuple(&[10, 0, 0, 1], proto::UDP, 1)[4..]));
        attrs.extend(attr(3, &8u32.to_be_bytes()));
        let zone = attr(CTA_ZONE, &7u16.to_be_bytes());
        attrs.extend(zone.clone());
        let entry = parse_entry(&attrs).expect("entry");
        assert_eq!(entry.daddr, IpAddr::from([192, 168, 50, 2]));
        assert_eq!((entry.dport, entry.proto), (30053, proto::UDP));
        let mut identity = orig;
        identity.extend(zone);
        assert_eq!(entry.identity, identity);
    }

    #[test]
    fn ipv6_entries_and_truncated_messages() {
        let v6: Ipv6Addr = "fd00:10:96::20".parse().unwrap();
        let attrs = tuple(&v6.octets(), proto::UDP, 53);
        let entry = parse_entry(&attrs).expect("entry");
        assert_eq!(entry.daddr, IpAddr::V6(v6));
        assert_eq!(entry.dport, 53);
        assert_eq!(parse_entry(&attrs[..attrs.len() - 6]), None);
        assert_eq!(parse_entry(&[]), None);
    }
}
