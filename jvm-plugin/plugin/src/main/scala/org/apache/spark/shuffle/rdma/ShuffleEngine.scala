/*
 * Licensed under the Apache License, Version 2.0.
 */
package org.apache.spark.shuffle.rdma

import java.io.File

/**
 * One contiguous range of reduce partitions of one map output: what a Spark shuffle block id
 * (`shuffle_S_M_R`, or the batch form `shuffle_S_M_R1_R2`) names.
 *
 * @param startReduceId first reduce partition (inclusive)
 * @param endReduceId last reduce partition (exclusive); `startReduceId + 1` for a single block
 */
final case class BlockRange(shuffleId: Int, mapId: Long, startReduceId: Int, endReduceId: Int)

/**
 * What the JVM side needs from a shuffle engine. [[NativeEngine]] implements it over JNI; tests
 * implement it in the JVM to exercise the glue (lease accounting, block-id mapping, failure
 * mapping) without the native library.
 *
 * Thread-safety: every method may be called from any thread.
 */
trait ShuffleEngine {

  /** Port of this engine's block server. */
  def port: Int

  /** Transport in use: `verbs` or `tcp`. */
  def transport: String

  /** Why this transport (for the executor's log), when the engine says. */
  def transportReason: String = ""

  /** Makes a committed map output servable (see [[NativeBridge.registerMapOutput]]). */
  def registerMapOutput(
      shuffleId: Int,
      mapId: Long,
      dataFile: File,
      indexFile: File,
      numPartitions: Int): Unit

  /** Forgets a shuffle; returns how many map outputs were registered for it. */
  def unregisterShuffle(shuffleId: Int): Int

  /**
   * Starts fetching `blocks` from the engine at `host:port`; `callback` then receives exactly
   * one result per index, possibly from other threads.
   */
  def fetchBlocks(
      host: String,
      port: Int,
      blocks: IndexedSeq[BlockRange],
      callback: FetchCallback): Unit

  /**
   * Streams `block` from the engine at `host:port` into `file` (see
   * [[NativeBridge.fetchBlockToFile]]): exactly one `callback.onFile(0, length)` or
   * `callback.onFailure(0, ...)` follows, possibly from another thread. An engine that cannot
   * stream answers with a failure.
   */
  def fetchBlockToFile(
      host: String,
      port: Int,
      block: BlockRange,
      file: File,
      callback: FetchCallback): Unit =
    callback.onFailure(0, "other", s"${getClass.getSimpleName} cannot stream blocks to files")

  /** Returns the memory of a fetched block (exactly once per lease). */
  def releaseLease(lease: Long): Unit

  /** Counters as `key -> value` (blocks_served, bytes_served, blocks_fetched, bytes_fetched, ...). */
  def stats: Seq[(String, String)]

  /** Stops the engine. Idempotent. */
  def close(): Unit
}
