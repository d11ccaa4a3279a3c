//! `kube-proxy-ebpf dump`: human tables decoded from the pinned maps, usable while the agent runs.
//! The services, backends, conntrack and affinity tables show both families, one row each with
//! its `FAMILY` (`IPv4`/`IPv6`, upstream's `ip_family` values); IPv6 endpoints print as
//! `[addr]:port`.

use std::{
    collections::BTreeMap,
    fmt::Write as _,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
};

use proxy_common::{
    AffinityKey, AffinityValue, Counter, CtKey, CtValue, FragKey, FragValue, SCOPE_INTERNAL,
    Scheduler, ServiceValue, SnatKey, SnatValue, backend_flags, ct_dir, ct_flags, ct_state,
    frag_action, frag_hook,
    ipv6::{Ct6Key, Ct6Value, MAP_CONNTRACK6},
    service_flags,
};

use crate::{
    cli::DumpWhat,
    dataplane::{
        bpffs::PinLayout,
        clock::monotonic_ns,
        maps::{
            Affinity, Conntrack, Conntrack6, Fragments, Ipv6Tables, LcCounts, ServiceMaps, Snat,
            Stats,
        },
    },
    pipeline::{
        encode,
        model::{Protocol, Scope},
        programmed::Programmed,
    },
};

pub fn dump(pins: &PinLayout, what: DumpWhat) -> anyhow::Result<String> {
    if !pins.has_maps() {
        anyhow::bail!(
            "no pinned maps under {}: is the agent running (or was it started with another --pin-dir)?",
            pins.dir.display()
        );
    }
    Ok(match what {
        DumpWhat::Services => services_table(
            &ServiceMaps::open_pinned(pins)?.read_programmed()?,
            &Ipv6Tables::read_pinned(pins)?,
        ),
        DumpWhat::Backends => {
            let p = ServiceMaps::open_pinned(pins)?.read_programmed()?;
            let v6 = Ipv6Tables::read_pinned(pins)?;
            // Maps pinned by an agent without least connection: no counts to show.
            let flows = match LcCounts::open_pinned(pins) {
                Ok(lc) => (p.backends.ids().chain(v6.backends.keys().copied()))
                    .map(|id| (id, lc.effective(id)))
                    .collect(),
                Err(_) => BTreeMap::new(),
            };
            backends_table(&p, &v6, &flows)
        }
        DumpWhat::Conntrack => {
            // Maps pinned by an agent without IPv6: no IPv6 flows.
            let flows6 = if pins.map(MAP_CONNTRACK6).exists() {
                Conntrack6::open_pinned(pins)?.entries()
            } else {
                Vec::new()
            };
            conntrack_table(
                &Conntrack::open_pinned(pins)?.entries(),
                &flows6,
                monotonic_ns(),
            )
        }
        DumpWhat::Stats => stats_table(&Stats::open_pinned(pins)?.read()?),
        DumpWhat::Snat => snat_table(&Snat::open_pinned(pins)?.entries(), monotonic_ns()),
        DumpWhat::Fragments => {
            fragments_table(&Fragments::open_pinned(pins)?.entries(), monotonic_ns())
        }
        DumpWhat::Affinity => affinity_table(
            &Affinity::open_pinned(pins)?.entries(),
            &ServiceMaps::open_pinned(pins)?.read_programmed()?,
            &Ipv6Tables::read_pinned(pins)?,
            monotonic_ns(),
        ),
        DumpWhat::Maglev => {
            let maps = ServiceMaps::open_pinned(pins)?;
            let p = maps.read_programmed()?;
            let entries = p
                .maglev
                .iter()
                .map(|(id, t)| {
                    let chunks = (0..t.chunks())
                        .filter_map(|chunk| {
                            maps.maglev_chunk(&proxy_common::maglev::MaglevKey {
                                table: *id,
                                chunk,
                            })
                        })
                        .collect::<Vec<_>>();
                    // The table ends where its entries do (the last chunk is padded with 0).
                    let mut table = chunks.concat();
                    table.truncate(table.iter().position(|s| *s == 0).unwrap_or(table.len()));
                    (*id, table)
                })
                .collect();
            maglev_table(&p, &entries)
        }
    })
}

fn proto_name(n: u8) -> String {
    Protocol::from_number(n).map_or_else(|| n.to_string(), |p| p.to_string())
}

fn flags_text(flags: u8) -> String {
    let mut parts = Vec::new();
    if flags & backend_flags::TERMINATING != 0 {
        parts.push("terminating");
    }
    if flags & backend_flags::LOCAL != 0 {
        parts.push("local");
    }
    if flags & backend_flags::NOT_SERVING != 0 {
        parts.push("not-serving");
    }
    if parts.is_empty() {
        "-".into()
    } else {
        parts.join(",")
    }
}

/// A frontend entry's scheduler name (`?<code>` for a code this build does not know).
fn scheduler_text(code: u8) -> String {
    Scheduler::from_code(code).map_or_else(|| format!("?{code}"), |s| s.name().to_owned())
}

/// A frontend entry's session affinity timeout (`-` without affinity).
fn affinity_text(v: &ServiceValue) -> String {
    if v.flags & service_flags::AFFINITY != 0 {
        format!("{}s", v.affinity_timeout_s)
    } else {
        "-".into()
    }
}

/// One block per Maglev table: the frontends naming it, its entries, and how many of them each
/// slot's backend holds (each within ±1 of M/N when the table is whole).
pub fn maglev_table(p: &Programmed, entries: &BTreeMap<u32, Vec<u16>>) -> String {
    let mut out = String::new();
    for (id, table) in entries {
        let mut frontends: Vec<(String, u16, Vec<String>)> = p
            .services
            .iter()
            .filter(|(k, v)| k.slot == 0 && v.maglev_table == *id)
            .filter_map(|(k, v)| {
                let (fe, _) = encode::decode_service_key(k)?;
                let names = (1..=v.count)
                    .map(|slot| {
                        p.services
                            .get(&k.with_slot(slot))
                            .and_then(|s| p.backends.get(&s.backend_id))
                            .and_then(encode::decode_endpoint)
                            .map_or_else(|| "?".to_owned(), |e| e.to_string())
                    })
                    .collect();
                Some((fe.to_string(), v.count, names))
            })
            .collect();
        frontends.sort();
        let mut per_slot: BTreeMap<u16, usize> = BTreeMap::new();
        for slot in table {
            *per_slot.entry(*slot).or_default() += 1;
        }
        let named: Vec<&str> = frontends.iter().map(|(f, ..)| f.as_str()).collect();
        let _ = writeln!(
            out,
            "table {id}: {} entries (chunks of {}), frontends: {}",
            table.len(),
            proxy_common::maglev::CHUNK_ENTRIES,
            if named.is_empty() {
                "-".to_owned()
            } else {
                named.join(", ")
            }
        );
        let backends = frontends
            .first()
            .map(|(_, _, b)| b.as_slice())
            .unwrap_or(&[]);
        for (slot, n) in per_slot {
            let who = match slot {
                0 => "(empty)".to_owned(),
                s => backends
                    .get(usize::from(s) - 1)
                    .cloned()
                    .unwrap_or_else(|| format!("slot {s}")),
            };
            let _ = writeln!(out, "  slot {slot:>5}  {n:>7} entries  {who}");
        }
    }
    if out.is_empty() {
        out.push_str("no Maglev tables\n");
    }
    out
}

/// `IPv4`/`IPv6`: upstream's `ip_family` label values.
const IPV4: &str = "IPv4";
const IPV6: &str = "IPv6";

/// An IPv6 endpoint as URLs write it.
fn endpoint6(addr: [u8; 16], port: [u8; 2]) -> String {
    format!("[{}]:{}", Ipv6Addr::from(addr), u16::from_be_bytes(port))
}

/// One row per frontend, IPv4 then IPv6: its scheduler, session affinity timeout and backends
/// in slot order.
pub fn services_table(p: &Programmed, v6: &Ipv6Tables) -> String {
    // (family, frontend, protocol, entry, targets)
    let mut rows: Vec<(&str, String, String, ServiceValue, Vec<String>)> = Vec::new();
    let mut frontends: BTreeMap<_, (ServiceValue, Vec<String>)> = BTreeMap::new();
    for (key, value) in &p.services {
        if key.slot != 0 {
            continue;
        }
        let Some((fe, _)) = encode::decode_service_key(key) else {
            continue;
        };
        let backends = (1..=value.count)
            .map(|slot| match p.services.get(&key.with_slot(slot)) {
                Some(s) => match p
                    .backends
                    .get(&s.backend_id)
                    .and_then(encode::decode_backend)
                {
                    Some(b) => format!(
                        "{}:{} (#{})",
                        b.endpoint.addr, b.endpoint.port, s.backend_id
                    ),
                    None => format!("#{} (missing)", s.backend_id),
                },
                None => format!("slot {slot} (missing)"),
            })
            .collect();
        frontends.insert(fe, (value, backends));
    }
    for (fe, (value, backends)) in frontends {
        let name = match fe.scope {
            Scope::AllClients => format!("{}:{}", fe.addr, fe.port),
            Scope::InCluster => format!("{}:{} (in-cluster)", fe.addr, fe.port),
        };
        rows.push((IPV4, name, fe.protocol.to_string(), value, backends));
    }
    for (key, value) in v6.services.iter().filter(|(k, _)| k.slot == 0) {
        let backends = (1..=value.count)
            .map(
                |slot| match v6.services.get(&key.with_slot(slot)).map(|s| s.backend_id) {
                    Some(id) => match v6.backends.get(&id) {
                        Some(b) => format!("{} (#{id})", endpoint6(b.addr, b.port)),
                        None => format!("#{id} (missing)"),
                    },
                    None => format!("slot {slot} (missing)"),
                },
            )
            .collect();
        let mut name = endpoint6(key.addr, key.port);
        if key.scope == SCOPE_INTERNAL {
            name.push_str(" (in-cluster)");
        }
        rows.push((IPV6, name, proto_name(key.proto), *value, backends));
    }
    let mut out = format!(
        "{:<6} {:<34} {:<6} {:>6} {:<6} {:>8} {:>8}  {}\n",
        "FAMILY", "FRONTEND", "PROTO", "REVNAT", "SCHED", "AFFINITY", "BACKENDS", "TARGETS"
    );
    for (family, fe, protocol, value, backends) in &rows {
        let targets = if backends.is_empty() {
            "(none: rejected)".to_string()
        } else {
            backends.join(", ")
        };
        let _ = writeln!(
            out,
            "{:<6} {:<34} {:<6} {:>6} {:<6} {:>8} {:>8}  {}",
            family,
            fe,
            protocol,
            value.rev_nat_id,
            scheduler_text(value.scheduler),
            affinity_text(value),
            value.count,
            targets
        );
    }
    out
}

/// The backends of both families, with their active-flow counts (`flows`, by id: what least
/// connection compares; `-` when unknown).
pub fn backends_table(p: &Programmed, v6: &Ipv6Tables, flows: &BTreeMap<u32, u64>) -> String {
    let mut out = format!(
        "{:<6} {:>6}  {:<22} {:<6} {:>6}  {}\n",
        "FAMILY", "ID", "ADDRESS", "PROTO", "FLOWS", "FLAGS"
    );
    let mut ids: Vec<_> = p.backends.ids().collect();
    ids.sort_unstable();
    let v4 = ids.into_iter().map(|id| {
        let b = p.backends[&id];
        (IPV4, id, endpoint(b.addr, b.port), b.proto, b.flags)
    });
    let v6 = (v6.backends.iter())
        .map(|(&id, b)| (IPV6, id, endpoint6(b.addr, b.port), b.proto, b.flags));
    for (family, id, addr, proto, flags) in v4.chain(v6) {
        let _ = writeln!(
            out,
            "{:<6} {:>6}  {:<22} {:<6} {:>6}  {}",
            family,
            id,
            addr,
            proto_name(proto),
            flows
                .get(&id)
                .map_or_else(|| "-".to_string(), u64::to_string),
            flags_text(flags)
        );
    }
    out
}

/// A flow's state as netfilter names it for its protocol (SCTP flows use the TCP states: see
/// `proxy_common::flow_state`).
fn state_name(proto: u8, state: u8) -> &'static str {
    use proxy_common::proto::{SCTP, UDP};
    match (proto, state) {
        (UDP, _) => "udp",
        (SCTP, ct_state::SYN_SENT) => "cookie_wait",
        (SCTP, ct_state::SYN_RECV) => "init_acked",
        (SCTP, ct_state::FIN_ORIGINAL) => "shutdown_client",
        (SCTP, ct_state::FIN_REPLY) => "shutdown_backend",
        (SCTP, ct_state::CLOSING) => "closed",
        (_, ct_state::SYN_SENT) => "syn_sent",
        (_, ct_state::SYN_RECV) => "syn_recv",
        (_, ct_state::ESTABLISHED) => "established",
        (_, ct_state::CLOSING) => "closing",
        (_, ct_state::FIN_ORIGINAL) => "fin_client",
        (_, ct_state::FIN_REPLY) => "fin_backend",
        _ => "?",
    }
}

fn endpoint(addr: [u8; 4], port: [u8; 2]) -> String {
    format!("{}:{}", Ipv4Addr::from(addr), u16::from_be_bytes(port))
}

/// One translated flow entry, as both flow tables print it.
struct FlowRow {
    family: &'static str,
    dir: &'static str,
    proto: u8,
    src: String,
    dst: String,
    nat: String,
    state: u8,
    idle_s: u64,
}

impl FlowRow {
    /// The row of one entry keyed by a flow tuple (conntrack and SNAT keys share the shape).
    fn new(
        k: &CtKey,
        dir: &'static str,
        nat: String,
        state: u8,
        last_seen_ns: u64,
        now: u64,
    ) -> Self {
        Self {
            family: IPV4,
            dir,
            proto: k.proto,
            src: endpoint(k.saddr, k.sport),
            dst: endpoint(k.daddr, k.dport),
            nat,
            state,
            idle_s: idle_s(now, last_seen_ns),
        }
    }
}

/// A table of flow rows (conntrack, SNAT), in the given order, with one header line.
fn flow_table(rows: Vec<FlowRow>) -> String {
    let mut out = format!(
        "{:<6} {:<6} {:<5} {:<22} {:<22} {:<24} {:<12} {:>8}\n",
        "FAMILY", "DIR", "PROTO", "SOURCE", "DESTINATION", "NAT", "STATE", "IDLE_S"
    );
    for r in rows {
        let _ = writeln!(
            out,
            "{:<6} {:<6} {:<5} {:<22} {:<22} {:<24} {:<12} {:>8}",
            r.family,
            r.dir,
            proto_name(r.proto),
            r.src,
            r.dst,
            r.nat,
            state_name(r.proto, r.state),
            r.idle_s
        );
    }
    out
}

fn idle_s(now_ns: u64, last_seen_ns: u64) -> u64 {
    now_ns.saturating_sub(last_seen_ns) / 1_000_000_000
}

/// Both conntrack maps: the IPv4 flows, then the IPv6 ones, each ORIGINAL then REPLY.
pub fn conntrack_table(
    entries: &[(CtKey, CtValue)],
    entries6: &[(Ct6Key, Ct6Value)],
    now_ns: u64,
) -> String {
    let dir_name = |dir| {
        if dir == ct_dir::ORIGINAL {
            "orig"
        } else {
            "reply"
        }
    };
    let mut entries: Vec<_> = entries.iter().collect();
    entries.sort_by_key(|(k, _)| (k.dir, k.saddr, k.sport, k.daddr, k.dport));
    let mut entries6: Vec<_> = entries6.iter().collect();
    entries6.sort_by_key(|(k, _)| (k.dir, k.saddr, k.sport, k.daddr, k.dport));
    let v4 = entries.into_iter().map(|(k, v)| {
        let nat = ct_translation(
            (v.flags, v.nat_sport),
            endpoint(v.backend_addr, v.backend_port),
            endpoint(v.frontend_addr, v.frontend_port),
            k.dir,
        );
        FlowRow::new(k, dir_name(k.dir), nat, v.state, v.last_seen_ns, now_ns)
    });
    let v6 = entries6.into_iter().map(|(k, v)| {
        let nat = ct_translation(
            (v.flags, v.nat_sport),
            endpoint6(v.backend_addr, v.backend_port),
            endpoint6(v.frontend_addr, v.frontend_port),
            k.dir,
        );
        FlowRow {
            family: IPV6,
            dir: dir_name(k.dir),
            proto: k.proto,
            src: endpoint6(k.saddr, k.sport),
            dst: endpoint6(k.daddr, k.dport),
            nat,
            state: v.state,
            idle_s: idle_s(now_ns, v.last_seen_ns),
        }
    });
    flow_table(v4.chain(v6).collect())
}

/// What a conntrack entry does to its direction's packets: the address it rewrites (none for a
/// flow straight to a pod, `direct`), and the client port a reply-tuple clash moved it to.
fn ct_translation(
    (flags, nat_sport): (u8, [u8; 2]),
    backend: String,
    frontend: String,
    dir: u8,
) -> String {
    let moved = flags & ct_flags::SPORT_NAT != 0;
    let port = u16::from_be_bytes(nat_sport);
    let mut out = if flags & ct_flags::RETIRED != 0 {
        // A closed flow's reply tuple, held while the backend may be in TIME_WAIT.
        "retired (tuple held)".to_owned()
    } else if flags & ct_flags::DIRECT != 0 {
        "direct".to_owned()
    } else if dir == ct_dir::ORIGINAL {
        format!("→ {backend}")
    } else {
        format!("← {frontend}")
    };
    if moved {
        out.push_str(&if dir == ct_dir::ORIGINAL {
            format!(", sport → {port}")
        } else {
            format!(", dport → {port}")
        });
    }
    out
}

/// SNAT entries: `out` (client → backend leaves as node:port) and `in` (backend → node:port goes
/// back to the client).
pub fn snat_table(entries: &[(SnatKey, SnatValue)], now_ns: u64) -> String {
    let mut entries: Vec<_> = entries.iter().collect();
    entries.sort_by_key(|(k, _)| (k.dir, k.saddr, k.sport, k.daddr, k.dport));
    flow_table(
        entries
            .into_iter()
            .map(|(k, v)| {
                let (dir, nat) = if k.dir == ct_dir::ORIGINAL {
                    ("out", format!("src → {}", endpoint(v.addr, v.port)))
                } else {
                    ("in", format!("dst → {}", endpoint(v.addr, v.port)))
                };
                FlowRow::new(k, dir, nat, v.state, v.last_seen_ns, now_ns)
            })
            .collect(),
    )
}

/// Fragment records: a datagram as its fragments arrive at a hook, and what its later fragments
/// get (the addresses they leave with, passed, or dropped).
pub fn fragments_table(entries: &[(FragKey, FragValue)], now_ns: u64) -> String {
    let mut entries: Vec<_> = entries.iter().collect();
    entries.sort_by_key(|(k, _)| (k.hook, k.saddr, k.daddr, k.id));
    let mut out = format!(
        "{:<7} {:<5} {:<15} {:<15} {:>6} {:<36} {:>6}\n",
        "HOOK", "PROTO", "SOURCE", "DESTINATION", "IP_ID", "LATER FRAGMENTS", "AGE_S"
    );
    for (k, v) in entries {
        let hook = if k.hook == frag_hook::INGRESS {
            "ingress"
        } else {
            "egress"
        };
        let action = match v.action {
            frag_action::TRANSLATE => format!(
                "as {} → {}",
                Ipv4Addr::from(v.saddr),
                Ipv4Addr::from(v.daddr)
            ),
            frag_action::DROP => "dropped".to_owned(),
            _ => "passed".to_owned(),
        };
        let _ = writeln!(
            out,
            "{:<7} {:<5} {:<15} {:<15} {:>6} {:<36} {:>6}",
            hook,
            proto_name(k.proto),
            Ipv4Addr::from(k.saddr).to_string(),
            Ipv4Addr::from(k.daddr).to_string(),
            u16::from_be_bytes(k.id),
            action,
            idle_s(now_ns, v.created_ns)
        );
    }
    out
}

/// Session affinity records: per Service port (named by the frontends that share its affinity
/// id), client → endpoint, idle time since the client's last new flow, and whether a new flow
/// would still use it (`live`), or not (`expired`; `stale`: no frontend has that scope any more,
/// the record ages out of the LRU).
pub fn affinity_table(
    records: &[(AffinityKey, AffinityValue)],
    p: &Programmed,
    v6: &Ipv6Tables,
    now_ns: u64,
) -> String {
    // Affinity id → (its frontends, their timeout); an id names a Service port, whose frontends
    // of both families share it.
    let mut scopes: BTreeMap<u32, (Vec<String>, u32)> = BTreeMap::new();
    let mut frontends: Vec<_> = p
        .services
        .iter()
        .filter(|(k, v)| k.slot == 0 && v.flags & proxy_common::service_flags::AFFINITY != 0)
        .filter_map(|(k, v)| Some((encode::decode_service_key(k)?.0, v)))
        .collect();
    frontends.sort_by_key(|(fe, _)| *fe);
    let named4 = frontends.into_iter().map(|(fe, v)| {
        let name = match fe.scope {
            Scope::AllClients => format!("{}:{}/{}", fe.addr, fe.port, fe.protocol),
            Scope::InCluster => format!("{}:{}/{} (in-cluster)", fe.addr, fe.port, fe.protocol),
        };
        (name, v)
    });
    let named6 = (v6.services.iter())
        .filter(|(k, v)| k.slot == 0 && v.flags & proxy_common::service_flags::AFFINITY != 0)
        .map(|(k, v)| {
            let mut name = format!("{}/{}", endpoint6(k.addr, k.port), proto_name(k.proto));
            if k.scope == SCOPE_INTERNAL {
                name.push_str(" (in-cluster)");
            }
            (name, *v)
        });
    for (name, v) in named4.chain(named6) {
        let scope = scopes.entry(v.affinity_id).or_default();
        if !scope.0.contains(&name) {
            scope.0.push(name);
        }
        scope.1 = scope.1.max(v.affinity_timeout_s);
    }
    let v4 = affinity_rows(
        IPV4,
        records,
        |k| (k.affinity_id, Ipv4Addr::from(k.client)),
        |id| p.backends.get(&id).map(|b| endpoint(b.addr, b.port)),
    );
    let v6_rows = affinity_rows(
        IPV6,
        &v6.affinity,
        |k| (k.affinity_id, Ipv6Addr::from(k.client)),
        |id| v6.backends.get(&id).map(|b| endpoint6(b.addr, b.port)),
    );
    let mut out = format!(
        "{:<6} {:<10} {:<15} {:<28} {:>8} {:>9} {:<8} {}\n",
        "FAMILY",
        "SCOPE",
        "CLIENT",
        "ENDPOINT",
        "IDLE_S",
        "TIMEOUT_S",
        "STATE",
        "SERVICE PORT FRONTENDS"
    );
    for (family, affinity_id, client, v, endpoint) in v4.into_iter().chain(v6_rows) {
        let endpoint = match endpoint {
            Some(e) => format!("{e} (#{})", v.backend_id),
            None => format!("#{} (gone)", v.backend_id),
        };
        let (frontends, timeout, state) = match scopes.get(&affinity_id) {
            Some((names, timeout)) => {
                let live = proxy_common::affinity_live(v.last_used_ns, now_ns, *timeout);
                (
                    names.join(", "),
                    timeout.to_string(),
                    if live { "live" } else { "expired" },
                )
            }
            None => ("(none)".to_owned(), "-".to_owned(), "stale"),
        };
        let _ = writeln!(
            out,
            "{:<6} {:<10} {:<15} {:<28} {:>8} {:>9} {:<8} {}",
            family,
            affinity_id,
            client,
            endpoint,
            idle_s(now_ns, v.last_used_ns),
            timeout,
            state,
            frontends
        );
    }
    out
}

/// One family's affinity records as `affinity_table` rows, sorted by (affinity id, client):
/// (family, affinity id, client, record, the endpoint its backend id names, if any).
fn affinity_rows<'a, K: 'a, C: Ord + Into<IpAddr>>(
    family: &'static str,
    records: impl IntoIterator<Item = &'a (K, AffinityValue)>,
    id_and_client: impl Fn(&K) -> (u32, C),
    endpoint: impl Fn(u32) -> Option<String>,
) -> Vec<(&'static str, u32, String, &'a AffinityValue, Option<String>)> {
    let mut rows: Vec<_> = (records.into_iter())
        .map(|(k, v)| (id_and_client(k), v))
        .collect();
    rows.sort_by(|(a, _), (b, _)| a.cmp(b));
    (rows.into_iter())
        .map(|((id, client), v)| {
            (
                family,
                id,
                client.into().to_string(),
                v,
                endpoint(v.backend_id),
            )
        })
        .collect()
}

pub fn stats_table(values: &[u64]) -> String {
    let mut out = format!("{:<28} {:>14}\n", "COUNTER", "PACKETS");
    for (c, v) in Counter::ALL.iter().zip(values) {
        let _ = writeln!(out, "{:<28} {:>14}", c.name(), v);
    }
    out
}

#[cfg(test)]
mod tests {
    use proxy_common::{Backend, RevNat, ServiceKey, ipv6::Affinity6Key, proto, sched};

    use super::*;

    /// A TCP backend at 10.244.1.`last`:8080.
    fn web_backend(last: u8) -> Backend {
        Backend {
            addr: [10, 244, 1, last],
            port: 8080u16.to_be_bytes(),
            proto: proto::TCP,
            flags: 0,
        }
    }

    #[test]
    fn flow_states_are_named_per_protocol() {
        let names = |p| {
            [
                ct_state::SYN_SENT,
                ct_state::SYN_RECV,
                ct_state::ESTABLISHED,
                ct_state::FIN_ORIGINAL,
                ct_state::FIN_REPLY,
                ct_state::CLOSING,
            ]
            .map(|s| state_name(p, s))
        };
        assert_eq!(
            names(proto::TCP),
            [
                "syn_sent",
                "syn_recv",
                "established",
                "fin_client",
                "fin_backend",
                "closing"
            ]
        );
        assert_eq!(
            names(proto::SCTP),
            [
                "cookie_wait",
                "init_acked",
                "established",
                "shutdown_client",
                "shutdown_backend",
                "closed"
            ]
        );
        assert_eq!(names(proto::UDP), ["udp"; 6]);
        assert_eq!(proto_name(proto::SCTP), "SCTP");
    }

    #[test]
    fn backend_flags_are_named() {
        assert_eq!(flags_text(0), "-");
        assert_eq!(
            flags_text(backend_flags::TERMINATING | backend_flags::NOT_SERVING),
            "terminating,not-serving"
        );
        assert_eq!(flags_text(backend_flags::NOT_SERVING), "not-serving");
    }

    #[test]
    fn backends_table_shows_active_flows_per_backend() {
        let mut p = Programmed::default();
        for (id, last, flags) in [(1u32, 11u8, 0u8), (2, 12, backend_flags::LOCAL)] {
            let b = Backend {
                addr: [10, 244, 1, last],
                port: 8080u16.to_be_bytes(),
                proto: proto::TCP,
                flags,
            };
            p.backends.insert(id, b);
        }
        let out = backends_table(&p, &Ipv6Tables::default(), &BTreeMap::from([(1, 3)]));
        let want = "FAMILY     ID  ADDRESS                PROTO   FLOWS  FLAGS\nIPv4        1  10.244.1.11:8080       TCP         3  -\nIPv4        2  10.244.1.12:8080       TCP         -  local\n";
        assert_eq!(out, want);
    }

    #[test]
    fn maglev_table_shows_its_frontends_and_each_backend_s_share() {
        let mut p = Programmed::default();
        let fe = ServiceKey::new([10, 96, 0, 10], 53u16.to_be_bytes(), proto::UDP, 0);
        let mut v = ServiceValue::frontend(2, 1);
        v.maglev_table = 4;
        v.scheduler = proxy_common::sched::code::MAGLEV;
        p.services.insert(fe, v);
        for (slot, id, last) in [(1, 7, 11), (2, 8, 12)] {
            p.services
                .insert(fe.with_slot(slot), ServiceValue::slot(id));
            let b = Backend {
                addr: [10, 244, 1, last],
                port: 5353u16.to_be_bytes(),
                proto: proto::UDP,
                flags: 0,
            };
            p.backends.insert(id, b);
        }
        let endpoints = [11, 12]
            .map(|last| {
                encode::decode_endpoint(&Backend {
                    addr: [10, 244, 1, last],
                    port: 5353u16.to_be_bytes(),
                    proto: proto::UDP,
                    flags: 0,
                })
                .unwrap()
            })
            .to_vec();
        let table = crate::pipeline::maglev::MaglevTable::new(251, endpoints).entries();
        let out = maglev_table(&p, &BTreeMap::from([(4, table)]));
        assert!(
            out.starts_with("table 4: 251 entries (chunks of 960), frontends: 10.96.0.10:53/UDP\n"),
            "{out}"
        );
        assert!(
            out.contains("  slot     1      126 entries  10.244.1.11:5353/UDP\n"),
            "{out}"
        );
        assert!(
            out.contains("  slot     2      125 entries  10.244.1.12:5353/UDP\n"),
            "{out}"
        );
        assert_eq!(maglev_table(&p, &BTreeMap::new()), "no Maglev tables\n");
    }

    #[test]
    fn services_table_lists_backends_in_slot_order_and_marks_rejecting_frontends() {
        let mut p = Programmed::default();
        let fe = ServiceKey::new([10, 96, 0, 10], 80u16.to_be_bytes(), proto::TCP, 0);
        p.services.insert(
            fe,
            ServiceValue {
                scheduler: sched::code::ROUND_ROBIN,
                affinity_timeout_s: 10_800,
                affinity_id: 1,
                ..ServiceValue::frontend_with_flags(2, 1, service_flags::AFFINITY)
            },
        );
        p.services.insert(fe.with_slot(1), ServiceValue::slot(7));
        p.services.insert(fe.with_slot(2), ServiceValue::slot(8));
        p.backends.insert(7, web_backend(11));
        p.backends.insert(8, web_backend(12));
        p.rev_nats.insert(
            1,
            RevNat {
                addr: [10, 96, 0, 10],
                port: 80u16.to_be_bytes(),
                _pad: [0; 2],
            },
        );
        let empty = ServiceKey::new([10, 96, 0, 30], 80u16.to_be_bytes(), proto::TCP, 0);
        p.services.insert(empty, ServiceValue::frontend(0, 2));
        // The in-cluster entry of an eTP=Local frontend: same address, own row.
        let inner = ServiceKey {
            scope: proxy_common::SCOPE_INTERNAL,
            ..fe
        };
        p.services.insert(
            inner,
            ServiceValue {
                scheduler: sched::code::MAGLEV,
                // A timeout without the flag is not affinity.
                affinity_timeout_s: 60,
                ..ServiceValue::frontend(1, 3)
            },
        );
        p.services.insert(inner.with_slot(1), ServiceValue::slot(8));
        let t = services_table(&p, &Ipv6Tables::default());
        assert!(
            t.lines()
                .next()
                .is_some_and(|h| h.contains(" SCHED ") && h.contains(" AFFINITY ")),
            "{t}"
        );
        let row = |start: &str| {
            t.lines()
                .find(|l| {
                    l.strip_prefix("IPv4   ")
                        .is_some_and(|r| r.starts_with(start))
                })
                .unwrap_or_else(|| panic!("no row {start} in\n{t}"))
                .split_whitespace()
                .skip(1)
                .collect::<Vec<_>>()
        };
        assert_eq!(
            row("10.96.0.10:80 ")[..6],
            ["10.96.0.10:80", "TCP", "1", "rr", "10800s", "2"]
        );
        assert_eq!(
            row("10.96.0.10:80 (in-cluster)")[2..6],
            ["TCP", "3", "mh", "-"]
        );
        assert_eq!(
            row("10.96.0.30:80")[..6],
            ["10.96.0.30:80", "TCP", "2", "random", "-", "0"]
        );
        let mut unknown = Programmed::default();
        unknown.services.insert(
            empty,
            ServiceValue {
                scheduler: 9,
                ..ServiceValue::frontend(0, 2)
            },
        );
        assert!(
            services_table(&unknown, &Ipv6Tables::default()).contains(" ?9 "),
            "an unknown code is shown as such"
        );
        let row = t
            .lines()
            .find(|l| l.starts_with("IPv4   10.96.0.10:80 (in-cluster)"))
            .unwrap_or_else(|| panic!("no in-cluster row in\n{t}"));
        assert!(row.ends_with("  10.244.1.12:8080 (#8)"), "{row}");
        assert!(
            t.contains("10.244.1.11:8080 (#7), 10.244.1.12:8080 (#8)"),
            "{t}"
        );
        assert!(
            t.contains("10.96.0.30:80") && t.contains("(none: rejected)"),
            "{t}"
        );
    }

    #[test]
    fn conntrack_table_shows_original_then_reply_with_their_translation() {
        let key = |saddr, sport: u16, daddr, dport: u16, dir| CtKey {
            saddr,
            daddr,
            sport: sport.to_be_bytes(),
            dport: dport.to_be_bytes(),
            proto: proto::TCP,
            dir,
            _pad: [0; 2],
        };
        let value = CtValue {
            last_seen_ns: 1_000_000_000,
            frontend_addr: [10, 96, 0, 10],
            frontend_port: 80u16.to_be_bytes(),
            backend_addr: [10, 244, 1, 11],
            backend_port: 8080u16.to_be_bytes(),
            state: ct_state::ESTABLISHED,
            ..Default::default()
        };
        let table = conntrack_table(
            &[
                (
                    key(
                        [10, 244, 1, 11],
                        8080,
                        [10, 244, 1, 2],
                        40000,
                        ct_dir::REPLY,
                    ),
                    value,
                ),
                (
                    key(
                        [10, 244, 1, 2],
                        40000,
                        [10, 96, 0, 10],
                        80,
                        ct_dir::ORIGINAL,
                    ),
                    value,
                ),
            ],
            &[],
            4_000_000_000,
        );
        let lines: Vec<&str> = table.lines().collect();
        assert_eq!(lines.len(), 3, "{table}");
        assert!(
            lines[1].starts_with("IPv4   orig") && lines[1].contains("→ 10.244.1.11:8080"),
            "{table}"
        );
        assert!(
            lines[2].starts_with("IPv4   reply") && lines[2].contains("← 10.96.0.10:80"),
            "{table}"
        );
        assert!(
            lines[1].contains("established") && lines[1].trim_end().ends_with('3'),
            "{table}"
        );
    }

    #[test]
    fn conntrack_table_shows_direct_flows_and_moved_client_ports() {
        let key = |sport: u16, daddr, dport: u16, dir| CtKey {
            saddr: [10, 244, 1, 2],
            daddr,
            sport: sport.to_be_bytes(),
            dport: dport.to_be_bytes(),
            proto: proto::TCP,
            dir,
            _pad: [0; 2],
        };
        let direct = CtValue {
            frontend_addr: [10, 244, 1, 11],
            frontend_port: 8080u16.to_be_bytes(),
            backend_addr: [10, 244, 1, 11],
            backend_port: 8080u16.to_be_bytes(),
            flags: ct_flags::DIRECT,
            ..Default::default()
        };
        let moved = CtValue {
            frontend_addr: [10, 96, 0, 11],
            frontend_port: 80u16.to_be_bytes(),
            backend_addr: [10, 244, 1, 11],
            backend_port: 8080u16.to_be_bytes(),
            flags: ct_flags::SPORT_NAT,
            nat_sport: 5000u16.to_be_bytes(),
            ..Default::default()
        };
        let table = conntrack_table(
            &[
                (key(40000, [10, 244, 1, 11], 8080, ct_dir::ORIGINAL), direct),
                (key(40000, [10, 96, 0, 11], 80, ct_dir::ORIGINAL), moved),
            ],
            &[],
            1,
        );
        assert!(table.contains("direct"), "{table}");
        assert!(
            table.contains("→ 10.244.1.11:8080, sport → 5000"),
            "{table}"
        );
    }

    #[test]
    fn affinity_table_names_the_scope_endpoint_idle_time_and_state() {
        let mut p = Programmed::default();
        let s = 1_000_000_000u64;
        let affinity = |count, rev, timeout, id| ServiceValue {
            affinity_timeout_s: timeout,
            affinity_id: id,
            ..ServiceValue::frontend_with_flags(count, rev, proxy_common::service_flags::AFFINITY)
        };
        let cluster_ip = ServiceKey::new([10, 96, 0, 10], 80u16.to_be_bytes(), proto::TCP, 0);
        let node_port = ServiceKey::new([192, 168, 50, 10], 30080u16.to_be_bytes(), proto::TCP, 0);
        p.services.insert(cluster_ip, affinity(1, 1, 60, 77));
        p.services.insert(node_port, affinity(1, 2, 60, 77));
        p.services.insert(
            ServiceKey::new([10, 96, 0, 11], 53u16.to_be_bytes(), proto::UDP, 0),
            ServiceValue::frontend(0, 3),
        );
        p.backends.insert(7, web_backend(11));
        let record = |id, client, backend_id, last_used_s: u64| {
            (
                AffinityKey {
                    affinity_id: id,
                    client,
                },
                AffinityValue {
                    backend_id,
                    _pad: 0,
                    last_used_ns: last_used_s * s,
                },
            )
        };
        let now = 1_000 * s;
        let table = affinity_table(
            &[
                record(77, [10, 244, 2, 5], 7, 990),
                record(77, [10, 244, 2, 4], 7, 900),
                record(5, [10, 244, 2, 4], 9, 999),
            ],
            &p,
            &Ipv6Tables::default(),
            now,
        );
        let lines: Vec<&str> = table.lines().collect();
        assert_eq!(lines.len(), 4, "{table}");
        assert!(
            lines[1].starts_with("IPv4   5 ")
                && lines[1].contains("#9 (gone)")
                && lines[1].contains("stale")
                && lines[1].contains("(none)"),
            "{table}"
        );
        let frontends = "10.96.0.10:80/TCP, 192.168.50.10:30080/TCP";
        assert!(
            lines[2].contains("10.244.2.4")
                && lines[2].contains("10.244.1.11:8080 (#7)")
                && lines[2].contains("     100        60 expired")
                && lines[2].ends_with(frontends),
            "{table}"
        );
        assert!(
            lines[3].contains("10.244.2.5")
                && lines[3].contains("      10        60 live")
                && lines[3].ends_with(frontends),
            "{table}"
        );
    }

    #[test]
    fn stats_table_names_every_counter() {
        let values: Vec<u64> = (0..Counter::ALL.len() as u64).collect();
        let t = stats_table(&values);
        for c in Counter::ALL {
            assert!(t.contains(c.name()), "{t}");
        }
    }

    #[test]
    fn fragments_table_shows_what_later_fragments_get() {
        let key = |hook, id: u16| FragKey {
            saddr: [10, 244, 1, 2],
            daddr: [10, 96, 0, 10],
            id: id.to_be_bytes(),
            proto: 17,
            hook,
        };
        let v = |action, daddr| FragValue {
            created_ns: 1_000_000_000,
            saddr: [10, 244, 1, 2],
            daddr,
            action,
            _pad: [0; 7],
        };
        let table = fragments_table(
            &[
                (
                    key(frag_hook::EGRESS, 7),
                    v(frag_action::PASS, [10, 96, 0, 10]),
                ),
                (
                    key(frag_hook::INGRESS, 513),
                    v(frag_action::TRANSLATE, [10, 244, 1, 11]),
                ),
                (
                    key(frag_hook::INGRESS, 9),
                    v(frag_action::DROP, [10, 96, 0, 10]),
                ),
            ],
            4_000_000_000,
        );
        let lines: Vec<&str> = table.lines().collect();
        assert_eq!(lines.len(), 4, "{table}");
        assert!(
            lines[1].starts_with("ingress") && lines[1].contains("     9 dropped"),
            "{table}"
        );
        assert!(
            lines[2].starts_with("ingress")
                && lines[2].contains("UDP")
                && lines[2]
                    .contains("10.244.1.2      10.96.0.10         513 as 10.244.1.2 → 10.244.1.11")
                && lines[2].trim_end().ends_with(" 3"),
            "{table}"
        );
        assert!(
            lines[3].starts_with("egress") && lines[3].contains("passed"),
            "{table}"
        );
    }

    #[test]
    fn snat_table_shows_both_directions() {
        let out_key = SnatKey {
            saddr: [192, 168, 50, 100],
            daddr: [10, 244, 2, 11],
            sport: 40_000u16.to_be_bytes(),
            dport: 8080u16.to_be_bytes(),
            proto: 6,
            dir: ct_dir::ORIGINAL,
            _pad: [0; 2],
        };
        let in_key = SnatKey {
            saddr: [10, 244, 2, 11],
            daddr: [192, 168, 50, 10],
            sport: 8080u16.to_be_bytes(),
            dport: 61_234u16.to_be_bytes(),
            dir: ct_dir::REPLY,
            ..out_key
        };
        let v = |addr, port: u16| SnatValue {
            last_seen_ns: 0,
            addr,
            port: port.to_be_bytes(),
            state: ct_state::ESTABLISHED,
            flags: 0,
        };
        let table = snat_table(
            &[
                (in_key, v([192, 168, 50, 100], 40_000)),
                (out_key, v([192, 168, 50, 10], 61_234)),
            ],
            5_000_000_000,
        );
        let lines: Vec<&str> = table.lines().collect();
        assert_eq!(lines.len(), 3, "{table}");
        assert!(
            lines[1].starts_with("IPv4   out") && lines[1].contains("src → 192.168.50.10:61234"),
            "{table}"
        );
        assert!(
            lines[2].starts_with("IPv4   in") && lines[2].contains("dst → 192.168.50.100:40000"),
            "{table}"
        );
        assert!(lines[1].contains("established"), "{table}");
    }

    /// The IPv6 maps' Services, backends, flows and affinity records: rows of family IPv6 after
    /// the IPv4 ones, addresses as `[addr]:port`, backends resolved from `BACKENDS6_V1`, and an
    /// affinity id shared with an IPv4 frontend names both families' frontends.
    #[test]
    fn ipv6_rows_follow_the_ipv4_ones_with_their_family_and_bracketed_addresses() {
        use proxy_common::ipv6::{Backend6, Service6Key};
        let a6 = |s: &str| s.parse::<Ipv6Addr>().unwrap().octets();
        let mut p = Programmed::default();
        let fe4 = ServiceKey::new([10, 96, 0, 10], 80u16.to_be_bytes(), proto::TCP, 0);
        let affinity = ServiceValue {
            affinity_timeout_s: 60,
            affinity_id: 4,
            ..ServiceValue::frontend_with_flags(1, 1, service_flags::AFFINITY)
        };
        p.services.insert(fe4, affinity);
        p.services.insert(fe4.with_slot(1), ServiceValue::slot(1));
        p.backends.insert(1, web_backend(11));
        let mut v6 = Ipv6Tables::default();
        let fe6 = Service6Key::new(a6("fd00:96::10"), 80u16.to_be_bytes(), proto::TCP, 0);
        v6.services.insert(
            fe6,
            ServiceValue {
                rev_nat_id: 7,
                ..affinity
            },
        );
        v6.services.insert(fe6.with_slot(1), ServiceValue::slot(2));
        let empty6 = Service6Key::new(a6("fd00:96::99"), 53u16.to_be_bytes(), proto::UDP, 0);
        v6.services.insert(empty6, ServiceValue::frontend(0, 8));
        v6.backends.insert(
            2,
            Backend6 {
                addr: a6("fd00:244:1::11"),
                port: 8080u16.to_be_bytes(),
                proto: proto::TCP,
                flags: backend_flags::LOCAL,
            },
        );
        let client = a6("fd00:244:2::5");
        v6.affinity.push((
            Affinity6Key {
                affinity_id: 4,
                client,
            },
            AffinityValue {
                backend_id: 2,
                _pad: 0,
                last_used_ns: 990_000_000_000,
            },
        ));

        let t = services_table(&p, &v6);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines.len(), 4, "{t}");
        assert!(lines[0].starts_with("FAMILY FRONTEND"), "{t}");
        assert!(lines[1].starts_with("IPv4   10.96.0.10:80 "), "{t}");
        let row6: Vec<&str> = lines[2].split_whitespace().collect();
        assert_eq!(
            row6,
            [
                "IPv6",
                "[fd00:96::10]:80",
                "TCP",
                "7",
                "random",
                "60s",
                "1",
                "[fd00:244:1::11]:8080",
                "(#2)"
            ],
            "{t}"
        );
        assert!(
            lines[3].starts_with("IPv6   [fd00:96::99]:53 ")
                && lines[3].ends_with("(none: rejected)"),
            "{t}"
        );

        let b = backends_table(&p, &v6, &BTreeMap::from([(2, 5)]));
        assert!(
            b.ends_with("IPv6        2  [fd00:244:1::11]:8080  TCP         5  local\n"),
            "{b}"
        );

        let flow = Ct6Value {
            last_seen_ns: 1_000_000_000,
            frontend_addr: a6("fd00:96::10"),
            frontend_port: 80u16.to_be_bytes(),
            backend_addr: a6("fd00:244:1::11"),
            backend_port: 8080u16.to_be_bytes(),
            state: ct_state::ESTABLISHED,
            ..Default::default()
        };
        let original = Ct6Key {
            saddr: client,
            daddr: flow.frontend_addr,
            sport: 40000u16.to_be_bytes(),
            dport: 80u16.to_be_bytes(),
            proto: proto::TCP,
            dir: ct_dir::ORIGINAL,
            _pad: [0; 2],
        };
        let reply = Ct6Key {
            saddr: flow.backend_addr,
            daddr: client,
            sport: flow.backend_port,
            dport: original.sport,
            dir: ct_dir::REPLY,
            ..original
        };
        let c = conntrack_table(&[], &[(reply, flow), (original, flow)], 3_000_000_000);
        let lines: Vec<&str> = c.lines().collect();
        assert_eq!(lines.len(), 3, "{c}");
        let orig: Vec<&str> = lines[1].split_whitespace().collect();
        assert_eq!(
            orig,
            [
                "IPv6",
                "orig",
                "TCP",
                "[fd00:244:2::5]:40000",
                "[fd00:96::10]:80",
                "→",
                "[fd00:244:1::11]:8080",
                "established",
                "2"
            ],
            "{c}"
        );
        assert!(
            lines[2].starts_with("IPv6   reply") && lines[2].contains("← [fd00:96::10]:80"),
            "{c}"
        );

        let a = affinity_table(&[], &p, &v6, 1_000_000_000_000);
        let lines: Vec<&str> = a.lines().collect();
        assert_eq!(lines.len(), 2, "{a}");
        assert!(
            lines[1].starts_with("IPv6   4          fd00:244:2::5")
                && lines[1].contains("[fd00:244:1::11]:8080 (#2)")
                && lines[1].contains("live")
                && lines[1].ends_with("10.96.0.10:80/TCP, [fd00:96::10]:80/TCP"),
            "{a}"
        );
    }
}
