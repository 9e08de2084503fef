//! Challenge–response authentication with a shared secret.
//!
//! When Spark's `spark.authenticate` is on, every executor of an application knows the same
//! secret. Each side picks a fresh nonce; the client proves knowledge of the secret with
//! `HMAC-SHA256(secret, "rdma-shuffle client" || client_nonce || server_nonce)` and the server
//! answers with the same construction under its own label, so both sides are authenticated
//! and neither proof can be replayed on another connection (the nonces differ) or reflected
//! (the labels differ). The secret itself never crosses the wire.

use crate::frame::{NONCE_LEN, PROOF_LEN};
use hmac::{Hmac, Mac};
use sha2::Sha256;
use std::fmt;

type HmacSha256 = Hmac<Sha256>;

const CLIENT_LABEL: &[u8] = b"rdma-shuffle client";
const SERVER_LABEL: &[u8] = b"rdma-shuffle server";

/// A shared secret. Its `Debug` output never shows the bytes.
#[derive(Clone)]
pub struct Secret(Vec<u8>);

impl Secret {
    /// Wraps the secret bytes (Spark's `spark.authenticate.secret`, UTF-8).
    pub fn new(bytes: impl Into<Vec<u8>>) -> Self {
        Secret(bytes.into())
    }

    fn mac(&self, label: &[u8], client: &[u8; NONCE_LEN], server: &[u8; NONCE_LEN]) -> HmacSha256 {
        // HMAC accepts keys of any length; `new_from_slice` cannot fail for it.
        let mut mac = match HmacSha256::new_from_slice(&self.0) {
            Ok(m) => m,
            Err(_) => unreachable_hmac(),
        };
        mac.update(label);
        mac.update(client);
        mac.update(server);
        mac
    }

    /// The client's proof for this pair of nonces.
    pub fn client_proof(&self, client: &[u8; NONCE_LEN], server: &[u8; NONCE_LEN]) -> [u8; PROOF_LEN] {
        self.mac(CLIENT_LABEL, client, server).finalize().into_bytes().into()
    }

    /// The server's proof for this pair of nonces.
    pub fn server_proof(&self, client: &[u8; NONCE_LEN], server: &[u8; NONCE_LEN]) -> [u8; PROOF_LEN] {
        self.mac(SERVER_LABEL, client, server).finalize().into_bytes().into()
    }

    /// Checks a client proof in constant time.
    pub fn verify_client(&self, client: &[u8; NONCE_LEN], server: &[u8; NONCE_LEN], proof: &[u8; PROOF_LEN]) -> bool {
        self.mac(CLIENT_LABEL, client, server).verify_slice(proof).is_ok()
    }

    /// Checks a server proof in constant time.
    pub fn verify_server(&self, client: &[u8; NONCE_LEN], server: &[u8; NONCE_LEN], proof: &[u8; PROOF_LEN]) -> bool {
        self.mac(SERVER_LABEL, client, server).verify_slice(proof).is_ok()
    }
}

#[cold]
fn unreachable_hmac() -> ! {
    // hmac documents that HMAC keys of any length are valid.
    unreachable!("HMAC-SHA256 accepts keys of any length")
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Secret(<{} bytes>)", self.0.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proofs_verify_only_with_the_same_secret_nonces_and_role() {
        let s = Secret::new("app-secret");
        let (c, n) = ([1u8; 16], [2u8; 16]);
        let p = s.client_proof(&c, &n);
        assert!(s.verify_client(&c, &n, &p));
        assert!(!Secret::new("other").verify_client(&c, &n, &p));
        assert!(!s.verify_client(&n, &c, &p), "nonces swapped");
        assert!(!s.verify_server(&c, &n, &p), "a client proof is not a server proof");
        assert_ne!(s.server_proof(&c, &n), p);
        assert!(!format!("{s:?}").contains("app-secret"));
    }
}
