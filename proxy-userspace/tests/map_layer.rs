//! Privileged: the map layer against real kernel maps (unpinned load). Batched writes must leave
//! exactly what the plan says, in any mix of puts and deletes, including deletes of keys that are
//! already gone.
//!
//! Run by `sudo cargo xtask test` (KPE_PRIVILEGED=1); skipped otherwise.

use std::{collections::BTreeMap, net::Ipv4Addr};

use kube_proxy_ebpf::{
    dataplane::{loader, maps::ServiceMaps},
    diff,
    model::{
        DesiredBackend, DesiredFrontend, DesiredState, EndpointAddr, Frontend, FrontendKind,
        Protocol, ServicePortName,
    },
    programmed::{Capacities, MapOp, Programmed},
};
use proxy_common::{DatapathConfig, ServiceKey};
use proxy_testenv::require_privileged;

fn state(services: u32, backends_each: u32, offset: u32) -> DesiredState {
    let mut frontends = BTreeMap::new();
    for s in 0..services {
        let frontend = Frontend::new(Ipv4Addr::from(0x0a60_0000 + s), 80, Protocol::Tcp);
        let backends = (0..backends_each)
            .map(|b| DesiredBackend {
                endpoint: EndpointAddr {
                    addr: Ipv4Addr::from(0x0af4_0000 + s * 16 + b + offset),
                    port: 8080,
                    protocol: Protocol::Tcp,
                },
                terminating: false,
                local: false,
            })
            .collect();
        let service = ServicePortName {
            namespace: "ns".into(),
            name: format!("svc{s}"),
            port_name: String::new(),
        };
        frontends.insert(
            frontend,
            DesiredFrontend {
                service,
                kind: FrontendKind::ClusterIp,
                external_local: false,
                source_ranges: Vec::new(),
                backends,
                retained: vec![],
            },
        );
    }
    DesiredState { frontends }
}

/// Plans `desired` against `shadow`, applies with `apply_all`, and checks the kernel maps equal
/// the shadow afterwards.
fn sync(maps: &mut ServiceMaps, shadow: &mut Programmed, desired: &DesiredState) -> usize {
    let plan = diff::plan(desired, shadow, &Capacities::default());
    assert!(plan.skipped.is_empty(), "{:?}", plan.skipped);
    let (applied, err) = maps.apply_all(&plan.ops);
    assert!(
        err.is_none(),
        "apply_all failed after {applied} ops: {err:?}"
    );
    assert_eq!(applied, plan.ops.len());
    for op in &plan.ops {
        shadow.apply(op);
    }
    let read = maps.read_programmed().expect("reading maps back");
    assert_eq!(&read, shadow, "kernel maps differ from the shadow");
    plan.ops.len()
}

#[test]
fn batched_apply_leaves_exactly_the_plan_in_the_kernel_maps() {
    require_privileged!();
    let mut ebpf = loader::load_unpinned(&DatapathConfig::DEFAULT).expect("load");
    let mut maps = ServiceMaps::from_ebpf(&mut ebpf).expect("maps");
    let mut shadow = Programmed::default();

    let grown = sync(&mut maps, &mut shadow, &state(500, 10, 0));
    assert_eq!(
        grown,
        500 * 10 + 500 * 11 + 500,
        "backends + slots/frontends + rev-NATs"
    );
    assert_eq!(shadow.frontend_count(), 500);

    // Shrink and move: half the Services go, the rest get other backends (puts + deletes).
    sync(&mut maps, &mut shadow, &state(250, 4, 3));
    assert_eq!(shadow.frontend_count(), 250);
    assert_eq!(
        sync(&mut maps, &mut shadow, &state(250, 4, 3)),
        0,
        "idempotent"
    );

    // Deletes of keys already gone (another writer, a crash) are tolerated, and the batch still
    // removes the keys that exist.
    let present = ServiceKey::new([10, 96, 0, 1], 80u16.to_be_bytes(), 6, 0);
    let missing = ServiceKey::new([10, 96, 255, 255], 80u16.to_be_bytes(), 6, 0);
    assert!(shadow.services.contains_key(&present));
    let ops = [
        MapOp::DeleteService { key: missing },
        MapOp::DeleteService { key: present },
    ];
    let (applied, err) = maps.apply_all(&ops);
    assert!(err.is_none(), "{err:?}");
    assert_eq!(applied, 2);
    let read = maps.read_programmed().expect("read");
    assert!(
        !read.services.contains_key(&present),
        "present key was not deleted"
    );
}
