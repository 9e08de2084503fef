//! The locked-memory limit: RDMA registration pins memory, and a limit below what the engine
//! registers makes `ibv_reg_mr` fail with `ENOMEM`. Checked when the provider opens, and named
//! in every registration failure, with the fix.

use rdma_shuffle_wire::Knob;

/// The locked-memory limit (soft) of this process, in bytes (`None` = unlimited or unknown),
/// as `/proc/self/limits` reports it.
pub fn memlock_limit() -> Option<u64> {
    let limits = std::fs::read_to_string("/proc/self/limits").ok()?;
    parse_memlock(&limits)
}

/// The soft "Max locked memory" of a `/proc/<pid>/limits` text.
fn parse_memlock(limits: &str) -> Option<u64> {
    let line = limits.lines().find(|l| l.starts_with("Max locked memory"))?;
    line["Max locked memory".len()..].split_whitespace().next()?.parse().ok()
}

/// Whether this thread may lock memory beyond the limit (CAP_IPC_LOCK, e.g. root).
pub fn can_lock_unlimited() -> bool {
    const CAP_IPC_LOCK: u32 = 14;
    std::fs::read_to_string("/proc/thread-self/status")
        .ok()
        .and_then(|s| s.lines().find_map(|l| l.strip_prefix("CapEff:").map(|v| v.trim().to_string())))
        .and_then(|hex| u64::from_str_radix(&hex, 16).ok())
        .map(|caps| caps & (1 << CAP_IPC_LOCK) != 0)
        .unwrap_or(false)
}

fn advice(limit: u64, need: u64) -> String {
    format!(
        "the locked-memory limit is {limit} bytes and RDMA needs at least {need}: raise it (`ulimit -l unlimited`, \
         LimitMEMLOCK=infinity for systemd units, or memlock in /etc/security/limits.conf), or lower {}",
        Knob::PoolCapBytes
    )
}

/// Checks that `need` bytes can be registered under `limit` (None = unlimited), unless the
/// process may exceed the limit. The error names the limit, the need, and what to change.
pub fn check_memlock(limit: Option<u64>, privileged: bool, need: u64) -> Result<(), String> {
    match limit {
        Some(l) if !privileged && l < need => {
            Err(format!("cannot register {need} bytes (memory pool, receive and send buffers): {}", advice(l, need)))
        }
        _ => Ok(()),
    }
}

/// What to tell a user whose registration of `bytes` failed with `ENOMEM`.
pub fn memlock_advice(bytes: u64) -> String {
    match memlock_limit() {
        Some(l) => advice(l, bytes),
        None => "the locked-memory limit is unlimited, so the device itself is out of memory".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_limit_is_read_from_proc() {
        let text = "Limit                     Soft Limit           Hard Limit           Units     \n\
                    Max locked memory         8388608              unlimited            bytes     \n";
        assert_eq!(parse_memlock(text), Some(8 << 20));
        assert_eq!(parse_memlock(&text.replace("8388608  ", "unlimited")), None);
        // This process: whatever it is, reading it works (root: often unlimited).
        let _ = memlock_limit();
    }

    #[test]
    fn memlock_check_names_the_limit_the_need_and_the_fix() {
        assert!(check_memlock(None, false, 1 << 40).is_ok());
        assert!(check_memlock(Some(8 << 20), true, 1 << 30).is_ok(), "CAP_IPC_LOCK is not limited");
        assert!(check_memlock(Some(1 << 30), false, 1 << 20).is_ok());
        let e = check_memlock(Some(8 << 20), false, 512 << 20).unwrap_err();
        assert!(
            e.contains("8388608") && e.contains("536870912") && e.contains("ulimit -l") && e.contains("memory pool cap"),
            "{e}"
        );
    }
}
