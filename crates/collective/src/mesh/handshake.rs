//! The mesh handshake as a sans-IO exchange: the driver loop feeds it the bodies of the
//! peer's handshake messages and sends what it answers.
//!
//! ```text
//!  connecting rank (higher)                 accepting rank (lower)
//!   HELLO   {magic, version, world, from, to, auth, nonce, job}  →
//!                                         ←  WELCOME {same fields of the acceptor ‖ server proof}
//!   PROOF   {client proof}                                       →
//!                                         ←  READY
//! ```
//!
//! Both proofs are HMAC-SHA256 under the shared secret over a [`Transcript`] of the exact
//! HELLO and WELCOME fields (so both nonces, ranks, world and job are covered), with the
//! client and server labels of `wire`'s authentication (a proof cannot be reflected as the
//! other role's). The acceptor proves first; the connecting side proves only to an acceptor
//! that proved it knows the secret. Any difference (job, world, ranks, one side without the
//! secret) is refused with a reason naming what differs and the setting to change.

use super::MAX_JOB_LEN;
use rdma_shuffle_wire::frame::PROOF_LEN;
use rdma_shuffle_wire::{Secret, Transcript};

/// Version of the mesh handshake; both sides must speak the same.
const MESH_VERSION: u32 = 2;
const MAGIC: &[u8; 8] = b"MOBIUSv2";
const NONCE_LEN: usize = 16;
/// The `credits` field of the server proof: the mesh grants none, the version stands in.
const PROOF_TAG: u32 = MESH_VERSION;

/// Who this rank is, and what a peer must match.
#[derive(Clone)]
pub(crate) struct Handshaker {
    pub(crate) rank: usize,
    pub(crate) world: usize,
    pub(crate) job: String,
    pub(crate) secret: Option<Secret>,
}

#[derive(Debug)]
struct Hello {
    world: u32,
    from: u32,
    to: u32,
    auth: bool,
    nonce: [u8; NONCE_LEN],
    job: String,
}

impl Hello {
    fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(64 + self.job.len());
        b.extend_from_slice(MAGIC);
        b.extend_from_slice(&MESH_VERSION.to_be_bytes());
        b.extend_from_slice(&self.world.to_be_bytes());
        b.extend_from_slice(&self.from.to_be_bytes());
        b.extend_from_slice(&self.to.to_be_bytes());
        b.push(self.auth as u8);
        b.extend_from_slice(&self.nonce);
        b.extend_from_slice(&(self.job.len() as u16).to_be_bytes());
        b.extend_from_slice(self.job.as_bytes());
        b
    }

    fn decode(b: &[u8]) -> Result<Hello, String> {
        let mut r = Reader(b);
        if r.take(8)? != MAGIC {
            return Err("not a Mobius mesh peer of this version (bad magic); use the same Mobius build on every rank".into());
        }
        let version = r.u32()?;
        if version != MESH_VERSION {
            return Err(format!("mesh protocol version {version}, this rank speaks {MESH_VERSION}; use the same Mobius build"));
        }
        let world = r.u32()?;
        let from = r.u32()?;
        let to = r.u32()?;
        let auth = r.take(1)?[0] != 0;
        let mut nonce = [0u8; NONCE_LEN];
        nonce.copy_from_slice(r.take(NONCE_LEN)?);
        let n = u16::from_be_bytes([r.take(1)?[0], r.take(1)?[0]]) as usize;
        if n > MAX_JOB_LEN {
            return Err(format!("job name of {n} bytes"));
        }
        let job = String::from_utf8(r.take(n)?.to_vec()).map_err(|_| "job name is not UTF-8".to_string())?;
        if !r.0.is_empty() {
            return Err("trailing bytes after the hello".into());
        }
        Ok(Hello { world, from, to, auth, nonce, job })
    }
}

/// A cursor over handshake and control bodies.
pub(crate) struct Reader<'a>(pub(crate) &'a [u8]);

impl<'a> Reader<'a> {
    pub(crate) fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        if self.0.len() < n {
            return Err("truncated message".into());
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }
    pub(crate) fn u32(&mut self) -> Result<u32, String> {
        let b = self.take(4)?;
        Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }
    pub(crate) fn u64(&mut self) -> Result<u64, String> {
        let b = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_be_bytes(a))
    }
}

fn nonce() -> [u8; NONCE_LEN] {
    let mut n = [0u8; NONCE_LEN];
    rand::RngCore::fill_bytes(&mut rand::rngs::OsRng, &mut n);
    n
}

/// The transcript both proofs cover: the exact HELLO and WELCOME fields.
fn transcript(hello: &[u8], welcome_fields: &[u8]) -> Transcript {
    Transcript::of_messages(hello, welcome_fields)
}

const NO_SECRET_HERE: &str = "it requires a shared secret and this rank has none; set the same MOBIUS_SECRET on every rank";
const NO_SECRET_THERE: &str =
    "it runs without a shared secret but this rank requires one; set the same MOBIUS_SECRET on every rank";

/// The connecting side, after it sent its HELLO.
pub(crate) struct ClientHs {
    to: usize,
    hello: Vec<u8>,
}

/// The accepting side, after it answered a HELLO with its WELCOME.
pub(crate) struct ServerHs {
    pub(crate) from: usize,
    transcript: Transcript,
}

impl Handshaker {
    /// Starts a handshake with the lower rank `to`: the HELLO body to send.
    pub(crate) fn client_hello(&self, to: usize) -> (ClientHs, Vec<u8>) {
        let hello = Hello {
            world: self.world as u32,
            from: self.rank as u32,
            to: to as u32,
            auth: self.secret.is_some(),
            nonce: nonce(),
            job: self.job.clone(),
        }
        .encode();
        (ClientHs { to, hello: hello.clone() }, hello)
    }

    /// The acceptor's WELCOME: checks who it is and its proof; answers the PROOF body.
    pub(crate) fn client_welcome(&self, hs: &ClientHs, welcome: &[u8]) -> Result<Vec<u8>, String> {
        if welcome.len() < PROOF_LEN {
            return Err("truncated welcome".into());
        }
        let (fields, server_proof) = welcome.split_at(welcome.len() - PROOF_LEN);
        let w = Hello::decode(fields)?;
        if w.from as usize != hs.to || w.to as usize != self.rank || w.world as usize != self.world || w.job != self.job {
            return Err(format!(
                "it answered as rank {} of world {} in job {:?} (expected rank {} of world {} in job {:?})",
                w.from, w.world, w.job, hs.to, self.world, self.job
            ));
        }
        match (&self.secret, w.auth) {
            (Some(s), true) => {
                let t = transcript(&hs.hello, fields);
                let mut p = [0u8; PROOF_LEN];
                p.copy_from_slice(server_proof);
                if !s.verify_server(&t, PROOF_TAG, &p) {
                    return Err("authentication failed: it does not know the shared secret (server proof invalid): a rank of another group, or \
                         MOBIUS_SECRET differs; set the same MOBIUS_SECRET on every rank"
                        .into());
                }
                Ok(s.client_proof(&t).to_vec())
            }
            (Some(_), false) => Err(NO_SECRET_THERE.into()),
            (None, true) => Err(NO_SECRET_HERE.into()),
            (None, false) => Ok(vec![0u8; PROOF_LEN]),
        }
    }

    /// A HELLO arrived: checks it and answers the WELCOME body. The error names the rank
    /// the peer claimed, when it could be read, and the reason to send it.
    pub(crate) fn server_hello(&self, hello: &[u8]) -> Result<(ServerHs, Vec<u8>), (Option<usize>, String)> {
        let h = Hello::decode(hello).map_err(|e| (None, e))?;
        let from = h.from as usize;
        let refuse = |why: String| Err((Some(from), why));
        if h.job != self.job {
            return refuse(format!(
                "job {:?} connected to job {:?}: a rank of another group or of an earlier job (set MOBIUS_JOB alike on every \
                 rank)",
                h.job, self.job
            ));
        }
        if h.world as usize != self.world {
            return refuse(format!(
                "world size {} differs from this rank's {} (set WORLD_SIZE alike on every rank)",
                h.world, self.world
            ));
        }
        if h.to as usize != self.rank || from <= self.rank || from >= self.world {
            return refuse(format!("a connection claiming rank {} for rank {} reached rank {}", h.from, h.to, self.rank));
        }
        match (&self.secret, h.auth) {
            (Some(_), false) => {
                return refuse(
                    "this rank requires a shared secret and the peer has none; set the same MOBIUS_SECRET on every rank".into(),
                )
            }
            (None, true) => {
                return refuse(
                    "the peer requires a shared secret and this rank has none; set the same MOBIUS_SECRET on every rank".into(),
                )
            }
            _ => {}
        }
        let fields = Hello {
            world: self.world as u32,
            from: self.rank as u32,
            to: from as u32,
            auth: self.secret.is_some(),
            nonce: nonce(),
            job: self.job.clone(),
        }
        .encode();
        let t = transcript(hello, &fields);
        let proof = match &self.secret {
            Some(s) => s.server_proof(&t, PROOF_TAG),
            None => [0u8; PROOF_LEN],
        };
        let mut welcome = fields;
        welcome.extend_from_slice(&proof);
        Ok((ServerHs { from, transcript: t }, welcome))
    }

    /// The connecting side's PROOF: checks it (with a secret). On `Ok` the peer is
    /// authenticated and READY goes out.
    pub(crate) fn server_proof(&self, hs: &ServerHs, proof: &[u8]) -> Result<(), String> {
        if let Some(s) = &self.secret {
            let ok = proof.len() == PROOF_LEN && {
                let mut p = [0u8; PROOF_LEN];
                p.copy_from_slice(proof);
                s.verify_client(&hs.transcript, &p)
            };
            if !ok {
                return Err(
                    "authentication failed: the peer does not know the shared secret (a rank of another group, or MOBIUS_SECRET \
                     differs)"
                        .into(),
                );
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hs(rank: usize, secret: Option<&str>, job: &str) -> Handshaker {
        Handshaker { rank, world: 3, job: job.into(), secret: secret.map(Secret::new) }
    }

    fn run(client: &Handshaker, server: &Handshaker) -> Result<(), String> {
        let (c, hello) = client.client_hello(server.rank);
        let (s, welcome) = server.server_hello(&hello).map_err(|e| e.1)?;
        let proof = client.client_welcome(&c, &welcome)?;
        server.server_proof(&s, &proof)
    }

    #[test]
    fn matching_peers_authenticate_and_every_difference_is_refused_with_the_setting() {
        assert!(run(&hs(2, Some("k"), "j"), &hs(0, Some("k"), "j")).is_ok());
        assert!(run(&hs(2, None, "j"), &hs(0, None, "j")).is_ok());
        let e = run(&hs(2, Some("bad"), "j"), &hs(0, Some("k"), "j")).unwrap_err();
        assert!(e.contains("MOBIUS_SECRET"), "{e}");
        let e = run(&hs(2, None, "j"), &hs(0, Some("k"), "j")).unwrap_err();
        assert!(e.contains("MOBIUS_SECRET"), "{e}");
        let e = run(&hs(2, None, "other"), &hs(0, None, "j")).unwrap_err();
        assert!(e.contains("\"other\"") && e.contains("MOBIUS_JOB"), "{e}");
        // A lower rank may not connect to a higher one.
        let e = run(&hs(0, None, "j"), &hs(2, None, "j")).unwrap_err();
        assert!(e.contains("claiming rank 0"), "{e}");
    }

    #[test]
    fn a_tampered_welcome_or_a_replayed_proof_fails() {
        let (c, s) = (hs(1, Some("k"), "j"), hs(0, Some("k"), "j"));
        let (ch, hello) = c.client_hello(0);
        let (_, mut welcome) = s.server_hello(&hello).unwrap();
        // The acceptor's nonce changed on the way: the transcript differs, its proof fails.
        welcome[30] ^= 1;
        assert!(c.client_welcome(&ch, &welcome).unwrap_err().contains("server proof invalid"));
        // A proof made for one connection does not open another (fresh nonces).
        let (ch1, hello1) = c.client_hello(0);
        let (_, welcome1) = s.server_hello(&hello1).unwrap();
        let proof1 = c.client_welcome(&ch1, &welcome1).unwrap();
        let (_, hello2) = c.client_hello(0);
        let (sh2, _) = s.server_hello(&hello2).unwrap();
        assert!(s.server_proof(&sh2, &proof1).is_err());
        assert!(Hello::decode(b"GET / HTTP/1.0\r\n\r\n").unwrap_err().contains("bad magic"));
    }

    #[test]
    fn random_bytes_and_truncated_hellos_are_refused_before_any_proof() {
        let s = hs(0, Some("k"), "mobius/g1");
        let mut junk = [0u8; 300];
        for (i, b) in junk.iter_mut().enumerate() {
            *b = (i as u8).wrapping_mul(151).wrapping_add(7);
        }
        assert!(s.server_hello(&junk).err().unwrap().1.contains("bad magic"));
        let (_, hello) = hs(1, Some("k"), "mobius/g1").client_hello(0);
        for cut in [0, 8, 20, hello.len() - 1] {
            assert!(s.server_hello(&hello[..cut]).is_err(), "a hello cut at {cut} bytes was accepted");
        }
        // An earlier group of the same name (another id) is refused even with the same secret.
        let (_, old) = hs(1, Some("k"), "mobius/g0").client_hello(0);
        let (claimed, why) = s.server_hello(&old).err().unwrap();
        assert_eq!(claimed, Some(1));
        assert!(why.contains("mobius/g0"), "{why}");
    }
}
