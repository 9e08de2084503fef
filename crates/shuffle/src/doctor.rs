//! The preflight an operator runs on a node before Spark does (`Doctor` in the plugin jar):
//! what this node's RDMA devices offer, what the engine would pick and why, whether its memory
//! fits and registers, and a loopback transfer through two real engines.
//!
//! On an RDMA node what stops RDMA software first is the locked-memory limit in containers,
//! the RoCE GID index, the port state and MTU, and whether memory can be registered at all;
//! without this the answer is one line in an executor's log, after the fact. Every check runs
//! the engine's own code: [`select_provider`] for the transport `auto` picks, the provider's
//! GID selection ([`probe::pick_gid`]), [`MemoryBudget`] for the memory bound, and two
//! [`Engine`]s on loopback for the transfer (1 MiB in blocks small enough to go inline, by
//! SEND over verbs, then one 1 MiB block above the eager threshold, by RDMA READ over verbs).
//!
//! The report is text or JSON ([`Report`]); its exit code is non-zero when the transport asked
//! for cannot work.

use crate::budget::{fixed_memory, MemoryBudget, HEAP_RESERVE};
use crate::engine::{select_provider, Engine, EngineConfig, Selected};
use crate::{BlockSink, FetchedBlock, ShuffleBlock};
use rdma_shuffle_providers::verbs::memlock::{can_lock_unlimited, check_memlock, memlock_limit};
use rdma_shuffle_providers::verbs::probe;
use rdma_shuffle_providers::AUTO;
use rdma_shuffle_wire::BlockFailure;
use std::fmt::Write as _;
use std::net::{IpAddr, Ipv4Addr};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Exit code when the transport asked for cannot work.
pub const EXIT_UNUSABLE: i32 = 2;

/// Bytes each loopback transfer moves.
const LOOPBACK_BYTES: usize = 1 << 20;

/// A JSON value, enough for the report (no dependency for one small document).
#[derive(Clone, Debug)]
pub enum Json {
    /// A string.
    Str(String),
    /// An integer.
    Int(u64),
    /// A number with a fraction.
    Num(f64),
    /// true / false.
    Bool(bool),
    /// null.
    Null,
    /// An array.
    Arr(Vec<Json>),
    /// An object, in insertion order.
    Obj(Vec<(String, Json)>),
}

impl Json {
    fn render(&self, out: &mut String) {
        match self {
            Json::Str(s) => {
                out.push('"');
                for c in s.chars() {
                    match c {
                        '"' => out.push_str("\\\""),
                        '\\' => out.push_str("\\\\"),
                        '\n' => out.push_str("\\n"),
                        c if (c as u32) < 0x20 => {
                            let _ = write!(out, "\\u{:04x}", c as u32);
                        }
                        c => out.push(c),
                    }
                }
                out.push('"');
            }
            Json::Int(n) => {
                let _ = write!(out, "{n}");
            }
            Json::Num(f) if f.is_finite() => {
                let _ = write!(out, "{f:.3}");
            }
            Json::Num(_) | Json::Null => out.push_str("null"),
            Json::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
            Json::Arr(items) => {
                out.push('[');
                for (i, v) in items.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    v.render(out);
                }
                out.push(']');
            }
            Json::Obj(fields) => {
                out.push('{');
                for (i, (k, v)) in fields.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    Json::Str(k.clone()).render(out);
                    out.push(':');
                    v.render(out);
                }
                out.push('}');
            }
        }
    }

    /// The value as JSON text.
    pub fn to_text(&self) -> String {
        let mut s = String::new();
        self.render(&mut s);
        s
    }
}

fn obj(fields: Vec<(&str, Json)>) -> Json {
    Json::Obj(fields.into_iter().map(|(k, v)| (k.to_string(), v)).collect())
}

fn s(v: impl Into<String>) -> Json {
    Json::Str(v.into())
}

/// What the preflight found.
pub struct Report {
    /// The report as JSON.
    pub json: Json,
    /// The same for a person, one finding per line.
    pub text: String,
    /// 0 when the transport asked for works here, [`EXIT_UNUSABLE`] when it cannot.
    pub exit_code: i32,
}

/// One loopback transfer: how many bytes in how many blocks, and how long.
struct Transfer {
    blocks: usize,
    bytes: usize,
    took: Duration,
}

impl Transfer {
    fn json(&self, path: &str) -> Json {
        obj(vec![
            ("path", s(path)),
            ("blocks", Json::Int(self.blocks as u64)),
            ("bytes", Json::Int(self.bytes as u64)),
            ("ms", Json::Num(self.took.as_secs_f64() * 1e3)),
            ("mib_per_s", Json::Num(self.bytes as f64 / (1 << 20) as f64 / self.took.as_secs_f64().max(1e-9))),
        ])
    }

    fn text(&self) -> String {
        format!(
            "{} bytes in {} block(s) in {:.2} ms ({:.0} MiB/s)",
            self.bytes,
            self.blocks,
            self.took.as_secs_f64() * 1e3,
            self.bytes as f64 / (1 << 20) as f64 / self.took.as_secs_f64().max(1e-9)
        )
    }
}

/// Runs every check for `config` (the settings an executor would get; its `transport` is the
/// transport asked for).
pub fn run(config: &EngineConfig) -> Report {
    let mut text = String::new();
    let mut fields: Vec<(&str, Json)> = Vec::new();
    let asked_name = config.transport.as_str();
    let line = |t: &mut String, what: &str, detail: String| {
        let _ = writeln!(t, "{what:<13} {detail}");
    };
    line(&mut text, "transport", format!("asked: {asked_name} (spark.shuffle.rdma.transport)"));
    fields.push(("transport_asked", s(asked_name)));
    let verbs_built = cfg!(feature = "verbs");
    fields.push(("verbs_built", Json::Bool(verbs_built)));

    // Devices, ports, GIDs.
    let devices = probe::devices();
    match &devices {
        Ok(list) if list.is_empty() => line(&mut text, "devices", "none (no RDMA device: /sys/class/infiniband is empty)".into()),
        Ok(list) => {
            for d in list {
                line(&mut text, "device", format!("{} ({} memory windows)", d.name, d.max_mw));
                for p in &d.ports {
                    line(
                        &mut text,
                        "  port",
                        format!("{} {} link layer {} MTU {} (max {})", p.port, p.state, p.link_layer, p.active_mtu, p.max_mtu),
                    );
                    for g in &p.gids {
                        line(
                            &mut text,
                            "    gid",
                            format!(
                                "[{}] {} {} {}",
                                g.index,
                                g.text(),
                                g.kind.as_deref().unwrap_or("type ?"),
                                g.netdev.as_deref().unwrap_or("")
                            ),
                        );
                    }
                }
            }
        }
        Err(e) => line(&mut text, "devices", format!("none: {e}")),
    }
    fields.push(("devices", devices_json(&devices)));

    // The device, port and GID the engine would use.
    let chosen = devices.as_ref().ok().and_then(|list| {
        list.iter()
            .filter(|d| config.device.as_deref().map(|w| w == d.name).unwrap_or(true))
            .find_map(|d| d.ports.iter().find(|p| p.is_active()).map(|p| (d, p)))
    });
    match chosen {
        Some((d, p)) => {
            let table: Vec<(u32, [u8; 16])> = p.gids.iter().map(|g| (g.index, g.gid)).collect();
            let device_why = match &config.device {
                Some(n) => format!("spark.shuffle.rdma.device={n}"),
                None => "the first device with an active port; spark.shuffle.rdma.device picks another".into(),
            };
            match probe::pick_gid(&table, config.gid_index) {
                Ok((index, why)) => {
                    let g = p.gids.iter().find(|g| g.index == u32::from(index));
                    let kind = g.and_then(|g| g.kind.clone()).unwrap_or_else(|| "?".into());
                    let gid = g.map(|g| g.text()).unwrap_or_default();
                    line(
                        &mut text,
                        "uses",
                        format!("{} port {} ({device_why}), GID [{index}] {gid} {kind}: {why}", d.name, p.port),
                    );
                    fields.push((
                        "uses",
                        obj(vec![
                            ("device", s(&d.name)),
                            ("device_why", s(device_why)),
                            ("port", Json::Int(u64::from(p.port))),
                            ("gid_index", Json::Int(u64::from(index))),
                            ("gid", s(gid)),
                            ("gid_type", s(kind)),
                            ("why", s(why)),
                        ]),
                    ));
                }
                Err(e) => {
                    line(&mut text, "uses", format!("{} port {}: no usable GID: {e}", d.name, p.port));
                    fields.push(("uses", obj(vec![("device", s(&d.name)), ("error", s(e))])));
                }
            }
        }
        None => {
            let why = match (&devices, &config.device) {
                (Err(e), _) => e.to_string(),
                (Ok(_), Some(n)) => format!("no active port on device {n} (spark.shuffle.rdma.device)"),
                (Ok(_), None) => "no RDMA device with an active port".into(),
            };
            line(&mut text, "uses", format!("no RDMA device: {why}"));
            fields.push(("uses", obj(vec![("error", s(why))])));
        }
    }

    // The memory bound over each provider the transport may open, and memlock against what
    // the first of them would hold (auto: verbs).
    let candidates = MemoryBudget::candidates(config);
    let budgets: Vec<(&'static str, Result<MemoryBudget, crate::EngineError>)> =
        candidates.iter().map(|&name| (name, MemoryBudget::over(config, name))).collect();
    let bound = config.memory_bound.as_ref();
    line(
        &mut text,
        "memory",
        match bound {
            Some(b) => format!("bound {} bytes: {}", b.bytes, b.source),
            None => "no bound (no Spark memory settings given: --conf spark.executor.memory=... or a spark-defaults.conf)".into(),
        },
    );
    let budget_json = |b: &Result<MemoryBudget, crate::EngineError>| match b {
        Ok(b) => obj(vec![("pool_cap_bytes", Json::Int(b.pool_cap)), ("fixed_bytes", Json::Int(b.fixed))]),
        Err(e) => obj(vec![("error", s(e.to_string()))]),
    };
    for (name, b) in &budgets {
        line(
            &mut text,
            "",
            match b {
                Ok(b) => format!("over {name}: pool cap {} bytes + {} bytes fixed", b.pool_cap, b.fixed),
                Err(e) => format!("over {name}: does not fit: {e}"),
            },
        );
    }
    let mut memory = vec![
        ("bound_bytes", bound.map(|b| Json::Int(b.bytes)).unwrap_or(Json::Null)),
        ("bound_source", bound.map(|b| s(&b.source)).unwrap_or(Json::Null)),
        ("heap_reserve_bytes", Json::Int(HEAP_RESERVE)),
    ];
    memory.extend(budgets.iter().map(|(name, b)| (*name, budget_json(b))));
    fields.push(("memory", obj(memory)));
    let pool_cap = budgets.iter().find_map(|(_, b)| b.as_ref().ok()).map(|b| b.pool_cap).unwrap_or(0);
    // What the first provider holds: the pool, and its fixed memory (verbs: the receive and
    // send buffers and the blocks exposed at once, all pinned).
    let first = candidates.first().copied().unwrap_or(AUTO);
    let need = pool_cap + fixed_memory(config, first).map_or(0, |f| f.bytes());
    let limit = memlock_limit();
    let privileged = can_lock_unlimited();
    let memlock = check_memlock(limit, privileged, need).map_err(|e| {
        format!(
            "{e} (spark.shuffle.rdma.pool.capBytes; unset, it follows spark.shuffle.rdma.memory.overheadPercent of \
             spark.executor.memoryOverhead); in a container also --ulimit memlock=-1:-1 and the IPC_LOCK capability"
        )
    });
    line(
        &mut text,
        "memlock",
        format!(
            "limit {} ({}), {first} needs {need} bytes: {}",
            limit.map(|l| format!("{l} bytes")).unwrap_or_else(|| "unlimited".into()),
            if privileged { "CAP_IPC_LOCK: the limit does not apply" } else { "no CAP_IPC_LOCK" },
            match &memlock {
                Ok(()) => "ok".to_string(),
                Err(e) => format!("NOT ENOUGH: {e}"),
            }
        ),
    );
    fields.push((
        "memlock",
        obj(vec![
            ("limit_bytes", limit.map(Json::Int).unwrap_or(Json::Null)),
            ("cap_ipc_lock", Json::Bool(privileged)),
            ("needed_bytes", Json::Int(need)),
            ("ok", Json::Bool(memlock.is_ok())),
            ("message", memlock.as_ref().err().map(|e| s(e.clone())).unwrap_or(Json::Null)),
        ]),
    ));

    // Registering the pool's memory.
    let registration = if chosen.is_some() {
        Some(probe::register(config.device.as_deref(), config.gid_index, pool_cap as usize))
    } else {
        None
    };
    match &registration {
        Some(Ok(took)) => line(
            &mut text,
            "register",
            format!("{pool_cap} bytes (the pool's cap) registered in {:.1} ms: ok", took.as_secs_f64() * 1e3),
        ),
        Some(Err(e)) => line(&mut text, "register", format!("{pool_cap} bytes (the pool's cap): FAILED: {e}")),
        None => line(&mut text, "register", "not tried (no RDMA device)".into()),
    }
    fields.push((
        "registration",
        match &registration {
            Some(Ok(took)) => {
                obj(vec![("bytes", Json::Int(pool_cap)), ("ok", Json::Bool(true)), ("ms", Json::Num(took.as_secs_f64() * 1e3))])
            }
            Some(Err(e)) => obj(vec![("bytes", Json::Int(pool_cap)), ("ok", Json::Bool(false)), ("error", s(e.to_string()))]),
            None => obj(vec![("ok", Json::Null), ("error", s("no RDMA device"))]),
        },
    ));

    // What auto picks, and why.
    let auto = select_provider(&EngineConfig { transport: AUTO.into(), ..config.clone() });
    let auto_pick = match &auto {
        Ok(Selected { provider, why, .. }) => {
            line(&mut text, "auto picks", format!("{}: {why}", provider.name()));
            Some(provider.name())
        }
        Err(e) => {
            line(&mut text, "auto picks", format!("nothing: {e}"));
            None
        }
    };
    fields.push((
        "auto",
        match &auto {
            Ok(Selected { provider, why, .. }) => obj(vec![("transport", s(provider.name())), ("why", s(why))]),
            Err(e) => obj(vec![("error", s(e.to_string()))]),
        },
    ));
    drop(auto);

    // The loopback through the transport asked for (auto: what it picks, else the last of
    // its order).
    let run_on = match (asked_name, auto_pick) {
        (AUTO, Some(picked)) => picked,
        (AUTO, None) => rdma_shuffle_providers::registry().auto_order().last().copied().unwrap_or(AUTO),
        (asked, _) => asked,
    };
    let lb = loopback(config, run_on);
    let exit_code = match &lb {
        Ok((send, read, ..)) => {
            line(&mut text, "loopback", format!("over {run_on} (two engines on 127.0.0.1): ok"));
            line(&mut text, "  SEND", send.text());
            line(&mut text, "  READ", read.text());
            0
        }
        Err(e) => {
            line(&mut text, "loopback", format!("over {run_on}: FAILED: {e}"));
            EXIT_UNUSABLE
        }
    };
    fields.push((
        "loopback",
        match &lb {
            Ok((send, read, counters, one_sided)) => obj(vec![
                ("transport", s(run_on)),
                ("ok", Json::Bool(true)),
                ("send", send.json(if *one_sided { "SEND/RECV" } else { "inline" })),
                ("read", read.json(if *one_sided { "RDMA READ" } else { "pulled" })),
                ("counters", obj(counters.iter().map(|(k, v)| (*k, Json::Int(*v))).collect())),
            ]),
            Err(e) => obj(vec![("transport", s(run_on)), ("ok", Json::Bool(false)), ("error", s(e.clone()))]),
        },
    ));
    let verdict = if exit_code == 0 {
        format!("transport {asked_name} works on this node (it runs over {run_on})")
    } else {
        format!("transport {asked_name} cannot work on this node")
    };
    line(&mut text, "verdict", verdict.clone());
    fields.push(("ok", Json::Bool(exit_code == 0)));
    fields.push(("verdict", s(verdict)));
    fields.push(("exit_code", Json::Int(exit_code as u64)));
    Report { json: obj(fields), text, exit_code }
}

fn devices_json(devices: &Result<Vec<probe::DeviceInfo>, rdma_shuffle_fabric::FabricError>) -> Json {
    match devices {
        Err(e) => obj(vec![("error", s(e.to_string()))]),
        Ok(list) => Json::Arr(
            list.iter()
                .map(|d| {
                    obj(vec![
                        ("name", s(&d.name)),
                        ("max_mw", Json::Int(u64::from(d.max_mw))),
                        (
                            "ports",
                            Json::Arr(
                                d.ports
                                    .iter()
                                    .map(|p| {
                                        obj(vec![
                                            ("port", Json::Int(u64::from(p.port))),
                                            ("state", s(&p.state)),
                                            ("link_layer", s(&p.link_layer)),
                                            ("active_mtu", Json::Int(u64::from(p.active_mtu))),
                                            ("max_mtu", Json::Int(u64::from(p.max_mtu))),
                                            (
                                                "gids",
                                                Json::Arr(
                                                    p.gids
                                                        .iter()
                                                        .map(|g| {
                                                            obj(vec![
                                                                ("index", Json::Int(u64::from(g.index))),
                                                                ("gid", s(g.text())),
                                                                ("type", g.kind.clone().map(s).unwrap_or(Json::Null)),
                                                                ("netdev", g.netdev.clone().map(s).unwrap_or(Json::Null)),
                                                            ])
                                                        })
                                                        .collect(),
                                                ),
                                            ),
                                        ])
                                    })
                                    .collect(),
                            ),
                        ),
                    ])
                })
                .collect(),
        ),
    }
}

/// One block of a fetch, copied out of its pool buffer.
type Outcome = (usize, Result<Vec<u8>, BlockFailure>);

/// Collects a fetch's blocks (copied out, so the pool buffers go back at once).
struct Collect(Mutex<mpsc::Sender<Outcome>>);

/// The two loopback transfers (SEND, READ), the client's counters, and whether the provider
/// reads one-sidedly.
type Loopback = (Transfer, Transfer, Vec<(&'static str, u64)>, bool);

impl BlockSink for Collect {
    fn on_block(&self, index: usize, result: Result<FetchedBlock, BlockFailure>) {
        let _ = self.0.lock().map(|tx| tx.send((index, result.map(|b| b.to_vec()))));
    }
}

/// Two engines on 127.0.0.1 over `transport`: 1 MiB in blocks up to the eager threshold (SEND
/// over verbs), then one 1 MiB block above it (RDMA READ over verbs), each checked byte for byte
/// against the file it came from. Returns both transfers and the client's counters.
fn loopback(config: &EngineConfig, transport: &str) -> Result<Loopback, String> {
    let dir = std::env::temp_dir().join(format!("rdma-shuffle-doctor-{}-{}", std::process::id(), rand::random::<u32>()));
    std::fs::create_dir_all(&dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    let result = loopback_in(config, transport, &dir);
    let _ = std::fs::remove_dir_all(&dir);
    result
}

fn loopback_in(config: &EngineConfig, transport: &str, dir: &std::path::Path) -> Result<Loopback, String> {
    let eager = (config.eager_threshold as usize).clamp(1, 64 << 10);
    let n_small = LOOPBACK_BYTES.div_ceil(eager);
    let big = LOOPBACK_BYTES.max(config.eager_threshold as usize + 1);
    let mut sizes = vec![eager; n_small];
    sizes.push(big);
    let out = crate::testkit::write_map_output(dir, 0, 1, &sizes, 38).map_err(|e| format!("writing test data: {e}"))?;
    let open = |id: &str| {
        Engine::open(EngineConfig {
            transport: transport.into(),
            bind_host: IpAddr::V4(Ipv4Addr::LOCALHOST),
            port: 0,
            executor_id: id.into(),
            secret: None,
            ..config.clone()
        })
        .map_err(|e| format!("opening an engine over {transport}: {e}"))
    };
    let server = open("doctor-server")?;
    let client = open("doctor-client")?;
    let run = || -> Result<Loopback, String> {
        server.server().register(out.map_output_files()).map_err(|e| format!("registering the test data: {e}"))?;
        let addr = server.server().local_addr();
        let fetch = |indices: &[u32]| -> Result<Duration, String> {
            let (tx, rx) = mpsc::channel();
            let blocks: Vec<ShuffleBlock> = indices.iter().map(|&r| ShuffleBlock::single(0, 1, r)).collect();
            let t0 = Instant::now();
            client.client().fetch(addr, &blocks, Arc::new(Collect(Mutex::new(tx))));
            for _ in indices {
                let (i, r) = rx
                    .recv_timeout(config.fetch_timeout.max(Duration::from_secs(5)) + Duration::from_secs(5))
                    .map_err(|_| "no answer within the fetch timeout".to_string())?;
                let got = r.map_err(|f| format!("block {}: {f}", indices[i]))?;
                if got != out.range_bytes(indices[i], indices[i] + 1) {
                    return Err(format!("block {} arrived with different bytes", indices[i]));
                }
            }
            Ok(t0.elapsed())
        };
        // Connect (handshake, queue pair) outside the timed transfers.
        fetch(&[0])?;
        let small: Vec<u32> = (0..n_small as u32).collect();
        let send = Transfer { blocks: n_small, bytes: eager * n_small, took: fetch(&small)? };
        let read = Transfer { blocks: 1, bytes: big, took: fetch(&[n_small as u32])? };
        let c = client.client().stats();
        let r = |a: &std::sync::atomic::AtomicU64| a.load(std::sync::atomic::Ordering::Relaxed);
        let counters = vec![
            ("eager_blocks_fetched", r(&c.eager_blocks)),
            ("rendezvous_blocks_fetched", r(&c.rendezvous_blocks)),
            ("one_sided_reads", r(&c.one_sided_reads)),
            ("read_bytes", r(&c.read_bytes)),
        ];
        if r(&c.rendezvous_blocks) == 0 {
            return Err("the large block did not take the rendezvous path".into());
        }
        let one_sided = client.capabilities().one_sided;
        if one_sided && r(&c.one_sided_reads) == 0 {
            return Err(format!("over {transport}, which reads one-sidedly, the large block was not read by RDMA READ"));
        }
        Ok((send, read, counters, one_sided))
    };
    let result = run();
    client.shutdown();
    server.shutdown();
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn on_a_host_without_a_device_auto_is_tcp_and_the_loopback_moves_1_mib_both_ways() {
        // CI's hosts have no RDMA device; the SoftRoCE VM runs the verbs side
        // (scripts/spark-verbs-test.sh).
        if std::path::Path::new("/sys/class/infiniband").read_dir().map(|mut d| d.next().is_some()).unwrap_or(false) {
            return;
        }
        let config = EngineConfig {
            memory_bound: Some(crate::budget::MemoryBound {
                bytes: 192 << 20,
                source: "test".into(),
                overhead_key: "spark.executor.memoryOverhead".into(),
                percent: 50,
            }),
            ..EngineConfig::default()
        };
        let r = run(&config);
        let json = r.json.to_text();
        eprintln!("{}\n{json}", r.text);
        assert_eq!(r.exit_code, 0, "{}", r.text);
        assert!(json.contains(r#""auto":{"transport":"tcp","why":"transport=auto: using tcp because"#), "{json}");
        assert!(json.contains(r#""loopback":{"transport":"tcp","ok":true"#), "{json}");
        assert!(r.text.contains("verdict       transport auto works on this node (it runs over tcp)"), "{}", r.text);
        // Asking for verbs where there is none: the exit code says it cannot work.
        let verbs = run(&EngineConfig { transport: "verbs".into(), ..config });
        assert_eq!(verbs.exit_code, EXIT_UNUSABLE, "{}", verbs.text);
        assert!(verbs.text.contains("transport verbs cannot work on this node"), "{}", verbs.text);
    }

    #[test]
    fn json_strings_are_escaped() {
        let j = obj(vec![("a", s("x\"y\\z\n\u{1}")), ("b", Json::Arr(vec![Json::Int(1), Json::Null, Json::Bool(false)]))]);
        assert_eq!(j.to_text(), r#"{"a":"x\"y\\z\n\u0001","b":[1,null,false]}"#);
    }
}
