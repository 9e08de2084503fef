//! Turning native failures into Java exceptions.

use jni::JNIEnv;
use std::panic::{catch_unwind, AssertUnwindSafe};

/// Java class of every exception the bridge throws.
pub const EXCEPTION_CLASS: &str = "org/apache/spark/shuffle/rdma/RdmaShuffleException";

/// Every kind the bridge itself raises, and whether a retry may cure it. Per-block fetch
/// failures use [`FailureCode`](rdma_shuffle_shuffle::FailureCode) names instead. The Java side
/// keeps the same lists (`RdmaShuffleException.TRANSIENT_KINDS` / `PERMANENT_KINDS`); a test
/// checks that they agree.
pub const BRIDGE_KINDS: [(&str, bool); 8] = [
    ("connect", true),
    ("closed", true),
    ("config", false),
    ("transport", false),
    ("register", false),
    ("invalid_argument", false),
    ("jni", false),
    ("internal", false),
];

/// A failure to report to Java, with the exception kind (see `RdmaShuffleException`).
#[derive(Debug)]
pub struct BridgeError {
    /// Kind: `config`, `transport`, `register`, `invalid_argument`, `closed`, `jni`, `internal`.
    pub kind: &'static str,
    /// What failed, with context.
    pub message: String,
}

impl BridgeError {
    /// A failure of `kind`.
    pub fn new(kind: &'static str, message: impl Into<String>) -> Self {
        BridgeError { kind, message: message.into() }
    }
}

impl From<jni::errors::Error> for BridgeError {
    fn from(e: jni::errors::Error) -> Self {
        BridgeError::new("jni", e.to_string())
    }
}

/// Throws `RdmaShuffleException(kind, message)`; if even that fails, a plain RuntimeException.
fn throw(env: &mut JNIEnv, e: &BridgeError) {
    if env.exception_check().unwrap_or(false) {
        // A Java exception is already pending (e.g. from a callback): keep it.
        return;
    }
    let made = (|| -> jni::errors::Result<()> {
        let kind = env.new_string(e.kind)?;
        let msg = env.new_string(&e.message)?;
        let obj = env.new_object(EXCEPTION_CLASS, "(Ljava/lang/String;Ljava/lang/String;)V", &[(&kind).into(), (&msg).into()])?;
        env.throw(jni::objects::JThrowable::from(obj))
    })();
    if made.is_err() {
        let _ = env.exception_clear();
        let _ = env.throw_new("java/lang/RuntimeException", format!("[{}] {}", e.kind, e.message));
    }
}

/// Runs an export's body: `Ok` returns its value, `Err` or a panic throws and returns
/// `default` (which Java never sees, since the exception is pending).
pub fn guard<T>(env: &mut JNIEnv, default: T, f: impl FnOnce(&mut JNIEnv) -> Result<T, BridgeError>) -> T {
    match catch_unwind(AssertUnwindSafe(|| f(env))) {
        Ok(Ok(v)) => v,
        Ok(Err(e)) => {
            tracing::debug!(kind = e.kind, message = %e.message, "native call failed");
            throw(env, &e);
            default
        }
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".into());
            tracing::error!(panic = %what, "native panic caught at the JNI boundary");
            throw(env, &BridgeError::new("internal", format!("native panic: {what}")));
            default
        }
    }
}
