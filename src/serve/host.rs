//! Which `Host` header the studio answers.
//!
//! A page of another site can make a browser send requests here by pointing
//! a name of its own at 127.0.0.1 (DNS rebinding): the browser then thinks
//! the studio is that site, sends `Host: evil.example:8000`, and lets the
//! page read the answers. The studio therefore answers only requests whose
//! `Host` names it:
//!
//! - the address it listens on (`127.0.0.1`, `[::1]`), or any IP literal
//!   when it listens on every address (`0.0.0.0`, `::`): an IP literal
//!   cannot be rebound;
//! - `localhost`;
//! - the name given to `--host` (so `--host studio.lan` works on a LAN);
//!
//! and whose port (80 when the header names none) is the one it listens on.
//! Names are compared without case and without a trailing dot.

use std::net::{IpAddr, SocketAddr};

/// What [`HostCheck::allows`] accepts.
#[derive(Debug, Clone)]
pub(crate) struct HostCheck {
    /// The address listened on (its port included).
    pub served: SocketAddr,
    /// `--host`, lower-cased, without a trailing dot.
    pub named: String,
}

impl HostCheck {
    pub fn new(served: SocketAddr, named: &str) -> Self {
        HostCheck {
            served,
            named: normal(named),
        }
    }

    /// Whether a request with this `Host` header is for the studio.
    pub fn allows(&self, header: &str) -> bool {
        let Some((name, port)) = split_host(header) else {
            return false;
        };
        if port != self.served.port() {
            return false;
        }
        let name = normal(name);
        if name == "localhost" || name == self.named {
            return true;
        }
        match name.parse::<IpAddr>() {
            Ok(ip) => ip == self.served.ip() || self.served.ip().is_unspecified(),
            Err(_) => false,
        }
    }
}

fn normal(name: &str) -> String {
    let name = name.trim();
    let name = name
        .strip_prefix('[')
        .and_then(|n| n.strip_suffix(']'))
        .unwrap_or(name);
    name.strip_suffix('.').unwrap_or(name).to_ascii_lowercase()
}

/// The name and port of a `Host` header (`name`, `name:port`, `[v6]:port`);
/// none when it is malformed (empty name, a port that is not a number).
fn split_host(header: &str) -> Option<(&str, u16)> {
    let header = header.trim();
    let (name, port) = if let Some(rest) = header.strip_prefix('[') {
        let (v6, after) = rest.split_once(']')?;
        match after {
            "" => (v6, None),
            p => (v6, Some(p.strip_prefix(':')?)),
        }
    } else {
        match header.split_once(':') {
            Some((n, p)) => (n, Some(p)),
            None => (header, None),
        }
    };
    if name.is_empty() {
        return None;
    }
    let port = match port {
        None => 80,
        Some(p) if !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()) => p.parse().ok()?,
        Some(_) => return None,
    };
    Some((name, port))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(addr: &str, named: &str) -> HostCheck {
        HostCheck::new(addr.parse().unwrap(), named)
    }

    #[test]
    fn the_served_address_and_localhost_are_allowed() {
        let c = check("127.0.0.1:8765", "127.0.0.1");
        for h in [
            "127.0.0.1:8765",
            "localhost:8765",
            "LocalHost.:8765",
            " localhost:8765 ",
        ] {
            assert!(c.allows(h), "{h}");
        }
        let v6 = check("[::1]:9000", "::1");
        assert!(v6.allows("[::1]:9000"));
        assert!(v6.allows("localhost:9000"));
        assert!(!v6.allows("127.0.0.1:9000"));
    }

    #[test]
    fn other_names_ports_and_malformed_headers_are_refused() {
        let c = check("127.0.0.1:8765", "127.0.0.1");
        for h in [
            "evil.example:8765",
            "evil.example",
            "127.0.0.1:8766",
            "127.0.0.1",
            "localhost",
            "127.0.0.2:8765",
            "localhost.evil.example:8765",
            ":8765",
            "",
            "127.0.0.1:",
            "127.0.0.1:87x5",
            "127.0.0.1:99999",
            "[::1",
            "[::1]8765",
        ] {
            assert!(!c.allows(h), "{h:?}");
        }
    }

    #[test]
    fn the_name_given_to_host_and_any_ip_when_listening_everywhere() {
        let c = check("0.0.0.0:80", "Studio.LAN");
        assert!(c.allows("studio.lan"));
        assert!(c.allows("studio.lan:80"));
        assert!(c.allows("192.168.1.20"));
        assert!(c.allows("[fe80::1]:80"));
        assert!(!c.allows("evil.example"));
        assert!(!c.allows("studio.lan:8000"));
    }
}
