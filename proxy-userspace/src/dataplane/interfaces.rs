//! Which interfaces get the programs: name patterns (pure) and the list of this network
//! namespace's interfaces (via `if_nameindex`, which asks netlink — /sys/class/net may belong to
//! another namespace when the agent was started with `nsenter --net`).

/// Comma-separated glob patterns (`*` any run, `?` one character), e.g. `veth*,cali*,eth0`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Patterns(Vec<String>);

impl Patterns {
    pub fn parse(s: &str) -> Self {
        Self(
            s.split(',')
                .map(str::trim)
                .filter(|p| !p.is_empty())
                .map(String::from)
                .collect(),
        )
    }

    /// Patterns matching exactly these names (detected devices; a name with `*` or `?`, which
    /// Linux allows, would match more).
    pub fn exact<S: Into<String>>(names: impl IntoIterator<Item = S>) -> Self {
        Self(names.into_iter().map(Into::into).collect())
    }

    pub fn matches(&self, name: &str) -> bool {
        self.0
            .iter()
            .any(|p| glob_match(p.as_bytes(), name.as_bytes()))
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// Glob match with `*` and `?`, iterative with single backtrack point (linear in practice).
fn glob_match(pattern: &[u8], name: &[u8]) -> bool {
    let (mut p, mut n) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while n < name.len() {
        match pattern.get(p) {
            Some(b'*') => {
                star = Some((p, n));
                p += 1;
            }
            Some(&c) if c == b'?' || c == name[n] => {
                p += 1;
                n += 1;
            }
            _ => match star {
                Some((sp, sn)) => {
                    p = sp + 1;
                    n = sn + 1;
                    star = Some((sp, sn + 1));
                }
                None => return false,
            },
        }
    }
    pattern[p..].iter().all(|&c| c == b'*')
}

/// An interface of this network namespace.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Interface {
    pub index: u32,
    pub name: String,
}

/// Lists the interfaces of the current network namespace.
pub fn list() -> std::io::Result<Vec<Interface>> {
    let all = nix::net::if_::if_nameindex()?;
    Ok(all
        .iter()
        .map(|i| Interface {
            index: i.index(),
            name: i.name().to_string_lossy().into_owned(),
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn glob_patterns_match_like_a_shell() {
        let p = Patterns::parse("veth*, cali*,eth0,lxc?x");
        for yes in ["veth-be1", "veth", "cali1234", "eth0", "lxc1x"] {
            assert!(p.matches(yes), "{yes}");
        }
        for no in ["eth1", "xveth", "lxc12x", "lo", ""] {
            assert!(!p.matches(no), "{no}");
        }
        assert!(Patterns::parse("*").matches("anything"));
        assert!(Patterns::parse("a*b*c").matches("aXXbYYc"));
        assert!(!Patterns::parse("a*b*c").matches("aXXbYY"));
        assert!(Patterns::parse("").is_empty());
    }

    #[test]
    fn lists_loopback() {
        let all = list().expect("if_nameindex");
        assert!(all.iter().any(|i| i.name == "lo"), "{all:?}");
    }
}
