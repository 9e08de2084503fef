/*
 * Licensed under the Apache License, Version 2.0.
 */
package org.apache.spark.shuffle.rdma

import org.apache.spark.{InterruptibleIterator, ShuffleDependency, TaskContext}
import org.apache.spark.shuffle.ShuffleManager
import org.apache.spark.util.collection.ExternalSorter

/** What differs between Spark lines, for Spark 3.5 (compiled against 3.5.9). */
private[rdma] object SparkShims {

  /**
   * Spark 3.5 builds the shuffle manager inside `SparkEnv.create`, before `SparkEnv.get` can
   * return the new env; the manager must start its engine lazily, on first use.
   */
  val envReadyAtConstruction: Boolean = false

  /**
   * The post-fetch part of Spark 3.5's `BlockStoreShuffleReader.read()`: aggregate first, then
   * sort if the dependency has a key ordering.
   */
  def combineAndSort[K, C](
      dep: ShuffleDependency[K, _, C],
      context: TaskContext,
      interruptibleIter: InterruptibleIterator[(Any, Any)]): Iterator[Product2[K, C]] = {
    val aggregatedIter = ShuffleReadSteps.combineByKey[K, C](dep, context, interruptibleIter)
    dep.keyOrdering match {
      case Some(keyOrd: Ordering[K]) =>
        val sorter =
          new ExternalSorter[K, C, C](context, ordering = Some(keyOrd), serializer = dep.serializer)
        sorter.insertAllAndUpdateMetrics(aggregatedIter)
      case None =>
        aggregatedIter
    }
  }
}

/** The manager contract of this Spark line. */
private[rdma] trait ShuffleManagerContract extends ShuffleManager
