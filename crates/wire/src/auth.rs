//! Challenge–response authentication over the whole handshake transcript.
//!
//! When the application runs with authentication on, every engine of it knows the same
//! secret. The handshake is `Hello` (client: versions, capabilities, nonce, eager limit,
//! application id), `Challenge` (server: chosen version, capabilities, nonce, whether auth is
//! required, credit limit, eager threshold, application id), `Auth` (client proof) and
//! `Ready` (server proof and the live credit grant).
//!
//! Both proofs are HMAC-SHA256 keyed by the secret over a [`Transcript`]: the SHA-256 of the
//! exact encoded `Hello` and `Challenge` frames. So every negotiated field and both nonces are
//! covered: a field changed on the way (a lower version, other capabilities, more credits,
//! another application id) makes the two sides hash different transcripts, and the proof
//! fails. The client proves `HMAC(secret, CLIENT_LABEL ‖ transcript)`; the server answers
//! `HMAC(secret, SERVER_LABEL ‖ transcript ‖ credits)`, which also covers the one field
//! `Ready` adds. Fresh nonces on both sides stop replay onto another connection; the labels
//! stop a proof from being reflected back as the other role's. The secret never crosses the
//! wire.

use crate::frame::{Frame, PROOF_LEN};
use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};
use std::fmt;

type HmacSha256 = Hmac<Sha256>;

const CLIENT_LABEL: &[u8] = b"rdma-shuffle v2 client";
const SERVER_LABEL: &[u8] = b"rdma-shuffle v2 server";

/// SHA-256 of the encoded `Hello` and `Challenge` of one connection, as both sides saw them.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Transcript([u8; 32]);

impl Transcript {
    /// The transcript of a `Hello` followed by a `Challenge`. The codec is canonical (a
    /// decoded frame re-encodes to the same bytes), so both sides can hash frames they built
    /// or decoded alike.
    pub fn new(hello: &Frame, challenge: &Frame) -> Self {
        let mut h = Sha256::new();
        h.update(hello.to_vec());
        h.update(challenge.to_vec());
        Transcript(h.finalize().into())
    }

    /// The transcript of two handshake messages of a protocol that is not this one (the shm
    /// provider's, Mobius's mesh): each is length-prefixed, so no two pairs hash alike.
    pub fn of_messages(first: &[u8], second: &[u8]) -> Self {
        let mut h = Sha256::new();
        for m in [first, second] {
            h.update((m.len() as u64).to_be_bytes());
            h.update(m);
        }
        Transcript(h.finalize().into())
    }

    /// The hash bytes.
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }
}

impl fmt::Debug for Transcript {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Transcript({:02x}{:02x}{:02x}{:02x}..)", self.0[0], self.0[1], self.0[2], self.0[3])
    }
}

/// A shared secret. Its `Debug` output never shows the bytes.
#[derive(Clone)]
pub struct Secret(Vec<u8>);

impl Secret {
    /// Wraps the secret bytes (the application's shared secret, as UTF-8).
    pub fn new(bytes: impl Into<Vec<u8>>) -> Self {
        Secret(bytes.into())
    }

    fn mac(&self, label: &[u8], transcript: &Transcript, extra: &[u8]) -> HmacSha256 {
        // HMAC accepts keys of any length; `new_from_slice` cannot fail for it.
        let mut mac = match HmacSha256::new_from_slice(&self.0) {
            Ok(m) => m,
            Err(_) => unreachable_hmac(),
        };
        mac.update(label);
        mac.update(transcript.as_bytes());
        mac.update(extra);
        mac
    }

    /// The client's proof for this transcript.
    pub fn client_proof(&self, transcript: &Transcript) -> [u8; PROOF_LEN] {
        self.mac(CLIENT_LABEL, transcript, &[]).finalize().into_bytes().into()
    }

    /// The server's proof for this transcript and live credit grant.
    pub fn server_proof(&self, transcript: &Transcript, credits: u32) -> [u8; PROOF_LEN] {
        self.mac(SERVER_LABEL, transcript, &credits.to_be_bytes()).finalize().into_bytes().into()
    }

    /// Checks a client proof in constant time.
    pub fn verify_client(&self, transcript: &Transcript, proof: &[u8; PROOF_LEN]) -> bool {
        self.mac(CLIENT_LABEL, transcript, &[]).verify_slice(proof).is_ok()
    }

    /// Checks a server proof in constant time.
    pub fn verify_server(&self, transcript: &Transcript, credits: u32, proof: &[u8; PROOF_LEN]) -> bool {
        self.mac(SERVER_LABEL, transcript, &credits.to_be_bytes()).verify_slice(proof).is_ok()
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

    fn hello(nonce: u8, app: &str) -> Frame {
        Frame::Hello { min_version: 3, max_version: 3, caps: 7, nonce: [nonce; 16], max_eager: 4096, app_id: app.into() }
    }

    fn challenge(credits: u32) -> Frame {
        Frame::Challenge {
            version: 3,
            caps: 7,
            nonce: [2; 16],
            auth_required: true,
            credits,
            eager_threshold: 1024,
            app_id: "app".into(),
        }
    }

    #[test]
    fn proofs_verify_only_with_the_same_secret_transcript_and_role() {
        let s = Secret::new("app-secret");
        let t = Transcript::new(&hello(1, "app"), &challenge(8));
        let p = s.client_proof(&t);
        assert!(s.verify_client(&t, &p));
        assert!(!Secret::new("other").verify_client(&t, &p));
        assert!(!s.verify_server(&t, 8, &p), "a client proof is not a server proof");
        let sp = s.server_proof(&t, 8);
        assert!(s.verify_server(&t, 8, &sp));
        assert!(!s.verify_server(&t, 9, &sp), "the live grant is covered");
        assert!(!format!("{s:?}").contains("app-secret"));
    }

    #[test]
    fn every_transcript_field_changes_the_proof() {
        let s = Secret::new("k");
        let base = Transcript::new(&hello(1, "app"), &challenge(8));
        let p = s.client_proof(&base);
        for t in [
            Transcript::new(&hello(3, "app"), &challenge(8)),
            Transcript::new(&hello(1, "app2"), &challenge(8)),
            Transcript::new(&hello(1, "app"), &challenge(9)),
            Transcript::new(&challenge(8), &hello(1, "app")),
        ] {
            assert_ne!(t, base);
            assert!(!s.verify_client(&t, &p), "{t:?}");
        }
    }
}
