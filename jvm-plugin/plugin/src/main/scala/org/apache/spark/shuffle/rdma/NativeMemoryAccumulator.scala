/*
 * Licensed under the Apache License, Version 2.0.
 */
package org.apache.spark.shuffle.rdma

import org.apache.spark.util.AccumulatorV2

/**
 * The peak of the engines' native memory, as a named accumulator of each shuffle the plugin
 * serves, so that Spark's UI (the stage page's Accumulators table and the task table) and its
 * REST API (`/api/v1/applications/<app>/stages/...`: `accumulatorUpdates` of a stage and of
 * each task) show it.
 *
 * Spark's executor metrics (`ExecutorMetricType`: `JVMHeapMemory`, `ProcessTreeJVMRSSMemory`,
 * ...) are a sealed, fixed list in Spark 3.5 and 4.x alike, so no plugin can add one to the
 * executors page or `/executors`; a named accumulator is the per-task, per-stage view Spark
 * offers to code outside it (SQL metrics work the same way). Each map and reduce task of a
 * shuffle adds its executor's `native_peak_bytes` when it ends; values merge by maximum, so a
 * task shows its executor's peak so far and the stage the highest of its executors. The executor-level
 * gauges (current, peak, bound and their parts) are in the `rdmaShuffle` metrics source.
 */
private[rdma] final class NativeMemoryAccumulator extends AccumulatorV2[Long, Long] {
  private var peak = 0L

  override def isZero: Boolean = peak == 0L

  override def copy(): NativeMemoryAccumulator = {
    val c = new NativeMemoryAccumulator
    c.peak = peak
    c
  }

  override def reset(): Unit = peak = 0L

  override def add(v: Long): Unit = if (v > peak) peak = v

  override def merge(other: AccumulatorV2[Long, Long]): Unit = add(other.value)

  override def value: Long = peak
}

private[rdma] object NativeMemoryAccumulator {

  /** The name Spark's UI and REST API show. */
  val Name = "rdmaShuffle native memory peak (bytes)"
}
