/*
 * Licensed under the Apache License, Version 2.0.
 */
package org.apache.spark.shuffle.rdma

import org.apache.spark.{Aggregator, InterruptibleIterator, ShuffleDependency, TaskContext}
import org.apache.spark.shuffle.ShuffleManager
import org.apache.spark.util.collection.ExternalSorter

/**
 * What differs between Spark lines, for Spark 4.x (compiled against 4.2.0).
 *
 * Spark 4.3 replaces the manager contract with `BlockingShuffleManager`; when the build moves
 * to it, this folder's [[ShuffleManagerContract]] is the one line that changes.
 */
private[rdma] object SparkShims {

  /**
   * Spark 4 creates the shuffle manager after `SparkEnv` is set (SparkContext / Executor
   * call `initializeShuffleManager`), so the manager can start its engine and register with
   * the driver in its constructor.
   */
  val envReadyAtConstruction: Boolean = true

  /**
   * The post-fetch part of Spark 4.2's `BlockStoreShuffleReader.read()`: with a key ordering the
   * ExternalSorter sorts and aggregates in one pass (SPARK-46512); otherwise combine by key.
   */
  def combineAndSort[K, C](
      dep: ShuffleDependency[K, _, C],
      context: TaskContext,
      interruptibleIter: InterruptibleIterator[(Any, Any)]): Iterator[Product2[K, C]] = {
    if (dep.keyOrdering.isDefined) {
      val sorter: ExternalSorter[K, _, C] = if (dep.aggregator.isDefined) {
        if (dep.mapSideCombine) {
          new ExternalSorter[K, C, C](
            context,
            Option(new Aggregator[K, C, C](
              identity,
              dep.aggregator.get.mergeCombiners,
              dep.aggregator.get.mergeCombiners)),
            ordering = Some(dep.keyOrdering.get),
            serializer = dep.serializer
          )
        } else {
          new ExternalSorter[K, Nothing, C](
            context,
            dep.aggregator.asInstanceOf[Option[Aggregator[K, Nothing, C]]],
            ordering = Some(dep.keyOrdering.get),
            serializer = dep.serializer)
        }
      } else {
        new ExternalSorter[K, C, C](
          context,
          ordering = Some(dep.keyOrdering.get),
          serializer = dep.serializer)
      }
      sorter.insertAllAndUpdateMetrics(interruptibleIter.asInstanceOf[Iterator[(K, Nothing)]])
    } else {
      ShuffleReadSteps.combineByKey[K, C](dep, context, interruptibleIter)
    }
  }
}

/** The manager contract of this Spark line. */
private[rdma] trait ShuffleManagerContract extends ShuffleManager
