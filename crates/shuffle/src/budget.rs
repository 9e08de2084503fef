//! The engine's native-memory bound, and the pool cap it leaves.
//!
//! Inside Spark the engine's native memory is bounded by a share ([`MemoryBound`],
//! `spark.shuffle.rdma.memory.overheadPercent`) of the memory overhead Spark sizes the executor's
//! container with for memory outside the JVM heap (`spark.executor.memoryOverhead`, computed as
//! Spark computes it; see the README). The JVM hands the engine Spark's memory settings as it
//! resolves them ([`SPARK_MEMORY_KEYS`]); the engine splits the bound:
//!
//! * fixed memory, reserved first: a reserve for the engine's own heap ([`HEAP_RESERVE`]) and
//!   what the provider holds whatever the traffic, as the provider itself says through the
//!   registry ([`FixedMemory`]): over verbs the registered receive and send buffers and the
//!   bytes of blocks it may expose for RDMA READ at once (`maxBytesExposed`), over ofi its
//!   buffers and exposed copies, over tcp nothing;
//! * the pool, which gets the rest. The pool's cap is hard: beyond it fetches wait for
//!   buffers to come back (backpressure), so the engine's memory never grows past the bound
//!   because of load.
//!
//! An explicit `spark.shuffle.rdma.pool.capBytes` must fit in the same bound; the JVM asks
//! [`MemoryBudget::resolve`] when Spark starts, so a cap that cannot fit fails the application
//! at start, naming both settings and the numbers.
//!
//! Engines opened outside Spark without a bound (benchmarks, tests) keep the cap they are
//! given, or [`DEFAULT_POOL_CAP`].

use crate::engine::{provider_options, EngineConfig, EngineError};
use rdma_shuffle_providers::{self as providers, Fit, FixedMemory};
use std::fmt::Write as _;

/// Bytes of the bound kept for the engine's own Rust heap (connection state, frames,
/// tables): 0.15-0.5 MiB per executor at the end of TPC-DS runs (`native_heap_bytes`); it
/// grows with open connections (the scale benchmark's RSS grew 0.37 MiB per peer), which close
/// when idle. The heap is measured and reported, not capped: it is the part of the bound that
/// is reserved rather than enforced.
pub const HEAP_RESERVE: u64 = 8 << 20;

/// The pool cap of an engine given neither a bound nor a cap (opened outside Spark).
pub const DEFAULT_POOL_CAP: u64 = 512 << 20;

const CAP_KEY: &str = "spark.shuffle.rdma.pool.capBytes";
const PERCENT_KEY: &str = "spark.shuffle.rdma.memory.overheadPercent";

/// The Spark settings the bound is computed from. The JVM passes each one that is set, as
/// `SparkConf` resolves it (deprecated names included); a config with none of them (an engine
/// opened outside Spark) has no bound.
pub const SPARK_MEMORY_KEYS: &[&str] = &[
    "spark.master",
    "spark.executor.memory",
    "spark.executor.memoryOverhead",
    "spark.executor.memoryOverheadFactor",
    "spark.executor.minMemoryOverhead",
    "spark.driver.memory",
    "spark.driver.memoryOverhead",
    "spark.driver.memoryOverheadFactor",
    "spark.driver.minMemoryOverhead",
    "spark.kubernetes.memoryOverheadFactor",
];

/// Spark's floor of the memory overhead when `minMemoryOverhead` is not set (MiB).
const DEFAULT_MIN_OVERHEAD_MIB: u64 = 384;
/// Spark's default `memoryOverheadFactor`.
const DEFAULT_OVERHEAD_FACTOR: f64 = 0.10;

/// The bound on all of an engine's native memory, from Spark's memory settings.
///
/// Spark sizes an executor's container (YARN, Kubernetes) as its heap plus
/// `spark.executor.memoryOverhead` (plus off-heap and PySpark memory when those are set), and
/// the cluster manager kills a container that grows past it. The overhead is Spark's account of
/// what a JVM holds outside its heap, Netty's buffers for Spark's own shuffle fetches among it,
/// which the engine takes over. So the engine takes `percent` of that account, computed as Spark
/// computes the container request: `spark.executor.memoryOverhead` when set, else
/// `max(spark.executor.minMemoryOverhead (384 MiB), spark.executor.memoryOverheadFactor (0.10)
/// x spark.executor.memory)` (the factor's product truncated to whole MiB, as Spark does). In
/// local mode the driver runs the tasks, and the driver's settings count. Where Spark uses a
/// larger default factor (0.4 for non-JVM applications on Kubernetes) this reads 0.10: the
/// bound comes out smaller than Spark's account, never larger.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemoryBound {
    /// The bound.
    pub bytes: u64,
    /// How it was computed, naming the settings and their values.
    pub source: String,
    /// The overhead setting it is a share of (`spark.executor.memoryOverhead`).
    pub overhead_key: String,
    /// The share, in percent.
    pub percent: u32,
}

impl MemoryBound {
    /// The bound from Spark's settings (`get` answers the keys of [`SPARK_MEMORY_KEYS`] that
    /// are set) and the share `percent`.
    pub fn from_spark(get: &dyn Fn(&str) -> Option<String>, percent: u32) -> Result<MemoryBound, EngineError> {
        let master = get("spark.master").unwrap_or_default().trim().to_ascii_lowercase();
        let role = if master == "local" || master.starts_with("local[") { "driver" } else { "executor" };
        let overhead_key = format!("spark.{role}.memoryOverhead");
        let (overhead_mib, how) = match get(&overhead_key) {
            Some(v) => (mib(&overhead_key, &v)?, format!("set to '{v}'")),
            None => {
                let memory_key = format!("spark.{role}.memory");
                let memory_mib = get(&memory_key).map(|v| mib(&memory_key, &v)).transpose()?.unwrap_or(1024);
                let factor_key = format!("spark.{role}.memoryOverheadFactor");
                let k8s_key = "spark.kubernetes.memoryOverheadFactor";
                let factor_setting = get(&factor_key)
                    .map(|v| (factor_key.clone(), v))
                    .or_else(|| get(k8s_key).filter(|_| master.starts_with("k8s://")).map(|v| (k8s_key.to_string(), v)));
                let (factor_text, factor) = match factor_setting {
                    Some((k, v)) => {
                        let f = v.trim().parse::<f64>().ok().filter(|f| f.is_finite() && *f >= 0.0).ok_or_else(|| {
                            EngineError::Setting {
                                key: k.clone(),
                                value: v.clone(),
                                why: "expected a non-negative number".into(),
                            }
                        })?;
                        (format!("{k}={v}"), f)
                    }
                    None => (format!("{factor_key}={DEFAULT_OVERHEAD_FACTOR} (default)"), DEFAULT_OVERHEAD_FACTOR),
                };
                let min_key = format!("spark.{role}.minMemoryOverhead");
                let (min_text, min_mib) = match get(&min_key) {
                    Some(v) => (format!("{min_key}={v}"), mib(&min_key, &v)?),
                    None => (format!("{DEFAULT_MIN_OVERHEAD_MIB}m"), DEFAULT_MIN_OVERHEAD_MIB),
                };
                let by_factor = (factor * memory_mib as f64) as u64;
                (by_factor.max(min_mib), format!("unset: max({min_text}, {factor_text} x {memory_key}={memory_mib}m)"))
            }
        };
        let overhead = overhead_mib << 20;
        Ok(MemoryBound {
            bytes: overhead * u64::from(percent) / 100,
            source: format!("{percent} % ({PERCENT_KEY}) of {overhead_key} = {overhead} bytes, {how}"),
            overhead_key,
            percent,
        })
    }

    /// What to set so that the bound is at least `needed` bytes.
    pub fn raise_to(&self, needed: u64) -> String {
        let per_mib = u64::from(self.percent.max(1)) << 20;
        let overhead_mib = (needed.saturating_mul(100)).div_ceil(per_mib);
        format!("raise {} to at least {overhead_mib}m (at {} %), or {PERCENT_KEY}", self.overhead_key, self.percent)
    }
}

/// A Spark memory setting in MiB: a bare number is MiB, as Spark reads these keys.
fn mib(key: &str, value: &str) -> Result<u64, EngineError> {
    let v = value.trim();
    let bytes = if v.chars().all(|c| c.is_ascii_digit()) {
        v.parse::<u64>().ok().and_then(|n| n.checked_mul(1 << 20))
    } else {
        crate::settings::parse_size(v)
    };
    bytes.map(|b| b >> 20).ok_or_else(|| EngineError::Setting {
        key: key.to_string(),
        value: v.to_string(),
        why: "expected a size (a bare number is MiB: 384, 2g, 512m)".into(),
    })
}

/// How an engine's native memory is split, for one provider.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemoryBudget {
    /// The bound on all native memory; `None` for engines opened outside Spark.
    pub bound: Option<u64>,
    /// Native memory besides the pool: the heap reserve and the provider's fixed memory
    /// (buffers and exposures).
    pub fixed: u64,
    /// The pool's hard cap.
    pub pool_cap: u64,
    /// Whether the cap is `spark.shuffle.rdma.pool.capBytes` (else derived from the bound).
    pub explicit_cap: bool,
}

impl MemoryBudget {
    /// The budget of `config` over the registered provider `name`, with the fixed memory
    /// the provider says it holds for the engine's options ([`fixed_memory`]).
    pub fn over(config: &EngineConfig, name: &str) -> Result<MemoryBudget, EngineError> {
        Self::resolve(config, name, &fixed_memory(config, name)?)
    }

    /// The budget of `config` over provider `name`, which holds `provider_fixed` besides the
    /// pool. Fails when an explicit cap does not fit in the bound, or the bound leaves the
    /// pool less than its largest tier; the message names the settings, the numbers and
    /// what to change.
    pub fn resolve(config: &EngineConfig, name: &str, provider_fixed: &FixedMemory) -> Result<MemoryBudget, EngineError> {
        let largest_tier = config.pool_tiers.iter().copied().max().unwrap_or(0) as u64;
        let fixed = HEAP_RESERVE.saturating_add(provider_fixed.bytes());
        let mut parts = format!("{HEAP_RESERVE} bytes of heap reserve");
        for p in provider_fixed.parts.iter().filter(|p| p.bytes > 0) {
            let settings: Vec<&str> = p.follows.iter().map(|f| setting_of(f)).collect();
            let _ = write!(parts, ", {} bytes of {}", p.bytes, p.what);
            if !settings.is_empty() {
                let _ = write!(parts, " ({})", settings.join(", "));
            }
        }
        let over = format!("over {name}");
        let bound = config.memory_bound.as_ref();
        let source = || bound.map(|b| b.source.clone()).unwrap_or_default();
        let raise = |needed: u64| bound.map(|b| b.raise_to(needed)).unwrap_or_default();
        match (bound.map(|b| b.bytes), config.pool_cap) {
            (None, cap) => {
                Ok(MemoryBudget { bound: None, fixed, pool_cap: cap.unwrap_or(DEFAULT_POOL_CAP), explicit_cap: cap.is_some() })
            }
            (Some(bound), Some(cap)) => {
                if cap.saturating_add(fixed) > bound {
                    return Err(EngineError::Setting {
                        key: CAP_KEY.into(),
                        value: cap.to_string(),
                        why: format!(
                            "{}the pool cap plus the engine's fixed native memory {over} ({fixed} bytes: {parts}) \
                             is {} bytes, more than the engine's native memory bound of {bound} bytes ({}). Lower {CAP_KEY} \
                             to at most {} bytes (or unset it: the cap is then derived from the bound), or {}",
                            who(config),
                            cap.saturating_add(fixed),
                            source(),
                            bound.saturating_sub(fixed),
                            raise(cap.saturating_add(fixed))
                        ),
                    });
                }
                Ok(MemoryBudget { bound: Some(bound), fixed, pool_cap: cap, explicit_cap: true })
            }
            (Some(bound), None) => {
                let cap = bound.saturating_sub(fixed);
                if cap < largest_tier {
                    return Err(EngineError::Setting {
                        key: config.memory_bound.as_ref().map(|b| b.overhead_key.clone()).unwrap_or_default(),
                        value: bound.to_string(),
                        why: format!(
                            "{}the engine's native memory bound of {bound} bytes ({}) leaves {cap} bytes for the \
                             pool {over} after {fixed} bytes of fixed native memory ({parts}), less than its largest tier \
                             ({largest_tier} bytes, spark.shuffle.rdma.pool.tiers): {}",
                            who(config),
                            source(),
                            raise(largest_tier + fixed)
                        ),
                    });
                }
                Ok(MemoryBudget { bound: Some(bound), fixed, pool_cap: cap, explicit_cap: false })
            }
        }
    }

    /// The budget for the provider `transport=...` may open, asked of the registry
    /// ([`Registry::fit`](rdma_shuffle_providers::Registry::fit)): for a name, that provider's
    /// (an error if its fixed memory does not fit); for `auto`, the first of the auto order
    /// whose fixed memory fits, and which one it passed over and why.
    pub fn for_transport(config: &EngineConfig) -> Result<Fit<MemoryBudget, EngineError>, EngineError> {
        providers::registry()
            .fit(&config.transport, &provider_options(config, 0), |name, fixed| Self::resolve(config, name, fixed))
            .unwrap_or_else(|| Err(unknown_transport(config)))
    }

    /// The providers `transport=...` may open: the registry's auto order for `auto`, else
    /// the one it names.
    pub fn candidates(config: &EngineConfig) -> Vec<&'static str> {
        providers::registry().candidates(&config.transport)
    }

    /// What happens when the settings of `config` do not fit: `None` where the user chose
    /// what does not fit (a provider by name, or `pool.capBytes`), and the start must fail
    /// naming it; else the fallback, `spark` (every shuffle goes to Spark's sort shuffle,
    /// with one warning). Asked by the JVM through the `unfit_fallback` line, so that it
    /// reads no provider's name.
    pub fn unfit_fallback(config: &EngineConfig) -> Option<&'static str> {
        (config.transport == providers::AUTO && config.pool_cap.is_none()).then_some("spark")
    }

    /// The smallest bound the settings of `config` fit in over provider `name`: the fixed
    /// memory plus the explicit cap, or plus the largest tier when the cap is derived.
    pub fn bound_needed(config: &EngineConfig, name: &str) -> Result<u64, EngineError> {
        let largest_tier = config.pool_tiers.iter().copied().max().unwrap_or(0) as u64;
        let fixed = HEAP_RESERVE.saturating_add(fixed_memory(config, name)?.bytes());
        Ok(fixed.saturating_add(config.pool_cap.unwrap_or(largest_tier)))
    }

    /// `key=value` lines describing this budget (the JVM's check and the preflight).
    pub fn describe(&self) -> String {
        format!(
            "native_bound_bytes={}\npool_cap_bytes={}\nnative_fixed_bytes={}\npool_cap_explicit={}\n",
            self.bound.unwrap_or(0),
            self.pool_cap,
            self.fixed,
            self.explicit_cap
        )
    }
}

/// The native memory provider `name` holds besides the pool with the options an engine of
/// `config` opens it with, as the provider says through the registry.
pub fn fixed_memory(config: &EngineConfig, name: &str) -> Result<FixedMemory, EngineError> {
    providers::registry().fixed_memory(name, &provider_options(config, 0)).ok_or_else(|| unknown_transport(config))
}

fn unknown_transport(config: &EngineConfig) -> EngineError {
    EngineError::Setting {
        key: "spark.shuffle.rdma.transport".into(),
        value: config.transport.clone(),
        why: format!(
            "no provider of that name: this build has {}, and {}",
            providers::registry().names().collect::<Vec<_>>().join(", "),
            providers::AUTO
        ),
    }
}

/// The Spark setting a provider option ([`ProviderOptions`](rdma_shuffle_providers::ProviderOptions)'s
/// field) comes from, as [`provider_options`] sets it.
fn setting_of(option: &str) -> &str {
    match option {
        "recv_buffers" => "spark.shuffle.rdma.recvBuffers",
        "eager_message" => "spark.shuffle.rdma.eagerThreshold",
        "exposed_bytes" => "spark.shuffle.rdma.maxBytesExposed",
        "pool_bytes" => CAP_KEY,
        "device" => "spark.shuffle.rdma.device",
        "gid_index" => "spark.shuffle.rdma.gidIndex",
        other => other,
    }
}

/// `executor <id>: ` where the config names an executor (the JVM checks before any exists).
fn who(config: &EngineConfig) -> String {
    match config.executor_id.as_str() {
        "" | "unknown" => String::new(),
        id => format!("executor {id}: "),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(bound: Option<u64>, cap: Option<u64>) -> EngineConfig {
        EngineConfig {
            memory_bound: bound.map(|bytes| MemoryBound {
                bytes,
                source: "50 % of spark.executor.memoryOverhead=402653184 bytes".into(),
                overhead_key: "spark.executor.memoryOverhead".into(),
                percent: 50,
            }),
            pool_cap: cap,
            executor_id: "7".into(),
            ..EngineConfig::default()
        }
    }

    #[test]
    fn the_pool_gets_the_bound_minus_the_fixed_memory_of_the_transport() {
        let c = config(Some(192 << 20), None);
        let tcp = MemoryBudget::over(&c, "tcp").unwrap();
        assert_eq!((tcp.pool_cap, tcp.fixed, tcp.explicit_cap), ((192 << 20) - HEAP_RESERVE, HEAP_RESERVE, false));
        let verbs = MemoryBudget::over(&c, "verbs").unwrap();
        // 512 receive + 128 send buffers of 68 KiB, 4 MiB exposed: the schema's defaults.
        let buffers = 640 * (68 << 10);
        assert_eq!(verbs.fixed, HEAP_RESERVE + buffers + (4 << 20));
        assert_eq!(verbs.pool_cap + verbs.fixed, 192 << 20);
        // Without a bound (outside Spark): the cap given, or the old default.
        assert_eq!(MemoryBudget::over(&config(None, None), "verbs").unwrap().pool_cap, DEFAULT_POOL_CAP);
        assert_eq!(MemoryBudget::over(&config(None, Some(64 << 20)), "verbs").unwrap().pool_cap, 64 << 20);
    }

    #[test]
    fn an_explicit_cap_that_cannot_fit_is_refused_naming_the_settings_and_numbers() {
        let c = config(Some(192 << 20), Some(512 << 20));
        let e = MemoryBudget::over(&c, "tcp").unwrap_err().to_string();
        for want in [
            "spark.shuffle.rdma.pool.capBytes='536870912'",
            "201326592",
            "spark.executor.memoryOverhead=402653184",
            "executor 7",
            &format!("at most {} bytes", (192 << 20) - HEAP_RESERVE),
            // (512 MiB + 8 MiB) at 50 %.
            "raise spark.executor.memoryOverhead to at least 1040m (at 50 %)",
        ] {
            assert!(e.contains(want), "{want:?} missing from: {e}");
        }
        // A cap that fits over tcp but not with the verbs buffers: auto falls back to tcp and
        // says why; verbs fails.
        let fits_tcp = config(Some(192 << 20), Some(160 << 20));
        let fit = MemoryBudget::for_transport(&fits_tcp).unwrap();
        assert_eq!((fit.name, fit.value.pool_cap), ("tcp", 160 << 20));
        let (passed_over, why) = fit.passed_over.expect("auto says why it passed over verbs");
        assert_eq!(passed_over, "verbs");
        assert!(why.to_string().contains("recvBuffers"), "{why}");
        let verbs = EngineConfig { transport: "verbs".into(), ..fits_tcp };
        assert!(MemoryBudget::for_transport(&verbs).is_err());
    }

    #[test]
    fn a_bound_too_small_for_the_largest_tier_says_how_large_it_must_be() {
        let e = MemoryBudget::over(&config(Some(20 << 20), None), "tcp").unwrap_err().to_string();
        // 16 MiB tier + 8 MiB heap reserve = 24 MiB, at 50 %: 48 MiB of overhead.
        assert!(e.contains("raise spark.executor.memoryOverhead to at least 48m (at 50 %)"), "{e}");
    }

    /// ofi pins its receive buffers too (and copies what it exposes): the budget counts what
    /// the provider says it holds, not tcp's nothing.
    #[test]
    fn the_fixed_memory_of_ofi_is_counted() {
        let c = config(Some(192 << 20), None);
        let ofi = MemoryBudget::over(&c, "ofi").unwrap();
        // The schema's defaults: 512 / 8 = 64 receive and 64 send buffers of 68 KiB, the
        // copies of the 4 MiB exposed at once (rounded up to powers of two: 8 MiB at most),
        // and 4 MiB of copies kept for reuse.
        assert_eq!(ofi.fixed, HEAP_RESERVE + 128 * (68 << 10) + 2 * (4 << 20) + (4 << 20));
        assert_eq!(ofi.pool_cap + ofi.fixed, 192 << 20);
        assert!(ofi.fixed > MemoryBudget::over(&c, "tcp").unwrap().fixed);
        // A cap that fits over tcp but not beside ofi's buffers: transport=ofi is refused,
        // naming ofi's part and the settings that size it.
        let cap = (192 << 20) - HEAP_RESERVE - (1 << 20);
        let c = EngineConfig { transport: "ofi".into(), ..config(Some(192 << 20), Some(cap)) };
        assert!(MemoryBudget::over(&c, "tcp").is_ok());
        let e = MemoryBudget::for_transport(&c).unwrap_err().to_string();
        for want in
            ["over ofi", "ofi receive and send buffers (spark.shuffle.rdma.recvBuffers", "spark.shuffle.rdma.maxBytesExposed"]
        {
            assert!(e.contains(want), "{want:?} missing from: {e}");
        }
        assert_eq!(MemoryBudget::bound_needed(&c, "ofi").unwrap(), ofi.fixed + cap);
    }

    /// What the user chose is refused when it does not fit (a provider by name, the pool
    /// cap); only what the plugin chose (`auto`, a derived cap) falls back to Spark.
    #[test]
    fn only_what_the_plugin_chose_falls_back_to_spark_when_it_does_not_fit() {
        assert_eq!(MemoryBudget::unfit_fallback(&config(Some(20 << 20), None)), Some("spark"));
        assert_eq!(MemoryBudget::unfit_fallback(&config(Some(20 << 20), Some(64 << 20))), None);
        for name in providers::registry().names() {
            let c = EngineConfig { transport: name.into(), ..config(Some(20 << 20), None) };
            assert_eq!(MemoryBudget::unfit_fallback(&c), None, "transport={name}");
        }
    }

    fn spark(kv: &[(&str, &str)], percent: u32) -> Result<MemoryBound, EngineError> {
        let map: std::collections::HashMap<String, String> = kv.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        MemoryBound::from_spark(&|k| map.get(k).cloned(), percent)
    }

    #[test]
    fn the_bound_is_a_share_of_the_overhead_as_spark_sizes_it() {
        // The floor: 10 % of 1 GiB is below 384 MiB.
        let b = spark(&[("spark.master", "spark://m:7077"), ("spark.executor.memory", "1g")], 50).unwrap();
        assert_eq!(b.bytes, 192 << 20);
        assert!(b.source.contains("spark.executor.memoryOverhead = 402653184 bytes, unset: max(384m"), "{}", b.source);
        // The factor: 10 % of 8 GiB = 819 MiB (truncated, as Spark does), a bare number is MiB.
        let b = spark(&[("spark.executor.memory", "8192")], 100).unwrap();
        assert_eq!(b.bytes, 819 << 20);
        // Set explicitly, and Spark 4's floor and factor settings.
        assert_eq!(spark(&[("spark.executor.memoryOverhead", "2g")], 25).unwrap().bytes, 512 << 20);
        let b = spark(
            &[
                ("spark.executor.memory", "4g"),
                ("spark.executor.memoryOverheadFactor", "0.2"),
                ("spark.executor.minMemoryOverhead", "100m"),
            ],
            50,
        )
        .unwrap();
        assert_eq!(b.bytes, (819 << 20) / 2);
        // Local mode: the driver's settings; Kubernetes' own factor only on Kubernetes.
        let b = spark(&[("spark.master", "local[4]"), ("spark.driver.memoryOverhead", "1000")], 50).unwrap();
        assert_eq!((b.bytes, b.overhead_key.as_str()), (500 << 20, "spark.driver.memoryOverhead"));
        let k8s = |m| {
            spark(&[("spark.master", m), ("spark.executor.memory", "10g"), ("spark.kubernetes.memoryOverheadFactor", "0.4")], 100)
        };
        assert_eq!(k8s("k8s://https://api:6443").unwrap().bytes, 4096 << 20);
        assert_eq!(k8s("yarn").unwrap().bytes, 1024 << 20);
        let e = spark(&[("spark.executor.memoryOverheadFactor", "lots")], 50).unwrap_err().to_string();
        assert!(e.contains("spark.executor.memoryOverheadFactor") && e.contains("lots"), "{e}");
    }

    /// The JVM passes the engine exactly the keys its own list names (SparkMemorySettings.java):
    /// a key missing there would silently leave the bound at Spark's defaults.
    #[test]
    fn the_jvm_passes_the_keys_the_bound_is_computed_from() {
        let java =
            include_str!("../../../jvm-plugin/plugin/src/main/java/org/apache/spark/shuffle/rdma/SparkMemorySettings.java");
        let list = java.split_once("KEYS = {").and_then(|(_, rest)| rest.split_once("};")).expect("the KEYS array").0;
        let keys: Vec<&str> = list.split(',').map(|k| k.trim().trim_matches('"')).filter(|k| !k.is_empty()).collect();
        assert_eq!(keys, SPARK_MEMORY_KEYS);
    }
}
