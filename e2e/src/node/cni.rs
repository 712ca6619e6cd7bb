//! The pod network: one Linux bridge with host-local IPAM (the standard CNI
//! plugins from Debian's containernetworking-plugins, in /usr/lib/cni), plus
//! portmap for `hostPort`s. The host is the bridge's gateway, so the test
//! process reaches Pods at their IPs directly.
//!
//! The bridge and the iptables chains the plugins create are global to the
//! machine; [`RealCluster`](super::RealCluster)s are serialised by a host
//! lock and these names are used by nothing else.

use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{Context as _, Result, ensure};
use serde_json::json;

use super::process::run;

/// Where Debian's containernetworking-plugins install the plugins.
pub const CNI_BIN_DIR: &str = "/usr/lib/cni";
/// The CNI network name (also the prefix of libcni's cache files).
pub const NETWORK_NAME: &str = "kinference-e2e";
/// The bridge the Pods are attached to.
pub const BRIDGE: &str = "kinfe2e0";
/// The Pod subnet: the node's Pods get addresses in it, the host `.1`.
pub const POD_SUBNET: &str = "10.213.0.0/24";

/// Write the network configuration into containerd's CNI `conf_dir`;
/// host-local keeps its allocations under `ipam_dir` (not /var/lib/cni).
pub(crate) fn write_config(conf_dir: &Path, ipam_dir: &Path) -> Result<PathBuf> {
    let conflist = json!({
        "cniVersion": "1.0.0",
        "name": NETWORK_NAME,
        "plugins": [
            {
                "type": "bridge",
                "bridge": BRIDGE,
                "isGateway": true,
                "ipMasq": true,
                "hairpinMode": true,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{ "subnet": POD_SUBNET }]],
                    "routes": [{ "dst": "0.0.0.0/0" }],
                    "dataDir": ipam_dir,
                },
            },
            { "type": "portmap", "capabilities": { "portMappings": true } },
        ],
    });
    fs::create_dir_all(conf_dir)?;
    let path = conf_dir.join("10-kinference-e2e.conflist");
    fs::write(&path, serde_json::to_vec_pretty(&conflist)?)
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(path)
}

/// Fail early if the subnet is already routed on this machine (another
/// network would swallow or shadow the Pods' traffic).
pub(crate) fn check_subnet_unused() -> Result<()> {
    let routes = run("ip", &["-4", "route", "show", POD_SUBNET])?;
    let foreign: Vec<&str> = routes
        .lines()
        .filter(|l| !l.contains(&format!("dev {BRIDGE}")))
        .collect();
    ensure!(
        foreign.is_empty(),
        "the Pod subnet {POD_SUBNET} is already routed here: {foreign:?}"
    );
    Ok(())
}

/// Whether a network interface exists.
pub(crate) fn link_exists(name: &str) -> bool {
    Path::new("/sys/class/net").join(name).exists()
}

/// Delete the bridge and any veth still attached to it.
pub(crate) fn delete_bridge() -> Result<()> {
    if !link_exists(BRIDGE) {
        return Ok(());
    }
    let brif = Path::new("/sys/class/net").join(BRIDGE).join("brif");
    for port in fs::read_dir(&brif).into_iter().flatten().flatten() {
        let _ = run(
            "ip",
            &["link", "delete", &port.file_name().to_string_lossy()],
        );
    }
    run("ip", &["link", "delete", BRIDGE]).map(|_| ())
}
