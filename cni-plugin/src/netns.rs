//! The pod's network namespace: pinning it with a bind mount (so a listener Envoy binds
//! in it never sees it vanish) and reading its interface with netlink.

use std::net::IpAddr;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use aether_common::quote::quote;
use futures::TryStreamExt;
use netlink_packet_route::address::AddressAttribute;
use nix::mount::{MntFlags, MsFlags};

use crate::result::Cidr;

#[derive(Debug, thiserror::Error)]
pub enum NetnsError {
    #[error("CNI_NETNS: {} does not exist", quote(.0))]
    Missing(String),
    #[error("pinning {netns} at {pin}: {reason}")]
    Pin { netns: String, pin: String, reason: String },
    #[error("unpinning {pin}: {source}")]
    Unpin { pin: String, source: std::io::Error },
    #[error("netlink in {netns}: {source}")]
    Netlink {
        netns: String,
        source: aether_common::netns::NetlinkError,
    },
}

/// Same namespace file (device and inode), e.g. a pin and what it pins.
fn same_file(a: &Path, b: &Path) -> bool {
    match (std::fs::metadata(a), std::fs::metadata(b)) {
        (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
        _ => false,
    }
}

/// Bind-mounts `netns` at `<pin_dir>/<container_id>`. Idempotent: an existing pin of the
/// same netns is kept; a stale one is replaced.
pub fn pin(netns: &Path, pin_dir: &Path, container_id: &str) -> Result<PathBuf, NetnsError> {
    let target = pin_dir.join(container_id);
    let fail = |reason: String| NetnsError::Pin {
        netns: netns.display().to_string(),
        pin: target.display().to_string(),
        reason,
    };
    if !netns.exists() {
        return Err(NetnsError::Missing(netns.display().to_string()));
    }
    if same_file(netns, &target) {
        return Ok(target);
    }
    std::fs::create_dir_all(pin_dir).map_err(|e| fail(format!("creating {}: {e}", pin_dir.display())))?;
    if target.exists() {
        // A pin of another (old) netns under the same id: replace it.
        let _ = nix::mount::umount2(&target, MntFlags::MNT_DETACH);
    }
    std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .open(&target)
        .map_err(|e| fail(format!("creating the mount point: {e}")))?;
    if let Err(e) = nix::mount::mount(Some(netns), &target, None::<&str>, MsFlags::MS_BIND, None::<&str>) {
        let _ = std::fs::remove_file(&target);
        return Err(fail(format!("bind mount: {e}")));
    }
    Ok(target)
}

/// Unmounts and deletes a pin. Idempotent.
pub fn unpin(pin: &Path) -> Result<bool, NetnsError> {
    let fail = |source| NetnsError::Unpin {
        pin: pin.display().to_string(),
        source,
    };
    match nix::mount::umount2(pin, MntFlags::MNT_DETACH) {
        Ok(()) | Err(nix::errno::Errno::EINVAL) | Err(nix::errno::Errno::ENOENT) => {}
        Err(e) => return Err(fail(std::io::Error::from(e))),
    }
    match std::fs::remove_file(pin) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(fail(e)),
    }
}

/// The pins under `pin_dir` (container ids).
pub fn pins(pin_dir: &Path) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(pin_dir) else {
        return Vec::new();
    };
    let mut ids: Vec<String> = entries
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| !n.starts_with('.'))
        .collect();
    ids.sort();
    ids
}

/// The addresses of interface `ifname` in `netns` (None: no such interface), read with
/// netlink from a thread that entered the netns.
pub fn interface_addresses(netns: &Path, ifname: &str) -> Result<Option<Vec<Cidr>>, NetnsError> {
    if !netns.exists() {
        return Err(NetnsError::Missing(netns.display().to_string()));
    }
    let ifname = ifname.to_owned();
    let query = move |handle| read(handle, ifname);
    aether_common::netns::query_blocking(netns, query).map_err(|source| NetnsError::Netlink {
        netns: netns.display().to_string(),
        source,
    })
}

/// A netlink request about the interface failed.
#[derive(Debug, thiserror::Error)]
enum ReadError {
    #[error("link {ifname}: {source}")]
    Link { ifname: String, source: rtnetlink::Error },
    #[error("addresses of {ifname}: {source}")]
    Addresses { ifname: String, source: rtnetlink::Error },
}

async fn read(handle: rtnetlink::Handle, ifname: String) -> Result<Option<Vec<Cidr>>, ReadError> {
    let mut links = handle.link().get().match_name(ifname.clone()).execute();
    let index = match links.try_next().await {
        Ok(Some(link)) => link.header.index,
        Ok(None) => return Ok(None),
        // ENODEV: no such interface.
        Err(rtnetlink::Error::NetlinkError(e)) if e.raw_code().abs() == libc_enodev() => return Ok(None),
        Err(source) => return Err(ReadError::Link { ifname, source }),
    };
    let mut out = Vec::new();
    let mut addrs = handle.address().get().set_link_index_filter(index).execute();
    while let Some(msg) = addrs.try_next().await.map_err(|source| ReadError::Addresses {
        ifname: ifname.clone(),
        source,
    })? {
        let ip = msg.attributes.iter().find_map(|a| match a {
            AddressAttribute::Address(ip) => Some(*ip),
            _ => None,
        });
        if let Some(ip) = ip
            && !is_link_local(&ip)
        {
            out.push(Cidr {
                ip,
                prefix: msg.header.prefix_len,
            });
        }
    }
    out.sort();
    Ok(Some(out))
}

fn libc_enodev() -> i32 {
    nix::errno::Errno::ENODEV as i32
}

fn is_link_local(ip: &IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => v4.is_link_local(),
        IpAddr::V6(v6) => v6.is_unicast_link_local(),
    }
}
