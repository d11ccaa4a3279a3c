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
    programs::{SchedClassifier, TestRun, TestRunOptions},
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
) -> Result<(u32, Vec<u8>, Duration), String> {
    let mut out = vec![0u8; input.len() + 256];
    let opts = TestRunOptions {
        data_in: Some(input),
        data_out: Some(&mut out),
        repeat,
        ..Default::default()
    };
    let result = prog(bpf, prog_name)
        .test_run(opts)
        .map_err(|e| format!("{e:#?}"))?;
    out.truncate(result.data_size_out as usize);
    Ok((result.return_value, out, result.duration))
}

/// `BPF_F_TEST_SKB_CHECKSUM_COMPLETE` (uapi bpf.h; Linux ≥ 6.11, which aya's options cannot set).
const BPF_F_TEST_SKB_CHECKSUM_COMPLETE: u32 = 1 << 2;

/// One run of `prog` over `input` on a CHECKSUM_COMPLETE skb, when the run is one whose
/// `skb->csum` the kernel can judge (see [`try_run_checksum_complete`]): a program on an
/// Ethernet device (the test harness takes the first 14 bytes of an L3 device's frame for a
/// MAC header, outside the sum) and a packet it passes on or drops (an answer built from it
/// is trimmed, which makes the skb CHECKSUM_NONE and leaves a stale `skb->csum` the harness
/// would still compare). Otherwise an ordinary run.
pub fn try_run_checked(
    bpf: &Ebpf,
    prog_name: &str,
    input: &[u8],
    expected_verdict: u32,
) -> Result<(u32, Vec<u8>, Duration), String> {
    if prog_name.ends_with("_l3") || expected_verdict == TC_ACT_REDIRECT {
        try_run(bpf, prog_name, input, 1)
    } else {
        try_run_checksum_complete(bpf, prog_name, input)
    }
}

/// One BPF_PROG_TEST_RUN of `prog` over `input` with `BPF_F_TEST_SKB_CHECKSUM_COMPLETE`: the
/// program gets a CHECKSUM_COMPLETE skb (`skb->csum` the sum of the packet from its network
/// header, as a NIC that sums what it receives delivers it) and the kernel checks after the run
/// that `skb->csum` still sums the packet as the program left it. A rewrite that keeps the L4
/// checksum right but `skb->csum` wrong fails with EBADMSG (a receiver would log "hw csum
/// failure" and sum every such packet again).
pub fn try_run_checksum_complete(
    bpf: &Ebpf,
    prog_name: &str,
    input: &[u8],
) -> Result<(u32, Vec<u8>, Duration), String> {
    use std::os::fd::{AsFd, AsRawFd};
    let fd = prog(bpf, prog_name).fd().map_err(|e| format!("{e:#?}"))?;
    test_run_fd(
        fd.as_fd().as_raw_fd(),
        input,
        BPF_F_TEST_SKB_CHECKSUM_COMPLETE,
    )
    .map_err(|e| match e.raw_os_error() {
        Some(libc::EBADMSG) => {
            format!("skb->csum no longer sums the packet after the run (CHECKSUM_COMPLETE): {e}")
        }
        _ => format!("{e}"),
    })
}

/// One BPF_PROG_TEST_RUN of the program `prog_fd` over `input` with `flags`, by the raw
/// syscall (a file descriptor number can be shared by threads that run it at once, on their
/// own CPUs): (verdict, output frame, duration).
pub fn test_run_fd(
    prog_fd: std::os::fd::RawFd,
    input: &[u8],
    flags: u32,
) -> std::io::Result<(u32, Vec<u8>, Duration)> {
    /// The `test` member of `union bpf_attr` (uapi bpf.h).
    #[repr(C)]
    #[derive(Default)]
    struct TestAttr {
        prog_fd: u32,
        retval: u32,
        data_size_in: u32,
        data_size_out: u32,
        data_in: u64,
        data_out: u64,
        repeat: u32,
        duration: u32,
        ctx_size_in: u32,
        ctx_size_out: u32,
        ctx_in: u64,
        ctx_out: u64,
        flags: u32,
        cpu: u32,
        batch_size: u32,
        _pad: u32,
    }
    const BPF_PROG_TEST_RUN: libc::c_long = 10;
    let mut out = vec![0u8; input.len() + 256];
    let mut attr = TestAttr {
        prog_fd: prog_fd as u32,
        data_size_in: input.len() as u32,
        data_size_out: out.len() as u32,
        data_in: input.as_ptr() as u64,
        data_out: out.as_mut_ptr() as u64,
        repeat: 1,
        flags,
        ..Default::default()
    };
    // SAFETY: `attr` is the uapi layout, its pointers name `input` and `out` with their sizes,
    // both alive for the call; the kernel writes only `out` and `attr`.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            BPF_PROG_TEST_RUN,
            &mut attr as *mut TestAttr,
            std::mem::size_of::<TestAttr>() as u32,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    out.truncate(attr.data_size_out as usize);
    Ok((attr.retval, out, Duration::from_nanos(attr.duration as u64)))
}

/// The calling thread runs on `cpu` only.
fn pin_to_cpu(cpu: usize) {
    // SAFETY: a zeroed cpu_set_t is an empty set; CPU_SET and sched_setaffinity(0 = this
    // thread) only read and write it.
    let rc = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set)
    };
    assert_eq!(
        rc,
        0,
        "sched_setaffinity to CPU {cpu}: {}",
        std::io::Error::last_os_error()
    );
}

/// `rounds` races: in round `r`, two threads pinned to two CPUs (one, on a one-CPU machine) are
/// released together and each runs `prog_fd` once over `packet(cpu, r)` — two receive queues
/// delivering packets at the same instant. Per round, per CPU: (verdict, output frame).
pub fn race_on_two_cpus(
    prog_fd: std::os::fd::RawFd,
    rounds: usize,
    packet: impl Fn(usize, usize) -> Vec<u8> + Sync,
) -> Vec<[(u32, Vec<u8>); 2]> {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    // A spinning barrier: both threads leave it within a few hundred nanoseconds of each other
    // (a futex wake-up would leave tens of microseconds between them, wider than the windows
    // raced for). On one CPU the spin yields so the other thread can arrive.
    let arrived = AtomicUsize::new(0);
    let run = |cpu: usize| -> Vec<(u32, Vec<u8>)> {
        pin_to_cpu(cpu % cpus);
        (0..rounds)
            .map(|r| {
                let input = packet(cpu, r);
                arrived.fetch_add(1, Ordering::SeqCst);
                while arrived.load(Ordering::SeqCst) < 2 * (r + 1) {
                    if cpus < 2 {
                        std::thread::yield_now();
                    } else {
                        std::hint::spin_loop();
                    }
                }
                let (verdict, out, _) = test_run_fd(prog_fd, &input, 0)
                    .unwrap_or_else(|e| panic!("BPF_PROG_TEST_RUN, round {r}, CPU {cpu}: {e}"));
                (verdict, out)
            })
            .collect()
    };
    let (first, second) = std::thread::scope(|s| {
        let first = s.spawn(|| run(0));
        let second = s.spawn(|| run(1));
        (
            first.join().expect("the CPU 0 thread"),
            second.join().expect("the CPU 1 thread"),
        )
    });
    first.into_iter().zip(second).map(|(a, b)| [a, b]).collect()
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
