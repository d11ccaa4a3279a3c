//! Privileged: what a start loads. The one-node topology synced from a fake API server
//! (`common_kube::Env`), with no L3 device:
//! - a fresh start verifies the IPv4 Ethernet programs and the socket hooks (and the IPv6 ones
//!   only where the node has IPv6) and pins them by fingerprint; no L3-device program is loaded;
//! - an L3 device (a TUN device, as wireguard-go makes) appearing later gets the L3 programs,
//!   loaded then, and pinned beside the others;
//! - a restart verifies nothing: every program comes from its pin (the same kernel program ids
//!   run on every interface before and after), and the Service answers through tc all along.
//!
//! How long each start takes is measured by `cargo xtask bench` (cold start), not here.
//! Run by `sudo cargo xtask test` (sets KPE_PRIVILEGED=1, one test thread); skipped otherwise.

mod common_kube;
mod common_netns;

use std::{
    collections::BTreeSet,
    net::Ipv4Addr,
    os::fd::AsFd as _,
    path::{Path, PathBuf},
    time::Duration,
};

use common_kube::{Env, backend_ips, ready, service, slice};
use kube_proxy_ebpf::dataplane::{
    link_sys,
    loader::{Needs, ProgramGroup},
};
use proxy_testenv::require_privileged;

const VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 9, 10);
const TUN: &str = "tun-l3";

/// The one fingerprint directory under `<pins>/programs/`, and the names pinned in it.
fn pinned_programs(pins: &Path) -> (PathBuf, BTreeSet<String>) {
    let dirs: Vec<PathBuf> = std::fs::read_dir(pins.join("programs"))
        .expect("programs/ under the pin dir")
        .map(|e| e.expect("entry").path())
        .collect();
    assert_eq!(dirs.len(), 1, "one fingerprint's programs pinned: {dirs:?}");
    let names = std::fs::read_dir(&dirs[0])
        .expect("fingerprint dir")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    (dirs[0].clone(), names)
}

/// The program id behind every pinned link (interface and hook → program).
fn linked_program_ids(pins: &Path) -> BTreeSet<(String, u32)> {
    std::fs::read_dir(pins.join("links"))
        .expect("links/")
        .map(|e| e.expect("entry"))
        .filter(|e| !e.file_name().to_string_lossy().starts_with("cgroup_"))
        .map(|e| {
            let fd = link_sys::obj_get(&e.path()).expect("open link pin");
            let id = link_sys::link_program_id(fd.as_fd()).expect("link info");
            (e.file_name().to_string_lossy().into_owned(), id)
        })
        .collect()
}

/// The kernel id of each pinned program, by name.
fn pinned_program_ids(dir: &Path) -> BTreeSet<(String, u32)> {
    std::fs::read_dir(dir)
        .expect("fingerprint dir")
        .map(|e| e.expect("entry"))
        .map(|e| {
            let fd = link_sys::obj_get(&e.path()).expect("open program pin");
            let id = link_sys::obj_identity(fd.as_fd()).expect("program info").id;
            (e.file_name().to_string_lossy().into_owned(), id)
        })
        .collect()
}

fn group_names(groups: &[ProgramGroup]) -> BTreeSet<String> {
    groups
        .iter()
        .flat_map(|g| g.programs())
        .map(|n| n.to_string())
        .collect()
}

/// `n` requests from the client pod to the Service, all answered by a backend (through tc:
/// the client is outside any cgroup the socket hooks cover).
fn answered(env: &Env, when: &str) {
    let url = format!("http://{VIP}/");
    let replies = env
        .topo
        .curl_many(&url, 4)
        .unwrap_or_else(|e| env.fail(&format!("{when}: curl: {e:#}")));
    for (i, r) in replies.iter().enumerate() {
        match r {
            Ok(r) => env.check(r.body.starts_with("be"), || {
                format!("{when}: request {i} answered by {:?}", r.body)
            }),
            Err(e) => env.fail(&format!("{when}: request {i}: {e}")),
        }
    }
}

#[test]
fn a_start_loads_what_the_node_uses_and_a_restart_verifies_nothing() {
    require_privileged!();
    let mut env = Env::start(vec![
        service("web", VIP, 80),
        slice("web", "1", &ready(&backend_ips())),
    ]);
    env.wait_frontend(VIP, Some(3), Duration::from_secs(30));
    env.agent
        .wait_log(&["agent: ready"], Duration::from_secs(30))
        .unwrap_or_else(|e| panic!("{e:#}"));
    answered(&env, "after the first start");
    let pins = env.agent.pin_dir().to_path_buf();

    // Fresh: the Ethernet programs (and IPv6 ones where the node has IPv6), nothing for L3.
    let (_, names) = pinned_programs(&pins);
    let ethernet = group_names(&[ProgramGroup::Ethernet]);
    let l3 = group_names(&[ProgramGroup::L3, ProgramGroup::Ipv6L3]);
    assert!(
        ethernet.is_subset(&names),
        "the IPv4 Ethernet programs are pinned: {names:?}"
    );
    assert!(
        names.is_disjoint(&l3),
        "no L3-device program loaded on a node without L3 devices: {names:?}"
    );
    let node_ipv6 = names.contains(proxy_common::PROG_TC_INGRESS6);
    let expected = group_names(
        &Needs {
            ipv6: node_ipv6,
            l3: false,
        }
        .groups(),
    );
    assert_eq!(
        names, expected,
        "exactly the groups the node uses are pinned"
    );

    // An L3 device appears: its programs are loaded then, and pinned beside the others.
    env.topo
        .node()
        .exec(&["ip", "tuntap", "add", "dev", TUN, "mode", "tun"])
        .expect("tun device");
    env.topo
        .node()
        .exec(&["ip", "link", "set", TUN, "up"])
        .expect("tun up");
    env.agent
        .wait_log(
            &["attached", &format!("interface={TUN}")],
            Duration::from_secs(30),
        )
        .unwrap_or_else(|e| panic!("{e:#}"));
    let (dir, names) = pinned_programs(&pins);
    let with_l3 = group_names(
        &Needs {
            ipv6: node_ipv6,
            l3: true,
        }
        .groups(),
    );
    assert_eq!(
        names, with_l3,
        "the L3 programs pinned once an L3 device came"
    );
    let before = pinned_program_ids(&dir);
    let linked_before = linked_program_ids(&pins);
    let ids: BTreeSet<u32> = before.iter().map(|(_, id)| *id).collect();
    assert!(
        linked_before.iter().all(|(_, id)| ids.contains(id)),
        "every interface runs a pinned program: links {linked_before:?}, pins {before:?}"
    );
    assert!(
        linked_before.iter().any(|(link, _)| link.contains(TUN)),
        "the L3 device is attached: {linked_before:?}"
    );

    // Restart: nothing verified, the same programs keep running everywhere.
    env.agent.restart().expect("restart");
    env.agent
        .wait_log(&["agent: ready"], Duration::from_secs(30))
        .unwrap_or_else(|e| panic!("{e:#}"));
    let log = env.agent.log_tail();
    let loads: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("programs loaded"))
        .collect();
    let since_restart = &loads[loads.len().saturating_sub(2)..];
    assert!(
        since_restart
            .iter()
            .all(|l| l.contains("verified=[]") && !l.contains("taken_from_pins=[]")),
        "a restart takes every program from its pin: {since_restart:#?}"
    );
    let (dir_after, _) = pinned_programs(&pins);
    assert_eq!(dir_after, dir, "the same fingerprint after a restart");
    assert_eq!(
        pinned_program_ids(&dir_after),
        before,
        "the same kernel programs are pinned"
    );
    assert_eq!(
        linked_program_ids(&pins),
        linked_before,
        "every interface runs the program it ran before the restart"
    );
    answered(&env, "after the restart");
    eprintln!(
        "fresh start: {} programs pinned ({} with the L3 device), restart: all {} taken from \
         their pins, {} links on the same programs",
        expected.len(),
        with_l3.len(),
        before.len(),
        linked_before.len()
    );
}
