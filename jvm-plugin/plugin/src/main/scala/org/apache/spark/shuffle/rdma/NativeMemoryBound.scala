/*
 * Licensed under the Apache License, Version 2.0.
 */
package org.apache.spark.shuffle.rdma

import org.apache.spark.SparkConf

/** Spark's memory settings, as the engine computes its native-memory bound from them. */
object NativeMemoryBound {

  /**
   * The keys of [[SparkMemorySettings]] that are set in `conf`, with their values, as `conf`
   * resolves them (deprecated names such as `spark.yarn.executor.memoryOverhead` included).
   */
  def settings(conf: SparkConf): Seq[(String, String)] =
    SparkMemorySettings.keys().toSeq.flatMap(k => conf.getOption(k).map(v => k -> v.trim))
}
