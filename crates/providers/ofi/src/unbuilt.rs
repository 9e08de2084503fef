//! The crate without the `libfabric` feature: opening an endpoint is refused with a typed
//! error that says how to build it, rather than the provider vanishing silently.

use crate::config::OfiConfig;
use crate::error::OfiError;

/// Stands in for the libfabric endpoint in builds without libfabric; never constructed.
#[derive(Debug)]
pub struct Endpoint {
    _never: std::convert::Infallible,
}

impl Endpoint {
    /// Always [`OfiError::NotBuilt`].
    pub fn open(_cfg: &OfiConfig) -> Result<Self, OfiError> {
        Err(OfiError::NotBuilt)
    }
}
