//! The `spark.shuffle.rdma.*` settings: their one declaration, and how the engine reads them.
//!
//! Every setting is declared once, in `settings/settings.tsv` at the repository root (name,
//! type, default, fallbacks, range, doc). This module embeds that file at compile time
//! ([`SCHEMA_TSV`]); the JVM plugin reads the same file from its jar, and the README tables are
//! generated from it. So a default lives in exactly one place: [`EngineConfig::default`] is the
//! schema's defaults applied to the config, not a second list of numbers.
//!
//! The JVM resolves Spark-side fallbacks (`spark.network.timeout`, the executor's host, ...)
//! and hands the engine canonical `key=value` lines (sizes in bytes, durations in ms, see
//! [`EngineConfig::to_kv`]); the parsers here also accept Spark's unit syntax (`64k`, `30s`), so
//! the schema's defaults and a hand-written config parse the same way.

use crate::engine::{EngineConfig, EngineError};
use rdma_shuffle_providers as providers;
use rdma_shuffle_wire::Secret;
use std::fmt::Write as _;
use std::net::{IpAddr, Ipv4Addr, ToSocketAddrs};
use std::sync::OnceLock;
use std::time::Duration;

/// The schema file, as compiled in.
pub const SCHEMA_TSV: &str = include_str!("../../../settings/settings.tsv");

/// What kind of value a setting takes (the schema's `type` column).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Kind {
    /// `true` / `false` (any case).
    Bool,
    /// One of a fixed set of words (any case; canonical form lower case).
    Choice(Vec<&'static str>),
    /// Bytes, in Spark's size syntax (`65536`, `64k`, `16m`, `1g`).
    Size,
    /// A comma-separated, strictly ascending list of sizes.
    Sizes,
    /// Milliseconds, in Spark's time syntax (`500ms`, `30s`, `2min`; a bare number is ms).
    Duration,
    /// A non-negative integer.
    Int,
    /// An IP address or a host name resolved to one.
    Host,
    /// Free text.
    Text,
}

/// Who reads a setting (the schema's `scope` column).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scope {
    /// Only the JVM plugin (e.g. `spark.shuffle.rdma.enabled`); the engine ignores it.
    Jvm,
    /// Handed to the engine.
    Engine,
}

/// One declared setting.
#[derive(Clone, Debug)]
pub struct Setting {
    /// Full key, `spark.shuffle.rdma.…`.
    pub key: &'static str,
    /// Value kind.
    pub kind: Kind,
    /// Value when neither the key nor a fallback is set; `None` means unset (automatic).
    pub default: Option<&'static str>,
    /// Settings the JVM consults, in order, before the default (`@executorHost` is the
    /// executor's host). The engine only ever sees the resolved value.
    pub fallback: Vec<&'static str>,
    /// Inclusive bounds (in bytes, ms or units) for sizes, durations and integers.
    pub min: Option<u64>,
    /// See [`Setting::min`].
    pub max: Option<u64>,
    /// Who reads it.
    pub scope: Scope,
    /// What it does.
    pub doc: &'static str,
}

/// A parsed, range-checked value.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Value {
    /// The setting is not set (only for settings without a default).
    Unset,
    /// A bool.
    Bool(bool),
    /// A size in bytes, a duration in ms, or an integer.
    Number(u64),
    /// A list of sizes in bytes.
    Numbers(Vec<u64>),
    /// A choice (lower case), a host or text.
    Text(String),
}

/// The declared settings, in schema order.
///
/// # Panics
/// If the compiled-in schema is malformed: a build defect that the unit tests of this module
/// catch before anything ships (and that the JNI boundary would still turn into an exception).
pub fn schema() -> &'static [Setting] {
    static SCHEMA: OnceLock<Vec<Setting>> = OnceLock::new();
    SCHEMA.get_or_init(|| parse_schema(SCHEMA_TSV).unwrap_or_else(|e| panic!("settings/settings.tsv: {e}")))
}

/// The declaration of `key`, if it is one.
pub fn lookup(key: &str) -> Option<&'static Setting> {
    schema().iter().find(|s| s.key == key)
}

fn parse_schema(text: &'static str) -> Result<Vec<Setting>, String> {
    let mut out: Vec<Setting> = Vec::new();
    let mut header_seen = false;
    for (n, line) in text.lines().enumerate() {
        let n = n + 1;
        if line.trim().is_empty() || line.starts_with('#') {
            continue;
        }
        let cols: Vec<&'static str> = line.split('\t').collect();
        if !header_seen {
            if cols != ["key", "type", "default", "fallback", "range", "scope", "doc"] {
                return Err(format!("line {n}: expected the header row, got {line:?}"));
            }
            header_seen = true;
            continue;
        }
        let [key, kind, default, fallback, range, scope, doc] = cols[..] else {
            return Err(format!("line {n}: expected 7 tab-separated columns, got {}", cols.len()));
        };
        let dash = |s: &'static str| if s == "-" { None } else { Some(s) };
        let kind = match kind {
            "bool" => Kind::Bool,
            "choice" => {
                Kind::Choice(dash(range).ok_or(format!("line {n}: a choice needs its values in 'range'"))?.split('|').collect())
            }
            "size" => Kind::Size,
            "sizes" => Kind::Sizes,
            "duration" => Kind::Duration,
            "int" => Kind::Int,
            "host" => Kind::Host,
            "string" => Kind::Text,
            other => return Err(format!("line {n}: unknown type {other:?}")),
        };
        let (mut min, mut max) = (None, None);
        if let (Some(r), Kind::Size | Kind::Sizes | Kind::Duration | Kind::Int) = (dash(range), &kind) {
            let (lo, hi) = r.split_once("..").ok_or(format!("line {n}: range {r:?} is not min..max"))?;
            let bound = |b: &str| -> Result<Option<u64>, String> {
                if b.is_empty() {
                    return Ok(None);
                }
                scalar(&kind, b).map(Some).ok_or(format!("line {n}: range bound {b:?} is not a {kind:?}"))
            };
            min = bound(lo)?;
            max = bound(hi)?;
        }
        let scope = match scope {
            "jvm" => Scope::Jvm,
            "engine" => Scope::Engine,
            other => return Err(format!("line {n}: unknown scope {other:?}")),
        };
        if !key.starts_with("spark.shuffle.rdma.") || out.iter().any(|s| s.key == key) {
            return Err(format!("line {n}: key {key:?} is a duplicate or lacks the spark.shuffle.rdma. prefix"));
        }
        let fallback = dash(fallback).map(|f| f.split(',').collect()).unwrap_or_default();
        let setting = Setting { key, kind, default: dash(default), fallback, min, max, scope, doc };
        if let Some(d) = setting.default {
            setting.parse(d).map_err(|e| format!("line {n}: the default does not parse: {e}"))?;
        }
        out.push(setting);
    }
    if out.is_empty() {
        return Err("no settings declared".into());
    }
    Ok(out)
}

/// Spark's `JavaUtils.byteStringAsBytes`: a bare number is bytes; suffixes b, k(b), m(b),
/// g(b), t(b), p(b) are powers of 1024.
pub fn parse_size(text: &str) -> Option<u64> {
    let t = text.trim().to_ascii_lowercase();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (digits, unit) = t.split_at(split);
    let n: u64 = digits.parse().ok()?;
    let shift = match unit {
        "" | "b" => 0,
        "k" | "kb" => 10,
        "m" | "mb" => 20,
        "g" | "gb" => 30,
        "t" | "tb" => 40,
        "p" | "pb" => 50,
        _ => return None,
    };
    n.checked_mul(1u64 << shift)
}

/// Spark's `JavaUtils.timeStringAsMs`: a bare number is milliseconds; suffixes us, ms, s,
/// m / min, h, d. Microseconds round down.
pub fn parse_duration_ms(text: &str) -> Option<u64> {
    let t = text.trim().to_ascii_lowercase();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (digits, unit) = t.split_at(split);
    let n: u64 = digits.parse().ok()?;
    match unit {
        "us" => Some(n / 1000),
        "" | "ms" => Some(n),
        "s" => n.checked_mul(1000),
        "m" | "min" => n.checked_mul(60_000),
        "h" => n.checked_mul(3_600_000),
        "d" => n.checked_mul(86_400_000),
        _ => None,
    }
}

fn scalar(kind: &Kind, text: &str) -> Option<u64> {
    match kind {
        Kind::Size | Kind::Sizes => parse_size(text),
        Kind::Duration => parse_duration_ms(text),
        Kind::Int => text.trim().parse().ok(),
        _ => None,
    }
}

impl Setting {
    /// Parses and range-checks `raw`; the error names the key, the value and what is allowed.
    pub fn parse(&self, raw: &str) -> Result<Value, EngineError> {
        let v = raw.trim();
        let bad = |why: String| EngineError::Setting { key: self.key.to_string(), value: v.to_string(), why };
        if v.is_empty() {
            return if self.default.is_none() { Ok(Value::Unset) } else { Err(bad("a value is required".into())) };
        }
        let in_range = |n: u64| -> Result<u64, EngineError> {
            if self.min.is_some_and(|m| n < m) || self.max.is_some_and(|m| n > m) {
                Err(bad(format!("must be {}", self.range_text())))
            } else {
                Ok(n)
            }
        };
        match &self.kind {
            Kind::Bool => match v.to_ascii_lowercase().as_str() {
                "true" => Ok(Value::Bool(true)),
                "false" => Ok(Value::Bool(false)),
                _ => Err(bad("expected true or false".into())),
            },
            Kind::Choice(options) => {
                let l = v.to_ascii_lowercase();
                if options.contains(&l.as_str()) {
                    Ok(Value::Text(l))
                } else {
                    Err(bad(format!("expected {}", options.join("|"))))
                }
            }
            Kind::Size | Kind::Duration | Kind::Int => {
                let n = scalar(&self.kind, v).ok_or_else(|| bad(format!("expected {}", self.kind_text())))?;
                Ok(Value::Number(in_range(n)?))
            }
            Kind::Sizes => {
                let mut out = Vec::new();
                for t in v.split(',').map(str::trim).filter(|t| !t.is_empty()) {
                    let n = parse_size(t).ok_or_else(|| bad(format!("'{t}' is not a size (example: 4k,64k,1m)")))?;
                    if out.last().is_some_and(|&prev| prev >= n) {
                        return Err(bad("sizes must be strictly ascending".into()));
                    }
                    out.push(in_range(n)?);
                }
                if out.is_empty() {
                    return Err(bad("expected at least one size".into()));
                }
                Ok(Value::Numbers(out))
            }
            Kind::Host | Kind::Text => Ok(Value::Text(v.to_string())),
        }
    }

    fn kind_text(&self) -> &'static str {
        match self.kind {
            Kind::Size => "a size (65536, 64k, 16m)",
            Kind::Duration => "a duration (500ms, 30s, 2min; a bare number is ms)",
            _ => "a non-negative integer",
        }
    }

    fn range_text(&self) -> String {
        let unit = match self.kind {
            Kind::Size | Kind::Sizes => " bytes",
            Kind::Duration => " ms",
            _ => "",
        };
        match (self.min, self.max) {
            (Some(lo), Some(hi)) => format!("{lo}..{hi}{unit}"),
            (Some(lo), None) => format!("at least {lo}{unit}"),
            (None, Some(hi)) => format!("at most {hi}{unit}"),
            (None, None) => "any value".into(),
        }
    }
}

fn number(v: &Value) -> u64 {
    match v {
        Value::Number(n) => *n,
        _ => 0,
    }
}

fn resolve_host(key: &str, host: &str) -> Result<IpAddr, EngineError> {
    if let Ok(ip) = host.parse() {
        return Ok(ip);
    }
    let bad = |why: String| EngineError::Setting { key: key.to_string(), value: host.to_string(), why };
    (host, 0)
        .to_socket_addrs()
        .map_err(|e| bad(format!("cannot resolve the host name: {e}")))?
        .next()
        .map(|a| a.ip())
        .ok_or_else(|| bad("the host name resolves to no address".into()))
}

/// `spark.shuffle.rdma.<provider>.<name>` with `<provider>` a registered provider: the
/// setting of that provider, `<provider>.<name>`, handed to it as it is
/// ([`EngineConfig::provider_settings`]). A new provider's settings need a line in the schema
/// and nothing here.
fn provider_key(key: &str) -> Option<&str> {
    let rest = key.strip_prefix("spark.shuffle.rdma.")?;
    let (provider, name) = rest.split_once('.')?;
    (!name.is_empty() && providers::registry().names().any(|n| n == provider)).then_some(rest)
}

/// A parsed value as the text a provider setting is handed over in; `None` when unset.
fn value_text(v: &Value) -> Option<String> {
    Some(match v {
        Value::Unset => return None,
        Value::Bool(b) => b.to_string(),
        Value::Number(n) => n.to_string(),
        Value::Numbers(ns) => ns.iter().map(u64::to_string).collect::<Vec<_>>().join(","),
        Value::Text(t) => t.clone(),
    })
}

impl EngineConfig {
    /// Sets the field behind an engine-scope schema key. Every engine key has an arm here; a
    /// unit test walks the schema to keep it so.
    fn apply(&mut self, key: &str, v: &Value) -> Result<(), EngineError> {
        let text = || match v {
            Value::Text(t) => Some(t.clone()),
            _ => None,
        };
        match key {
            // A registry name or `auto`: the schema's choice, which a test keeps equal to the
            // registry's names.
            "spark.shuffle.rdma.transport" => self.transport = text().unwrap_or_else(|| providers::AUTO.to_string()),
            // In range by the schema (at most 16 MiB): the casts below cannot truncate.
            "spark.shuffle.rdma.eagerThreshold" => self.eager_threshold = number(v) as u32,
            "spark.shuffle.rdma.pool.tiers" => {
                if let Value::Numbers(t) = v {
                    self.pool_tiers = t.iter().map(|&n| n as usize).collect();
                }
            }
            "spark.shuffle.rdma.pool.capBytes" => self.pool_cap = matches!(v, Value::Number(_)).then(|| number(v)),
            "spark.shuffle.rdma.port" => self.port = number(v) as u16,
            "spark.shuffle.rdma.bindHost" => self.bind_host = resolve_host(key, &text().unwrap_or_default())?,
            "spark.shuffle.rdma.connectTimeout" => self.connect_timeout = Duration::from_millis(number(v)),
            "spark.shuffle.rdma.fetchTimeout" => self.fetch_timeout = Duration::from_millis(number(v)),
            "spark.shuffle.rdma.idleTimeout" => self.idle_timeout = Duration::from_millis(number(v)),
            "spark.shuffle.rdma.credits" => self.credits = number(v) as u32,
            "spark.shuffle.rdma.maxBytesInFlight" => self.max_bytes_in_flight = number(v),
            "spark.shuffle.rdma.recvBuffers" => self.recv_buffers = number(v) as u32,
            "spark.shuffle.rdma.store.maxOpenFiles" => self.max_open_files = number(v) as usize,
            "spark.shuffle.rdma.maxBytesExposed" => self.max_bytes_exposed = number(v),
            // In range by the schema (1..100).
            "spark.shuffle.rdma.memory.overheadPercent" => self.overhead_percent = number(v) as u32,
            "spark.shuffle.rdma.device" => self.device = text().filter(|d| !d.is_empty()),
            "spark.shuffle.rdma.gidIndex" => self.gid_index = matches!(v, Value::Number(_)).then(|| number(v) as u8),
            _ if provider_key(key).is_some() => {
                let k = provider_key(key).unwrap_or_default().to_string();
                match value_text(v) {
                    Some(t) => self.provider_settings.insert(k, t),
                    None => self.provider_settings.remove(&k),
                };
            }
            _ => {
                return Err(EngineError::Setting {
                    key: key.to_string(),
                    value: String::new(),
                    why: "declared in settings/settings.tsv for the engine, but the engine has no field for it \
                          (add it to EngineConfig and settings.rs)"
                        .into(),
                })
            }
        }
        Ok(())
    }

    /// The value in force of an engine-scope setting, in the canonical form the JVM sends
    /// (bytes, ms, lower-case words; empty when unset). `None` for keys the engine does not hold.
    pub fn setting(&self, key: &str) -> Option<String> {
        let ms = |d: &Duration| d.as_millis().to_string();
        Some(match key {
            "spark.shuffle.rdma.transport" => self.transport.clone(),
            "spark.shuffle.rdma.eagerThreshold" => self.eager_threshold.to_string(),
            "spark.shuffle.rdma.pool.tiers" => self.pool_tiers.iter().map(|t| t.to_string()).collect::<Vec<_>>().join(","),
            "spark.shuffle.rdma.pool.capBytes" => self.pool_cap.map(|c| c.to_string()).unwrap_or_default(),
            "spark.shuffle.rdma.port" => self.port.to_string(),
            "spark.shuffle.rdma.bindHost" => self.bind_host.to_string(),
            "spark.shuffle.rdma.connectTimeout" => ms(&self.connect_timeout),
            "spark.shuffle.rdma.fetchTimeout" => ms(&self.fetch_timeout),
            "spark.shuffle.rdma.idleTimeout" => ms(&self.idle_timeout),
            "spark.shuffle.rdma.credits" => self.credits.to_string(),
            "spark.shuffle.rdma.maxBytesInFlight" => self.max_bytes_in_flight.to_string(),
            "spark.shuffle.rdma.recvBuffers" => self.recv_buffers.to_string(),
            "spark.shuffle.rdma.store.maxOpenFiles" => self.max_open_files.to_string(),
            "spark.shuffle.rdma.maxBytesExposed" => self.max_bytes_exposed.to_string(),
            "spark.shuffle.rdma.memory.overheadPercent" => self.overhead_percent.to_string(),
            "spark.shuffle.rdma.device" => self.device.clone().unwrap_or_default(),
            "spark.shuffle.rdma.gidIndex" => self.gid_index.map(|g| g.to_string()).unwrap_or_default(),
            _ => self.provider_settings.get(provider_key(key)?).cloned().unwrap_or_default(),
        })
    }

    /// Every engine-scope setting in force as canonical `key=value` lines, in schema order.
    /// `from_kv(&c.to_kv())` gives `c` back (secret and executor id aside).
    pub fn to_kv(&self) -> String {
        let mut out = String::new();
        for s in schema().iter().filter(|s| s.scope == Scope::Engine) {
            let _ = writeln!(out, "{}={}", s.key, self.setting(s.key).unwrap_or_default());
        }
        out
    }

    /// Parses newline-separated `key=value` lines: the `spark.shuffle.rdma.*` keys of the
    /// schema (values in canonical units or Spark's unit syntax, range-checked), plus
    /// `spark.executor.id`, `spark.app.id`, `spark.authenticate` and `spark.authenticate.secret`. A key that is
    /// not given keeps its schema default. Other keys are ignored: the JVM warns once about
    /// unknown `spark.shuffle.rdma.*` keys and never forwards them.
    pub fn from_kv(text: &str) -> Result<Self, EngineError> {
        let mut c = EngineConfig::default();
        let mut auth = false;
        let mut secret = None;
        let mut spark_memory = std::collections::HashMap::new();
        for line in text.lines() {
            let Some((k, v)) = line.split_once('=') else { continue };
            let (k, v) = (k.trim(), v.trim());
            match k {
                "spark.authenticate" => auth = v.eq_ignore_ascii_case("true"),
                "spark.authenticate.secret" => secret = Some(v.to_string()),
                "spark.executor.id" => c.executor_id = v.to_string(),
                "spark.app.id" => c.app_id = v.to_string(),
                k if crate::budget::SPARK_MEMORY_KEYS.contains(&k) => {
                    spark_memory.insert(k.to_string(), v.to_string());
                }
                _ => {
                    if let Some(s) = lookup(k).filter(|s| s.scope == Scope::Engine) {
                        c.apply(s.key, &s.parse(v)?)?;
                    }
                }
            }
        }
        if !spark_memory.is_empty() {
            c.memory_bound = Some(crate::budget::MemoryBound::from_spark(&|k| spark_memory.get(k).cloned(), c.overhead_percent)?);
        }
        let largest_tier = c.pool_tiers.iter().copied().max().unwrap_or(0) as u64;
        if let Some(cap) = c.pool_cap.filter(|&cap| cap < largest_tier) {
            return Err(EngineError::Setting {
                key: "spark.shuffle.rdma.pool.capBytes".into(),
                value: cap.to_string(),
                why: format!(
                    "smaller than the largest pool tier ({largest_tier} bytes); raise it or lower spark.shuffle.rdma.pool.tiers"
                ),
            });
        }
        if auth {
            let s = secret.filter(|s| !s.is_empty()).ok_or_else(|| EngineError::Setting {
                key: "spark.authenticate.secret".into(),
                value: String::new(),
                why: "spark.authenticate is true but no secret reached the executor".into(),
            })?;
            c.secret = Some(Secret::new(s));
        }
        Ok(c)
    }
}

impl Default for EngineConfig {
    /// The schema's defaults. Fields that are not settings start empty (no secret, executor
    /// id `unknown`) or at the engine's own default (`spin`).
    fn default() -> Self {
        // Placeholders only: every settings field is overwritten from the schema below.
        let mut c = EngineConfig {
            transport: providers::AUTO.to_string(),
            provider_settings: std::collections::BTreeMap::new(),
            eager_threshold: 0,
            pool_tiers: Vec::new(),
            pool_cap: None,
            memory_bound: None,
            overhead_percent: 0,
            port: 0,
            bind_host: IpAddr::V4(Ipv4Addr::UNSPECIFIED),
            connect_timeout: Duration::ZERO,
            fetch_timeout: Duration::ZERO,
            idle_timeout: Duration::ZERO,
            credits: 0,
            max_bytes_in_flight: 0,
            recv_buffers: 0,
            max_open_files: 0,
            max_bytes_exposed: 0,
            secret: None,
            executor_id: "unknown".into(),
            device: None,
            gid_index: None,
            app_id: String::new(),
            spin: rdma_shuffle_fabric::DEFAULT_SPIN,
        };
        for s in schema().iter().filter(|s| s.scope == Scope::Engine) {
            let v = s.default.map(|d| s.parse(d)).unwrap_or(Ok(Value::Unset));
            // The schema's own tests parse every default and apply every key, so this holds.
            if let Err(e) = v.and_then(|v| c.apply(s.key, &v)) {
                panic!("settings/settings.tsv: default of {}: {e}", s.key);
            }
        }
        c
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn engine_keys() -> impl Iterator<Item = &'static Setting> {
        schema().iter().filter(|s| s.scope == Scope::Engine)
    }

    /// The canonical text of a value, as the JVM would send it.
    fn canonical(s: &Setting, v: &Value) -> String {
        match v {
            Value::Unset => String::new(),
            Value::Bool(b) => b.to_string(),
            Value::Number(n) => n.to_string(),
            Value::Numbers(ns) => ns.iter().map(u64::to_string).collect::<Vec<_>>().join(","),
            Value::Text(t) if s.kind == Kind::Host => resolve_host(s.key, t).unwrap().to_string(),
            Value::Text(t) => t.clone(),
        }
    }

    /// A valid value other than the default, to prove a key reaches its field.
    fn other_value(s: &Setting) -> String {
        let d = s.default.map(|d| s.parse(d).unwrap()).unwrap_or(Value::Unset);
        match (&s.kind, d) {
            (Kind::Bool, Value::Bool(b)) => (!b).to_string(),
            (Kind::Choice(o), Value::Text(t)) => o.iter().find(|x| **x != t).unwrap().to_string(),
            (Kind::Sizes, Value::Numbers(n)) => n[..n.len() - 1].iter().map(u64::to_string).collect::<Vec<_>>().join(","),
            (Kind::Host, _) => "127.0.0.2".into(),
            (Kind::Text, _) => "dev0".into(),
            // An unset size (the pool cap): one that holds the largest default tier.
            (Kind::Size, Value::Unset) => "64m".into(),
            (_, Value::Number(n)) => if s.max == Some(n) { n - 1 } else { n + 1 }.to_string(),
            (_, _) => s.min.unwrap_or(1).to_string(),
        }
    }

    #[test]
    fn the_schema_parses_and_declares_every_known_key() {
        let keys: Vec<&str> = schema().iter().map(|s| s.key).collect();
        for k in [
            "spark.shuffle.rdma.enabled",
            "spark.shuffle.rdma.transport",
            "spark.shuffle.rdma.eagerThreshold",
            "spark.shuffle.rdma.bindHost",
            "spark.shuffle.rdma.idleTimeout",
            "spark.shuffle.rdma.recvBuffers",
        ] {
            assert!(keys.contains(&k), "{k} missing from the schema: {keys:?}");
        }
        assert_eq!(lookup("spark.shuffle.rdma.enabled").unwrap().scope, Scope::Jvm);
    }

    #[test]
    fn every_engine_key_is_handled_with_the_schema_default() {
        let c = EngineConfig::default();
        for s in engine_keys() {
            let want = s.default.map(|d| canonical(s, &s.parse(d).unwrap())).unwrap_or_default();
            assert_eq!(c.setting(s.key).as_deref(), Some(want.as_str()), "default of {}", s.key);
        }
        // Spot checks against values the rest of the engine was designed around.
        assert_eq!(c.eager_threshold, 64 * 1024);
        assert_eq!(c.connect_timeout, Duration::from_secs(120));
        assert_eq!(c.pool_tiers.last(), Some(&(16 << 20)));
    }

    #[test]
    fn every_engine_key_reaches_its_field() {
        for s in engine_keys() {
            let v = other_value(s);
            let c = EngineConfig::from_kv(&format!("{}={v}\n", s.key)).unwrap_or_else(|e| panic!("{}={v}: {e}", s.key));
            assert_ne!(c.setting(s.key), EngineConfig::default().setting(s.key), "{}={v} changed nothing", s.key);
            assert_eq!(c.setting(s.key).unwrap(), canonical(s, &s.parse(&v).unwrap()), "{}", s.key);
        }
    }

    #[test]
    fn canonical_lines_round_trip() {
        let c = EngineConfig::from_kv(
            "spark.shuffle.rdma.transport=TCP\nspark.shuffle.rdma.gidIndex=3\nspark.shuffle.rdma.fetchTimeout=2min\n",
        )
        .unwrap();
        let again = EngineConfig::from_kv(&c.to_kv()).unwrap();
        assert_eq!(again.to_kv(), c.to_kv());
        assert!(c.to_kv().contains("spark.shuffle.rdma.fetchTimeout=120000\n"));
        assert!(c.to_kv().contains("spark.shuffle.rdma.device=\n"), "unset keys are sent empty");
        assert_eq!(engine_keys().count(), c.to_kv().lines().count());
    }

    #[test]
    fn units_follow_spark() {
        assert_eq!(parse_size("64k"), Some(65536));
        assert_eq!(parse_size("16MB"), Some(16 << 20));
        assert_eq!(parse_size("1g"), Some(1 << 30));
        assert_eq!(parse_size("1.5m"), None, "Spark rejects fractions");
        assert_eq!(parse_size("12"), Some(12));
        assert_eq!(parse_duration_ms("30s"), Some(30_000));
        assert_eq!(parse_duration_ms("2m"), Some(120_000), "m is minutes for durations, as in Spark");
        assert_eq!(parse_duration_ms("1500"), Some(1500));
        assert_eq!(parse_duration_ms("soon"), None);
    }

    /// Spark's transport takes the provider registry's names and `auto`: a provider
    /// registered without its name in settings/settings.tsv (or the other way round) fails here.
    #[test]
    fn the_transport_setting_takes_the_registry_names() {
        let Kind::Choice(mut names) = lookup("spark.shuffle.rdma.transport").unwrap().kind.clone() else {
            panic!("spark.shuffle.rdma.transport is a choice")
        };
        let mut want: Vec<&str> = std::iter::once(providers::AUTO).chain(providers::registry().names()).collect();
        names.sort_unstable();
        want.sort_unstable();
        assert_eq!(names, want, "settings/settings.tsv's transport values against the provider registry");
        for name in providers::registry().names() {
            let c = EngineConfig::from_kv(&format!("spark.shuffle.rdma.transport={name}\n")).unwrap();
            assert_eq!(c.transport, name);
        }
    }

    /// `spark.shuffle.rdma.<provider>.<name>` of a registered provider reaches it as it is; of
    /// anything else it is no setting the engine holds.
    #[test]
    fn a_providers_own_settings_are_handed_to_it() {
        let mut c = EngineConfig::default();
        c.apply("spark.shuffle.rdma.verbs.example", &Value::Text("x;y".into())).unwrap();
        assert_eq!(c.provider_settings.get("verbs.example").map(String::as_str), Some("x;y"));
        assert_eq!(c.setting("spark.shuffle.rdma.verbs.example").as_deref(), Some("x;y"));
        c.apply("spark.shuffle.rdma.verbs.example", &Value::Unset).unwrap();
        // (Other providers' declared settings, with their defaults, stay.)
        assert!(!c.provider_settings.contains_key("verbs.example"), "{:?}", c.provider_settings);
        assert!(c.apply("spark.shuffle.rdma.nosuch.example", &Value::Text("1".into())).is_err());
        assert_eq!(c.setting("spark.shuffle.rdma.nosuch.example"), None);
    }

    #[test]
    fn bad_values_name_the_key_and_the_limit() {
        let e = |kv: &str| EngineConfig::from_kv(kv).unwrap_err().to_string();
        let t = e("spark.shuffle.rdma.transport=ib");
        assert!(t.contains("spark.shuffle.rdma.transport") && t.contains("auto|tcp|shm|verbs"), "{t}");
        let t = e("spark.shuffle.rdma.port=70000");
        assert!(t.contains("spark.shuffle.rdma.port") && t.contains("0..65535"), "{t}");
        let t = e("spark.shuffle.rdma.eagerThreshold=32m");
        assert!(t.contains("eagerThreshold") && t.contains("1..16777216 bytes"), "{t}");
        let t = e("spark.shuffle.rdma.pool.tiers=64k,4k");
        assert!(t.contains("pool.tiers") && t.contains("ascending"), "{t}");
        let t = e("spark.shuffle.rdma.pool.capBytes=1m");
        assert!(t.contains("capBytes") && t.contains("largest pool tier"), "{t}");
        let t = e("spark.shuffle.rdma.fetchTimeout=0");
        assert!(t.contains("fetchTimeout") && t.contains("at least 1 ms"), "{t}");
        let t = e("spark.shuffle.rdma.credits=");
        assert!(t.contains("credits") && t.contains("required"), "{t}");
        let t = e("spark.shuffle.rdma.bindHost=no-such-host.invalid");
        assert!(t.contains("bindHost") && t.contains("resolve"), "{t}");
    }

    #[test]
    fn settings_parse_and_other_keys_are_ignored() {
        let c = EngineConfig::from_kv(
            "spark.shuffle.rdma.transport=tcp\nspark.shuffle.rdma.eagerThreshold=32768\nspark.shuffle.rdma.pool.tiers=4096,65536\n\
             spark.shuffle.rdma.pool.capBytes=1048576\nspark.shuffle.rdma.fetchTimeout=1500\nspark.executor.id=7\nunknown.key=1\n\
             spark.shuffle.rdma.enabled=whatever-the-jvm-reads\nspark.shuffle.rdma.bindHost=localhost\n",
        )
        .unwrap();
        assert_eq!(c.transport, "tcp");
        assert_eq!(c.eager_threshold, 32768);
        assert_eq!(c.pool_tiers, vec![4096, 65536]);
        assert_eq!(c.fetch_timeout, Duration::from_millis(1500));
        assert_eq!(c.executor_id, "7");
        assert!(c.bind_host.is_loopback(), "{}", c.bind_host);
        let e = EngineConfig::from_kv("spark.authenticate=true").unwrap_err().to_string();
        assert!(e.contains("spark.authenticate.secret"), "{e}");
        assert!(EngineConfig::from_kv("spark.authenticate=true\nspark.authenticate.secret=x").unwrap().secret.is_some());
    }
}
