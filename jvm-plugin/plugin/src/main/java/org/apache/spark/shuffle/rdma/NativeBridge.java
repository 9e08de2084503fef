/*
 * Licensed under the Apache License, Version 2.0.
 */
package org.apache.spark.shuffle.rdma;

/**
 * The JNI surface of the native engine (Rust crate {@code crates/jni}, cdylib
 * {@code rdma_shuffle_jni}). Every method is static and takes the engine as an opaque
 * {@code long} handle returned by {@link #engineOpen}.
 *
 * <p>Only {@link NativeEngine} calls these; nothing here may be called before
 * {@link NativeLoader#load()} succeeded. Every method reports errors by throwing
 * {@link RdmaShuffleException} (with a kind), never by a magic return value.
 *
 * <p>Handle lifetime: a handle is valid from {@code engineOpen} until {@code engineClose};
 * calling anything with a closed handle is a bug the JVM side prevents ({@link NativeEngine}
 * guards it), so the native side may treat it as undefined behaviour.
 */
public final class NativeBridge {
  private NativeBridge() {}

  /**
   * Starts an engine: memory pool, progress thread(s), block server listening on a port.
   *
   * @param config newline-separated {@code key=value} lines: every engine setting of the schema
   *     ({@code settings/settings.tsv}) resolved, in canonical form (sizes in bytes, durations in
   *     milliseconds, empty when unset; see {@code RdmaShuffleConf.engineConfig}),
   *     {@code spark.executor.id}, {@code spark.app.id}, and {@code spark.authenticate=true}
   *     plus {@code spark.authenticate.secret} when Spark authentication is on. A schema key the
   *     native side is not given keeps the schema's default; other keys are ignored.
   * @return a non-zero handle
   */
  public static native long engineOpen(String config);

  /**
   * @param h engine handle
   * @return the TCP port the engine's control/block server listens on (never 0 once open)
   */
  public static native int enginePort(long h);

  /**
   * @param h engine handle
   * @return the transport actually chosen: the name of the provider the engine opened (one of
   *     the values of {@code spark.shuffle.rdma.transport} but {@code auto})
   */
  public static native String engineTransport(long h);

  /**
   * @param h engine handle
   * @return why the engine runs over its transport, e.g. {@code transport=auto: using tcp
   *     because verbs is unusable: <what stopped it>}
   */
  public static native String engineTransportReason(long h);

  /**
   * Makes a committed map output servable. Called once per successful map task, after Spark
   * has renamed the files into place.
   *
   * @param h engine handle
   * @param shuffleId shuffle id
   * @param mapId map task id (Spark's unique task attempt id, not the partition index)
   * @param dataPath absolute path of the .data file. May not exist when every partition of this
   *     map output is empty (Spark then writes only the index); such blocks are never fetched.
   * @param indexPath absolute path of the .index file ({@code numPartitions + 1} big-endian longs)
   * @param numPartitions number of reduce partitions
   */
  public static native void registerMapOutput(long h, int shuffleId, long mapId, String dataPath,
      String indexPath, int numPartitions);

  /**
   * Forgets every map output of a shuffle and invalidates its remote keys.
   *
   * @param h engine handle
   * @param shuffleId shuffle id
   * @return the number of map outputs that were registered for that shuffle
   */
  public static native int unregisterShuffle(long h, int shuffleId);

  /**
   * Starts fetching blocks from one remote engine; returns at once. For every index {@code i}
   * exactly one of {@code cb.onBlock(i, ...)} / {@code cb.onFailure(i, ...)} follows, from a
   * native thread. Block {@code i} is reduce partitions
   * {@code [startReduceIds[i], endReduceIds[i])} of map output {@code (shuffleIds[i], mapIds[i])}
   * as one contiguous byte range (a single partition when the range has length 1).
   *
   * <p>The engine applies {@code spark.shuffle.rdma.connectTimeout} and
   * {@code spark.shuffle.rdma.fetchTimeout}: a hung fetch ends in {@code onFailure(i,"timeout",..)}.
   *
   * @param h engine handle
   * @param host the remote engine's host
   * @param port the remote engine's port
   * @param shuffleIds per-block shuffle ids (all arrays have the same length)
   * @param mapIds per-block map ids
   * @param startReduceIds per-block first reduce partition (inclusive)
   * @param endReduceIds per-block last reduce partition (exclusive)
   * @param cb receives the results
   */
  public static native void fetchBlocks(long h, String host, int port, int[] shuffleIds,
      long[] mapIds, int[] startReduceIds, int[] endReduceIds, FetchCallback cb);

  /**
   * Streams one block of any length (above the pool cap, above 2 GiB) from a remote engine into
   * the file at {@code path} (created or truncated), through at most two pool buffers of at most
   * the largest pool tier at a time; returns at once. Then exactly one {@code cb.onFile(0,
   * length)} or {@code cb.onFailure(0, kind, message)} follows, from a native thread. The caller
   * owns the file (and deletes it, also after a failure).
   *
   * @param h engine handle
   * @param host the remote engine's host
   * @param port the remote engine's port
   * @param shuffleId shuffle id
   * @param mapId map id
   * @param startReduceId first reduce partition (inclusive)
   * @param endReduceId last reduce partition (exclusive)
   * @param path the file to write
   * @param cb receives the result
   */
  public static native void fetchBlockToFile(long h, String host, int port, int shuffleId,
      long mapId, int startReduceId, int endReduceId, String path, FetchCallback cb);

  /**
   * Returns a fetched block's memory to the pool. Call it once per lease handed to {@link
   * FetchCallback#onBlock}; the direct ByteBuffer must not be touched afterwards. A handle is a
   * key into the native lease table, not a pointer: releasing one twice, or one never handed
   * out, is a no-op (logged with the handle), never a double free. Valid after the engine that
   * fetched the block was closed.
   *
   * @param leaseHandle the lease (0, an empty block's, is a no-op)
   * @return true when this call released a lease, false for 0 or a stale or unknown handle
   */
  public static native boolean releaseLease(long leaseHandle);

  /**
   * @param h engine handle
   * @return {@code key=value} lines: at least {@code blocks_served}, {@code bytes_served},
   *     {@code blocks_fetched}, {@code bytes_fetched}, then transport-specific counters
   */
  public static native String engineStats(long h);

  /**
   * How an engine opened with {@code config} would split its native memory; needs no engine.
   * The JVM asks when Spark starts, so that settings that cannot fit fail the start.
   *
   * @param config the engine settings and the bound, as {@code RdmaShuffleConf.budgetConfig}
   *     gives them
   * @return {@code key=value} lines for each provider the transport may open, with the prefix
   *     {@code <provider>_}, and without a prefix for the one it ends on when the others do
   *     not fit: {@code native_bound_bytes}, {@code pool_cap_bytes}, {@code native_fixed_bytes},
   *     {@code pool_cap_explicit} when the settings fit, else {@code unfit} (why, naming the
   *     settings and the numbers); {@code bound_needed_bytes}, the smallest bound they fit in;
   *     and {@code unfit_fallback}: {@code spark} when settings that do not fit hand every
   *     shuffle to Spark, {@code none} when they fail the start (the user chose them)
   * @throws RdmaShuffleException of kind {@code config} for a malformed config
   */
  public static native String memoryBudget(String config);

  /**
   * The preflight an operator runs on a node ({@link Doctor}): devices, ports, GIDs, the GID and
   * transport the engine would pick and why, memlock against the memory bound, registration
   * of the pool's memory, and a loopback transfer through two engines. Needs no engine.
   *
   * @param config engine settings and Spark memory settings as {@code key=value} lines (Spark's
   *     unit syntax accepted); {@code spark.shuffle.rdma.transport} is the transport asked for
   * @param json the report as one JSON document instead of text
   * @return {@code exit=<code>} on the first line (0 when the transport asked for works here, 2
   *     when it cannot), then the report
   */
  public static native String doctor(String config, boolean json);

  /**
   * @param h engine handle
   * @return the engine's settings in force: one canonical {@code key=value} line per engine
   *     setting of the schema, in the form {@code engineOpen} takes
   */
  public static native String engineSettings(long h);

  /**
   * Stops the engine: closes connections, joins native threads, frees the pool. Outstanding
   * leases must have been released. The handle is invalid afterwards.
   *
   * @param h engine handle
   */
  public static native void engineClose(long h);
}
