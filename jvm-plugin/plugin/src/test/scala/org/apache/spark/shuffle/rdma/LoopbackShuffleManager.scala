/*
 * Licensed under the Apache License, Version 2.0.
 */
package org.apache.spark.shuffle.rdma

import org.apache.spark.SparkConf
import org.apache.spark.shuffle.BaseShuffleHandle
import org.apache.spark.storage.{BlockId, BlockManagerId}

/**
 * The real [[RdmaShuffleManager]] with the native library replaced by a [[LoopbackEngine]], for
 * end-to-end tests in `local[N]` mode (Spark instantiates it by name, as it would the real one).
 *
 * In local mode every block is local, so Spark would never call the block store client. This
 * manager relabels every block's location as a remote executor `remote-<id>` on another host;
 * the reader directory maps `remote-<id>` back to `<id>` through the real driver registry.
 * Everything between — Spark's fetcher iterator, retries, the client's callback mapping, lease
 * release, the commit hook — is the production code.
 */
class LoopbackShuffleManager(conf: SparkConf, isDriver: Boolean)
  extends RdmaShuffleManager(conf, isDriver) {

  override protected def nativeLibrary(): NativeLoader.Outcome =
    NativeLoader.Outcome.of(true, "test", null)

  override protected def memoryBudget(config: String): String = LoopbackShuffleManager.budget

  override protected def openEngine(config: String): ShuffleEngine = {
    LoopbackShuffleManager.lastConfig = config
    val e = new LoopbackEngine(
      LoopbackShuffleManager.failure,
      LoopbackShuffleManager.refuseRegistration)
    LoopbackShuffleManager.engine = e
    e
  }

  override protected def readerDirectory(registry: CachingEngineDirectory): EngineDirectory =
    new EngineDirectory {
      override def lookup(executorId: String): Option[EngineAddress] =
        registry.lookup(executorId.stripPrefix(LoopbackShuffleManager.RemotePrefix))
    }

  override protected def mapSizesByExecutorId(
      handle: BaseShuffleHandle[_, _, _],
      startMapIndex: Int,
      endMapIndex: Int,
      startPartition: Int,
      endPartition: Int)
      : (Iterator[(BlockManagerId, scala.collection.Seq[(BlockId, Long, Int)])], Boolean) = {
    val (it, batch) =
      super.mapSizesByExecutorId(handle, startMapIndex, endMapIndex, startPartition, endPartition)
    (
      it.map { case (bm, blocks) =>
        (
          BlockManagerId(
            LoopbackShuffleManager.RemotePrefix + bm.executorId,
            // The real host only where a test needs Spark's own transfer to reach the files
            // (with spark.shuffle.readHostLocalDisk=false, else Spark reads them from disk).
            if (LoopbackShuffleManager.realHost) bm.host else "remote-host",
            bm.port
          ),
          blocks)
      },
      batch)
  }
}

/** Test-wide handles (Spark creates the manager, tests need to reach its engine). */
object LoopbackShuffleManager {
  val RemotePrefix = "remote-"
  @volatile var engine: LoopbackEngine = _
  @volatile var lastConfig: String = _
  @volatile var failure: (BlockRange, Int) => Option[(String, String)] = (_, _) => None
  @volatile var refuseRegistration: (Int, Long) => Boolean = (_, _) => false
  @volatile var realHost = false

  /** The engine's answer to `memoryBudget` (its lines, as the native library gives them). */
  @volatile var budget: String = FittingBudget

  def FittingBudget: String = "pool_cap_bytes=67108864\nunfit_fallback=spark\n"

  def reset(): Unit = {
    budget = FittingBudget
    engine = null
    lastConfig = null
    failure = (_, _) => None
    refuseRegistration = (_, _) => false
    realHost = false
  }
}
