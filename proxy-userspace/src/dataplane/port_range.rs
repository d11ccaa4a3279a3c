//! The node's ephemeral port range (`net.ipv4.ip_local_port_range`) against the dedicated SNAT
//! ports (`SNAT_PORT_MIN..=SNAT_PORT_MAX`). On the node's own address the datapath shares every
//! unprivileged port with the node's sockets safely (it looks the sockets up, and remaps a later
//! connection of the node that would clash). The dedicated ports are used on a tunnel device's
//! own address (flannel.1, vxlan.calico) without that: if the ranges overlap, a connection the
//! node opens from such an address may meet a SNATed flow's tuple. Rare, so a warning at start,
//! not a refusal. Pure check and parser, one IO function.

use proxy_common::{SNAT_PORT_MAX, SNAT_PORT_MIN};

/// The sysctl, by the name an operator sets it with.
pub const SYSCTL: &str = "net.ipv4.ip_local_port_range";
/// Where it is read: /proc/sys shows the values of the reader's network namespace, the node's.
const PATH: &str = "/proc/sys/net/ipv4/ip_local_port_range";

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(
        "{SYSCTL} is {low}-{high}, which overlaps the ports {SNAT_PORT_MIN}-{SNAT_PORT_MAX} the \
         datapath SNATs external flows to on tunnel devices' own addresses: a connection the \
         node opens from such an address on one of them may get a SNATed flow's replies; \
         narrow it in the node's network namespace, e.g. `sysctl -w {SYSCTL}=\"32768 {}\"` \
         (the kernel's default)",
        SNAT_PORT_MIN - 1
    )]
    Overlap { low: u16, high: u16 },
    #[error("{PATH} holds {0:?}, not two port numbers")]
    Parse(String),
    #[error("cannot read {PATH} ({SYSCTL}): {0}")]
    Read(#[from] std::io::Error),
}

/// Parses the sysctl's value: two port numbers separated by whitespace.
pub fn parse(text: &str) -> Result<(u16, u16), Error> {
    let mut it = text.split_whitespace().map(str::parse::<u16>);
    match (it.next(), it.next(), it.next()) {
        (Some(Ok(low)), Some(Ok(high)), None) => Ok((low, high)),
        _ => Err(Error::Parse(text.trim().to_owned())),
    }
}

/// A local port range that shares a port with the dedicated SNAT range is an error.
pub fn check((low, high): (u16, u16)) -> Result<(), Error> {
    let (snat_low, snat_high) = (u32::from(SNAT_PORT_MIN), u32::from(SNAT_PORT_MAX));
    if u32::from(low) <= snat_high && u32::from(high) >= snat_low {
        return Err(Error::Overlap { low, high });
    }
    Ok(())
}

/// Reads this network namespace's range and checks it.
pub fn check_node() -> Result<(), Error> {
    check(parse(&std::fs::read_to_string(PATH)?)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_overlapping_the_snat_ports_are_refused_with_both_ranges_named() {
        for ok in [(32768, 60999), (1024, 60999), (1024, 1024)] {
            assert!(check(ok).is_ok(), "{ok:?}");
        }
        for bad in [
            (32768, 65535),
            (32768, 61000),
            (61000, 61000),
            (65535, 65535),
            (62000, 63000),
            (1024, 65535),
        ] {
            let err = check(bad).expect_err("overlap");
            let msg = err.to_string();
            for part in [
                SYSCTL.to_owned(),
                format!("{}-{}", bad.0, bad.1),
                "61000-65535".to_owned(),
            ] {
                assert!(msg.contains(&part), "{bad:?}: {msg:?} lacks {part}");
            }
        }
    }

    #[test]
    fn the_sysctl_value_parses_as_two_ports() {
        assert_eq!(parse("32768\t60999\n").unwrap(), (32768, 60999));
        assert_eq!(parse("1024 65535").unwrap(), (1024, 65535));
        for bad in ["", "32768", "32768 60999 1", "a b", "70000 80000"] {
            assert!(matches!(parse(bad), Err(Error::Parse(_))), "{bad:?}");
        }
    }
}
