//! What a device's ports and GID tables say, as plain data, and the engine's choice of GID:
//! the leaf both the device layer (`sys`, which fills these in) and the preflight
//! ([`crate::probe`], which reports them) use, so neither depends on the other.

use std::net::Ipv6Addr;

/// One GID of a port.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GidInfo {
    /// Index in the port's GID table.
    pub index: u32,
    /// The GID.
    pub gid: [u8; 16],
    /// Its type as the kernel reports it (`RoCE v2`, `IB/RoCE v1`), if it says.
    pub kind: Option<String>,
    /// The network device it belongs to (RoCE), if any.
    pub netdev: Option<String>,
}

impl GidInfo {
    /// The GID in IPv6 notation (`::ffff:10.0.2.15` for an IPv4-mapped RoCE v2 GID).
    pub fn text(&self) -> String {
        Ipv6Addr::from(self.gid).to_string()
    }
}

/// One port of a device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PortInfo {
    /// Port number (1-based).
    pub port: u8,
    /// `ACTIVE`, `DOWN`, `INIT`, `ARMED`, ...
    pub state: String,
    /// `Ethernet` (RoCE), `InfiniBand`, or `unspecified`.
    pub link_layer: String,
    /// Active MTU in bytes.
    pub active_mtu: u32,
    /// Largest MTU the port supports, in bytes.
    pub max_mtu: u32,
    /// The non-empty entries of the GID table.
    pub gids: Vec<GidInfo>,
}

impl PortInfo {
    /// Whether the port can carry traffic.
    pub fn is_active(&self) -> bool {
        self.state == "ACTIVE"
    }
}

/// One RDMA device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Its name (`mlx5_0`, `rxe0`).
    pub name: String,
    /// Its ports.
    pub ports: Vec<PortInfo>,
    /// Memory windows it supports (the engine needs type-2 windows to expose blocks to one
    /// peer only).
    pub max_mw: u32,
}

/// Whether `gid` is an IPv4-mapped address (`::ffff:a.b.c.d`): on RoCE, the v2 GID of an
/// IPv4 address, routable between subnets.
pub fn is_ipv4_mapped(gid: &[u8; 16]) -> bool {
    gid[..10].iter().all(|b| *b == 0) && gid[10] == 0xff && gid[11] == 0xff
}

/// The GID index the engine uses on a port whose table is `gids` (index, GID): `wanted`
/// (`spark.shuffle.rdma.gidIndex`) when set, else the first IPv4-mapped GID (RoCE v2 of an IPv4
/// address). Returns the index and why; the error says what is missing and which setting picks
/// another.
pub fn pick_gid(gids: &[(u32, [u8; 16])], wanted: Option<u8>) -> Result<(u8, String), String> {
    match wanted {
        Some(i) => match gids.iter().find(|(index, _)| *index == u32::from(i)) {
            Some(_) => Ok((i, format!("spark.shuffle.rdma.gidIndex={i}"))),
            None => Err(format!("spark.shuffle.rdma.gidIndex={i} names an empty or missing GID table entry")),
        },
        None => gids
            .iter()
            .find(|(index, g)| *index < 256 && is_ipv4_mapped(g))
            .map(|(index, g)| {
                let text = Ipv6Addr::from(*g);
                (
                    *index as u8,
                    format!(
                        "the first IPv4-mapped GID ({text}, RoCE v2 of an IPv4 address); \
                         spark.shuffle.rdma.gidIndex picks another"
                    ),
                )
            })
            .ok_or_else(|| {
                "no IPv4-mapped (RoCE v2) GID: give the netdev an IPv4 address, or set spark.shuffle.rdma.gidIndex".into()
            }),
    }
}

/// The kernel's name for the type of GID `index` of `device`'s `port`, and its network device
/// (from sysfs; `None` where the kernel does not say).
pub fn gid_attrs(device: &str, port: u8, index: u32) -> (Option<String>, Option<String>) {
    let base = format!("/sys/class/infiniband/{device}/ports/{port}/gid_attrs");
    let read = |what: &str| {
        std::fs::read_to_string(format!("{base}/{what}/{index}")).ok().map(|s| s.trim().to_string()).filter(|s| !s.is_empty())
    };
    (read("types"), read("ndevs"))
}

/// The MTU of an `ibv_mtu` enumeration value, in bytes (0 for an unknown value).
pub fn mtu_bytes(v: u32) -> u32 {
    if (1..=5).contains(&v) {
        128 << v
    } else {
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v4(a: [u8; 4]) -> [u8; 16] {
        let mut g = [0u8; 16];
        g[10] = 0xff;
        g[11] = 0xff;
        g[12..].copy_from_slice(&a);
        g
    }

    #[test]
    fn the_engine_takes_the_first_ipv4_mapped_gid_unless_told_otherwise() {
        let link_local = {
            let mut g = [0u8; 16];
            g[0] = 0xfe;
            g[1] = 0x80;
            g[15] = 1;
            g
        };
        // What rxe shows: index 0 link-local, index 1 the IPv4-mapped address.
        let table = [(0, link_local), (1, v4([10, 0, 2, 15]))];
        let (i, why) = pick_gid(&table, None).unwrap();
        assert_eq!(i, 1);
        assert!(why.contains("::ffff:10.0.2.15") && why.contains("gidIndex"), "{why}");
        assert_eq!(pick_gid(&table, Some(0)).unwrap().0, 0);
        assert!(pick_gid(&table, Some(7)).unwrap_err().contains("gidIndex=7"));
        let e = pick_gid(&table[..1], None).unwrap_err();
        assert!(e.contains("IPv4") && e.contains("gidIndex"), "{e}");
        assert_eq!(GidInfo { index: 1, gid: v4([10, 0, 2, 15]), kind: None, netdev: None }.text(), "::ffff:10.0.2.15");
    }

    #[test]
    fn mtus_are_bytes() {
        assert_eq!((mtu_bytes(1), mtu_bytes(3), mtu_bytes(5), mtu_bytes(9)), (256, 1024, 4096, 0));
    }
}
