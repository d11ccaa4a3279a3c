//! Set-up shared by the datapath table tests (datapath.rs, datapath6.rs, datapath_sctp.rs): the
//! embedded eBPF object loaded with small maps and its programs loaded as the agent loads them,
//! one BPF_PROG_TEST_RUN of a program, the datapath's counters and the NODE map.

#![allow(
    dead_code,
    reason = "each test binary uses a different part of the helpers"
)]

use std::{collections::BTreeMap, net::Ipv4Addr, time::Duration};

use aya::{
    Ebpf, EbpfLoader,
    maps::{Array, MapData, PerCpuArray},
    programs::{ProgramError, SchedClassifier, TestRun, TestRunOptions},
};
use kube_proxy_ebpf::dataplane::{ebpf_object::EBPF_OBJECT, loader};
use proxy_common::{
    CONFIG_GLOBAL, Counter, DatapathConfig, MAP_NODE, MAP_STATS, NodeInfo, bpf_log,
};

/// `TC_ACT_UNSPEC` (TCX_NEXT, -1): the datapath's pass verdict, so later programs on the hook run.
pub const TC_NEXT: u32 = u32::MAX;
pub const TC_ACT_SHOT: u32 = 2;
pub const TC_ACT_REDIRECT: u32 = 7;

/// The embedded object with `cfg` as its config global, `log_level` as the datapath trace's
/// global (`None`: the object's default, off) and `maps` sized to `capacity` (small maps load
/// fast; the datapath does not depend on their size), with every program, and the new-flow
/// programs in the tail-call arrays, loaded as the agent loads them.
pub fn load_object(
    cfg: &DatapathConfig,
    log_level: Option<u8>,
    maps: &[&str],
    capacity: u32,
) -> Ebpf {
    let mut l = EbpfLoader::new();
    l.override_global(CONFIG_GLOBAL, cfg, true);
    if let Some(level) = &log_level {
        l.override_global(bpf_log::LOG_LEVEL_GLOBAL, level, true);
    }
    for map in maps {
        l.map_max_entries(map, capacity);
    }
    let mut bpf = l.load(EBPF_OBJECT).unwrap_or_else(|e| {
        panic!("loading the embedded eBPF object failed (run as root?): {e:#?}")
    });
    loader::load_programs(&mut bpf)
        .unwrap_or_else(|e| panic!("verifier rejected a program: {e:#?}"));
    bpf
}

pub fn prog<'a>(bpf: &'a Ebpf, name: &str) -> &'a SchedClassifier {
    bpf.program(name).unwrap().try_into().unwrap()
}

/// `repeat` runs of `prog` over `input`: (verdict, output frame, mean duration of one run).
pub fn try_run(
    bpf: &Ebpf,
    prog_name: &str,
    input: &[u8],
    repeat: u32,
) -> Result<(u32, Vec<u8>, Duration), ProgramError> {
    let mut out = vec![0u8; input.len() + 256];
    let opts = TestRunOptions {
        data_in: Some(input),
        data_out: Some(&mut out),
        repeat,
        ..Default::default()
    };
    let result = prog(bpf, prog_name).test_run(opts)?;
    out.truncate(result.data_size_out as usize);
    Ok((result.return_value, out, result.duration))
}

/// One run of `prog` over `input`, nothing checked: (verdict, output frame).
pub fn run(bpf: &Ebpf, prog_name: &str, input: &[u8]) -> (u32, Vec<u8>) {
    let (verdict, out, _) = try_run(bpf, prog_name, input, 1)
        .unwrap_or_else(|e| panic!("BPF_PROG_TEST_RUN of {prog_name}: {e:#?}"));
    (verdict, out)
}

/// Every datapath counter by name, summed over the CPUs.
pub fn counters(bpf: &Ebpf) -> BTreeMap<&'static str, u64> {
    let stats: PerCpuArray<&MapData, u64> =
        PerCpuArray::try_from(bpf.map(MAP_STATS).expect("STATS map")).expect("STATS type");
    Counter::ALL
        .iter()
        .map(|c| {
            let per_cpu = stats
                .get(&(*c as u32), 0)
                .unwrap_or_else(|e| panic!("read counter {}: {e}", c.name()));
            (c.name(), per_cpu.iter().sum())
        })
        .collect()
}

/// The node's address for SNAT (the NODE map's one entry).
pub fn set_node_addr(bpf: &mut Ebpf, addr: Ipv4Addr) {
    let mut node: Array<&mut MapData, NodeInfo> =
        Array::try_from(bpf.map_mut(MAP_NODE).expect("NODE map")).expect("NODE type");
    let info = NodeInfo {
        snat_addr: addr.octets(),
        flags: 0,
    };
    node.set(0, info, 0).expect("write NODE");
}
