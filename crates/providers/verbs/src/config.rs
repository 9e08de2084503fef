//! The settings of the verbs provider.

/// Settings of the verbs provider. Receive and send buffers are per driver (engine), not
/// per connection.
#[derive(Clone, Debug)]
pub struct VerbsConfig {
    /// Device name (`mlx5_0`, `rxe0`); `None` takes the first device with an active port.
    pub device: Option<String>,
    /// Port number (1-based).
    pub port: u8,
    /// GID index; `None` picks the first RoCEv2 IPv4-mapped GID (`::ffff:a.b.c.d`).
    pub gid_index: Option<u8>,
    /// Buffers of each driver's shared receive queue (shared by every peer). Half of
    /// them back the credits its server grants, half the answers its client waits for.
    pub recv_buffers: u32,
    /// Registered send buffers of each driver.
    pub send_buffers: u32,
    /// Largest message (frame + eager payload): the size of every receive and send
    /// buffer. Peers announce theirs when they attach.
    pub max_message: u32,
    /// Bytes the pool may register, checked against the memlock limit when opening.
    pub pool_bytes: u64,
    /// Send-queue depth of each queue pair (sends, reads and binds posted at once).
    pub sq_depth: u32,
    /// One-sided reads one queue pair may have in flight.
    pub max_reads_per_qp: u32,
    /// Receiver-not-ready NAK timer this side asks senders to wait (IB encoding; 26 =
    /// 61 ms).
    pub min_rnr_timer: u8,
    /// Retries after a receiver-not-ready NAK before the send fails (finite: 7 would
    /// retry forever).
    pub rnr_retry: u8,
}

impl Default for VerbsConfig {
    /// 512 receive buffers and 128 send buffers of 68 KiB (64 KiB eager threshold plus
    /// frame headroom): about 43 MiB registered per driver whatever the number of peers.
    fn default() -> Self {
        VerbsConfig {
            device: None,
            port: 1,
            gid_index: None,
            recv_buffers: crate::DEFAULT_RECV_BUFFERS,
            send_buffers: crate::DEFAULT_SEND_BUFFERS,
            max_message: crate::DEFAULT_MAX_MESSAGE,
            pool_bytes: 0,
            sq_depth: 256,
            max_reads_per_qp: 128,
            min_rnr_timer: 26,
            rnr_retry: 6,
        }
    }
}

impl VerbsConfig {
    /// Registered bytes of one driver's receive and send buffers.
    pub fn buffer_bytes(&self) -> u64 {
        (self.recv_buffers as u64 + self.send_buffers as u64) * self.max_message as u64
    }
}
