//! What an endpoint is opened with, and what the provider granted.

/// The libfabric provider used when none is named: TCP sockets under the `ofi_rxm` utility
/// provider, which turns connected endpoints into reliable datagrams. It runs on any host.
pub const DEFAULT_PROVIDER: &str = "tcp;ofi_rxm";

/// How to open a reliable-datagram endpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OfiConfig {
    /// libfabric provider name as `fi_info -l` prints it; a utility provider is layered with
    /// `;` (`tcp;ofi_rxm`, `verbs;ofi_rxm`, `shm`, `efa`, ...).
    pub provider: String,
    /// Local address to bind (passed to `fi_getinfo` with `FI_SOURCE`); `None` lets the
    /// provider choose. For `tcp;ofi_rxm` an IP address such as `127.0.0.1`.
    pub node: Option<String>,
    /// Local service (port for tcp) to bind; `None` for an ephemeral one.
    pub service: Option<String>,
    /// The libfabric domain to open (`fi_info -v`'s domain name: a NIC such as `rxe0` or
    /// `efa_0`, an interface such as `eth0` for tcp); `None` takes the provider's first.
    pub domain: Option<String>,
    /// Ask for one-sided read (`FI_RMA`). When the provider has none the endpoint opens
    /// without it and [`EndpointInfo::rma`] says so.
    pub rma: bool,
    /// Receive buffers kept posted.
    pub rx_depth: usize,
    /// Size of each receive buffer: the largest message either end may send.
    pub max_msg: usize,
    /// Completion-queue entries.
    pub cq_size: usize,
    /// Ask for a completion queue with a file descriptor to wait on (`FI_WAIT_FD`). When the
    /// provider has none the queue is opened without and must be polled each turn.
    pub wait_fd: bool,
}

impl Default for OfiConfig {
    fn default() -> Self {
        OfiConfig {
            provider: DEFAULT_PROVIDER.to_string(),
            node: None,
            service: None,
            domain: None,
            rma: true,
            rx_depth: 64,
            max_msg: 64 * 1024,
            cq_size: 1024,
            wait_fd: true,
        }
    }
}

impl OfiConfig {
    /// A configuration for `provider` with the defaults otherwise.
    pub fn provider(provider: &str) -> Self {
        OfiConfig { provider: provider.to_string(), ..Default::default() }
    }
}

/// What the provider granted for an open endpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndpointInfo {
    /// The provider chain libfabric chose (`fi_info`'s `prov_name`, e.g. `tcp;ofi_rxm`).
    pub provider: String,
    /// The fabric name (e.g. an IP network for tcp, `shm` for shm, the device for verbs).
    pub fabric: String,
    /// The domain name (a NIC, an interface).
    pub domain: String,
    /// One-sided read of registered memory is available.
    pub rma: bool,
    /// Completions carry the sender's address (`FI_SOURCE`).
    pub source: bool,
    /// Local buffers must be registered for sends, receives and reads (`FI_MR_LOCAL`).
    pub mr_local: bool,
    /// Remote addresses are virtual addresses (`FI_MR_VIRT_ADDR`); else offsets.
    pub mr_virt_addr: bool,
    /// Largest message `fi_inject` takes (no completion, buffer reusable at once).
    pub inject_size: usize,
    /// Largest message the provider transfers.
    pub max_msg_size: usize,
    /// The completion queue has a file descriptor to wait on.
    pub wait_fd: bool,
    /// Bytes of a memory key the application may choose (`mr_key_size`; 0 where the
    /// provider chooses keys itself, `FI_MR_PROV_KEY`).
    pub key_bytes: usize,
    /// Registrations a peer reads must be bound to the endpoint (`FI_MR_ENDPOINT`).
    pub mr_endpoint: bool,
    /// Addresses are socket addresses (`FI_SOCKADDR_IN`/`IN6`): a domain is an IP interface
    /// and an endpoint binds one of its addresses (tcp).
    pub sockaddr: bool,
}

/// A region of a peer's memory that peer exposed for one-sided read: what travels on the
/// wire (24 bytes) after the peer authenticated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RemoteRegion {
    /// Address to read at offset 0 (a virtual address under `FI_MR_VIRT_ADDR`, else 0).
    pub addr: u64,
    /// Bytes exposed.
    pub len: u64,
    /// The memory key.
    pub key: u64,
}

impl RemoteRegion {
    /// Encoded length.
    pub const ENCODED_LEN: usize = 24;

    /// Little-endian encoding: addr, len, key.
    pub fn encode(&self) -> [u8; Self::ENCODED_LEN] {
        let mut out = [0u8; Self::ENCODED_LEN];
        out[..8].copy_from_slice(&self.addr.to_le_bytes());
        out[8..16].copy_from_slice(&self.len.to_le_bytes());
        out[16..].copy_from_slice(&self.key.to_le_bytes());
        out
    }

    /// Decodes [`encode`](Self::encode)'s output; `None` unless exactly 24 bytes.
    pub fn decode(bytes: &[u8]) -> Option<Self> {
        if bytes.len() != Self::ENCODED_LEN {
            return None;
        }
        let word = |i: usize| u64::from_le_bytes(bytes[i..i + 8].try_into().expect("8 bytes"));
        Some(RemoteRegion { addr: word(0), len: word(8), key: word(16) })
    }
}

/// A peer's index in the endpoint's address vector (libfabric's `fi_addr_t`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PeerAddr(pub u64);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remote_region_round_trips_and_refuses_other_lengths() {
        let r = RemoteRegion { addr: 0x7f00_0000_1000, len: 1 << 20, key: 0xdead_beef_0000_0001 };
        assert_eq!(RemoteRegion::decode(&r.encode()), Some(r));
        assert_eq!(RemoteRegion::decode(&r.encode()[..23]), None);
        assert_eq!(RemoteRegion::decode(&[0u8; 25]), None);
    }
}
