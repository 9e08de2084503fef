/*
 * Licensed under the Apache License, Version 2.0.
 */
package org.apache.spark.shuffle.rdma

import java.io.{File, IOException}
import java.nio.ByteBuffer

import org.apache.spark.SparkConf
import org.apache.spark.network.buffer.{FileSegmentManagedBuffer, ManagedBuffer}
import org.apache.spark.network.client.StreamCallbackWithID
import org.apache.spark.serializer.SerializerManager
import org.apache.spark.shuffle.IndexShuffleBlockResolver
import org.apache.spark.storage.{BlockId, ShuffleDataBlockId, ShuffleIndexBlockId}

/**
 * Spark's `IndexShuffleBlockResolver`, with the length of the data file checked against the
 * index before a block is handed out. Spark's local reads (a reducer reading the map outputs of
 * its own executor) and its block manager's serving both come here.
 *
 * Why: Spark opens a data file lazily and reads it through a length-limited stream, so a data
 * file truncated after commit ends the block early without an error. With uncompressed blocks
 * (`spark.shuffle.compress=false`) the deserializer takes that end for the end of the block and
 * the reducer silently loses records (seen on the 3-host cluster, issue 14: 5629 of 6000
 * records). Here the block fails with an `IOException` naming the file, its length and the
 * range the index promises; Spark's fetcher turns it into a FetchFailed and the map output is
 * recomputed, as for a block the native engine refuses to serve (its store checks the same).
 * A file truncated while a block is being read is not caught here (the store's `pread` path
 * catches it for remote reads).
 *
 * It also reports map outputs that arrive by shuffle-block migration (decommissioning: Spark's
 * `BlockManagerDecommissioner` on the leaving executor uploads each output's `.data` and
 * `.index` through Spark's block transfer, and this executor's block manager writes them here
 * through [[putShuffleBlockAsStream]]). Once both files of an output are in place,
 * [[migrationHook]] is called, and the manager registers the output with this executor's
 * engine, so reducers, which the driver now points at this executor, fetch it through the
 * engine like an output written here.
 */
private[rdma] class CheckedIndexShuffleBlockResolver(conf: SparkConf)
  extends IndexShuffleBlockResolver(conf) {

  /**
   * Called with `(shuffleId, mapId)` when a migrated map output is complete on disk (see the
   * class docs). Set by the manager; must not throw (failures are the manager's to log).
   */
  @volatile private[rdma] var migrationHook: (Int, Long) => Unit = (_, _) => ()

  override def getBlockData(blockId: BlockId, dirs: Option[Array[String]]): ManagedBuffer =
    CheckedIndexShuffleBlockResolver.verified(blockId, super.getBlockData(blockId, dirs))

  override def putShuffleBlockAsStream(
      blockId: BlockId,
      serializerManager: SerializerManager): StreamCallbackWithID = {
    val inner = super.putShuffleBlockAsStream(blockId, serializerManager)
    new StreamCallbackWithID {
      override def getID: String = inner.getID
      override def onData(streamId: String, buf: ByteBuffer): Unit = inner.onData(streamId, buf)
      override def onFailure(streamId: String, cause: Throwable): Unit =
        inner.onFailure(streamId, cause)
      override def onComplete(streamId: String): Unit = {
        inner.onComplete(streamId) // renames the file into place
        // Spark 3.2+ sends an output's data file, then its index (only the index for an output
        // without data), so the index completes the output. The data case covers a sender that
        // sends them the other way round; a second registration replaces the first.
        blockId match {
          case ShuffleIndexBlockId(shuffleId, mapId, _) => migrationHook(shuffleId, mapId)
          case ShuffleDataBlockId(shuffleId, mapId, _) if getIndexFile(shuffleId, mapId).exists() =>
            migrationHook(shuffleId, mapId)
          case _ =>
        }
      }
    }
  }
}

/** The check itself, separate so that it can be tested on plain files. */
private[rdma] object CheckedIndexShuffleBlockResolver {

  /** `buf` if it is not a file segment, or its file still holds the whole segment. */
  def verified(blockId: BlockId, buf: ManagedBuffer): ManagedBuffer = buf match {
    case seg: FileSegmentManagedBuffer =>
      val file: File = seg.getFile
      val end = seg.getOffset + seg.getLength
      // length() is 0 for a file that is gone: reported as missing, not as short.
      if (!file.exists()) {
        throw new IOException(
          s"$blockId: data file missing: $file was deleted after the map output was " +
            "committed; the map output must be recomputed")
      }
      val actual = file.length()
      if (actual < end) {
        throw new IOException(
          s"$blockId: data file truncated: $file is $actual bytes, the block needs bytes " +
            s"[${seg.getOffset}, $end) (index offsets); the map output must be recomputed")
      }
      seg
    case other => other
  }
}
