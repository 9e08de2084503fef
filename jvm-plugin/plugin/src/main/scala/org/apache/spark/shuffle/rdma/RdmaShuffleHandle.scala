/*
 * Licensed under the Apache License, Version 2.0.
 */
package org.apache.spark.shuffle.rdma

import java.io.File

import org.apache.spark.ShuffleDependency
import org.apache.spark.scheduler.MapStatus
import org.apache.spark.shuffle.{BaseShuffleHandle, ShuffleHandle, ShuffleWriter}

/**
 * Marks a shuffle that the plugin serves. It wraps the handle Spark's `SortShuffleManager` chose
 * (bypass-merge, serialized or base), which still selects the writer. A shuffle the manager
 * handed over to Spark keeps Spark's plain handle, so executors can tell the two apart without
 * asking the driver.
 *
 * @param nativeMemoryPeak the shuffle's [[NativeMemoryAccumulator]], registered on the driver;
 *                         travels to the tasks with the handle, as Spark's own accumulators do
 */
private[rdma] class RdmaShuffleHandle[K, V, C](
    shuffleId: Int,
    dependency: ShuffleDependency[K, V, C],
    val sortHandle: ShuffleHandle,
    val nativeMemoryPeak: Option[NativeMemoryAccumulator] = None)
  extends BaseShuffleHandle[K, V, C](shuffleId, dependency)

/**
 * A map task's committed output, as the native engine needs it to serve the blocks.
 *
 * @param mapId Spark's map id (the map task's unique attempt id)
 * @param dataFile the `.data` file; absent when every partition of this output is empty
 * @param indexFile the `.index` file (`numPartitions + 1` offsets)
 */
final case class MapOutputCommit(
    shuffleId: Int,
    mapId: Long,
    dataFile: File,
    indexFile: File,
    numPartitions: Int)

/**
 * Seam (a) of the plugin: learns about each map output after Spark's writer committed it.
 * Implementations must be thread-safe (map tasks commit concurrently). An exception fails the
 * map task, which Spark then retries.
 */
trait MapOutputCommitHook {

  /** Called once per successful map task, after the files are in place. */
  def onMapOutputCommitted(commit: MapOutputCommit): Unit
}

/**
 * Wraps a Spark shuffle writer and calls `onCommit` when it stops successfully with a
 * MapStatus (that is, after `commitAllPartitions` renamed the files into place).
 */
private[rdma] final class CommitNotifyingWriter[K, V](
    inner: ShuffleWriter[K, V],
    onCommit: () => Unit) extends ShuffleWriter[K, V] {

  override def write(records: Iterator[Product2[K, V]]): Unit = inner.write(records)

  override def stop(success: Boolean): Option[MapStatus] = {
    val status = inner.stop(success)
    if (success && status.isDefined) onCommit()
    status
  }

  override def getPartitionLengths(): Array[Long] = inner.getPartitionLengths()
}
