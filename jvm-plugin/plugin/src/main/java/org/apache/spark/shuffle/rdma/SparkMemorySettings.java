/*
 * Licensed under the Apache License, Version 2.0.
 */
package org.apache.spark.shuffle.rdma;

/**
 * The Spark settings the engine's native-memory bound is computed from. The engine computes the
 * bound from them as Spark computes an executor's memory overhead for its container request
 * ({@code MemoryBound::from_spark} in crates/shuffle/src/budget.rs, whose
 * {@code SPARK_MEMORY_KEYS} lists the same keys); the shuffle manager passes each one that is
 * set as its {@code SparkConf} resolves it, the preflight ({@link Doctor}) as a
 * {@code spark-defaults.conf} or {@code --conf} gives it.
 */
public final class SparkMemorySettings {
  private SparkMemorySettings() {}

  private static final String[] KEYS = {
    "spark.master",
    "spark.executor.memory",
    "spark.executor.memoryOverhead",
    "spark.executor.memoryOverheadFactor",
    "spark.executor.minMemoryOverhead",
    "spark.driver.memory",
    "spark.driver.memoryOverhead",
    "spark.driver.memoryOverheadFactor",
    "spark.driver.minMemoryOverhead",
    "spark.kubernetes.memoryOverheadFactor",
  };

  /** @return the keys (a copy) */
  public static String[] keys() {
    return KEYS.clone();
  }

  /**
   * @param key a setting
   * @return whether the engine's memory bound depends on it
   */
  public static boolean isKey(String key) {
    for (String k : KEYS) {
      if (k.equals(key)) {
        return true;
      }
    }
    return false;
  }
}
