//! The exported functions of `org.apache.spark.shuffle.rdma.NativeBridge`.

use crate::errors::{guard, BridgeError};
use crate::leases::LeaseTable;
use jni::objects::{GlobalRef, JClass, JIntArray, JLongArray, JObject, JString, JValue};
use jni::sys::{jboolean, jint, jlong, jstring, JNI_FALSE, JNI_TRUE};
use jni::{JNIEnv, JavaVM};
use rdma_shuffle_shuffle::budget::MemoryBudget;
use rdma_shuffle_shuffle::doctor;
use rdma_shuffle_shuffle::store::MapOutputFiles;
use rdma_shuffle_shuffle::{
    BlockFailure, BlockSink, ChunkSink, Engine, EngineConfig, FailureCode, FetchedBlock, Lease, ShuffleBlock, StreamConfig,
};
use std::fmt::Write as _;
use std::io::Write;
use std::net::{SocketAddr, ToSocketAddrs};
use std::path::PathBuf;
use std::ptr::NonNull;
use std::sync::{Arc, Once};

fn init_logging() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // Executor stderr ends up in Spark's executor log; RUST_LOG overrides the level.
        let filter =
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
        let _ = tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_writer(std::io::stderr)
            .with_ansi(false)
            .with_target(false)
            .try_init();
    });
}

/// # Safety contract with Java
/// `h` comes from `engineOpen` and is not used after `engineClose` (NativeEngine guards it).
fn engine<'a>(h: jlong) -> Result<&'a Engine, BridgeError> {
    if h == 0 {
        return Err(BridgeError::new("closed", "engine handle is 0 (closed or never opened)"));
    }
    // SAFETY: see the contract above; the Box behind `h` lives until engineClose.
    Ok(unsafe { &*(h as *const Engine) })
}

fn string(env: &mut JNIEnv, s: &JString, what: &str) -> Result<String, BridgeError> {
    if s.is_null() {
        return Err(BridgeError::new("invalid_argument", format!("{what} is null")));
    }
    Ok(env.get_string(s)?.into())
}

#[no_mangle]
pub extern "system" fn Java_org_apache_spark_shuffle_rdma_NativeBridge_engineOpen(
    mut env: JNIEnv,
    _c: JClass,
    config: JString,
) -> jlong {
    guard(&mut env, 0, |env| {
        init_logging();
        let text = string(env, &config, "config")?;
        let cfg = EngineConfig::from_kv(&text).map_err(|e| BridgeError::new("config", e.to_string()))?;
        let id = cfg.executor_id.clone();
        let engine = Engine::open(cfg)
            .map_err(|e| BridgeError::new("transport", format!("executor {id}: cannot start the shuffle engine: {e}")))?;
        tracing::info!(executor = %id, port = engine.server().local_addr().port(), transport = engine.transport(), "shuffle engine started");
        Ok(Box::into_raw(Box::new(engine)) as jlong)
    })
}

#[no_mangle]
pub extern "system" fn Java_org_apache_spark_shuffle_rdma_NativeBridge_enginePort(mut env: JNIEnv, _c: JClass, h: jlong) -> jint {
    guard(&mut env, 0, |_| Ok(engine(h)?.server().local_addr().port() as jint))
}

#[no_mangle]
pub extern "system" fn Java_org_apache_spark_shuffle_rdma_NativeBridge_engineTransport(
    mut env: JNIEnv,
    _c: JClass,
    h: jlong,
) -> jstring {
    guard(&mut env, std::ptr::null_mut(), |env| Ok(env.new_string(engine(h)?.transport())?.into_raw()))
}

/// Why the engine runs over its transport (`transport=auto: using tcp because ...`).
#[no_mangle]
pub extern "system" fn Java_org_apache_spark_shuffle_rdma_NativeBridge_engineTransportReason(
    mut env: JNIEnv,
    _c: JClass,
    h: jlong,
) -> jstring {
    guard(&mut env, std::ptr::null_mut(), |env| Ok(env.new_string(engine(h)?.transport_reason())?.into_raw()))
}

#[no_mangle]
pub extern "system" fn Java_org_apache_spark_shuffle_rdma_NativeBridge_registerMapOutput(
    mut env: JNIEnv,
    _c: JClass,
    h: jlong,
    shuffle_id: jint,
    map_id: jlong,
    data_path: JString,
    index_path: JString,
    num_partitions: jint,
) {
    guard(&mut env, (), |env| {
        let e = engine(h)?;
        if shuffle_id < 0 || map_id < 0 || num_partitions < 0 {
            return Err(BridgeError::new(
                "invalid_argument",
                format!(
                    "shuffle {shuffle_id} map {map_id} with {num_partitions} partitions: ids and counts must be non-negative"
                ),
            ));
        }
        let files = MapOutputFiles {
            shuffle_id: shuffle_id as u32,
            map_id: map_id as u64,
            data_path: PathBuf::from(string(env, &data_path, "dataPath")?),
            index_path: PathBuf::from(string(env, &index_path, "indexPath")?),
            num_partitions: Some(num_partitions as u32),
        };
        e.server()
            .register(files)
            .map_err(|err| BridgeError::new("register", format!("executor {}: {err}", e.config().executor_id)))
    })
}

#[no_mangle]
pub extern "system" fn Java_org_apache_spark_shuffle_rdma_NativeBridge_unregisterShuffle(
    mut env: JNIEnv,
    _c: JClass,
    h: jlong,
    shuffle_id: jint,
) -> jint {
    guard(&mut env, 0, |_| {
        if shuffle_id < 0 {
            return Ok(0);
        }
        Ok(engine(h)?.server().unregister_shuffle(shuffle_id as u32) as jint)
    })
}

/// Delivers block outcomes to a Java `FetchCallback` from native threads.
struct JvmSink {
    vm: JavaVM,
    callback: GlobalRef,
}

impl JvmSink {
    fn call(&self, index: usize, result: Result<FetchedBlock, BlockFailure>) -> jni::errors::Result<()> {
        // Daemon attachment: engine threads must never keep the executor JVM alive.
        let mut env = self.vm.attach_current_thread_as_daemon()?;
        // The thread stays attached for the engine's life and never returns to Java, so the
        // local references made here (the ByteBuffer, the strings) would otherwise live until
        // the thread dies: one leaked ByteBuffer per fetched block. A frame per call frees them.
        env.with_local_frame(4, |env| Self::deliver(env, &self.callback, index, result))
    }

    fn deliver(
        env: &mut JNIEnv,
        callback: &GlobalRef,
        index: usize,
        result: Result<FetchedBlock, BlockFailure>,
    ) -> jni::errors::Result<()> {
        match result {
            Ok(block) => {
                let lease = block.into_lease();
                let (ptr, len) = match &lease {
                    Some(l) => (l.as_ptr() as *mut u8, l.len()),
                    // An empty block has no buffer; a zero-capacity view of a dangling (never
                    // read) pointer is what NewDirectByteBuffer accepts.
                    None => (NonNull::<u8>::dangling().as_ptr(), 0),
                };
                // SAFETY: the memory stays valid until Java calls releaseLease with the handle
                // below; the ByteBuffer's documented lifetime ends there (FetchCallback docs).
                let buf = unsafe { env.new_direct_byte_buffer(ptr, len)? };
                let handle = lease.map(|l| LEASES.insert(l)).unwrap_or(0);
                let r = env.call_method(
                    callback,
                    "onBlock",
                    "(ILjava/nio/ByteBuffer;J)V",
                    &[JValue::Int(index as jint), (&buf).into(), JValue::Long(handle)],
                );
                if r.is_err() || env.exception_check()? {
                    let _ = env.exception_describe();
                    let _ = env.exception_clear();
                    // Java may or may not have released the handle before it threw: taking it
                    // out of the table is what decides, so the buffer goes back exactly once.
                    match LEASES.take(handle) {
                        Some(lease) => {
                            drop(lease);
                            tracing::warn!(index, handle, "FetchCallback.onBlock threw; block buffer released");
                        }
                        None => tracing::warn!(
                            index,
                            handle,
                            "FetchCallback.onBlock threw after releasing its block buffer; nothing left to release"
                        ),
                    }
                }
            }
            Err(f) => {
                let kind = env.new_string(f.code.name())?;
                let msg = env.new_string(&f.message)?;
                let r = env.call_method(
                    callback,
                    "onFailure",
                    "(ILjava/lang/String;Ljava/lang/String;)V",
                    &[JValue::Int(index as jint), (&kind).into(), (&msg).into()],
                );
                if r.is_err() || env.exception_check()? {
                    let _ = env.exception_describe();
                    let _ = env.exception_clear();
                    tracing::warn!(index, "FetchCallback.onFailure threw");
                }
            }
        }
        Ok(())
    }
}

impl BlockSink for JvmSink {
    /// A fetched block is one JNI call that wraps the buffer and hands it to Spark's fetch
    /// listener, which queues it for the task thread (`NativeBlockStoreClient.onBlock`;
    /// `FetchCallback` documents that it must not block): cheap enough for the engine's loop
    /// thread, which then attaches to the JVM once, as a daemon, and stays attached until it
    /// ends. Failures take the delivery thread: their Java side may fetch through Spark's
    /// own client or start a stream into a file. Like Netty's event loops, the loop stops for
    /// a GC safepoint while it is in Java; the pause is the JVM's, not the loop's.
    fn inline(&self) -> bool {
        true
    }

    fn on_block(&self, index: usize, result: Result<FetchedBlock, BlockFailure>) {
        // Never unwind into the engine's threads from Java trouble.
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.call(index, result)));
        match r {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::error!(index, error = %e, "cannot deliver a block to the JVM"),
            Err(_) => tracing::error!(index, "panic while delivering a block to the JVM"),
        }
    }
}

/// Every lease Java holds, by handle (see [`crate::leases`]): one table for the process, as
/// `releaseLease` carries no engine handle. A lease keeps its pool alive, so a lease released
/// after its engine closed still goes back safely.
static LEASES: LeaseTable<Lease> = LeaseTable::new();

/// Gives back the lease of `handle`; true when this call released one. 0 (an empty block) is
/// a no-op; a handle released already or never handed out is a no-op with one warning naming
/// it, never a second free.
fn release(handle: jlong) -> bool {
    if handle == 0 {
        return false;
    }
    match LEASES.take(handle) {
        Some(lease) => {
            drop(lease);
            true
        }
        None => {
            tracing::warn!(
                handle,
                live = LEASES.live(),
                "releaseLease: lease handle {handle} is unknown or was released already; ignored"
            );
            false
        }
    }
}

#[allow(clippy::too_many_arguments)]
#[no_mangle]
pub extern "system" fn Java_org_apache_spark_shuffle_rdma_NativeBridge_fetchBlocks(
    mut env: JNIEnv,
    _c: JClass,
    h: jlong,
    host: JString,
    port: jint,
    shuffle_ids: JIntArray,
    map_ids: JLongArray,
    starts: JIntArray,
    ends: JIntArray,
    cb: JObject,
) {
    guard(&mut env, (), |env| {
        let e = engine(h)?;
        if cb.is_null() {
            return Err(BridgeError::new("invalid_argument", "callback is null"));
        }
        let host = string(env, &host, "host")?;
        let addr = resolve(&host, port)?;
        if shuffle_ids.is_null() || map_ids.is_null() || starts.is_null() || ends.is_null() {
            return Err(BridgeError::new(
                "invalid_argument",
                "block arrays (shuffleIds, mapIds, startReduceIds, endReduceIds) must not be null",
            ));
        }
        let n = env.get_array_length(&shuffle_ids)? as usize;
        let lens = [env.get_array_length(&map_ids)?, env.get_array_length(&starts)?, env.get_array_length(&ends)?];
        if lens.iter().any(|l| *l as usize != n) {
            return Err(BridgeError::new("invalid_argument", format!("block arrays differ in length: {n} vs {lens:?}")));
        }
        let mut s = vec![0i32; n];
        let mut m = vec![0i64; n];
        let mut a = vec![0i32; n];
        let mut b = vec![0i32; n];
        env.get_int_array_region(&shuffle_ids, 0, &mut s)?;
        env.get_long_array_region(&map_ids, 0, &mut m)?;
        env.get_int_array_region(&starts, 0, &mut a)?;
        env.get_int_array_region(&ends, 0, &mut b)?;
        let mut blocks = Vec::with_capacity(n);
        for i in 0..n {
            if s[i] < 0 || m[i] < 0 || a[i] < 0 || b[i] < 0 {
                return Err(BridgeError::new(
                    "invalid_argument",
                    format!("block {i}: negative id in shuffle_{}_{}_{}_{}", s[i], m[i], a[i], b[i]),
                ));
            }
            blocks.push(ShuffleBlock::batch(s[i] as u32, m[i] as u64, a[i] as u32, b[i] as u32));
        }
        let sink = Arc::new(JvmSink { vm: env.get_java_vm()?, callback: env.new_global_ref(&cb)? });
        // Block on no lock held by Java: the engine connects (bounded by connectTimeout) and
        // queues; results arrive on engine threads.
        e.client().fetch(addr, &blocks, sink);
        Ok(())
    })
}

fn resolve(host: &str, port: jint) -> Result<SocketAddr, BridgeError> {
    if !(0..=65535).contains(&port) {
        return Err(BridgeError::new("invalid_argument", format!("port {port} out of range")));
    }
    (host, port as u16)
        .to_socket_addrs()
        .map_err(|err| BridgeError::new("connect", format!("cannot resolve {host}:{port}: {err}")))?
        .next()
        .ok_or_else(|| BridgeError::new("connect", format!("{host}:{port} resolves to no address")))
}

/// Writes a streamed block into its temp file, then tells Java (`onFile` or `onFailure`,
/// index 0) from the delivery thread.
struct FileSink {
    path: PathBuf,
    file: std::sync::Mutex<Option<std::io::BufWriter<std::fs::File>>>,
    jvm: JvmSink,
}

impl FileSink {
    fn io_failure(&self, what: &str, e: std::io::Error) -> BlockFailure {
        BlockFailure::new(FailureCode::Io, format!("{what} {}: {e}", self.path.display()))
    }

    fn end(&self, result: Result<u64, BlockFailure>) -> jni::errors::Result<()> {
        let mut env = self.jvm.vm.attach_current_thread_as_daemon()?;
        env.with_local_frame(4, |env| {
            let r = match &result {
                Ok(len) => env.call_method(&self.jvm.callback, "onFile", "(IJ)V", &[JValue::Int(0), JValue::Long(*len as jlong)]),
                Err(f) => {
                    let kind = env.new_string(f.code.name())?;
                    let msg = env.new_string(&f.message)?;
                    env.call_method(
                        &self.jvm.callback,
                        "onFailure",
                        "(ILjava/lang/String;Ljava/lang/String;)V",
                        &[JValue::Int(0), (&kind).into(), (&msg).into()],
                    )
                }
            };
            if r.is_err() || env.exception_check()? {
                let _ = env.exception_describe();
                let _ = env.exception_clear();
                tracing::warn!(path = %self.path.display(), "FetchCallback threw on a streamed block");
            }
            Ok(())
        })
    }
}

impl ChunkSink for FileSink {
    fn on_chunk(&self, _offset: u64, _block_len: u64, chunk: &[u8]) -> Result<(), BlockFailure> {
        let mut f = self.file.lock().unwrap_or_else(|p| p.into_inner());
        let w = f.as_mut().ok_or_else(|| BlockFailure::new(FailureCode::Io, "temp file already closed"))?;
        w.write_all(chunk).map_err(|e| self.io_failure("writing", e))
    }

    fn on_end(&self, result: Result<u64, BlockFailure>) {
        let flushed = self
            .file
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
            .map(|mut w| w.flush().map_err(|e| self.io_failure("writing", e)));
        let result = match (result, flushed) {
            (Ok(_), Some(Err(f))) => Err(f),
            (r, _) => r,
        };
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.end(result)));
        if !matches!(r, Ok(Ok(()))) {
            tracing::error!(path = %self.path.display(), "cannot report a streamed block to the JVM");
        }
    }
}

/// Streams one block (of any length: above the pool cap, above 2 GiB) from a remote engine
/// into the file at `path` (created or truncated), through pool buffers of at most the
/// largest tier, two at a time. Then exactly one `cb.onFile(0, length)` or
/// `cb.onFailure(0, kind, message)` follows, from a native thread.
#[allow(clippy::too_many_arguments)]
#[no_mangle]
pub extern "system" fn Java_org_apache_spark_shuffle_rdma_NativeBridge_fetchBlockToFile(
    mut env: JNIEnv,
    _c: JClass,
    h: jlong,
    host: JString,
    port: jint,
    shuffle_id: jint,
    map_id: jlong,
    start: jint,
    end: jint,
    path: JString,
    cb: JObject,
) {
    guard(&mut env, (), |env| {
        let e = engine(h)?;
        if cb.is_null() {
            return Err(BridgeError::new("invalid_argument", "callback is null"));
        }
        if shuffle_id < 0 || map_id < 0 || start < 0 || end < 0 {
            return Err(BridgeError::new(
                "invalid_argument",
                format!("negative id in shuffle_{shuffle_id}_{map_id}_{start}_{end}"),
            ));
        }
        let host = string(env, &host, "host")?;
        let addr = resolve(&host, port)?;
        let path = PathBuf::from(string(env, &path, "path")?);
        let jvm = JvmSink { vm: env.get_java_vm()?, callback: env.new_global_ref(&cb)? };
        let block = ShuffleBlock::batch(shuffle_id as u32, map_id as u64, start as u32, end as u32);
        match std::fs::File::create(&path) {
            Ok(file) => {
                let file = std::sync::Mutex::new(Some(std::io::BufWriter::with_capacity(1 << 20, file)));
                let sink = Arc::new(FileSink { path, file, jvm });
                e.client().fetch_stream(addr, block, StreamConfig::default(), sink);
            }
            Err(err) => {
                let sink = FileSink { path, file: std::sync::Mutex::new(None), jvm };
                let what = format!("executor {}: {}: cannot create the temp file", e.config().executor_id, block.span());
                let f = sink.io_failure(&what, err);
                sink.on_end(Err(f));
            }
        }
        Ok(())
    })
}

#[no_mangle]
pub extern "system" fn Java_org_apache_spark_shuffle_rdma_NativeBridge_releaseLease(
    mut env: JNIEnv,
    _c: JClass,
    handle: jlong,
) -> jboolean {
    guard(&mut env, JNI_FALSE, |_| Ok(if release(handle) { JNI_TRUE } else { JNI_FALSE }))
}

#[no_mangle]
pub extern "system" fn Java_org_apache_spark_shuffle_rdma_NativeBridge_engineStats(
    mut env: JNIEnv,
    _c: JClass,
    h: jlong,
) -> jstring {
    guard(&mut env, std::ptr::null_mut(), |env| {
        let mut text = engine(h)?.stats_text();
        // Block buffers Java holds now, over every engine of the process (the table is one per
        // process): 0 between shuffles, or a reader leaked a buffer (scripts/soak.sh checks).
        let _ = writeln!(text, "leases_held={}", LEASES.live());
        Ok(env.new_string(text)?.into_raw())
    })
}

/// How an engine opened with `config` would split its native memory, for the JVM to check
/// when Spark starts (before any engine opens). `key=value` lines for each provider the
/// transport may open (`auto`: the registry's auto order), with the prefix `<provider>_`
/// (`verbs_`, `tcp_`), and without a prefix for the one of them that needs the least fixed
/// memory (the one `auto` ends on when the others do not fit; for a name, that provider):
/// `native_bound_bytes`, `pool_cap_bytes`, `native_fixed_bytes`, `pool_cap_explicit` when the
/// settings fit, else `unfit=<why, naming the settings and numbers>`; and
/// `bound_needed_bytes`, the smallest bound they fit in; `bound_source`, how the bound was
/// computed from Spark's settings; `unfit_fallback`, what the plugin does when the
/// unprefixed plan is `unfit`: `spark` (every shuffle to Spark's sort shuffle) or `none` (the
/// start fails: the user chose the provider or the pool cap). Throws `config` only for a
/// malformed config.
#[no_mangle]
pub extern "system" fn Java_org_apache_spark_shuffle_rdma_NativeBridge_memoryBudget(
    mut env: JNIEnv,
    _c: JClass,
    config: JString,
) -> jstring {
    guard(&mut env, std::ptr::null_mut(), |env| {
        let text = string(env, &config, "config")?;
        let cfg = EngineConfig::from_kv(&text).map_err(|e| BridgeError::new("config", e.to_string()))?;
        let setting = |e: rdma_shuffle_shuffle::EngineError| BridgeError::new("config", e.to_string());
        let mut sized = Vec::new();
        for name in MemoryBudget::candidates(&cfg) {
            sized.push((name, MemoryBudget::bound_needed(&cfg, name).map_err(setting)?));
        }
        let smallest = sized.iter().min_by_key(|(_, needed)| *needed).map(|(name, _)| *name);
        let mut out = String::new();
        for (name, needed) in &sized {
            let prefixes =
                if Some(*name) == smallest { vec![format!("{name}_"), String::new()] } else { vec![format!("{name}_")] };
            let budget = MemoryBudget::over(&cfg, name);
            for prefix in prefixes {
                match &budget {
                    Ok(b) => {
                        for line in b.describe().lines() {
                            let _ = writeln!(out, "{prefix}{line}");
                        }
                    }
                    Err(e) => {
                        let _ = writeln!(out, "{prefix}unfit={}", e.to_string().replace('\n', " "));
                    }
                }
                let _ = writeln!(out, "{prefix}bound_needed_bytes={needed}");
            }
        }
        if let Some(b) = &cfg.memory_bound {
            let _ = writeln!(out, "bound_source={}", b.source);
        }
        let _ = writeln!(out, "unfit_fallback={}", MemoryBudget::unfit_fallback(&cfg).unwrap_or("none"));
        Ok(env.new_string(out)?.into_raw())
    })
}

/// The preflight (`Doctor`): every check of [`doctor::run`] for the settings in `config`; the
/// first line is `exit=<code>` (0 when the transport asked for works here, 2 when it cannot),
/// then the report as text or (`json`) one JSON document. Logs nothing: the report is the
/// output.
#[no_mangle]
pub extern "system" fn Java_org_apache_spark_shuffle_rdma_NativeBridge_doctor(
    mut env: JNIEnv,
    _c: JClass,
    config: JString,
    json: jboolean,
) -> jstring {
    guard(&mut env, std::ptr::null_mut(), |env| {
        let text = string(env, &config, "config")?;
        let cfg = EngineConfig::from_kv(&text).map_err(|e| BridgeError::new("config", e.to_string()))?;
        let report = doctor::run(&cfg);
        let body = if json == JNI_FALSE { report.text } else { report.json.to_text() + "\n" };
        Ok(env.new_string(format!("exit={}\n{body}", report.exit_code))?.into_raw())
    })
}

/// The engine's settings in force, as canonical `key=value` lines (one per engine setting of
/// the schema): what the JVM sent, as the engine understood it. Tests compare it with the JVM's
/// own resolution, so the two sides cannot read the schema differently.
#[no_mangle]
pub extern "system" fn Java_org_apache_spark_shuffle_rdma_NativeBridge_engineSettings(
    mut env: JNIEnv,
    _c: JClass,
    h: jlong,
) -> jstring {
    guard(&mut env, std::ptr::null_mut(), |env| Ok(env.new_string(engine(h)?.config().to_kv())?.into_raw()))
}

#[no_mangle]
pub extern "system" fn Java_org_apache_spark_shuffle_rdma_NativeBridge_engineClose(mut env: JNIEnv, _c: JClass, h: jlong) {
    guard(&mut env, (), |_| {
        if h == 0 {
            return Ok(());
        }
        // SAFETY: `h` came from engineOpen; Java calls close once and never uses it again.
        let engine = unsafe { Box::from_raw(h as *mut Engine) };
        tracing::info!(stats = %engine.stats_text().replace('\n', " "), "shuffle engine closing");
        engine.shutdown();
        drop(engine);
        Ok(())
    })
}
