/*
 * Licensed under the Apache License, Version 2.0.
 */
package org.apache.spark.shuffle.rdma

import org.apache.spark.SparkConf

/**
 * The Spark settings the engine's native-memory bound is computed from, as this JVM's
 * `SparkConf` resolves them (deprecated names such as `spark.yarn.executor.memoryOverhead`
 * included). The engine computes the bound from them as Spark computes an executor's memory
 * overhead for its container request (`MemoryBound::from_spark` in crates/shuffle/src/budget.rs,
 * whose `SPARK_MEMORY_KEYS` lists the same keys); the preflight (`Doctor`) passes the same keys
 * from a `spark-defaults.conf`.
 */
object NativeMemoryBound {

  /** The keys, as `budget.rs` reads them. */
  val Keys: Seq[String] = Seq(
    "spark.master",
    "spark.executor.memory",
    "spark.executor.memoryOverhead",
    "spark.executor.memoryOverheadFactor",
    "spark.executor.minMemoryOverhead",
    "spark.driver.memory",
    "spark.driver.memoryOverhead",
    "spark.driver.memoryOverheadFactor",
    "spark.driver.minMemoryOverhead",
    "spark.kubernetes.memoryOverheadFactor"
  )

  /** The keys that are set in `conf`, with their values. */
  def settings(conf: SparkConf): Seq[(String, String)] =
    Keys.flatMap(k => conf.getOption(k).map(v => k -> v.trim))
}
