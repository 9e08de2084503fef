//! Typed errors of the libfabric layer. Each names the libfabric call that failed and
//! libfabric's own text for the code (`fi_strerror`), so a user can look it up.

/// Errors of the libfabric layer.
#[derive(Debug, thiserror::Error)]
pub enum OfiError {
    /// A libfabric call returned an error code.
    #[error("{call} failed: {message} (libfabric error {code})")]
    Call {
        /// The libfabric function, e.g. `fi_endpoint`.
        call: &'static str,
        /// The positive libfabric error number (`FI_E*`).
        code: i32,
        /// `fi_strerror(code)`.
        message: String,
    },
    /// `fi_getinfo` found no provider by that name offering what the engine needs.
    #[error(
        "no libfabric provider '{provider}' offers {wanted} on this host ({message}); \
         `fi_info -l` lists the providers this libfabric has, and \
         spark.shuffle.rdma.ofi.provider chooses one"
    )]
    NoProvider {
        /// The provider name asked for (e.g. `tcp;ofi_rxm`).
        provider: String,
        /// What was asked of it (endpoint type, capabilities, memory-registration modes).
        wanted: String,
        /// `fi_strerror` of fi_getinfo's answer.
        message: String,
    },
    /// An operation completed with an error (read from the completion queue's error entry).
    #[error("{op} completed with an error: {message} (libfabric error {code}, provider error {prov_errno})")]
    Completion {
        /// Which kind of operation (`send`, `recv`, `read`).
        op: &'static str,
        /// The positive libfabric error number.
        code: i32,
        /// The provider's own error number.
        prov_errno: i32,
        /// `fi_strerror` and the provider's `fi_cq_strerror` text.
        message: String,
    },
    /// A message larger than the receive buffers both ends post.
    #[error("a message of {len} bytes exceeds the {max}-byte receive buffers (max_msg)")]
    MessageTooLarge {
        /// Bytes asked to send.
        len: usize,
        /// The receive buffer size.
        max: usize,
    },
    /// The provider offers no one-sided read (`FI_RMA`); large blocks must go by messages.
    #[error("libfabric provider '{provider}' offers no RMA read (FI_RMA); use a rendezvous of messages")]
    NoRma {
        /// The provider in use.
        provider: String,
    },
    /// A read or a buffer use outside the bounds of a region.
    #[error("{what}: {len} bytes at offset {offset} fall outside a region of {region} bytes")]
    OutOfRange {
        /// What was checked.
        what: &'static str,
        /// Offset asked for.
        offset: u64,
        /// Length asked for.
        len: u64,
        /// The region's length.
        region: u64,
    },
    /// An argument the layer refuses before calling libfabric (a malformed peer address, a
    /// zero-length buffer, a name with a NUL byte).
    #[error("invalid {what}: {detail}")]
    Invalid {
        /// What was refused.
        what: &'static str,
        /// Why.
        detail: String,
    },
    /// This build of the crate has no libfabric (the `libfabric` feature is off).
    #[error(
        "this build has no libfabric provider: build with the `libfabric` feature after \
         scripts/ensure-libfabric.sh (PKG_CONFIG_PATH=<its prefix>/lib/pkgconfig)"
    )]
    NotBuilt,
}

impl OfiError {
    /// The libfabric error number, where the error carries one.
    pub fn code(&self) -> Option<i32> {
        match self {
            OfiError::Call { code, .. } | OfiError::Completion { code, .. } => Some(*code),
            _ => None,
        }
    }
}
