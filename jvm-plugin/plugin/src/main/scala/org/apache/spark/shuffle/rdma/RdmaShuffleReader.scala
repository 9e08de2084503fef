/*
 * Licensed under the Apache License, Version 2.0.
 */
package org.apache.spark.shuffle.rdma

import org.apache.spark.{
  InterruptibleIterator,
  MapOutputTracker,
  ShuffleDependency,
  SparkEnv,
  TaskContext
}
import org.apache.spark.internal.{config, Logging}
import org.apache.spark.io.CompressionCodec
import org.apache.spark.network.shuffle.BlockStoreClient
import org.apache.spark.serializer.SerializerManager
import org.apache.spark.shuffle.{BaseShuffleHandle, ShuffleReader, ShuffleReadMetricsReporter}
import org.apache.spark.storage.{BlockId, BlockManager, BlockManagerId, ShuffleBlockFetcherIterator}
import org.apache.spark.util.CompletionIterator

/**
 * Reads a reduce partition range the way Spark's `BlockStoreShuffleReader` does — the same
 * `ShuffleBlockFetcherIterator` with the same settings, so bytes-in-flight limits, corruption
 * detection, `FetchFailedException`, host-local reads and read metrics all stay Spark's — but
 * hands the iterator `blockStoreClient` (a [[NativeBlockStoreClient]]) for remote blocks.
 *
 * The construction below mirrors Spark 4.2.0 / 3.5.9 `BlockStoreShuffleReader.read()` line by
 * line (both lines build the iterator identically); the post-fetch aggregation and sorting
 * differ between Spark lines and live in [[SparkShims.combineAndSort]].
 */
private[rdma] class RdmaShuffleReader[K, C](
    handle: BaseShuffleHandle[K, _, C],
    blocksByAddress: Iterator[(BlockManagerId, scala.collection.Seq[(BlockId, Long, Int)])],
    context: TaskContext,
    readMetrics: ShuffleReadMetricsReporter,
    blockStoreClient: BlockStoreClient,
    shouldBatchFetch: Boolean,
    serializerManager: SerializerManager = SparkEnv.get.serializerManager,
    blockManager: BlockManager = SparkEnv.get.blockManager,
    mapOutputTracker: MapOutputTracker = SparkEnv.get.mapOutputTracker)
  extends ShuffleReader[K, C] with Logging {

  private val dep = handle.dependency

  /** Same decision as Spark's reader: batch fetch only when every layer can concatenate. */
  private def fetchContinuousBlocksInBatch: Boolean = {
    val conf = SparkEnv.get.conf
    val serializerRelocatable = dep.serializer.supportsRelocationOfSerializedObjects
    val compressed = conf.get(config.SHUFFLE_COMPRESS)
    val codecConcatenation = if (compressed) {
      CompressionCodec.supportsConcatenationOfSerializedStreams(CompressionCodec.createCodec(conf))
    } else {
      true
    }
    val useOldFetchProtocol = conf.get(config.SHUFFLE_USE_OLD_FETCH_PROTOCOL)
    // SPARK-34790: batch fetch is incompatible with io encryption.
    val ioEncryption = conf.get(config.IO_ENCRYPTION_ENABLED)
    shouldBatchFetch && serializerRelocatable &&
    (!compressed || codecConcatenation) && !useOldFetchProtocol && !ioEncryption
  }

  override def read(): Iterator[Product2[K, C]] = {
    val conf = SparkEnv.get.conf
    val wrappedStreams = new ShuffleBlockFetcherIterator(
      context,
      blockStoreClient,
      blockManager,
      mapOutputTracker,
      blocksByAddress,
      serializerManager.wrapStream,
      // Spark reads this size in MiB when no unit is given.
      conf.get(config.REDUCER_MAX_SIZE_IN_FLIGHT) * 1024 * 1024,
      conf.get(config.REDUCER_MAX_REQS_IN_FLIGHT),
      conf.get(config.REDUCER_MAX_BLOCKS_IN_FLIGHT_PER_ADDRESS),
      conf.get(config.MAX_REMOTE_BLOCK_SIZE_FETCH_TO_MEM),
      conf.get(config.SHUFFLE_MAX_ATTEMPTS_ON_NETTY_OOM),
      conf.get(config.SHUFFLE_DETECT_CORRUPT),
      conf.get(config.SHUFFLE_DETECT_CORRUPT_MEMORY),
      conf.get(config.SHUFFLE_CHECKSUM_ENABLED),
      conf.get(config.SHUFFLE_CHECKSUM_ALGORITHM),
      readMetrics,
      fetchContinuousBlocksInBatch
    ).toCompletionIterator

    val serializerInstance = dep.serializer.newInstance()
    val recordIter = wrappedStreams.flatMap { case (_, wrappedStream) =>
      // asKeyValueIterator closes the stream (releasing the fetched buffer) when exhausted.
      serializerInstance.deserializeStream(wrappedStream).asKeyValueIterator
    }
    val metricIter = CompletionIterator[(Any, Any), Iterator[(Any, Any)]](
      recordIter.map { record =>
        readMetrics.incRecordsRead(1)
        record
      },
      context.taskMetrics().mergeShuffleReadMetrics())
    // Interruptible so that task cancellation stops the read.
    val interruptibleIter = new InterruptibleIterator[(Any, Any)](context, metricIter)

    val resultIter = SparkShims.combineAndSort[K, C](dep, context, interruptibleIter)
    resultIter match {
      case _: InterruptibleIterator[Product2[K, C]] => resultIter
      case _ => new InterruptibleIterator[Product2[K, C]](context, resultIter)
    }
  }
}

/** Post-fetch steps every Spark line shares; the line-specific order lives in [[SparkShims]]. */
private[rdma] object ShuffleReadSteps {

  /**
   * Aggregation by key as Spark's reader does it: merge combiners when the map side already
   * combined, else combine raw values; without an aggregator the records pass through.
   */
  def combineByKey[K, C](
      dep: ShuffleDependency[K, _, C],
      context: TaskContext,
      records: Iterator[(Any, Any)]): Iterator[Product2[K, C]] = {
    if (dep.aggregator.isDefined) {
      if (dep.mapSideCombine) {
        dep.aggregator.get.combineCombinersByKey(records.asInstanceOf[Iterator[(K, C)]], context)
      } else {
        dep.aggregator.get.combineValuesByKey(records.asInstanceOf[Iterator[(K, Nothing)]], context)
      }
    } else {
      records.asInstanceOf[Iterator[Product2[K, C]]]
    }
  }
}
