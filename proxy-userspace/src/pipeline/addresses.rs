//! Address settings, parsed: where to serve HTTP (`BindAddress`), IP prefixes (`Cidr`) and which
//! node addresses NodePorts answer on (`NodePortAddresses`).
//!
//! Owns the value types and their clap value parsers that the flags ([`crate::cli`]), the config
//! file ([`crate::cli::config`]) and the stages reading them (translate, kube, node_addrs) share. Pure;
//! calls nothing else in the crate.

use std::{
    fmt,
    net::{IpAddr, Ipv4Addr, SocketAddr},
    str::FromStr,
};

/// Upstream's default health port (`--healthz-bind-address`).
pub const HEALTHZ_PORT: u16 = 10256;
/// Upstream's default metrics port (`--metrics-bind-address`).
pub const METRICS_PORT: u16 = 10249;

/// An address to serve HTTP on, or disabled (`""` on the command line, like upstream).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BindAddress(pub Option<SocketAddr>);

impl BindAddress {
    /// `IP:port`, `[IPv6]:port`, a bare `IP` (the default port is added), or `""` (disabled).
    pub fn parse(s: &str, default_port: u16) -> Result<Self, String> {
        let s = s.trim();
        if s.is_empty() {
            return Ok(Self(None));
        }
        if let Ok(sa) = SocketAddr::from_str(s) {
            return Ok(Self(Some(sa)));
        }
        let bare = s.trim_start_matches('[').trim_end_matches(']');
        if let Ok(ip) = IpAddr::from_str(bare) {
            return Ok(Self(Some(SocketAddr::new(ip, default_port))));
        }
        Err(format!(
            "invalid bind address {s:?}: use IP:port (e.g. 0.0.0.0:{default_port}), or empty to disable"
        ))
    }
}

impl fmt::Display for BindAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(sa) => write!(f, "{sa}"),
            None => f.write_str("disabled"),
        }
    }
}

/// clap value parser for `--healthz-bind-address`.
pub fn parse_healthz_bind_address(s: &str) -> Result<BindAddress, String> {
    BindAddress::parse(s, HEALTHZ_PORT)
}

/// clap value parser for `--metrics-bind-address`.
pub fn parse_metrics_bind_address(s: &str) -> Result<BindAddress, String> {
    BindAddress::parse(s, METRICS_PORT)
}

/// An IP prefix, as written in nodePortAddresses and clusterCIDR.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Cidr {
    pub addr: IpAddr,
    pub prefix_len: u8,
}

impl Cidr {
    pub fn contains(&self, ip: IpAddr) -> bool {
        match (self.addr, ip) {
            (IpAddr::V4(net), IpAddr::V4(ip)) => {
                let mask = u32::MAX
                    .checked_shl(32 - u32::from(self.prefix_len))
                    .unwrap_or(0);
                u32::from(net) & mask == u32::from(ip) & mask
            }
            (IpAddr::V6(net), IpAddr::V6(ip)) => {
                let mask = u128::MAX
                    .checked_shl(128 - u32::from(self.prefix_len))
                    .unwrap_or(0);
                u128::from(net) & mask == u128::from(ip) & mask
            }
            _ => false,
        }
    }
}

impl FromStr for Cidr {
    type Err = String;

    /// Host bits may be set (`192.168.1.5/24`), as upstream's sloppy CIDR parsing allows.
    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || format!("invalid CIDR {s:?}: use e.g. 10.0.0.0/8 or fd00::/64");
        let (addr, len) = s.trim().split_once('/').ok_or_else(bad)?;
        let addr = IpAddr::from_str(addr).map_err(|_| bad())?;
        let prefix_len: u8 = len.parse().map_err(|_| bad())?;
        let max = if addr.is_ipv4() { 32 } else { 128 };
        if prefix_len > max {
            return Err(bad());
        }
        Ok(Self { addr, prefix_len })
    }
}

impl fmt::Display for Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix_len)
    }
}

/// Which node addresses NodePorts answer on (used by the NodePort stage; parsed and checked now).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum NodePortAddresses {
    /// Every local address (empty list; `all` is accepted as a spelling of it).
    #[default]
    All,
    /// The node's primary IPs (upstream nftables default: `primary`).
    Primary,
    /// Addresses inside these prefixes.
    Cidrs(Vec<Cidr>),
}

impl NodePortAddresses {
    pub fn from_list<S: AsRef<str>>(items: &[S]) -> Result<Self, String> {
        let items: Vec<&str> = items
            .iter()
            .map(|s| s.as_ref().trim())
            .filter(|s| !s.is_empty())
            .collect();
        match items.as_slice() {
            [] | ["all"] => Ok(Self::All),
            ["primary"] => Ok(Self::Primary),
            _ if items.iter().any(|s| *s == "primary" || *s == "all") => Err(format!(
                "{items:?}: `primary` and `all` must stand alone, not mixed with CIDRs"
            )),
            _ => items
                .iter()
                .map(|s| Cidr::from_str(s))
                .collect::<Result<Vec<_>, _>>()
                .map(Self::Cidrs),
        }
    }
}

impl fmt::Display for NodePortAddresses {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::All => f.write_str("all"),
            Self::Primary => f.write_str("primary"),
            Self::Cidrs(c) => {
                let list: Vec<String> = c.iter().map(ToString::to_string).collect();
                f.write_str(&list.join(","))
            }
        }
    }
}

/// clap value parser for one `--cluster-cidr` item.
pub fn parse_cidr(s: &str) -> Result<Cidr, String> {
    Cidr::from_str(s)
}

/// clap value parser for `--nodeport-addresses` (comma-separated).
pub fn parse_nodeport_addresses(s: &str) -> Result<NodePortAddresses, String> {
    NodePortAddresses::from_list(&s.split(',').collect::<Vec<_>>())
}

/// The IPv4 prefixes of `cidrs` (network, prefix length); IPv6 ones are left out (the
/// datapath is IPv4-only).
pub fn ipv4_prefixes(cidrs: &[Cidr]) -> Vec<(Ipv4Addr, u8)> {
    cidrs
        .iter()
        .filter_map(|c| match c.addr {
            IpAddr::V4(a) => Some((a, c.prefix_len)),
            IpAddr::V6(_) => None,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cidrs_and_node_port_addresses() {
        let c: Cidr = "10.244.1.7/16".parse().unwrap();
        assert!(c.contains("10.244.200.1".parse().unwrap()));
        assert!(!c.contains("10.245.0.1".parse().unwrap()));
        let all: Cidr = "0.0.0.0/0".parse().unwrap();
        assert!(all.contains("8.8.8.8".parse().unwrap()));
        assert!(!all.contains("::1".parse().unwrap()));
        let v6: Cidr = "fd00::/64".parse().unwrap();
        assert!(v6.contains("fd00::5".parse().unwrap()));
        assert_eq!(parse_nodeport_addresses(""), Ok(NodePortAddresses::All));
        assert_eq!(parse_nodeport_addresses("all"), Ok(NodePortAddresses::All));
        assert_eq!(
            parse_nodeport_addresses("primary"),
            Ok(NodePortAddresses::Primary)
        );
        assert!(parse_nodeport_addresses("primary,all").is_err());
    }
}
