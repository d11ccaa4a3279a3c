//! `kube-proxy-ebpf dump`: human tables decoded from the pinned maps, usable while the agent runs.

use std::{collections::BTreeMap, fmt::Write as _, net::Ipv4Addr};

use proxy_common::{
    Counter, CtKey, CtValue, FragKey, FragValue, SnatKey, SnatValue, backend_flags, ct_dir,
    ct_flags, ct_state, frag_action, frag_hook,
};

use crate::{
    cli::DumpWhat,
    dataplane::{
        bpffs::PinLayout,
        clock::monotonic_ns,
        maps::{Conntrack, Fragments, ServiceMaps, Snat, Stats},
    },
    encode,
    model::{Protocol, Scope},
    programmed::Programmed,
};

pub fn dump(pins: &PinLayout, what: DumpWhat) -> anyhow::Result<String> {
    if !pins.has_maps() {
        anyhow::bail!(
            "no pinned maps under {}: is the agent running (or was it started with another --pin-dir)?",
            pins.dir.display()
        );
    }
    Ok(match what {
        DumpWhat::Services => services_table(&ServiceMaps::open_pinned(pins)?.read_programmed()?),
        DumpWhat::Backends => backends_table(&ServiceMaps::open_pinned(pins)?.read_programmed()?),
        DumpWhat::Conntrack => {
            conntrack_table(&Conntrack::open_pinned(pins)?.entries(), monotonic_ns())
        }
        DumpWhat::Stats => stats_table(&Stats::open_pinned(pins)?.read()?),
        DumpWhat::Snat => snat_table(&Snat::open_pinned(pins)?.entries(), monotonic_ns()),
        DumpWhat::Fragments => {
            fragments_table(&Fragments::open_pinned(pins)?.entries(), monotonic_ns())
        }
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
    if parts.is_empty() {
        "-".into()
    } else {
        parts.join(",")
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

/// One row per frontend: its backends in slot order.
pub fn services_table(p: &Programmed) -> String {
    let mut frontends: BTreeMap<_, (u32, u16, Vec<String>)> = BTreeMap::new();
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
        frontends.insert(fe, (value.rev_nat_id, value.count, backends));
    }
    let mut out = format!(
        "{:<34} {:<6} {:>6} {:>8}  {}\n",
        "FRONTEND", "PROTO", "REVNAT", "BACKENDS", "TARGETS"
    );
    for (fe, (rev, count, backends)) in &frontends {
        let targets = if backends.is_empty() {
            "(none: rejected)".to_string()
        } else {
            backends.join(", ")
        };
        let _ = writeln!(
            out,
            "{:<34} {:<6} {:>6} {:>8}  {}",
            match fe.scope {
                Scope::AllClients => format!("{}:{}", fe.addr, fe.port),
                Scope::InCluster => format!("{}:{} (in-cluster)", fe.addr, fe.port),
            },
            fe.protocol,
            rev,
            count,
            targets
        );
    }
    out
}

pub fn backends_table(p: &Programmed) -> String {
    let mut out = format!(
        "{:>6}  {:<22} {:<6} {}\n",
        "ID", "ADDRESS", "PROTO", "FLAGS"
    );
    let mut ids: Vec<_> = p.backends.keys().copied().collect();
    ids.sort_unstable();
    for id in ids {
        let b = p.backends[&id];
        let _ = writeln!(
            out,
            "{:>6}  {:<22} {:<6} {}",
            id,
            format!("{}:{}", Ipv4Addr::from(b.addr), u16::from_be_bytes(b.port)),
            proto_name(b.proto),
            flags_text(b.flags)
        );
    }
    out
}

fn state_name(proto: u8, state: u8) -> &'static str {
    match (proto, state) {
        (proxy_common::proto::UDP, _) => "udp",
        (_, ct_state::SYN_SENT) => "syn_sent",
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
        "{:<6} {:<5} {:<22} {:<22} {:<24} {:<12} {:>8}\n",
        "DIR", "PROTO", "SOURCE", "DESTINATION", "NAT", "STATE", "IDLE_S"
    );
    for r in rows {
        let _ = writeln!(
            out,
            "{:<6} {:<5} {:<22} {:<22} {:<24} {:<12} {:>8}",
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

pub fn conntrack_table(entries: &[(CtKey, CtValue)], now_ns: u64) -> String {
    let mut entries: Vec<_> = entries.iter().collect();
    entries.sort_by_key(|(k, _)| (k.dir, k.saddr, k.sport, k.daddr, k.dport));
    flow_table(
        entries
            .into_iter()
            .map(|(k, v)| {
                let (dir, nat) = if k.dir == ct_dir::ORIGINAL {
                    ("orig", ct_translation(v, ct_dir::ORIGINAL))
                } else {
                    ("reply", ct_translation(v, ct_dir::REPLY))
                };
                FlowRow::new(k, dir, nat, v.state, v.last_seen_ns, now_ns)
            })
            .collect(),
    )
}

/// What a conntrack entry does to its direction's packets: the address it rewrites (none for a
/// flow straight to a pod, `direct`), and the client port a reply-tuple clash moved it to.
fn ct_translation(v: &CtValue, dir: u8) -> String {
    let moved = v.flags & ct_flags::SPORT_NAT != 0;
    let port = u16::from_be_bytes(v.nat_sport);
    let mut out = if v.flags & ct_flags::DIRECT != 0 {
        "direct".to_owned()
    } else if dir == ct_dir::ORIGINAL {
        format!("→ {}", endpoint(v.backend_addr, v.backend_port))
    } else {
        format!("← {}", endpoint(v.frontend_addr, v.frontend_port))
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

pub fn stats_table(values: &[u64]) -> String {
    let mut out = format!("{:<28} {:>14}\n", "COUNTER", "PACKETS");
    for (c, v) in Counter::ALL.iter().zip(values) {
        let _ = writeln!(out, "{:<28} {:>14}", c.name(), v);
    }
    out
}

#[cfg(test)]
mod tests {
    use proxy_common::{Backend, RevNat, ServiceKey, ServiceValue, proto};

    use super::*;

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
        let table = crate::maglev::MaglevTable::new(251, endpoints).entries();
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
        p.services.insert(fe, ServiceValue::frontend(2, 1));
        p.services.insert(fe.with_slot(1), ServiceValue::slot(7));
        p.services.insert(fe.with_slot(2), ServiceValue::slot(8));
        p.backends.insert(
            7,
            Backend {
                addr: [10, 244, 1, 11],
                port: 8080u16.to_be_bytes(),
                proto: proto::TCP,
                flags: 0,
            },
        );
        p.backends.insert(
            8,
            Backend {
                addr: [10, 244, 1, 12],
                port: 8080u16.to_be_bytes(),
                proto: proto::TCP,
                flags: 0,
            },
        );
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
        p.services.insert(inner, ServiceValue::frontend(1, 3));
        p.services.insert(inner.with_slot(1), ServiceValue::slot(8));
        let t = services_table(&p);
        assert!(t.contains("10.96.0.10:80"), "{t}");
        let row = t
            .lines()
            .find(|l| l.starts_with("10.96.0.10:80 (in-cluster)"))
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
            4_000_000_000,
        );
        let lines: Vec<&str> = table.lines().collect();
        assert_eq!(lines.len(), 3, "{table}");
        assert!(
            lines[1].starts_with("orig") && lines[1].contains("→ 10.244.1.11:8080"),
            "{table}"
        );
        assert!(
            lines[2].starts_with("reply") && lines[2].contains("← 10.96.0.10:80"),
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
            1,
        );
        assert!(table.contains("direct"), "{table}");
        assert!(
            table.contains("→ 10.244.1.11:8080, sport → 5000"),
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
            lines[1].starts_with("out") && lines[1].contains("src → 192.168.50.10:61234"),
            "{table}"
        );
        assert!(
            lines[2].starts_with("in") && lines[2].contains("dst → 192.168.50.100:40000"),
            "{table}"
        );
        assert!(lines[1].contains("established"), "{table}");
    }
}
