//! The `handshake` harness: the session state machines fed hostile or arbitrary peers.
//!
//! The input is a script. Its first byte picks a mode, a few bytes configure the sessions,
//! and the rest is a list of operations, each an op byte and its arguments, read with a
//! [`Cursor`] until the input ends (see the `*_op` modules for the op numbers, and
//! [`crate::seeds`] for scripts that do real work):
//!
//! - [`Mode::Server`]: a [`ServerSession`], with or without a secret, fed frames built from
//!   the input and sent through the codec, raw bytes through both decoders, a correct `Auth`
//!   (the proof cannot be guessed, so the script can ask for it), pulls and releases of the
//!   regions it announced, timeouts and connection loss.
//! - [`Mode::Client`]: a [`ClientSession`] that fetches blocks while the script plays the
//!   server: arbitrary frames, well-formed answers for the blocks it requested, pulls,
//!   credits, and the driver's `send_pull`/`pull_complete` calls.
//! - [`Mode::Pair`]: a client and a server connected in memory through the codec, the script
//!   choosing secrets, credits, thresholds, the blocks, the interleaving, and optional
//!   corruption, loss and timeouts.
//!
//! Invariants asserted (besides "no panic"):
//!
//! - server: with a secret, no block is resolved and no `Eager`, `Rendezvous`, `PullData`,
//!   `BlockFailed` or `Credit` is sent before an `Auth` carrying the correct proof arrived;
//!   its `Ready` carries the correct server proof; an `Err` from any handler leaves the
//!   session closed, and a closed session emits nothing more; in-flight blocks never exceed
//!   the credits; eager blocks respect both thresholds; pulls stay inside announced regions
//!   and within [`MAX_PULL_CHUNK`]; every output survives the codec;
//! - client: `Connected` only after a correct server proof when a secret is set; no `Fetch`
//!   before `Connected`, each block requested once and as asked; every block ends exactly
//!   once (delivered or failed), `RequestDone` exactly once and only after all of its blocks,
//!   `Closed` exactly once and only after every request is done; credits never exceed the
//!   grant; an `Err` leaves the session closed;
//! - pair, when nothing was disturbed: every block has exactly the outcome the resolver and
//!   the negotiated thresholds call for, all credits come back and every region is released;
//!   with mismatched secrets, nothing is served and every block fails with `AuthRefused`.

use crate::cursor::Cursor;
use crate::frames::{read_frame, same_after_codec, through_codec, TIGHT};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::{Duration, Instant};
use wire::frame::{Header, HEADER_LEN, MAX_PULL_CHUNK, NONCE_LEN, PROOF_LEN};
use wire::{
    caps, BlockFailure, BlockSpan, ClientConfig, ClientEvent, ClientSession, Descriptor, FailureCode, Frame, FrameError, Limits,
    ProtocolError, Resolved, Secret, ServerConfig, ServerOutput, ServerSession, Token, Transcript,
};

/// The server's nonce in every mode.
pub const SERVER_NONCE: [u8; NONCE_LEN] = [0x5e; NONCE_LEN];
/// The client's nonce in every mode.
pub const CLIENT_NONCE: [u8; NONCE_LEN] = [0xc1; NONCE_LEN];
/// The shared secret, where one is configured.
pub const SECRET: &str = "fuzz-secret";
/// A different secret, for mismatches.
pub const OTHER_SECRET: &str = "not-the-secret";

/// What the first input byte selects (modulo 3).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Mode {
    /// A server session against a scripted client.
    Server = 0,
    /// A client session against a scripted server.
    Client = 1,
    /// A client and a server against each other.
    Pair = 2,
}

/// Server-mode ops (the op byte is taken modulo [`server_op::COUNT`]).
pub mod server_op {
    /// A frame built from the input ([`crate::frames::read_frame`]), through the codec.
    pub const FRAME: u8 = 0;
    /// A `u16`-length blob decoded with `Frame::decode_message`.
    pub const RAW: u8 = 1;
    /// A blob decoded as a stream driver does: header, then the fixed part.
    pub const STREAM: u8 = 2;
    /// An `Auth` with the correct proof for the first `Hello`'s nonce.
    pub const VALID_AUTH: u8 = 3;
    /// A `Pull` of an announced region: index byte, mode byte, offset `u64`, len `u64`.
    pub const PULL: u8 = 4;
    /// A `Release` of an announced region: index byte.
    pub const RELEASE: u8 = 5;
    /// Advance the clock by `u16` × 100 ms and call `handle_timeout`.
    pub const TIMEOUT: u8 = 6;
    /// The transport reports the connection lost.
    pub const LOST: u8 = 7;
    /// Number of ops.
    pub const COUNT: u8 = 8;
}

/// Client-mode ops (the op byte is taken modulo [`client_op::COUNT`]).
pub mod client_op {
    /// A frame built from the input, through the codec.
    pub const FRAME: u8 = 0;
    /// A blob decoded with `Frame::decode_message`.
    pub const RAW: u8 = 1;
    /// A current-version `Challenge`: caps byte, nonce, flags byte (bit 7 flips `auth_required`,
    /// low 4 bits + 1 = credits), eager threshold `u32`.
    pub const CHALLENGE: u8 = 2;
    /// A `Ready` with the correct server proof (none without a secret).
    pub const READY: u8 = 3;
    /// `ClientSession::fetch`: count byte (mod 12), then group, object, start, end bytes each.
    pub const FETCH: u8 = 4;
    /// An `Eager` for a requested block: index byte, mode byte, len `u32`.
    pub const EAGER: u8 = 5;
    /// A `Rendezvous` for a requested block: index byte, region byte, addr `u64`, len `u32`,
    /// rkey `u32`.
    pub const RENDEZVOUS: u8 = 6;
    /// A `BlockFailed` for a requested block: index byte, code `u16`, message blob.
    pub const BLOCK_FAILED: u8 = 7;
    /// A `PullData` for an announced region: index byte, mode byte, offset `u64`, len `u64`.
    pub const PULL_DATA: u8 = 8;
    /// The driver: index byte, then a byte: bit 0 `send_pull`, else `pull_complete` (bit 1:
    /// success).
    pub const DRIVER: u8 = 9;
    /// A `Credit`: `u32`.
    pub const CREDIT: u8 = 10;
    /// A byte: 0 timeout (then `u16` × 100 ms), 1 connection lost, 2 close, 3 decode error.
    pub const LIFECYCLE: u8 = 11;
    /// Number of ops.
    pub const COUNT: u8 = 12;
}

/// Pair-mode ops (the op byte is taken modulo [`pair_op::COUNT`]).
pub mod pair_op {
    /// `ClientSession::fetch`: count byte (mod 10), then group byte, object `u32`, start
    /// byte, end byte each.
    pub const FETCH: u8 = 0;
    /// Move up to (byte mod 16 + 1) frames each way.
    pub const STEP: u8 = 1;
    /// Move frames until both sides are quiet.
    pub const SETTLE: u8 = 2;
    /// Flip bits of the next frame: direction byte (bit 0: server to client), position
    /// `u16`, xor byte.
    pub const CORRUPT: u8 = 3;
    /// Both transports report the connection lost.
    pub const LOST: u8 = 4;
    /// Advance the clock by `u16` seconds and call both `handle_timeout`s.
    pub const TIMEOUT: u8 = 5;
    /// Number of ops.
    pub const COUNT: u8 = 6;
}

/// Runs one script.
pub fn run(data: &[u8]) {
    run_with_stats(data);
}

/// How far a script got, so tests can tell that the seeds exercise what they claim to.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// The mode the script ran in.
    pub mode: Option<Mode>,
    /// Eager, rendezvous and pull-data outputs the server produced.
    pub server_served: u64,
    /// Whether a client reported `Connected`.
    pub client_connected: bool,
    /// Blocks whose end (delivered or failed) a client reported.
    pub client_blocks_ended: u64,
    /// Blocks whose outcome the pair mode compared with the expected one.
    pub pair_blocks_checked: u64,
}

/// Runs one script and says how far it got.
pub fn run_with_stats(data: &[u8]) -> Stats {
    let mut c = Cursor::new(data);
    match c.u8() % 3 {
        0 => run_server(&mut c),
        1 => run_client(&mut c),
        _ => run_pair(&mut c),
    }
}

mod client;
mod pair;
mod server;

use client::run_client;
use pair::run_pair;
use server::run_server;

/// The frame a driver sends for a server output (`None` for a revocation, which sends
/// nothing); an exposure becomes a `Rendezvous` with key `rkey`.
fn output_frame(o: &ServerOutput<u64>, rkey: u32) -> Option<Frame> {
    match o {
        ServerOutput::Frame(f) | ServerOutput::Eager { frame: f, .. } | ServerOutput::PullData { frame: f, .. } => {
            Some(f.clone())
        }
        ServerOutput::Expose { req, index, region, offset, len, block_len, .. } => Some(Frame::Rendezvous {
            req: *req,
            index: *index,
            desc: Descriptor { region: *region, addr: *offset, len: *len, rkey },
            block_len: *block_len,
        }),
        ServerOutput::Revoke { .. } => None,
    }
}
