//! UDS delivery (`endpoint.aether.io/uds-socket: <volume>/<file>`): a pod's inbound
//! traffic is delivered to a Unix socket in one of its emptyDir volumes instead of its
//! loopback ports. Callers are unaffected: they reach the pod's mesh ports as always.
//!
//! The volume lives on the node at `<kubelet root>/pods/<uid>/volumes/kubernetes.io~empty-dir/<volume>`,
//! too long for a socket address (107 bytes). So the agent links `<link dir>/<uid>` to it
//! when the pod joins, and Envoy connects to `<link dir>/<uid>/<file>` (the kernel
//! follows the link on connect); the link goes when the pod leaves.

use std::io;
use std::path::{Path, PathBuf};

use aether_api::pod::{UdsSocket, uds_socket};

use crate::pod::PodInfo;

/// Where the links live and where kubelet keeps pods' volumes.
#[derive(Clone, Debug)]
pub struct UdsLinks {
    pub link_dir: PathBuf,
    pub kubelet_root: PathBuf,
}

/// Where Envoy connects for a pod whose annotation names `socket`.
pub fn socket_path(link_dir: &Path, uid: &str, socket: &UdsSocket) -> PathBuf {
    link_dir.join(uid).join(&socket.file)
}

/// The socket the pod's annotation names, if valid (an invalid one is reported with the
/// pod's other annotation errors and ignored).
pub fn socket_of(info: &PodInfo) -> Option<UdsSocket> {
    uds_socket(&info.annotations).ok().flatten()
}

impl UdsLinks {
    /// Links the pod's volume, if its annotation names a socket; a pod without a uid (so
    /// without a volume path) cannot use one.
    pub fn link(&self, info: &PodInfo) -> io::Result<()> {
        let Some(socket) = socket_of(info) else { return Ok(()) };
        if info.uid.is_empty() || info.uid.contains(['/', '.']) {
            let message = format!(
                "{}: the pod has no usable uid for its volume path",
                aether_api::pod::UDS_SOCKET_ANNOTATION
            );
            return Err(io::Error::new(io::ErrorKind::InvalidInput, message));
        }
        let volume = (self.kubelet_root.join("pods").join(&info.uid))
            .join("volumes/kubernetes.io~empty-dir")
            .join(&socket.volume);
        std::fs::create_dir_all(&self.link_dir)?;
        let link = self.link_dir.join(&info.uid);
        match std::fs::read_link(&link) {
            Ok(target) if target == volume => return Ok(()),
            Ok(_) => std::fs::remove_file(&link)?,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        std::os::unix::fs::symlink(&volume, &link)
    }

    /// Removes the pod's link, if it has one.
    pub fn unlink(&self, info: &PodInfo) -> io::Result<()> {
        if info.uid.is_empty() || info.uid.contains(['/', '.']) {
            return Ok(());
        }
        match std::fs::remove_file(self.link_dir.join(&info.uid)) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    fn pod(uid: &str, socket: &str) -> PodInfo {
        PodInfo {
            namespace: "shop".into(),
            name: "cart-0".into(),
            uid: uid.into(),
            annotations: BTreeMap::from([(aether_api::pod::UDS_SOCKET_ANNOTATION.to_owned(), socket.to_owned())]),
            ..Default::default()
        }
    }

    #[test]
    fn the_link_reaches_the_volume_and_keeps_the_socket_path_short() {
        let dir = tempfile::tempdir().unwrap();
        let links = UdsLinks {
            link_dir: dir.path().join("uds"),
            kubelet_root: dir.path().join("kubelet"),
        };
        let uid = "0f5e8a2c-3b1d-4c6e-9a7f-2d4b6c8e0a1b";
        let info = pod(uid, "sockets/app.sock");
        links.link(&info).unwrap();
        let volume = dir
            .path()
            .join("kubelet/pods")
            .join(uid)
            .join("volumes/kubernetes.io~empty-dir/sockets");
        assert_eq!(std::fs::read_link(dir.path().join("uds").join(uid)).unwrap(), volume);
        // Again (a retried ADD), and to another volume: the link follows.
        links.link(&info).unwrap();
        links.link(&pod(uid, "other/app.sock")).unwrap();
        assert!(
            std::fs::read_link(dir.path().join("uds").join(uid))
                .unwrap()
                .ends_with("other")
        );
        let path = socket_path(Path::new("/run/aether/uds"), uid, &socket_of(&info).unwrap());
        assert!(
            path.as_os_str().len() + 48 - "app.sock".len() <= 107,
            "{}",
            path.display()
        );
        links.unlink(&info).unwrap();
        links.unlink(&info).unwrap();
        assert!(!dir.path().join("uds").join(uid).exists());
        assert!(
            links.link(&pod("", "sockets/app.sock")).is_err(),
            "no uid, no volume path"
        );
        assert!(links.link(&pod("../x", "sockets/app.sock")).is_err());
    }
}
